"""Top-k of rows short enough to sit in one program's registers: a search for the k-th key.

A row of up to 32K float32 scores is 128 keys a thread at 8 warps (up to 4K more are
held beside them: a decode row at 32K context has a block more), so one program can
ask "how many keys reach c?" again and again without reading memory: a compare and an
add a key, then one block reduction. The search keeps a bracket of keys around the
k-th largest (at least k keys reach its low end, fewer than k its high end) and counts
two candidates a round: the bracket's midpoint, which bounds the rounds by 32, and the
point where a straight line through the bracket's counts crosses k, which on smooth
scores finds the gap between the k-th and the (k+1)-th key in ~10 rounds. It stops
when exactly k keys reach the low end (no tie left to break) or when the bracket
closes on the k-th key itself. An emit pass then writes the keys above the k-th, and
of those equal to it the first by position, in ascending order through one prefix sum
per tile (the chunked kernel's emit rule).

Why a second kernel beside the chunked radix select (`dsa_topk`): that one spreads a
row over many programs, which few long rows need, but pays five launches and a ballot
histogram of ~100 instructions per key and pass. Here the selection is one launch. On
an H100 a 32K row takes one program ~40 us (the search ~26 of them: integer compares
run at half the float rate), whatever the batch; `dsa_topk.top_k_row_resident` says
where that beats the chunked passes.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from ._common import next_pow2, pdl
from .topk_shared import above_kth, bracket_search, emit_tile, fill_unselected, load_keys, tie_kth, visible_keys

# The longest power of two of keys held in registers (128 a thread at 8 warps), and the
# most held beside it: a decode row at 32K context has 32K + a block of positions.
_ROW_MAX_POW2 = 32768
_MAX_TAIL = 4096
ROW_MAX_COLS = _ROW_MAX_POW2 + _MAX_TAIL
_FILL_BLOCK = 1024
# The longest row whose prefix sum the emit takes in registers, beside its keys (at 16
# warps; ptxas spills at 32K); longer rows are read again in tiles of this length.
_EMIT_TILE = 16384


def row_top_k_fits(num_cols: int) -> bool:
    """Whether rows of num_cols scores fit one program of `row_top_k_indices`."""
    return num_cols <= ROW_MAX_COLS


def _num_warps(row: int) -> int:
    # Swept on an H100 (bench/results/dsa-kernels/h100/logs-archive/topk-row-h100-2026-11-23.log): 8 warps from 4K
    # keys (a 32K row is then 128 key registers a thread, no spills), 16 at 16K (5-10%
    # faster there), 4 below 4K.
    if row == 16384:
        return 16
    return 8 if row >= 4096 else 4


@triton.jit
def _row_top_k_kernel(
    scores_ptr, key_lens_ptr, out_ptr,
    num_cols,
    s_st, s_sj, s_kl, s_ot, s_ok,
    K: tl.constexpr, ROW: tl.constexpr, TAIL: tl.constexpr, TILE: tl.constexpr, FILL_BLOCK: tl.constexpr,
    ALIGNED: tl.constexpr, GDC: tl.constexpr,
):
    t = tl.program_id(0)
    if GDC:
        gdc_wait()
        gdc_launch_dependents()
    n = visible_keys(key_lens_ptr, t, s_kl, num_cols)
    row = scores_ptr + t.to(tl.int64) * s_st
    out_row = out_ptr + t.to(tl.int64) * s_ot
    pos = tl.arange(0, ROW)
    valid = pos < n
    # Hidden positions key as 0, below every candidate the search tries (each is >= 1).
    keys = tl.where(valid, load_keys(row, pos, n, s_sj, ALIGNED), 0)
    if TAIL > 0:
        # Positions past the power of two, held beside it (a decode row at 32K context
        # has a block more); only the search needs them in registers.
        tail_pos = ROW + tl.arange(0, TAIL)
        tail_keys = tl.where(tail_pos < n, load_keys(row, tail_pos, n, s_sj, ALIGNED), 0)
    else:
        tail_keys = keys
    refine = n > K
    lo, c_lo, c_hi = bracket_search(keys, tail_keys, n, K, K, refine, tl.zeros([], dtype=tl.int64),
                                    tl.full([], 1 << 32, tl.int64), TAIL > 0)
    # Exactly K keys reach lo: they are the selection (every key above lo - 1). Otherwise
    # the bracket closed on lo, the k-th key itself, and K - c_hi of the keys equal to it
    # are taken after the c_hi above it.
    exact = c_lo == K
    kth = tl.where(exact, lo - 1, lo).to(tl.uint32)
    want = tl.where(exact, 0, K - c_hi)

    take_all = n <= K
    if TILE == ROW:
        above, ties = emit_tile(out_row, s_ok, pos, above_kth(keys, valid, kth, take_all),
                                tie_kth(keys, valid, kth, refine), want, 0, 0, K)
    else:
        # A whole row's prefix sum beside its keys would not fit the registers: the
        # emit reads the row again (from L2) in tiles.
        above = tl.zeros([], dtype=tl.int32)
        ties = tl.zeros([], dtype=tl.int32)
        offs = tl.arange(0, TILE)
        for j0 in range(0, n, TILE):
            tile_pos = j0 + offs
            tile_keys = load_keys(row, tile_pos, n, s_sj, ALIGNED)
            tile_valid = tile_pos < n
            above, ties = emit_tile(out_row, s_ok, tile_pos, above_kth(tile_keys, tile_valid, kth, take_all),
                                    tie_kth(tile_keys, tile_valid, kth, refine), want, above, ties, K)
    selected = tl.minimum(above + tl.minimum(ties, want), K)
    fill_unselected(out_row, s_ok, selected, K, FILL_BLOCK)


def row_top_k_indices(scores: torch.Tensor, key_lens: torch.Tensor, k: int, out: torch.Tensor) -> torch.Tensor:
    """`dsa_topk.top_k_indices` for rows that fit (`row_top_k_fits`): one program a row.

    scores [T, L] float32 (any strides), key_lens [T] int32, out [T, k] int32, all checked
    by the caller; returns out, written as `top_k_indices` specifies.
    """
    num_rows, num_cols = scores.shape
    if not row_top_k_fits(num_cols):
        raise ValueError(f"scores: rows of at most {ROW_MAX_COLS} scores fit one program, got {num_cols}")
    if num_rows == 0:
        return out
    row = min(max(16, next_pow2(num_cols)), _ROW_MAX_POW2)
    tail = next_pow2(num_cols - row) if num_cols > row else 0
    aligned = num_cols % 4 == 0 and scores.stride(1) == 1 and scores.stride(0) % 4 == 0
    use_pdl = pdl(scores.device)
    _row_top_k_kernel[(num_rows,)](
        scores, key_lens, out,
        num_cols,
        *scores.stride(), key_lens.stride(0), *out.stride(),
        K=k, ROW=row, TAIL=tail, TILE=min(row, _EMIT_TILE), FILL_BLOCK=min(_FILL_BLOCK, next_pow2(k)),
        ALIGNED=aligned, GDC=use_pdl, num_warps=_num_warps(row), launch_pdl=use_pdl,
    )
    return out
