"""NCCL ranks for the GPU parallel tests: one process a GPU of this host, started by the library's own
launcher (`mla_func.parallel.workers.run_ranks`, as `mla-func generate --tensor-parallel` starts them).

Each rank loads its shard of every checkpoint each way (`GPU_MODES`: `support.parallel_runs.MODES`, and
TP and DP attention through symmetric memory's collectives) in bf16 and in fp32 and runs what the CPU tests run on it (`scenarios`, or its own `rank_steps` under data-parallel
attention); in fp32 it also runs the same steps through a graph-replaying step and through that step
eager (`graph_and_eager`), so the collectives run inside captured graphs. What a rank saw, moved to the
CPU, is saved for the test to judge, and so is the error of a run that raised. A rank that fails outside
a run saves its error and exits at once, which stops the other (`run_ranks`) rather than leaving it in
a collective; a rank that hangs (the other failed inside a collective) meets the group's timeout.
"""

from __future__ import annotations

import dataclasses
import os
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

import mla_func as mf
from mla_func.parallel import Parallel
from mla_func.parallel.data_parallel import plan_rank_step
from mla_func.parallel.workers import run_ranks
from support.graph_checks import LADDER
from support.parallel_runs import BLOCK_SIZE, MODES, WORLD, rank_steps, run_steps, scenarios

DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}
# mode -> (Parallel.expert_parallel, Parallel.data_parallel_attention, Parallel.symmetric_memory): the CPU
# tests' modes, and TP and DP attention with the collectives through symmetric memory (NCCL ranks of one host).
GPU_MODES = {**{mode: (*flags, False) for mode, flags in MODES.items()},
             "tp-sym": (False, False, True), "dp-sym": (False, True, True)}
GPU_TP_MODES = sorted(m for m, (_, dp, _) in GPU_MODES.items() if not dp)
GPU_DP_MODES = sorted(m for m, (_, dp, _) in GPU_MODES.items() if dp)
# A run: (checkpoint folder, mode of GPU_MODES, dtype of DTYPES)
Run = tuple[str, str, str]


# rank_steps' prefill, two decodes and a mixed step. Its verify step runs eagerly (`run_steps`, `scenarios`):
# V4 has no speculative decoding, so no graph of a V4 verify step has run on one GPU either, and a failure
# there would not be the collectives'.
GRAPH_STEPS = 4


def graph_and_eager(model: mf.Model, every_rank: list[list[mf.StepPlan]], rank: int,
                    data_parallel: bool) -> dict[str, list[Any]]:
    """Rank `rank`'s first GRAPH_STEPS steps (`every_rank[rank]`; every rank's plans are the same list
    under tensor parallelism) through a step that captures and replays CUDA graphs and through the same
    step eager, with the same padding (`graph_checks.LADDER`), each from an empty state. The ranks must
    capture together (a capture runs the step's collectives once more, its warm-up, than a replay does):
    under tensor parallelism every rank runs the same plans; under data-parallel attention `plan_rank_step`
    pads every rank's decode step to one static key, and runs prefill and mixed steps eagerly on all.

    Returns {"graph": [logits [num_logits, V] a step], "eager": [...], "replayed": [whether the graph
    step replayed a graph, a step]}, on the CPU."""
    out: dict[str, list[Any]] = {}
    for graphs in (True, False):
        step = mf.make_step(model, padding=LADDER, graphs=graphs)
        state = mf.init_state(model, num_blocks=48, block_size=BLOCK_SIZE)
        logits, replayed = [], []
        for i, plan in enumerate(every_rank[rank][:GRAPH_STEPS]):
            if data_parallel:
                batch, mode = plan_rank_step(model.config, state, [plans[i] for plans in every_rank], rank,
                                             backend=step.backend, padding=step.padding, graphs=step.graphs,
                                             max_position=model.max_positions)
            else:
                batch, mode = step.prepare(state, plan)
            state, result = step(state, batch, mode)
            logits.append(result.logits.cpu())
            replayed.append(result.graph)
        out["graph" if graphs else "eager"] = logits
        if graphs:
            out["replayed"] = replayed
    return out


def _on_cpu(tree: Any) -> Any:
    return mf.pytree.tree_map(lambda x: x.cpu() if isinstance(x, torch.Tensor) else x, tree)


def _run(parallel: Parallel, device: torch.device, path: str, mode: str, dtype: str) -> dict[str, Any]:
    """One run on this rank: its logits (and greedy tokens), and in fp32 its graph and eager steps."""
    rank, world = parallel.rank, parallel.tensor_parallel
    expert_parallel, data_parallel, symmetric_memory = GPU_MODES[mode]
    rank_parallel = dataclasses.replace(parallel, expert_parallel=expert_parallel,
                                        data_parallel_attention=data_parallel, symmetric_memory=symmetric_memory)
    model = mf.load_model(path, dtype=DTYPES[dtype], device=device, parallel=rank_parallel)
    if data_parallel:
        every_rank = [rank_steps(model, r) for r in range(world)]
        out: dict[str, Any] = {"steps": run_steps(model, every_rank[rank], every_rank=every_rank, rank=rank)}
    else:
        every_rank = [rank_steps(model, 0)] * world   # every rank runs every request
        out = scenarios(model)
    if dtype == "fp32":
        out["graphs"] = graph_and_eager(model, every_rank, rank, data_parallel)
    return _on_cpu(out)


def _runs(parallel: Parallel, device: torch.device, runs: tuple[Run, ...]) -> dict[Run, Any]:
    """{run: `_run`'s result, or the error it raised}. Both ranks fail alike where a run fails the same
    way on each (a kernel that does not compile, a shape refused): the next run starts on both."""
    results: dict[Run, Any] = {}
    for run in runs:
        try:
            results[run] = _run(parallel, device, *run)
        except Exception as e:  # saved for that run's tests, which name it
            results[run] = {"raised": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()}
        torch.cuda.empty_cache()
    return results


def save_rank_result(out: str, parallel: Parallel, compute: Callable[[], Any]) -> int:
    """A rank function's end: what `compute()` returns saved to out/rank{r}.pt, or the error it raised
    ({"raised", "traceback"}, for the test to name); after an error the process exits at once, past
    `run_ranks`' leave(), whose barrier would meet the other rank inside a step's collective."""
    file = Path(out) / f"rank{parallel.rank}.pt"
    try:
        torch.save(compute(), file)
    except Exception as e:  # saved for the test, which names it
        torch.save({"raised": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()}, file)
        os._exit(1)
    return 0


def _rank_main(task: tuple[str, tuple[Run, ...], str], parallel: Parallel) -> int:
    out, runs, device_type = task
    if device_type == "cpu":
        torch.set_num_threads(1)  # the ranks share the host's cores
    device = torch.device("cuda", parallel.rank) if device_type == "cuda" else torch.device("cpu")
    return save_rank_result(out, parallel, lambda: _runs(parallel, device, runs))


def run_gpu_group(runs: tuple[Run, ...], out: Path, *, device_type: str = "cuda",
                  timeout_s: float = 300.0) -> tuple[dict[int, Any], str | None]:
    """Every run on WORLD ranks of this host, one GPU each over NCCL (device_type "cpu": on the CPU over
    gloo, where no CUDA is visible, to try the harness; no graph is captured there):
    ({rank: what it saved}, the launcher's error or None).

    A rank that saved nothing is absent; timeout_s bounds the rendezvous and every collective wait."""
    failure = None
    try:
        run_ranks(WORLD, _rank_main, (str(out), runs, device_type), timeout_s=timeout_s)
    except ChildProcessError as e:
        failure = str(e)
    saved = {r: torch.load(out / f"rank{r}.pt", weights_only=False, map_location="cpu")
             for r in range(WORLD) if (out / f"rank{r}.pt").exists()}
    return saved, failure


def nccl_group_results(fn: Callable[[Any, Parallel], int], payload: Any, out: Path, *,
                       timeout_s: float = 300.0) -> list[Any]:
    """[what each of WORLD NCCL ranks saved to out/rank{r}.pt], from `run_ranks(WORLD, fn, payload)` with NCCL's
    NVLink SHARP off (these small collectives gain nothing from it, and its set-up needs multicast memory a
    host may not grant). Fails naming a rank that saved its error ({"raised", "traceback"}), the launcher's
    error, or the ranks that saved nothing."""
    failure = None
    with pytest.MonkeyPatch.context() as env:
        env.setenv("NCCL_NVLS_ENABLE", "0")
        try:
            run_ranks(WORLD, fn, payload, timeout_s=timeout_s)
        except ChildProcessError as e:
            failure = str(e)
    saved = {r: torch.load(out / f"rank{r}.pt", weights_only=False) for r in range(WORLD)
             if (out / f"rank{r}.pt").exists()}
    for rank, result in saved.items():
        assert "raised" not in result, f"rank {rank}: {result['raised']}\n{result['traceback']}"
    assert failure is None and sorted(saved) == list(range(WORLD)), f"{failure}; ranks that saved: {sorted(saved)}"
    return [saved[r] for r in range(WORLD)]
