"""float32 scores as uint32 keys whose unsigned order is the float order: what both top-k kernels select on."""

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
