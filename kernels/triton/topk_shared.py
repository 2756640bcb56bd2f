"""What the top-k kernels share: float32 scores as uint32 keys whose unsigned order is the float
order, the search for a key by counts over keys held in registers, and the emit that writes a
tile's selected positions in ascending order."""

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
def visible_keys(key_lens_ptr, t, s_kl, num_cols):
    """Row t's candidate count: its key_lens entry clamped to [0, num_cols]."""
    return tl.minimum(tl.maximum(tl.load(key_lens_ptr + t * s_kl), 0), num_cols)


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


@triton.jit
def count_two(keys, a, b):
    """Keys reaching a (low 16 bits) and b (high 16 bits), as one uint32 (no sign bit to overflow into)."""
    return tl.sum((keys >= a).to(tl.uint32) + ((keys >= b).to(tl.uint32) << 16), axis=0)


@triton.jit
def bracket_search(keys, tail_keys, n, target_lo, target_hi, refine, lo, hi, HAS_TAIL: tl.constexpr):
    """A key lo that between target_lo and target_hi of the n keys reach, searched by counts.

    keys, tail_keys: uint32 keys in registers (tail_keys counted only with HAS_TAIL); lanes
    that hold no key must hold 0, below every point the search tries (each is >= 1); n < 2^16.
    The search keeps a bracket: at least target_lo keys reach lo (c_lo of them), fewer than
    target_lo reach hi (c_hi). It starts from lo (int64, which all n keys reach) and hi (int64,
    which none reaches; at most 2^32). Each round counts the keys reaching two points inside it in
    one block reduction: the bracket's midpoint, which bounds the rounds by 32, and the point
    where a straight line through the bracket's counts crosses the middle of the target,
    which on smooth keys lands in it in a few rounds. It stops once c_lo <= target_hi, or when
    the bracket closes on the target_lo-th key itself (lo; hi = lo + 1), or at once unless refine.
    returns (lo int64, c_lo, c_hi)
    """
    c_lo = n
    c_hi = tl.zeros([], dtype=tl.int32)
    aim = (target_lo + target_hi) * 0.5 - 0.5
    while refine & (hi - lo > 1) & (c_lo > target_hi):
        mid = lo + (hi - lo) // 2
        share = (c_lo.to(tl.float32) - aim) / (c_lo - c_hi).to(tl.float32)
        line = lo + (share * (hi - lo).to(tl.float32)).to(tl.int64)
        line = tl.minimum(tl.maximum(line, lo + 1), hi - 1)
        a = tl.minimum(mid, line)
        b = tl.maximum(mid, line)
        counts = count_two(keys, a.to(tl.uint32), b.to(tl.uint32))
        if HAS_TAIL:
            counts += count_two(tail_keys, a.to(tl.uint32), b.to(tl.uint32))
        c_a = (counts & 0xFFFF).to(tl.int32)
        c_b = (counts >> 16).to(tl.int32)
        # a <= b, so c_a >= c_b: the bracket narrows to the neighbouring points around the target.
        lo_at_b = c_b >= target_lo
        lo_at_a = c_a >= target_lo
        hi_at_a = c_a < target_lo
        hi_at_b = c_b < target_lo
        lo = tl.where(lo_at_b, b, tl.where(lo_at_a, a, lo))
        c_lo = tl.where(lo_at_b, c_b, tl.where(lo_at_a, c_a, c_lo))
        hi = tl.where(hi_at_a, a, tl.where(hi_at_b, b, hi))
        c_hi = tl.where(hi_at_a, c_a, tl.where(hi_at_b, c_b, c_hi))
    return lo, c_lo, c_hi


@triton.jit
def above_kth(keys, valid, kth, take_all):
    """int32 per lane: valid keys above the k-th key kth (every valid key where take_all: a row of
    at most k keys)."""
    return (valid & ((keys > kth) | take_all)).to(tl.int32)


@triton.jit
def tie_kth(keys, valid, kth, refine):
    """int32 per lane: valid keys equal to the k-th key kth, where the row refines at all."""
    return (valid & refine & (keys == kth)).to(tl.int32)
