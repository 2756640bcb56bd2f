"""Top-k of rows short enough to sit in one program's registers: a bitwise search for the k-th key.

A row of at most 32K float32 scores is 64 values a thread at 16 warps, so one program
can hold all of it and ask "how many keys are at or above c?" again and again without
reading memory: a compare and an add a key, then one reduction over the block. The
k-th largest key is found bit by bit, most significant first: a candidate keeps the
bits fixed so far and sets the next one, and stays if at least k keys reach it. The
search stops as soon as exactly k keys reach the value found (no tie left to break),
which for continuous scores happens after ~20 of the 32 bits. An emit pass then
writes the keys above the k-th, and of those equal to it the first by position, in
ascending order through one prefix sum per tile (the chunked kernel's emit rule).

Why a second kernel beside the chunked radix select (`dsa_topk`): that one spreads a
row over many programs, which long rows and few rows need, but pays five launches and
a ballot histogram of ~100 instructions per key and pass. Here a key costs ~2
instructions per bit searched and the whole selection is one launch: it pays wherever
a row fits, i.e. at decode contexts up to 32K (V3.2) and for V4's compressed entries.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from ._common import next_pow2, pdl
from .sort_keys import load_keys

# The longest row held in registers: 64 keys a thread at 16 warps.
ROW_MAX_COLS = 32768
# Keys per step of the emit, which reads the row again (from L2) in tiles.
_EMIT_TILE = 4096
_FILL_BLOCK = 1024


def row_top_k_fits(num_cols: int) -> bool:
    """Whether rows of num_cols scores fit one program of `row_top_k_indices`."""
    return next_pow2(num_cols) <= ROW_MAX_COLS


def _num_warps(row: int) -> int:
    # At least 32 keys a thread (fewer warps, shorter block reductions) and at most
    # 16 warps: a 32K row is then 64 key registers a thread, within a 128-register budget.
    return min(16, max(4, row // 1024))


@triton.jit
def _row_top_k_kernel(
    scores_ptr, key_lens_ptr, out_ptr,
    num_cols,
    s_st, s_sj, s_kl, s_ot, s_ok,
    K: tl.constexpr, ROW: tl.constexpr, TILE: tl.constexpr, FILL_BLOCK: tl.constexpr,
    ALIGNED: tl.constexpr, GDC: tl.constexpr,
):
    t = tl.program_id(0)
    if GDC:
        gdc_wait()
        gdc_launch_dependents()
    n = tl.minimum(tl.maximum(tl.load(key_lens_ptr + t * s_kl), 0), num_cols)
    row = scores_ptr + t.to(tl.int64) * s_st
    out_row = out_ptr + t.to(tl.int64) * s_ot
    refine = n > K
    # The k-th largest key, and how many keys equal to it are taken (after every key above it).
    kth = tl.zeros([], dtype=tl.uint32)
    want = tl.zeros([], dtype=tl.int32)
    if refine:
        pos = tl.arange(0, ROW)
        # Hidden positions key as 0, below every candidate (each has a bit set); only a
        # NaN with every bit set keys as 0 too, and the emit still takes it by position.
        keys = tl.where(pos < n, load_keys(row, pos, n, s_sj, ALIGNED), 0)
        reached = n
        bit = tl.full([], 31, tl.int32)
        while (bit >= 0) & (reached != K):
            candidate = kth | (tl.full([], 1, tl.uint32) << bit.to(tl.uint32))
            count = tl.sum((keys >= candidate).to(tl.int32), axis=0)
            kth = tl.where(count >= K, candidate, kth)
            reached = tl.where(count >= K, count, reached)
            bit -= 1
        want = K - tl.sum((keys > kth).to(tl.int32), axis=0)

    offs = tl.arange(0, TILE)
    above_seen = tl.zeros([], dtype=tl.int32)
    ties_seen = tl.zeros([], dtype=tl.int32)
    for j0 in range(0, n, TILE):
        pos = j0 + offs
        valid = pos < n
        key = load_keys(row, pos, n, s_sj, ALIGNED)
        # A row of at most k keys takes every one ("above" the empty bucket).
        is_above = (valid & ((key > kth) | (n <= K))).to(tl.int32)
        tie = (valid & refine & (key == kth)).to(tl.int32)
        # Above-k-th keys counted in the low 16 bits, k-th-equal keys in the high ones.
        packed = is_above | (tie << 16)
        before_key = tl.cumsum(packed, axis=0) - packed
        ties_before = ties_seen + (before_key >> 16)
        chosen = (is_above != 0) | ((tie != 0) & (ties_before < want))
        slot = above_seen + (before_key & 0xFFFF) + tl.minimum(ties_before, want)
        tl.store(out_row + slot * s_ok, pos, mask=chosen & (slot < K))
        counts = tl.sum(packed, axis=0)
        above_seen += counts & 0xFFFF
        ties_seen += counts >> 16
    selected = tl.minimum(above_seen + tl.minimum(ties_seen, want), K)
    fill = tl.arange(0, FILL_BLOCK)
    for s0 in range(0, K, FILL_BLOCK):
        slot = s0 + fill
        tl.store(out_row + slot * s_ok, tl.full([FILL_BLOCK], -1, tl.int32), mask=(slot >= selected) & (slot < K))


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
    row = max(16, next_pow2(num_cols))
    aligned = num_cols % 4 == 0 and scores.stride(1) == 1 and scores.stride(0) % 4 == 0
    use_pdl = pdl(scores.device)
    _row_top_k_kernel[(num_rows,)](
        scores, key_lens, out,
        num_cols,
        *scores.stride(), key_lens.stride(0), *out.stride(),
        K=k, ROW=row, TILE=min(row, _EMIT_TILE), FILL_BLOCK=min(_FILL_BLOCK, next_pow2(k)),
        ALIGNED=aligned, GDC=use_pdl, num_warps=_num_warps(row), launch_pdl=use_pdl,
    )
    return out
