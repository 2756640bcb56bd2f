"""What each NCCL rank of the symmetric-memory all-reduce test runs (`run_ranks`' function).

Every case sums a rank-seeded tensor through the group's `SymmetricReduce` (asked for with
`Parallel(symmetric_memory=True)`; `join` leaves it off) and through NCCL alone, then a CUDA graph of two dependent sums replays on new
inputs beside the same calls made eagerly. The rank saves what it saw; the test compares.
"""

from __future__ import annotations

import dataclasses

import torch

from mla_func.kernels.collectives import ONE_SHOT_MAX_BYTES, SYMMETRIC_BUFFER_BYTES, SymmetricReduce
from mla_func.parallel import Parallel
from support.parallel_gpu_runs import save_rank_result

# (rows, columns, dtype name): one-shot sizes, two-shot sizes, the buffer's last fitting size, and what
# the buffer does not take (past its size, a dtype its kernels lack, a size not a multiple of 16 bytes).
CASES = (
    (1, 2048, "bf16"), (8, 7168, "bf16"), (64, 2048, "bf16"), (64, 7168, "bf16"), (256, 7168, "bf16"),
    (SYMMETRIC_BUFFER_BYTES // (2 * 7168), 7168, "bf16"), (SYMMETRIC_BUFFER_BYTES // (2 * 7168) + 1, 7168, "bf16"),
    (1, 2048, "fp32"), (64, 7168, "fp32"), (3, 7, "bf16"), (4, 2048, "fp16"),
)
DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32, "fp16": torch.float16}
assert ONE_SHOT_MAX_BYTES < 64 * 7168 * 2 < SYMMETRIC_BUFFER_BYTES  # the cases cover both kernels


def _operand(rows: int, cols: int, dtype: torch.dtype, rank: int, seed: int) -> torch.Tensor:
    generator = torch.Generator(device="cuda").manual_seed(seed * 7919 + rank)
    return torch.randn(rows, cols, generator=generator, device="cuda").to(dtype)


def symmetric_reduce_rank(out: str, parallel: Parallel) -> int:
    """Saves {"symmetric_memory": join's choice, "kind": the asked-for all-reduce's type name, "cases": {case: (sum through
    the group's all-reduce, NCCL's sum)}, "kept": whether a first result survived a second call, "graph":
    (replayed results, eager results)} to rank{r}.pt, or the error it raised (`save_rank_result`)."""

    def results() -> dict:
        torch.cuda.set_device(parallel.rank)
        ours = dataclasses.replace(parallel, symmetric_memory=True).collectives.all_reduce
        nccl = parallel.collectives.all_reduce
        cases = {}
        for i, (rows, cols, name) in enumerate(CASES):
            x = _operand(rows, cols, DTYPES[name], parallel.rank, seed=i)
            cases[(rows, cols, name)] = (ours(x.clone()).cpu(), nccl(x.clone()).cpu())
        # A result is the caller's own tensor: the next sum, through the same buffer, leaves it alone.
        first = ours(_operand(8, 2048, torch.bfloat16, parallel.rank, seed=100))
        kept_copy = first.clone()
        ours(_operand(8, 2048, torch.bfloat16, parallel.rank, seed=101))
        ours(_operand(256, 2048, torch.bfloat16, parallel.rank, seed=102))
        kept = bool(torch.equal(first, kept_copy))

        static = _operand(64, 2048, torch.bfloat16, parallel.rank, seed=200)

        def two_sums(x: torch.Tensor) -> torch.Tensor:
            y = ours(x * 2)
            return ours(torch.cat([y, y[:1]]) + 1)   # 65 rows: a one-shot, then a two-shot sum

        for _ in range(2):   # warm-up on a side stream, as graph capture wants
            two_sums(static)
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            captured = two_sums(static)
        replayed, eager = [], []
        for seed in (201, 202):
            new = _operand(64, 2048, torch.bfloat16, parallel.rank, seed=seed)
            static.copy_(new)
            graph.replay()
            replayed.append(captured.cpu())
            eager.append(two_sums(new).cpu())
        return {"symmetric_memory": parallel.symmetric_memory, "kind": type(ours).__name__,
                "is_symmetric": isinstance(ours, SymmetricReduce), "cases": cases, "kept": kept,
                "graph": (replayed, eager)}

    return save_rank_result(out, parallel, results)


def gloo_symmetric_choice(task: object, parallel: Parallel) -> dict:
    """One gloo rank (`parallel_runs.spawn_group`'s job): join's choice, and what asking for symmetric memory
    over this group raises."""
    try:
        dataclasses.replace(parallel, symmetric_memory=True).collectives
        refusal = None
    except ValueError as e:
        refusal = str(e)
    return {"symmetric_memory": parallel.symmetric_memory, "kind": type(parallel.collectives.all_reduce).__name__,
            "refusal": refusal}
