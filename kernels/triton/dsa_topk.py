"""Top-k selection of the indexer's scores by radix select: no sort, one program per row.

A row's k best positions are found without ordering the scores. Each float32
score maps to a uint32 key whose unsigned order is the float order; the k-th
largest key is then pinned down one byte at a time, most significant first: a
pass over the row builds a 256-bin histogram of the next byte among the keys
that share the bytes fixed so far (the "bucket"), and keeps the byte whose bin
holds the k-th largest. Every key above the bucket is selected; the bucket's
keys fill the remaining places, lowest positions first. A pass stops the
refinement early once the whole bucket is taken (no tie left to break), which
for continuous scores happens after two or three of the four bytes.

A last pass emits the selected positions in ascending order: each tile's
selections get their output slots from an exclusive prefix sum, offset by the
count of the tiles before it. A row whose key count is at most k selects every
visible position; -1 fills the slots after the last selection.

Every pass reads the row of scores from memory (a 128K-key row is 512 KB, which
stays in L2 across passes), so the cost is a few reads of the scores: small
next to the indexer's reads of its keys, which are 64x larger per position at
128 dims of bf16.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from ..checks import check_dtype, check_same_device, check_shape
from ._common import pdl

_RADIX_BITS = 8
_BINS = 1 << _RADIX_BITS
# Output slots per step of the -1 fill.
_FILL_BLOCK = 1024


@dataclass(frozen=True, slots=True)
class TopKConfig:
    """Scores per step of a pass, and warps of the one program of a row."""

    block: int
    num_warps: int


# 16 scores a thread at 8 warps.
_GPU_CONFIG = TopKConfig(block=4096, num_warps=8)
# The interpreter's cost is per step, and test rows are short.
_INTERPRETER_CONFIG = TopKConfig(block=64, num_warps=4)


@triton.jit
def _sortable_key(x):
    """float32 -> uint32 ordered like the floats (-inf lowest, +inf highest); -0.0 keys as 0.0."""
    bits = x.to(tl.int32, bitcast=True)
    # -0.0 == 0.0 must tie (broken by position): a zero score times a negative head
    # weight is -0.0, and zeros are the indexer's commonest score.
    bits = tl.where(bits == -2147483648, 0, bits)
    # Negative floats flip every bit (larger magnitude sorts lower); positive
    # ones set the sign bit so they sort above every negative one.
    flip = (bits >> 31) | -2147483648
    return (bits ^ flip).to(tl.uint32, bitcast=True)


@triton.jit(do_not_specialize=["num_cols"])
def _top_k_kernel(
    scores_ptr, key_lens_ptr, out_ptr,
    num_cols, s_st, s_sj, s_kl, s_ot, s_ok,
    K: tl.constexpr, BLOCK: tl.constexpr, FILL_BLOCK: tl.constexpr,
    BINS: tl.constexpr, RADIX_BITS: tl.constexpr, GDC: tl.constexpr,
):
    t = tl.program_id(0)
    if GDC:
        gdc_wait()
        gdc_launch_dependents()
    n = tl.minimum(tl.maximum(tl.load(key_lens_ptr + t * s_kl), 0), num_cols)
    row = scores_ptr + t.to(tl.int64) * s_st
    out_row = out_ptr + t.to(tl.int64) * s_ot
    offs = tl.arange(0, BLOCK)
    bins = tl.arange(0, BINS)

    # The bucket: keys whose bits under hi_mask equal prefix. `want` of its keys
    # are still to be taken after every key above it. A row of at most K keys
    # skips the refinement: its bucket is every key, all of them wanted.
    prefix = tl.zeros([], dtype=tl.uint32)
    hi_mask = tl.zeros([], dtype=tl.uint32)
    want = tl.minimum(n, K)
    shift = tl.full([], 32 - RADIX_BITS, tl.uint32)
    byte_mask = tl.full([], BINS - 1, tl.uint32)
    refining = n > K
    while refining:
        hist = tl.zeros([BINS], dtype=tl.int32)
        for j0 in range(0, n, BLOCK):
            pos = j0 + offs
            valid = pos < n
            key = _sortable_key(tl.load(row + pos * s_sj, mask=valid, other=0.0))
            member = valid & ((key & hi_mask) == prefix)
            digit = ((key >> shift) & byte_mask).to(tl.int32)
            hist += tl.histogram(digit, BINS, mask=member)
        # at_least[b]: bucket keys whose next byte is >= b (non-increasing in b);
        # the k-th largest lies in the highest bin where it reaches `want`.
        at_least = tl.cumsum(hist, axis=0, reverse=True)
        chosen = tl.sum((at_least >= want).to(tl.int32), axis=0) - 1
        in_bin = tl.sum(tl.where(bins == chosen, hist, 0), axis=0)
        above = tl.sum(tl.where(bins == chosen, at_least, 0), axis=0) - in_bin
        want -= above
        prefix = prefix | (chosen.to(tl.uint32) << shift)
        hi_mask = hi_mask | (byte_mask << shift)
        refining = (shift > 0) & (in_bin > want)
        shift -= RADIX_BITS
    bucket_max = prefix | ~hi_mask

    taken = tl.zeros([], dtype=tl.int32)
    ties_seen = tl.zeros([], dtype=tl.int32)
    for j0 in range(0, n, BLOCK):
        pos = j0 + offs
        valid = pos < n
        key = _sortable_key(tl.load(row + pos * s_sj, mask=valid, other=0.0))
        tie = (valid & ((key & hi_mask) == prefix)).to(tl.int32)
        tie_rank = ties_seen + tl.cumsum(tie, axis=0) - tie
        chosen = (valid & (key > bucket_max)) | ((tie != 0) & (tie_rank < want))
        pick = chosen.to(tl.int32)
        slot = taken + tl.cumsum(pick, axis=0) - pick
        tl.store(out_row + slot * s_ok, pos, mask=chosen & (slot < K))
        taken += tl.sum(pick, axis=0)
        ties_seen += tl.sum(tie, axis=0)
    fill = tl.arange(0, FILL_BLOCK)
    for s0 in range(0, K, FILL_BLOCK):
        slot = s0 + fill
        tl.store(out_row + slot * s_ok, tl.full([FILL_BLOCK], -1, tl.int32), mask=(slot >= taken) & (slot < K))


def top_k_indices(
    scores: torch.Tensor,
    key_lens: torch.Tensor,
    *,
    k: int,
    out: torch.Tensor | None = None,
    config: TopKConfig | None = None,
) -> torch.Tensor:
    """The positions of each row's k largest scores, in ascending position order.

    scores:   [T, L] float32 (any strides); only j < key_lens[t] are candidates
    key_lens: [T] int32 candidates per row (clamped to [0, L]); 0 marks a padded row
    k:        positions per row, >= 1
    out:      [T, k] int32 to write into (a captured graph allocates nothing), or None
    config:   overrides the block size and warps (benchmark sweeps)
    returns   indices [T, k] int32: the k best of j < key_lens[t], ties broken toward
              the lower position, listed in ascending order; when key_lens[t] < k every
              visible position in order, then -1.
    """
    if k < 1:
        raise ValueError(f"k: expected >= 1, got {k}")
    num_rows, num_cols = scores.shape
    check_shape("key_lens", key_lens, (num_rows,))
    check_dtype("scores", scores, (torch.float32,))
    check_dtype("key_lens", key_lens, (torch.int32,))
    check_same_device(scores=scores, key_lens=key_lens)
    if out is None:
        out = torch.empty((num_rows, k), dtype=torch.int32, device=scores.device)
    else:
        check_shape("out", out, (num_rows, k))
        check_dtype("out", out, (torch.int32,))
        check_same_device(scores=scores, out=out)
    if num_rows == 0:
        return out
    device = scores.device
    config = config or (_GPU_CONFIG if device.type == "cuda" else _INTERPRETER_CONFIG)
    use_pdl = pdl(device)
    _top_k_kernel[(num_rows,)](
        scores, key_lens, out,
        num_cols, *scores.stride(), key_lens.stride(0), *out.stride(),
        K=k, BLOCK=config.block, FILL_BLOCK=_FILL_BLOCK,
        BINS=_BINS, RADIX_BITS=_RADIX_BITS, GDC=use_pdl,
        num_warps=config.num_warps, launch_pdl=use_pdl,
    )
    return out
