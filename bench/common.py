"""Shared benchmark helpers: device ceilings measured in the same run, timers, result files."""

from __future__ import annotations

import argparse
import collections
import contextlib
import datetime as _dt
import json
import math
import os
import re
import subprocess
from collections.abc import Callable, Sequence
from pathlib import Path

import torch


def git_commit(explicit: str | None = None) -> str:
    """--commit, else `git rev-parse HEAD`, else $MLA_FUNC_COMMIT, else "unknown"."""
    if explicit:
        return explicit
    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, timeout=10,
                             cwd=Path(__file__).resolve().parent)
        if out.returncode == 0 and out.stdout.strip():
            return out.stdout.strip()
    except (OSError, subprocess.SubprocessError):
        pass
    return os.environ.get("MLA_FUNC_COMMIT", "unknown")


def gpu_name() -> str:
    return torch.cuda.get_device_name()


def gpu_slug() -> str:
    """'NVIDIA H100 80GB HBM3' -> 'h100'."""
    name = gpu_name().lower()
    match = re.search(r"\b([a-z]\d{2,4}[a-z]?)\b", name.replace("nvidia", ""))
    return match.group(1) if match else re.sub(r"[^a-z0-9]+", "-", name).strip("-")


def today() -> str:
    return _dt.date.today().isoformat()


def time_eager(fn: Callable[[], object], warmup_ms: float = 25, rep_ms: float = 100) -> float:
    """Milliseconds per call, launches included, L2 flushed before each call (triton.testing.do_bench)."""
    import triton.testing

    return float(triton.testing.do_bench(fn, warmup=warmup_ms, rep=rep_ms, return_mode="median"))


def time_graph(calls: Sequence[Callable[[], object]], replays: int = 20, warmup_ms: float = 25) -> float:
    """Milliseconds per call of `calls` captured back to back in one CUDA graph.

    The calls should touch different memory (other pages, other experts) so that
    one call does not find the previous call's data in L2. The graph replays for about
    warmup_ms before the timed replays, as `time_eager` warms up: the first graph timed
    in a process ran 11-13% slower than the same graph timed later (H100, one-row
    FP8 products of 20-25 us, bench/results/kernels/h100/logs-archive/fp8-row-sweep-h100-2026-11-28.log).
    """
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(2):
            for call in calls:
                call()
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for call in calls:
            call()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    graph.replay()
    end.record()
    torch.cuda.synchronize()
    for _ in range(min(1000, max(1, math.ceil(warmup_ms / max(start.elapsed_time(end), 1e-3))))):
        graph.replay()
    start.record()
    for _ in range(replays):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    ms = start.elapsed_time(end) / (replays * len(calls))
    del graph
    return ms


def kernel_profile(run: Callable[[], object], reps: int = 5) -> list[tuple[str, float, int]]:
    """GPU kernels of `run()` under the torch profiler, over `reps` calls: (name, us a call, launches a
    call), longest first. Kernels launched as programmatic dependents count their wait for the kernel
    before them; profile under `programmatic_launch_off()` for each kernel's own time."""
    run()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            run()
        torch.cuda.synchronize()
    times: dict[str, float] = collections.defaultdict(float)
    counts: collections.Counter[str] = collections.Counter()
    for event in prof.events():
        if event.device_type == torch.autograd.DeviceType.CUDA:
            times[event.name] += event.time_range.elapsed_us() / reps
            counts[event.name] += 1
    return sorted(((name, us, counts[name] // reps) for name, us in times.items()), key=lambda r: -r[1])


def step_kernels(make_step: Callable[[], Callable], state, batch_tensors, mode, label: str,
                 rows: int = 30) -> list[tuple[str, float, int]]:
    """`kernel_profile` of a decode step with programmatic launch off (each kernel's own time): the step
    `make_step()` builds inside `programmatic_launch_off`, so that its graph is captured that way, run
    over `state` (donated: the caller's state is spent), its `rows` longest kernels printed under `label`."""
    with programmatic_launch_off():
        step = make_step()
        states = [state]

        def advance():
            # Each step donates the state it is given: the next one takes the state it returned.
            states[0], _ = step(states[0], batch_tensors, mode)

        profile = kernel_profile(advance)
    print(f"{label}: kernels a step without programmatic launch, {sum(r[1] for r in profile):.0f} us "
          f"in {sum(r[2] for r in profile)} launches", flush=True)
    for name, us, launches in profile[:rows]:
        print(f"  {us:8.1f} us {launches:4d}x  {name[:100]}", flush=True)
    return profile


@contextlib.contextmanager
def programmatic_launch_off():
    """Inside, every kernel launches only once the one before it has ended, as on GPUs before Hopper
    (a graph captured inside keeps that). For profiles: a programmatic dependent's time includes its
    wait for its predecessor."""
    from mla_func.kernels.triton import _common

    capable = _common._pdl_capable
    _common._pdl_capable = lambda index: False
    try:
        yield
    finally:
        _common._pdl_capable = capable


def copy_bandwidth(num_bytes: int = 2 << 30) -> float:
    """Device-to-device copy rate in bytes/s, counting bytes read plus bytes written."""
    src = torch.empty(num_bytes, dtype=torch.uint8, device="cuda").random_(0, 255)
    dst = torch.empty_like(src)
    ms = time_eager(lambda: dst.copy_(src), warmup_ms=50, rep_ms=300)
    return 2 * num_bytes / (ms * 1e-3)


def matmul_rate(n: int = 8192) -> float:
    """bf16 torch.mm FLOP/s on random n x n x n operands."""
    a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    ms = time_eager(lambda: torch.mm(a, b), warmup_ms=100, rep_ms=500)
    return 2 * n ** 3 / (ms * 1e-3)


# Every result file holds these fields, plus its rows: `rows` (a list of dicts), or several lists named
# `<what>_rows`. Key names carry their unit: `_ms`, `_us`, `_s`, `_gb`, `_gb_s`, `_tflop_s`, `_tok_s`, `pct_`.
SCHEMA = ("benchmark", "device", "gpu", "date", "commit", "torch")


def result_path(out_dir: Path, bench: str, device: str, date: str, commit: str, suffix: str = ".json") -> Path:
    """`<out_dir>/<bench>/<device>/<date>-<commit7><suffix>`, with -2, -3, ... after the commit where
    that name is taken (several runs of one benchmark on one day at one commit)."""
    folder = out_dir / bench / device
    stem = f"{date}-{re.sub(r'[^0-9a-zA-Z]+', '', commit)[:7] or 'unknown'}"
    path, n = folder / f"{stem}{suffix}", 1
    while path.exists():
        n += 1
        path = folder / f"{stem}-{n}{suffix}"
    return path


def write_json(result: dict, out_dir: Path, bench: str) -> Path:
    """Write `result` as `<out_dir>/<bench>/<device>/<date>-<commit7>.json` (see `result_path`) and
    return the path; a log of the run belongs beside it, with the same stem and `.log`.

    Fills the schema's fields the result leaves out (benchmark = `bench`; device = `gpu_slug()`, or
    the result's old `gpu_slug` key; gpu, date, commit, torch of this run) and checks it has rows."""
    device = result.pop("gpu_slug", None)
    result = dict(benchmark=bench, device=result.get("device") or device or gpu_slug(),
                  gpu=result.get("gpu") or (gpu_name() if torch.cuda.is_available() else "cpu"),
                  date=result.get("date") or today(), commit=result.get("commit") or git_commit(),
                  torch=result.get("torch") or torch.__version__,
                  **{k: v for k, v in result.items() if k not in SCHEMA})
    if not any(k == "rows" or k.endswith("_rows") for k in result):
        raise ValueError(f"{bench}: a result needs `rows` or `<what>_rows`")
    path = result_path(out_dir, bench, result["device"], result["date"], result["commit"])
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=1) + "\n")
    return path


def print_table(rows: list[dict], columns: list[tuple[str, str]]) -> None:
    """Rows of dicts as a fixed-width table; columns are (key, header)."""
    cells = [[header for _, header in columns]]
    for row in rows:
        cells.append([_fmt(row.get(key, "")) for key, _ in columns])
    widths = [max(len(r[i]) for r in cells) for i in range(len(columns))]
    for i, r in enumerate(cells):
        print("  ".join(c.rjust(w) for c, w in zip(r, widths)))
        if i == 0:
            print("  ".join("-" * w for w in widths))


def _fmt(value) -> str:
    if isinstance(value, float):
        return f"{value:.3g}" if abs(value) < 1000 else f"{value:.0f}"
    return str(value)


def sweep_row(rows: list[dict], row: dict, **fields) -> None:
    """Append one timed sweep candidate to `rows` and print it at once, so a sweep cut short by a
    time limit still reports what it measured."""
    rows.append(dict(row, **fields))
    print(f"{fields.get('case', '')}  {fields.get('config', '')}  splits={row.get('splits')}  "
          f"us={row.get('us', float('nan')):.1f}  t/t_copy={row.get('copy_time_ratio', float('nan')):.2f}  "
          f"{row.get('error', '')}", flush=True)


# How the paged-attention kernel benchmarks time an op (recorded in their results).
GRAPH_REPLAY_TIMING = ("CUDA-graph replay, consecutive calls on other block tables; eager_ms: "
                       "triton.testing.do_bench median, L2 flushed")


def kernel_bench_parser(doc: str | None) -> argparse.ArgumentParser:
    """The options every kernel benchmark takes: --commit, --out, --sweep."""
    parser = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--commit", help="commit id to record (default: git rev-parse HEAD, $MLA_FUNC_COMMIT)")
    parser.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / "results")
    parser.add_argument("--sweep", action="store_true", help="time the tile-size candidates instead")
    return parser


def kernel_bench_run(script: str, commit: str | None, *, matmul: bool = False, **fields) -> tuple[dict, dict]:
    """Start a kernel benchmark on the GPU: (result, ceilings). The result holds the GPU, date,
    commit, versions and the ceilings measured now (copy bandwidth; bf16 matmul rate with
    `matmul`), plus `fields`, and an empty `rows` list; the ceilings are in bytes/s and flop/s."""
    if not torch.cuda.is_available():
        raise SystemExit(f"{script} needs a CUDA GPU")
    torch.manual_seed(0)
    import triton

    ceilings = {"copy": copy_bandwidth(), **({"matmul": matmul_rate()} if matmul else {})}
    result = dict(gpu=gpu_name(), device=gpu_slug(), date=today(), commit=git_commit(commit),
                  torch=torch.__version__, triton=triton.__version__,
                  sm_count=torch.cuda.get_device_properties(0).multi_processor_count,
                  copy_bandwidth_gb_s=ceilings["copy"] / 1e9, **fields, rows=[])
    if matmul:
        result["bf16_matmul_tflop_s"] = ceilings["matmul"] / 1e12
    mm = f", bf16 mm {result['bf16_matmul_tflop_s']:.0f} TFLOP/s" if matmul else ""
    print(f"{result['gpu']}: copy {result['copy_bandwidth_gb_s']:.0f} GB/s (read+write){mm}", flush=True)
    return result, ceilings
