"""The OpenAI-compatible server under an open-loop load, against the offline engine on the same requests.

    python bench/serve.py [--preset v2-lite] [--device cuda] [--num-prompts 256] [--min-input-len 128]
                          [--max-input-len 1024] [--output-len 256] [--rates 4,16,64,inf] [--engine-thread]
                          [--commit SHA]
    python bench/serve.py --preset tiny --device cpu --num-prompts 8 --output-len 4 --rates 8,inf   # smoke run

`mla-func serve` runs in a subprocess on 127.0.0.1. For each request rate, --num-prompts streaming
requests (random token-id prompts of uniform random length, greedy, no early stop) arrive as a
Poisson process (rate "inf": all at once, the saturation run); each client records its time to first
token and the time between its tokens (the server sends one event a token). Each rate gets prompts of
its own seed, so no run finds another's prompts in the prefix cache; the saturation run's prompts are
those of the offline run (`mla_func.serving.benchmark.run_throughput`, seed 0), which follows in this
process once the server has stopped, with the same engine limits. Target: the server's output
tokens/s at saturation >= 90% of the offline engine's. The server's overhead per request and per
token is the saturation run's extra time over the offline run's, divided by requests and by tokens.
The engine runs in a process of its own, as `mla-func serve` runs it; `--engine-thread` puts it on a
thread of the server's process instead, sharing the GIL with the HTTP side (the layout before the
engine had a process). Each server row also has the CPU time per output token of the server's
event-loop thread (its HTTP work), of the server's other threads (the engine's thread with
--engine-thread, else the reader and sender of the engine's pipe) and of its child processes (the
engine's), read from /proc (Linux), and the client's own: unlike the timings, these hardly move when
the client shares the machine's cores. Prints a table and writes JSON under bench/results/serve/.

The host overhead shows without a GPU (tiny model, 2 cores, the client on the same machine):

    OMP_NUM_THREADS=1 python bench/serve.py --preset tiny --device cpu --num-prompts 128 --min-input-len 16 \
        --max-input-len 64 --output-len 64 --rates inf
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import subprocess
import sys
import time
from pathlib import Path

import httpx
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402

import mla_func as mf  # noqa: E402
from mla_func.serving.benchmark import percentile, random_requests, run_throughput  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent


async def one_request(url: str, prompt: list[int], output_len: int, model: str) -> dict:
    """Stream one completion; its time to first token, inter-token times (s) and token count.

    HTTP/1.1 by hand on an asyncio stream, one connection a request, and the events counted in the raw
    bytes as they come (each ends with a blank line, which neither JSON nor the chunked encoding's
    framing holds), not parsed: the client shares the machine with the server, and httpx's stack and
    parsing every event cost it several times the server's CPU a token, enough to make the client the
    bottleneck of the measurement."""
    host, port = url.removeprefix("http://").rsplit(":", 1)
    body = json.dumps({"model": model, "prompt": prompt, "max_tokens": output_len, "temperature": 0,
                       "stream": True, "ignore_eos": True}).encode()
    started = time.perf_counter()
    reader, writer = await asyncio.open_connection(host, int(port))
    writer.write(f"POST /v1/completions HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
                 f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n".encode() + body)
    times: list[float] = []
    head: bytes | None = b""  # the response's status line and headers until they are whole
    tail = b""  # the end of the body so far
    try:
        while chunk := await reader.read(1 << 16):
            now = time.perf_counter()
            if head is not None:  # still in the status line and headers
                head += chunk
                if b"\r\n\r\n" not in head:
                    continue
                head, chunk = head.split(b"\r\n\r\n", 1)
                if not head.startswith(b"HTTP/1.1 200"):
                    raise RuntimeError((head + chunk + await reader.read()).decode(errors="replace"))
                head = None
            seen = tail + chunk  # an event's blank line or an error's key may straddle two reads
            if b'"error":' in seen:
                raise RuntimeError(seen.decode(errors="replace"))
            times += [now] * (seen.count(b"\n\n") - tail.count(b"\n\n"))
            tail = seen[-16:]
    finally:
        writer.close()
    if b"[DONE]\n\n" not in tail:  # the last event, before the chunked encoding's end
        raise RuntimeError(f"the stream ended without its [DONE] event: {tail!r}")
    times.pop()  # [DONE]'s
    return dict(ttft=times[0] - started, itl=[b - a for a, b in zip(times, times[1:])], tokens=len(times))


async def open_loop(url: str, prompts: list[list[int]], rate: float, output_len: int, model: str, seed: int) -> dict:
    """Send every prompt, arrivals a Poisson process of `rate` requests/s (inf: all at once)."""
    rng = random.Random(seed)
    started = time.perf_counter()
    tasks = []
    for prompt in prompts:
        tasks.append(asyncio.create_task(one_request(url, prompt, output_len, model)))
        if rate != float("inf"):
            await asyncio.sleep(rng.expovariate(rate))
    results = await asyncio.gather(*tasks)
    seconds = time.perf_counter() - started
    ttft = [r["ttft"] for r in results]
    itl = [t for r in results for t in r["itl"]]
    outputs = sum(r["tokens"] for r in results)
    return dict(rate=rate, num_prompts=len(prompts), output_tokens=outputs, seconds=seconds,
                output_tok_s=outputs / seconds,
                **{f"ttft_ms_p{q}": 1e3 * percentile(ttft, q) for q in (50, 90, 99)},
                **{f"itl_ms_p{q}": 1e3 * percentile(itl, q) for q in (50, 90, 99)})


def start_server(args: argparse.Namespace, max_model_len: int, log: Path) -> tuple[subprocess.Popen, str]:
    port = common_free_port()
    command = [sys.executable, "-m", "mla_func.cli.commands", "serve", "--model", args.preset, "--device", args.device,
               "--port", str(port), "--max-num-seqs", str(args.max_num_seqs),
               "--max-num-batched-tokens", str(args.max_num_batched_tokens), "--max-model-len", str(max_model_len),
               "--max-waiting", str(args.num_prompts), "--backend", args.backend,
               *(["--engine-thread"] if args.engine_thread else [])]
    process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=log.open("w"), cwd=ROOT)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 900
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"the server exited:\n{log.read_text()}")
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return process, url
        except httpx.TransportError:
            pass
        time.sleep(0.5)
    process.kill()
    raise RuntimeError(f"the server did not start:\n{log.read_text()}")


def server_cpu_s(pid: int) -> tuple[float, float, float]:
    """CPU seconds (user + system) so far of process `pid`'s main thread (the server's event loop), of its
    other threads together, and of its child processes (the engine's); nans where /proc is not there."""
    main = others = 0.0
    try:
        for task in Path(f"/proc/{pid}/task").iterdir():
            try:
                seconds = _cpu_s(task / "stat")
            except OSError:  # a thread that ended meanwhile
                continue
            if task.name == str(pid):
                main += seconds
            else:
                others += seconds
    except OSError:
        return float("nan"), float("nan"), float("nan")
    children = 0.0
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            if int(stat.read_text().rsplit(")", 1)[1].split()[1]) == pid:  # its parent's id
                children += _cpu_s(stat)
        except (OSError, ValueError):  # a process that ended meanwhile
            continue
    return main, others, children


def _cpu_s(stat: Path) -> float:
    """utime + stime of a /proc stat file (a process's: all its threads; a task's: that thread), in seconds."""
    fields = stat.read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def common_free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="v2-lite")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--backend", default=None)
    parser.add_argument("--num-prompts", type=int, default=256)
    parser.add_argument("--min-input-len", type=int, default=128)
    parser.add_argument("--max-input-len", type=int, default=1024)
    parser.add_argument("--output-len", type=int, default=256)
    parser.add_argument("--rates", default="4,16,64,inf", help="requests/s, comma-separated; inf = all at once")
    parser.add_argument("--max-num-seqs", type=int, default=256)
    parser.add_argument("--max-num-batched-tokens", type=int, default=8192)
    parser.add_argument("--engine-thread", action="store_true",
                        help="the engine on a thread of the server's process (mla-func serve --engine-thread)")
    parser.add_argument("--commit", default=None)
    parser.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / "results")
    args = parser.parse_args()
    args.backend = args.backend or ("triton" if args.device.startswith("cuda") else "torch")
    rates = [float(r) for r in args.rates.split(",")]
    config = mf.PRESETS[args.preset]() if args.preset in mf.PRESETS else None
    vocab = config.vocab_size if config is not None else mf.load_model(args.preset, device="cpu").config.vocab_size
    input_len = (args.min_input_len, args.max_input_len)
    longest = args.max_input_len + args.output_len
    max_model_len = longest + 16  # as run_throughput sets it (a block of room)

    log = args.out / "serve" / "server.log"
    log.parent.mkdir(parents=True, exist_ok=True)
    process, url = start_server(args, max_model_len, log)
    rows = []
    try:
        warm = random_requests(vocab, min(args.num_prompts, args.max_num_seqs), input_len, seed=1000)
        asyncio.run(open_loop(url, warm, float("inf"), min(args.output_len, 4), args.preset, seed=0))
        for k, rate in enumerate(rates):
            seed = 0 if rate == float("inf") else 100 + k
            prompts = random_requests(vocab, args.num_prompts, input_len, seed)
            cpu_before, client_before = server_cpu_s(process.pid), time.process_time()
            row = asyncio.run(open_loop(url, prompts, rate, args.output_len, args.preset, seed=k))
            cpu_after = server_cpu_s(process.pid)
            row["client_cpu_us_per_token"] = 1e6 * (time.process_time() - client_before) / row["output_tokens"]
            row["loop_cpu_us_per_token"], row["threads_cpu_us_per_token"], row["children_cpu_us_per_token"] = (
                1e6 * (after - before) / row["output_tokens"] for before, after in zip(cpu_before, cpu_after))
            print("server:", row, flush=True)
            rows.append(dict(run=f"server {rate:g} req/s", **row))
    finally:
        process.terminate()
        process.wait(timeout=120)

    model = mf.load_model(args.preset, dtype=torch.bfloat16 if args.device.startswith("cuda") else None,
                          device=args.device)
    offline = run_throughput(model, num_prompts=args.num_prompts, input_len=input_len, output_len=args.output_len,
                             backend=args.backend, max_num_seqs=args.max_num_seqs,
                             max_num_batched_tokens=args.max_num_batched_tokens, seed=0, progress=False)
    print("offline:", offline, flush=True)
    rows.append(dict(run="offline engine", rate=float("inf"), **{k: offline[k] for k in (
        "num_prompts", "output_tokens", "seconds", "output_tok_s", "ttft_ms_p50", "ttft_ms_p90", "ttft_ms_p99",
        "itl_ms_p50", "itl_ms_p90", "itl_ms_p99")}))
    saturated = next((r for r in rows if r["rate"] == float("inf") and r["run"].startswith("server")), None)
    summary = {}
    if saturated is not None:
        extra = saturated["seconds"] - offline["seconds"]
        summary = dict(vs_offline=saturated["output_tok_s"] / offline["output_tok_s"],
                       overhead_ms_per_request=1e3 * extra / args.num_prompts,
                       overhead_us_per_token=1e6 * extra / saturated["output_tokens"])
        saturated.update(summary)
    cuda = args.device.startswith("cuda")
    result = dict(
        preset=args.preset, backend=args.backend, engine="thread" if args.engine_thread else "process",
        output_len=args.output_len, input_len=list(input_len),
        max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
        gpu=common.gpu_name() if cuda else "cpu", device=common.gpu_slug() if cuda else "cpu",
        date=common.today(), commit=common.git_commit(args.commit), torch=torch.__version__,
        rows=[{k: (None if v == float("inf") else v) for k, v in r.items()} for r in rows], **summary)
    path = common.write_json(result, args.out, "serve")
    log.replace(path.with_suffix(".server.log"))
    print(f"\n{result['gpu']} -> {path}")
    common.print_table(rows, [
        ("run", "run"), ("num_prompts", "requests"), ("output_tokens", "output tok"), ("seconds", "s"),
        ("output_tok_s", "output tok/s"), ("ttft_ms_p50", "TTFT p50 ms"), ("ttft_ms_p99", "TTFT p99 ms"),
        ("itl_ms_p50", "ITL p50 ms"), ("itl_ms_p99", "ITL p99 ms"), ("vs_offline", "x offline"),
        ("overhead_ms_per_request", "ms/req over"), ("overhead_us_per_token", "us/tok over"),
        ("loop_cpu_us_per_token", "loop CPU us/tok"), ("threads_cpu_us_per_token", "threads CPU us/tok"),
        ("children_cpu_us_per_token", "engine proc CPU us/tok"), ("client_cpu_us_per_token", "client CPU us/tok"),
    ])


if __name__ == "__main__":
    main()
