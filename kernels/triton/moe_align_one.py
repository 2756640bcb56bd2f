"""`moe_align` for a decode step's few hundred pairs, in one program.

The three-launch counting sort (`moe_align`) pays three kernel latencies, and its
scatter ranks pairs with a scan down a [pairs, experts] one-hot tile: ~14 us on
an H200 for V2-Lite's batch 64 (512 pairs over 66 experts), where the reads are a
few kilobytes. Here one program holds every pair: a histogram gives each expert's
count and padded run, a register sort of the keys expert * BLOCK_P + pair puts the
pairs in expert order (within an expert, in their original order, as `moe_align`
keeps them), and a pair's row is its run's start plus its rank among its expert's
pairs. The run and count offsets pass through a small workspace, the one way a
program can index a vector by a per-element value.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from ._common import next_pow2, pdl

# Pairs up to which `moe_align` sorts in this one program, and the expert columns (E rounded
# up to a power of two) from which it does. H200, graph replays (bench/results/
# dsa-kernels/h200/logs-archive/moe-align-h200-2026-11-23.log), three launches vs one program: 66 experts, 128 pairs 12.6
# vs 7.3 us, 512 pairs 12.2 vs 9.2, 1024 pairs 12.9 vs 12.8; 257 experts, 1024 pairs 33.7
# vs 24.8; but 9 experts (V4), 576 pairs 9.0 vs 12.1: narrow counting tiles are cheap, the
# register sort of a 1024-key row is not.
ALIGN_ONE_MAX_PAIRS = 1024
ALIGN_ONE_MIN_EXPERTS = 64


@triton.jit
def store_block_experts(block_expert_ptr, run_start, run_end, num_blocks, BLOCK_M: tl.constexpr,
                        BLOCK_E: tl.constexpr, BLOCK_B: tl.constexpr):
    """block_expert[b] = the expert whose padded run [run_start, run_end) holds row b * BLOCK_M, else -1."""
    experts = tl.arange(0, BLOCK_E)
    offs_b = tl.arange(0, BLOCK_B)
    for b0 in range(0, num_blocks, BLOCK_B):
        blocks = b0 + offs_b
        first_row = blocks * BLOCK_M
        inside = (first_row[:, None] >= run_start[None, :]) & (first_row[:, None] < run_end[None, :])
        owner = tl.sum(tl.where(inside, experts[None, :], 0), axis=1)
        owned = tl.sum(inside.to(tl.int32), axis=1) > 0
        tl.store(block_expert_ptr + blocks, tl.where(owned, owner, -1), mask=blocks < num_blocks)


# Sizes that follow the step's token count are plain arguments (see `moe_align`).
@triton.jit(do_not_specialize=["num_pairs", "num_rows", "num_blocks"])
def _align_one_kernel(
    ids_ptr, sorted_ptr, block_expert_ptr, work_ptr,
    num_pairs, num_rows, num_blocks, s_ids_t, s_ids_k,
    TOP_K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_P: tl.constexpr,
    BLOCK_FILL: tl.constexpr, BLOCK_B: tl.constexpr, GDC: tl.constexpr,
):
    if GDC:
        gdc_wait()
        gdc_launch_dependents()
    pairs = tl.arange(0, BLOCK_P)
    experts = tl.arange(0, BLOCK_E)
    in_range = pairs < num_pairs
    ids = tl.load(ids_ptr + (pairs // TOP_K) * s_ids_t + (pairs % TOP_K) * s_ids_k, mask=in_range,
                  other=-1).to(tl.int32)
    valid = ids >= 0
    counts = tl.histogram(tl.where(valid, ids, 0), BLOCK_E, mask=valid)
    padded = tl.cdiv(counts, BLOCK_M) * BLOCK_M
    run_end = tl.cumsum(padded, axis=0)
    run_start = run_end - padded
    first_pair = tl.cumsum(counts, axis=0) - counts
    tl.store(work_ptr + experts, run_start)
    tl.store(work_ptr + BLOCK_E + experts, first_pair)
    # Every row starts as padding (the sentinel num_pairs) before the pairs land on theirs.
    offs_f = tl.arange(0, BLOCK_FILL)
    for r0 in range(0, num_rows, BLOCK_FILL):
        rows = r0 + offs_f
        tl.store(sorted_ptr + rows, tl.full([BLOCK_FILL], 0, tl.int32) + num_pairs, mask=rows < num_rows)
    store_block_experts(block_expert_ptr, run_start, run_end, num_blocks, BLOCK_M, BLOCK_E, BLOCK_B)
    # Invalid pairs sort last: their key is past every expert's.
    key = tl.where(valid, ids * BLOCK_P + pairs, BLOCK_E * BLOCK_P)
    key = tl.sort(key)
    expert = key // BLOCK_P
    pair = key % BLOCK_P
    ok = expert < BLOCK_E
    safe = tl.where(ok, expert, 0)
    # The offsets and the sentinel fill must be visible to every thread of the program.
    tl.debug_barrier()
    start = tl.load(work_ptr + safe, mask=ok, other=0)
    first = tl.load(work_ptr + BLOCK_E + safe, mask=ok, other=0)
    # Sorted position p of a pair = first[expert] + its rank among its expert's pairs.
    tl.store(sorted_ptr + start + (pairs - first), pair, mask=ok)


def align_one(topk_ids: torch.Tensor, block_m: int, block_e: int, sorted_pairs: torch.Tensor,
              block_expert: torch.Tensor) -> None:
    """`moe_align`'s sort of topk_ids [T, k] (T * k <= ALIGN_ONE_MAX_PAIRS) for BLOCK_E = block_e
    expert columns, written into sorted_pairs [R] and block_expert [R / block_m] (int32)."""
    num_pairs = topk_ids.numel()
    num_rows = sorted_pairs.shape[0]
    work = torch.empty(2 * block_e, dtype=torch.int32, device=topk_ids.device)
    _align_one_kernel[(1,)](
        topk_ids, sorted_pairs, block_expert, work,
        num_pairs, num_rows, num_rows // block_m, *topk_ids.stride(),
        TOP_K=topk_ids.shape[1], BLOCK_M=block_m, BLOCK_E=block_e, BLOCK_P=max(2, next_pow2(num_pairs)),
        # 8 warps: 7.9 us for 512 pairs over 66 experts on an H200, 4: 9.1, 16: 8.1.
        BLOCK_FILL=1024, BLOCK_B=max(2, 16384 // block_e), GDC=pdl(topk_ids.device), num_warps=8,
        launch_pdl=pdl(topk_ids.device),
    )
