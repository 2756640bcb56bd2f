"""What both top-k kernels share: float32 scores as uint32 keys whose unsigned order is the float
order, and the emit that writes a tile's selected positions in ascending order."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def sortable_key(x):
    """float32 -> uint32 ordered like the floats (-inf lowest, +inf highest); -0.0 keys as 0.0."""
    bits = x.to(tl.int32, bitcast=True)
    # -0.0 == 0.0 must tie (broken by position): a zero score times a negative head
    # weight is -0.0, and zeros are the indexer's commonest score.
    bits = tl.where(bits == -2147483648, 0, bits)
    # Negative floats flip every bit (larger magnitude sorts lower); positive
    # ones set the sign bit so they sort above every negative one.
    flip = (bits >> 31) | -2147483648
    return (bits ^ flip).to(tl.uint32, bitcast=True)


@triton.jit
def load_keys(row, pos, end, s_sj, ALIGNED: tl.constexpr):
    """Keys of the scores at pos < end (other lanes hold junk that callers mask)."""
    if ALIGNED:
        # A bound rounded up to 4 keeps the mask constant over each 16-byte vector
        # (the row holds a multiple of 4 scores, so the over-read stays inside it).
        load_end = tl.multiple_of(tl.cdiv(end, 4) * 4, 4)
    else:
        load_end = end
    return sortable_key(tl.load(row + pos * s_sj, mask=pos < load_end, other=0.0))


@triton.jit
def emit_tile(out_row, s_ok, pos, is_above, tie, want, above_seen, ties_seen, K: tl.constexpr):
    """Writes a tile's selected positions in order; returns the running counts with the tile's added.

    is_above [N] int32 marks keys above the k-th (all taken), tie [N] int32 keys equal to it (the
    first `want` of the row taken, by position); above_seen and ties_seen count both kinds in the
    row's earlier tiles, whose selections fill the slots before this tile's. N < 2^16.
    """
    # One scan counts both kinds before each key: above-k-th keys in the low 16 bits,
    # k-th-equal keys in the high ones.
    packed = is_above | (tie << 16)
    before_key = tl.cumsum(packed, axis=0) - packed
    ties_before = ties_seen + (before_key >> 16)
    chosen = (is_above != 0) | ((tie != 0) & (ties_before < want))
    slot = above_seen + (before_key & 0xFFFF) + tl.minimum(ties_before, want)
    tl.store(out_row + slot * s_ok, pos, mask=chosen & (slot < K))
    counts = tl.sum(packed, axis=0)
    return above_seen + (counts & 0xFFFF), ties_seen + (counts >> 16)


@triton.jit
def fill_unselected(out_row, s_ok, selected, K: tl.constexpr, FILL_BLOCK: tl.constexpr):
    """-1 in the slots from `selected` to K."""
    fill = tl.arange(0, FILL_BLOCK)
    for s0 in range(0, K, FILL_BLOCK):
        fill_slot = s0 + fill
        tl.store(out_row + fill_slot * s_ok, tl.full([FILL_BLOCK], -1, tl.int32),
                 mask=(fill_slot >= selected) & (fill_slot < K))
