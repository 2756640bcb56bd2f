"""Sorting a step's (token, slot) pairs by expert for the tiled fused MoE, on the device.

A counting sort: each expert's run of pairs is padded to a multiple of BLOCK_M,
so every BLOCK_M rows of the sorted order belong to one expert. Unused rows hold
the sentinel T * k; unused blocks get expert -1 and are skipped by the GEMMs.
`moe_align` runs it in three launches; `block_routing` is the same sort done
by one GEMM program for its own block, for steps of few pairs.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from ._common import next_pow2, pdl
from .moe_align_one import ALIGN_ONE_MAX_PAIRS, ALIGN_ONE_MIN_EXPERTS, align_one, store_block_experts


# The scatter ranks a tile's pairs by a scan down the tile, serial in its length: with
# few experts the 16K-element rule alone gave 1024-pair tiles (V4's 9 experts at batch
# 64: 20 us a launch), so longer tiles are split across programs instead.
_MAX_TILE_PAIRS = 256


def moe_sorted_size(num_pairs: int, num_experts: int, block_m: int) -> int:
    """Rows of the sorted, padded order: each non-empty expert (at most min(E, T*k)) pads < BLOCK_M rows."""
    return triton.cdiv(num_pairs + min(num_experts, num_pairs) * (block_m - 1), block_m) * block_m


# Sizes that follow the step's token count are plain (unspecialised) arguments:
# as constexprs or specialised ints, every new token count of an eager step
# would compile the kernel again.
@triton.jit(do_not_specialize=["num_pairs", "num_rows", "num_tiles"])
def _align_count_kernel(
    ids_ptr, tile_counts_ptr, sorted_ptr,
    num_pairs, num_rows, num_tiles, s_ids_t, s_ids_k,
    TOP_K: tl.constexpr, BLOCK_E: tl.constexpr, TILE_P: tl.constexpr, BLOCK_FILL: tl.constexpr, GDC: tl.constexpr,
):
    """Per tile of pairs: how many pairs each expert has; and the sentinel in every sorted row."""
    if GDC:
        gdc_wait()
        gdc_launch_dependents()
    tile = tl.program_id(0)
    experts = tl.arange(0, BLOCK_E)
    pairs = tile * TILE_P + tl.arange(0, TILE_P)
    ids = tl.load(ids_ptr + (pairs // TOP_K) * s_ids_t + (pairs % TOP_K) * s_ids_k, mask=pairs < num_pairs, other=-1)
    counts = tl.sum((ids[:, None] == experts[None, :]).to(tl.int32), axis=0)
    tl.store(tile_counts_ptr + tile * BLOCK_E + experts, counts)
    offs_f = tl.arange(0, BLOCK_FILL)
    for r0 in range(tile * BLOCK_FILL, num_rows, num_tiles * BLOCK_FILL):
        rows = r0 + offs_f
        tl.store(sorted_ptr + rows, tl.full([BLOCK_FILL], 0, tl.int32) + num_pairs, mask=rows < num_rows)


@triton.jit(do_not_specialize=["num_tiles", "num_blocks"])
def _align_offsets_kernel(
    tile_counts_ptr, tile_offsets_ptr, block_expert_ptr,
    num_tiles, num_blocks,
    BLOCK_M: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_FILL: tl.constexpr, GDC: tl.constexpr,
):
    """One program: each expert's padded run, where each tile's pairs start in it, each block's expert."""
    if GDC:
        gdc_wait()
        gdc_launch_dependents()
    experts = tl.arange(0, BLOCK_E)
    offs_t = tl.arange(0, BLOCK_T)
    totals = tl.zeros([BLOCK_E], dtype=tl.int32)
    for t0 in range(0, num_tiles, BLOCK_T):
        tiles = t0 + offs_t
        counts = tl.load(tile_counts_ptr + tiles[:, None] * BLOCK_E + experts[None, :],
                         mask=(tiles < num_tiles)[:, None], other=0)
        totals += tl.sum(counts, axis=0)
    padded = tl.cdiv(totals, BLOCK_M) * BLOCK_M
    run_end = tl.cumsum(padded, axis=0)
    run_start = run_end - padded
    # Tiles in order, so that within an expert pairs keep their original order.
    carry = run_start
    for t0 in range(0, num_tiles, BLOCK_T):
        tiles = t0 + offs_t
        in_range = (tiles < num_tiles)[:, None]
        counts = tl.load(tile_counts_ptr + tiles[:, None] * BLOCK_E + experts[None, :], mask=in_range, other=0)
        before = tl.cumsum(counts, axis=0) - counts
        tl.store(tile_offsets_ptr + tiles[:, None] * BLOCK_E + experts[None, :], carry[None, :] + before,
                 mask=in_range)
        carry += tl.sum(counts, axis=0)
    store_block_experts(block_expert_ptr, run_start, run_end, num_blocks, BLOCK_M, BLOCK_E, BLOCK_FILL)


@triton.jit(do_not_specialize=["num_pairs"])
def _align_scatter_kernel(
    ids_ptr, tile_offsets_ptr, sorted_ptr,
    num_pairs, s_ids_t, s_ids_k,
    TOP_K: tl.constexpr, BLOCK_E: tl.constexpr, TILE_P: tl.constexpr, GDC: tl.constexpr,
):
    """Per tile of pairs: each pair's row = its tile's start in its expert's run + its rank in the tile."""
    if GDC:
        gdc_wait()
        gdc_launch_dependents()
    tile = tl.program_id(0)
    experts = tl.arange(0, BLOCK_E)
    pairs = tile * TILE_P + tl.arange(0, TILE_P)
    ids = tl.load(ids_ptr + (pairs // TOP_K) * s_ids_t + (pairs % TOP_K) * s_ids_k, mask=pairs < num_pairs, other=-1)
    onehot = (ids[:, None] == experts[None, :]).to(tl.int32)
    rank = tl.sum(tl.cumsum(onehot, axis=0) * onehot, axis=1) - 1
    start = tl.load(tile_offsets_ptr + tile * BLOCK_E + experts)
    dest = tl.sum(onehot * start[None, :], axis=1) + rank
    tl.store(sorted_ptr + dest, pairs, mask=(pairs < num_pairs) & (ids >= 0))


@triton.jit
def block_routing(ids_ptr, s_ids_t, s_ids_k, block, num_pairs, num_experts,
                   TOP_K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_P: tl.constexpr):
    """The counting sort of `moe_align`, for one block of rows and all pairs in one tile."""
    experts = tl.arange(0, BLOCK_E)
    all_pairs = tl.arange(0, BLOCK_P)
    ids = tl.load(ids_ptr + (all_pairs // TOP_K) * s_ids_t + (all_pairs % TOP_K) * s_ids_k,
                  mask=all_pairs < num_pairs, other=-1)
    onehot = (ids[:, None] == experts[None, :]).to(tl.int32)
    padded = tl.cdiv(tl.sum(onehot, axis=0), BLOCK_M) * BLOCK_M
    run_end = tl.cumsum(padded, axis=0)
    run_start = run_end - padded
    rank = tl.sum(tl.cumsum(onehot, axis=0) * onehot, axis=1) - 1
    dest = tl.where(ids >= 0, tl.sum(onehot * run_start[None, :], axis=1) + rank, -1)
    first_row = block * BLOCK_M
    inside = (first_row >= run_start) & (first_row < run_end) & (experts < num_experts)
    expert = tl.where(tl.sum(inside.to(tl.int32), axis=0) > 0, tl.sum(tl.where(inside, experts, 0), axis=0), -1)
    rows = first_row + tl.arange(0, BLOCK_M)
    match = dest[None, :] == rows[:, None]
    pairs = tl.where(tl.sum(match.to(tl.int32), axis=1) > 0, tl.sum(tl.where(match, all_pairs[None, :], 0), axis=1),
                     num_pairs)
    return expert, pairs


@triton.jit
def gate_up_block(ids_ptr, sorted_ptr, block_expert_ptr, s_ids_t, s_ids_k, block, num_pairs, num_experts,
                  TOP_K: tl.constexpr, BLOCK_M: tl.constexpr, INLINE_ALIGN: tl.constexpr, BLOCK_E: tl.constexpr,
                  BLOCK_P: tl.constexpr):
    """A gate/up GEMM program's block of sorted rows: (its expert, -1 for an unused block; the pair of
    each of its BLOCK_M rows, num_pairs in padding rows), read from `moe_align`'s output.

    With INLINE_ALIGN (few pairs: decode) every program sorts the pairs itself (`block_routing`),
    which saves the align launch; the first column of programs publishes the result for the down kernel.
    """
    rows = block * BLOCK_M + tl.arange(0, BLOCK_M)
    if INLINE_ALIGN:
        expert, pairs = block_routing(ids_ptr, s_ids_t, s_ids_k, block, num_pairs, num_experts,
                                      TOP_K, BLOCK_M, BLOCK_E, BLOCK_P)
        if tl.program_id(1) == 0:
            tl.store(sorted_ptr + rows, pairs.to(tl.int32))
            tl.store(block_expert_ptr + block, expert.to(tl.int32))
    else:
        expert = tl.load(block_expert_ptr + block)
        pairs = tl.load(sorted_ptr + rows)
    return expert, pairs


def moe_align(
    topk_ids: torch.Tensor, num_experts: int, block_m: int, *, tile_pairs: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sort (token, slot) pairs by expert, each expert's run padded to a multiple of `block_m`.

    topk_ids:   [T, k] int32/int64 in [-1, E)
    tile_pairs: pairs a counting program takes (a power of two; by default as many
                as keep its [pairs, experts] one-hot tile at 16K elements, at most
                _MAX_TILE_PAIRS)
    returns     sorted_pairs [R] int32: pair index t * k + j in expert order, T * k in
                padding rows; block_expert [R / block_m] int32: the expert of each
                block of rows, -1 for unused blocks. R = moe_sorted_size(T * k, E, block_m).
    Within one expert, pairs keep their original order.

    Up to ALIGN_ONE_MAX_PAIRS pairs (decode) over at least ALIGN_ONE_MIN_EXPERTS expert
    columns, one program sorts them all (`moe_align_one`). Otherwise three launches, two
    of them over tiles of pairs: per-tile expert counts, one program that turns them
    into run and tile offsets, then the scatter (a one-hot single program took 0.18 ms
    at 256 tokens and grew with T).
    """
    num_tokens, top_k = topk_ids.shape
    num_pairs = num_tokens * top_k
    num_rows = moe_sorted_size(num_pairs, num_experts, block_m)
    num_blocks = num_rows // block_m
    device = topk_ids.device
    sorted_pairs = torch.empty(num_rows, dtype=torch.int32, device=device)
    block_expert = torch.empty(num_blocks, dtype=torch.int32, device=device)
    block_e = max(2, next_pow2(num_experts))
    if tile_pairs is None and num_pairs <= ALIGN_ONE_MAX_PAIRS and block_e >= ALIGN_ONE_MIN_EXPERTS:
        align_one(topk_ids, block_m, block_e, sorted_pairs, block_expert)
        return sorted_pairs, block_expert
    tile = tile_pairs or max(16, min(_MAX_TILE_PAIRS, 16384 // block_e))
    if tile != next_pow2(tile):
        raise ValueError(f"tile_pairs: expected a power of two, got {tile}")
    num_tiles = max(1, triton.cdiv(num_pairs, tile))
    tile_counts = torch.empty((num_tiles, block_e), dtype=torch.int32, device=device)
    tile_offsets = torch.empty_like(tile_counts)
    # Programmatic dependents (see `_common.pdl`): each launch is under way while the one before ends.
    use_pdl = pdl(device)
    _align_count_kernel[(num_tiles,)](
        topk_ids, tile_counts, sorted_pairs,
        num_pairs, num_rows, num_tiles, *topk_ids.stride(),
        TOP_K=top_k, BLOCK_E=block_e, TILE_P=tile, BLOCK_FILL=256, GDC=use_pdl, num_warps=4, launch_pdl=use_pdl,
    )
    _align_offsets_kernel[(1,)](
        tile_counts, tile_offsets, block_expert,
        num_tiles, num_blocks,
        BLOCK_M=block_m, BLOCK_E=block_e,
        BLOCK_T=max(2, 4096 // block_e), BLOCK_FILL=max(2, 16384 // block_e), GDC=use_pdl, num_warps=4,
        launch_pdl=use_pdl,
    )
    _align_scatter_kernel[(num_tiles,)](
        topk_ids, tile_offsets, sorted_pairs,
        num_pairs, *topk_ids.stride(),
        TOP_K=top_k, BLOCK_E=block_e, TILE_P=tile, GDC=use_pdl, num_warps=4, launch_pdl=use_pdl,
    )
    return sorted_pairs, block_expert
