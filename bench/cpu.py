"""CPU speed of the demo model, and the thread count the CLI defaults to.

    python bench/cpu.py                 # prints a table, writes bench/results/cpu/cpu-<cpu>-<cores>c/<date>-<commit>.json
    python bench/cpu.py --quick         # fewer tokens and repeats

Measures, for each torch thread count in --threads:
* single stream: tokens/s of one `mla-func generate`-like request (the demo, sampled,
  no early stop; decode rate after the first token), on an idle CPU and again with
  one busy competing process (`python -c "while True: pass"`) on the same cores;
* batched: `mla-func bench`'s workload (64 random prompts of 32-128 tokens, 32
  output tokens each, greedy) in output tokens/s, prefill included;
* score: seconds for `Engine.score` of 2048 tokens (the "tiny" preset: the demo's
  maximum length is 512) and of 512 tokens of the demo.
"""

from __future__ import annotations

import argparse
import os
import platform
import re
import signal
import statistics
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402

import mla_func as mf  # noqa: E402
from mla_func.serving.benchmark import random_requests, run_throughput  # noqa: E402

PROMPT = "Return the number of"


def cpu_model() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.processor() or "unknown"


@contextmanager
def busy_process(enabled: bool) -> Iterator[None]:
    """One competing process spinning on a core for the duration of the block."""
    if not enabled:
        yield
        return
    spinner = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        time.sleep(0.5)   # let it get scheduled before measuring
        yield
    finally:
        spinner.kill()
        spinner.wait()


def single_stream(model: mf.Model, tokens: int, repeats: int, budget_s: float = 5.0) -> float:
    """Median decode tokens/s of one sampled request (rate after the first token).

    Each run stops at `tokens` tokens or after `budget_s` seconds, whichever comes
    first, so a slow configuration costs seconds, not minutes.
    """
    engine = mf.Engine(model, graphs=False, max_num_seqs=1, max_num_batched_tokens=512)
    rates = []
    for r in range(repeats + 1):
        params = mf.SamplingParams(temperature=0.8, seed=r, max_tokens=tokens, ignore_eos=True)
        times: list[float] = []
        for _ in engine.generate_stream([PROMPT], params):
            times.append(time.perf_counter())
            if times[-1] - times[0] > budget_s:
                break
        if r:   # the first run warms up
            rates.append((len(times) - 1) / (times[-1] - times[0]))
    return statistics.median(rates)


def batched(model: mf.Model, num_prompts: int, output_len: int) -> dict:
    return run_throughput(model, num_prompts=num_prompts, input_len=(32, 128), output_len=output_len,
                          graphs=False, max_num_seqs=64, max_num_batched_tokens=2048, progress=False)


def score_seconds(model: mf.Model, num_tokens: int, repeats: int) -> float:
    """Median seconds of `Engine.score` on `num_tokens` random tokens (one warm-up call first)."""
    engine = mf.Engine(model, graphs=False, max_num_seqs=1, max_num_batched_tokens=2048, max_model_len=num_tokens)
    ids = random_requests(model.config.vocab_size, 1, (num_tokens, num_tokens), seed=0)[0]
    times = []
    for r in range(repeats + 1):
        started = time.perf_counter()
        engine.score(ids)
        if r:
            times.append(time.perf_counter() - started)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--quick", action="store_true", help="fewer tokens and repeats")
    parser.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / "results")
    args = parser.parse_args()
    # A terminated run still stops its busy process (SystemExit unwinds through busy_process's finally).
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    tokens, repeats, output_len = (64, 1, 8) if args.quick else (256, 3, 32)
    demo = mf.load_model("demo", device="cpu")
    tiny = mf.load_model("tiny", device="cpu")
    rows = []
    for threads in args.threads:
        torch.set_num_threads(threads)
        # The load average says how busy the machine was apart from this run's own busy process.
        row: dict = {"threads": threads, "loadavg_1min_before": os.getloadavg()[0]}
        row["stream_tok_s"] = single_stream(demo, tokens, repeats)
        with busy_process(True):
            row["stream_busy_tok_s"] = single_stream(demo, tokens, repeats)
        result = batched(demo, 64, output_len)
        row["bench_output_tok_s"] = result["output_tok_s"]
        row["bench_seconds"] = result["seconds"]
        with busy_process(True):
            row["bench_busy_output_tok_s"] = batched(demo, 64, output_len)["output_tok_s"]
        row["score_demo_512_s"] = score_seconds(demo, 512, repeats)
        row["score_tiny_2048_s"] = score_seconds(tiny, 2048, max(1, repeats - 2))
        row["loadavg_1min_after"] = os.getloadavg()[0]
        rows.append(row)
        print(f"threads {threads}: {row}", file=sys.stderr, flush=True)
    result = {
        "benchmark": "cpu", "gpu": "none", "cpu": cpu_model(), "cores": os.cpu_count(),
        "device": "cpu-" + re.sub(r"[^a-z0-9]+", "-", cpu_model().lower()).strip("-") + f"-{os.cpu_count()}c",
        "date": common.today(), "commit": common.git_commit(), "torch": torch.__version__,
        "python": platform.python_version(), "quick": args.quick,
        "workload": {"stream_tokens": tokens, "repeats": repeats, "bench_prompts": 64, "bench_input_len": [32, 128],
                     "bench_output_len": output_len, "prompt": PROMPT},
        "rows": rows,
    }
    print(f"{result['cpu']}, {result['cores']} cores, torch {result['torch']}, commit {result['commit'][:10]}")
    common.print_table(rows, [
        ("threads", "threads"), ("stream_tok_s", "stream tok/s"), ("stream_busy_tok_s", "stream busy tok/s"),
        ("bench_output_tok_s", "bench out tok/s"), ("bench_busy_output_tok_s", "bench busy out tok/s"),
        ("score_demo_512_s", "score demo 512 s"), ("score_tiny_2048_s", "score tiny 2048 s"),
        ("loadavg_1min_before", "load before"), ("loadavg_1min_after", "load after"),
    ])
    print(f"wrote {common.write_json(result, args.out, 'cpu')}")


if __name__ == "__main__":
    main()
