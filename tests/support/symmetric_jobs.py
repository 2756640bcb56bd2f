"""What each NCCL rank of the symmetric-memory collectives test runs (`run_ranks`' function).

Every case sums, gathers or reduce-scatters a rank-seeded tensor through the group's symmetric-memory
ops (asked for with `Parallel(symmetric_memory=True)`; `join` leaves it off) and through NCCL alone,
then a CUDA graph of dependent calls of all three replays on new inputs beside the same calls made
eagerly. The rank saves what it saw; the test compares.
"""

from __future__ import annotations

import dataclasses

import torch

from mla_func.kernels.collectives import (ONE_SHOT_MAX_BYTES, SYMMETRIC_BUFFER_BYTES, SymmetricGather, SymmetricReduce,
                                          SymmetricReduceScatter)
from mla_func.parallel import Parallel
from support.parallel_gpu_runs import save_rank_result

# (rows, columns, dtype name): one-shot sizes, two-shot sizes, the buffer's last fitting size, and what
# the buffer does not take (past its size, a dtype its kernels lack, a size not a multiple of 16 bytes).
CASES = (
    (1, 2048, "bf16"), (8, 7168, "bf16"), (64, 2048, "bf16"), (64, 7168, "bf16"), (256, 7168, "bf16"),
    (SYMMETRIC_BUFFER_BYTES // (2 * 7168), 7168, "bf16"), (SYMMETRIC_BUFFER_BYTES // (2 * 7168) + 1, 7168, "bf16"),
    (1, 2048, "fp32"), (64, 7168, "fp32"), (3, 7, "bf16"), (4, 2048, "fp16"),
)
# (rows, columns, dtype name, dim) a rank: a DP step's rows (32 and 128 of 2048), odd sizes, the logits'
# gather along the vocabulary, the exchange's int64 token ids, and past the buffer (NCCL's then).
PAST_BUFFER_ROWS = SYMMETRIC_BUFFER_BYTES // (2 * 2 * 7168) + 1
GATHER_CASES = (
    (32, 2048, "bf16", 0), (128, 2048, "bf16", 0), (3, 7, "bf16", 0), (5, 49, "fp32", 1), (16, 0, "int64", 0),
    (PAST_BUFFER_ROWS, 7168, "bf16", 0),
)
# (rows, columns, dtype name, dim) of the whole tensor each rank brings (rows split over the two ranks).
SCATTER_CASES = (
    (64, 2048, "bf16", 0), (256, 2048, "bf16", 0), (256, 2048, "fp32", 0), (6, 7, "fp32", 0), (3, 8, "bf16", 1),
    (2 * PAST_BUFFER_ROWS, 7168, "bf16", 0),
)
DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32, "fp16": torch.float16, "int64": torch.int64}
assert ONE_SHOT_MAX_BYTES < 64 * 7168 * 2 < SYMMETRIC_BUFFER_BYTES  # the cases cover both kernels


def _operand(rows: int, cols: int, dtype: torch.dtype, rank: int, seed: int) -> torch.Tensor:
    """[rows, cols] (cols 0: [rows]) of rank-seeded values; int64 ones are ids below 1000."""
    generator = torch.Generator(device="cuda").manual_seed(seed * 7919 + rank)
    shape = (rows, cols) if cols else (rows,)
    if dtype == torch.int64:
        return torch.randint(0, 1000, shape, generator=generator, device="cuda")
    return torch.randn(shape, generator=generator, device="cuda").to(dtype)


def symmetric_rank(out: str, parallel: Parallel) -> int:
    """Saves {"symmetric_memory": join's choice, "kinds": the asked-for ops' type names, "is_symmetric": whether
    all three are symmetric memory's, "sums" / "gathers" / "scatters": {case: (through symmetric memory, through
    NCCL)}, "kept": whether first results survived later calls, "graph": (replayed results, eager results)} to
    rank{r}.pt, or the error it raised (`save_rank_result`)."""

    def results() -> dict:
        torch.cuda.set_device(parallel.rank)
        ours = dataclasses.replace(parallel, symmetric_memory=True).collectives
        nccl, rank = parallel.collectives, parallel.rank
        sums, gathers, scatters = {}, {}, {}
        for i, (rows, cols, name) in enumerate(CASES):
            x = _operand(rows, cols, DTYPES[name], rank, seed=i)
            sums[(rows, cols, name)] = (ours.all_reduce(x.clone()).cpu(), nccl.all_reduce(x.clone()).cpu())
        for i, (rows, cols, name, dim) in enumerate(GATHER_CASES):
            x = _operand(rows, cols, DTYPES[name], rank, seed=50 + i)
            gathers[(rows, cols, name, dim)] = (ours.all_gather(x, dim=dim).cpu(), nccl.all_gather(x, dim=dim).cpu())
        for i, (rows, cols, name, dim) in enumerate(SCATTER_CASES):
            x = _operand(rows, cols, DTYPES[name], rank, seed=80 + i)
            scatters[(rows, cols, name, dim)] = (ours.reduce_scatter(x.clone(), dim=dim).cpu(),
                                                 nccl.reduce_scatter(x.clone(), dim=dim).cpu())
        # A result is the caller's own tensor: the next calls, through the same buffers, leave it alone.
        first = [ours.all_reduce(_operand(8, 2048, torch.bfloat16, rank, seed=100)),
                 ours.all_gather(_operand(8, 2048, torch.bfloat16, rank, seed=101), dim=0),
                 ours.reduce_scatter(_operand(16, 2048, torch.bfloat16, rank, seed=102), dim=0)]
        kept_copy = [t.clone() for t in first]
        for seed in (103, 104):
            ours.all_reduce(_operand(256, 2048, torch.bfloat16, rank, seed=seed))
            ours.all_gather(_operand(64, 2048, torch.bfloat16, rank, seed=seed), dim=0)
            ours.reduce_scatter(_operand(128, 2048, torch.bfloat16, rank, seed=seed), dim=0)
        kept = all(torch.equal(a, b) for a, b in zip(first, kept_copy))

        static = _operand(64, 2048, torch.bfloat16, rank, seed=200)

        def calls(x: torch.Tensor) -> torch.Tensor:
            y = ours.all_reduce(x * 2)
            every = ours.all_gather(torch.cat([y, y[:1]]) + 1, dim=0)   # 65 rows: a two-shot sum above
            mine = ours.reduce_scatter(every * every, dim=0)           # [65, 2048] of every rank's
            return ours.all_gather(ours.all_reduce(mine), dim=1)

        for _ in range(2):   # warm-up on a side stream, as graph capture wants
            calls(static)
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            captured = calls(static)
        replayed, eager = [], []
        for seed in (201, 202):
            new = _operand(64, 2048, torch.bfloat16, rank, seed=seed)
            static.copy_(new)
            graph.replay()
            replayed.append(captured.cpu())
            eager.append(calls(new).cpu())
        ops = (ours.all_reduce, ours.all_gather, ours.reduce_scatter)
        return {"symmetric_memory": parallel.symmetric_memory, "kinds": [type(op).__name__ for op in ops],
                "is_symmetric": [isinstance(op, kind) for op, kind in
                                 zip(ops, (SymmetricReduce, SymmetricGather, SymmetricReduceScatter))],
                "sums": sums, "gathers": gathers, "scatters": scatters, "kept": kept, "graph": (replayed, eager)}

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
