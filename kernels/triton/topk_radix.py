"""The radix select's pieces shared by its two launch plans (`dsa_topk`: a launch per pass;
`dsa_topk_synced`: one launch whose programs of a row wait for each other).

A row's selection is its state: the bucket (the keys whose bits under hi_mask equal
prefix), `want` (how many of the bucket's keys are still to be taken after every key
above it), whether another pass is needed, and per chunk the keys above the bucket and
the keys in it. A pass counts a 256-bin histogram of the next digit per chunk (the synced
plan adds them into one per row); folding a pass's histograms into the state narrows the
bucket by that digit.
"""

from __future__ import annotations

import triton
import triton.language as tl

from .topk_shared import emit_tile, fill_unselected, load_keys


@triton.jit
def initial_state(n, K, chunk_len, BLOCK_P: tl.constexpr):
    """A row's selection before any pass: the bucket is every visible key."""
    chunks = tl.arange(0, BLOCK_P)
    prefix = tl.zeros([], dtype=tl.uint32)
    hi_mask = tl.zeros([], dtype=tl.uint32)
    want = tl.minimum(n, K)
    refining = n > K
    ties = tl.minimum(tl.maximum(n - chunks * chunk_len, 0), chunk_len)
    above = tl.zeros([BLOCK_P], dtype=tl.int32)
    return prefix, hi_mask, want, refining, above, ties


@triton.jit
def choose_digit(total, want, BINS: tl.constexpr):
    """The digit whose bin of the row's histogram total [BINS] holds the k-th largest key.

    returns (chosen, the bucket keys in its bin, `want` of them still to take)
    """
    bins = tl.arange(0, BINS)
    # at_least[b]: bucket keys whose next digit is >= b (non-increasing in b);
    # the k-th largest lies in the highest bin where it reaches `want`.
    at_least = tl.cumsum(total, axis=0, reverse=True)
    chosen = tl.sum((at_least >= want).to(tl.int32), axis=0) - 1
    in_bin = tl.sum(tl.where(bins == chosen, total, 0), axis=0)
    want -= tl.sum(tl.where(bins == chosen, at_least, 0), axis=0) - in_bin
    return chosen, in_bin, want


@triton.jit
def narrow_bucket(prefix, hi_mask, chosen, PASS: tl.constexpr, RADIX_BITS: tl.constexpr):
    """The bucket after digit PASS is fixed to chosen: digit PASS covers bits [shift, shift + width)."""
    below = 32 - RADIX_BITS * (PASS + 1)
    shift = below * (below > 0)
    # The last digit is narrower when the width does not divide 32.
    width = 32 - RADIX_BITS * PASS - shift
    prefix = prefix | (chosen.to(tl.uint32) << shift)
    hi_mask = hi_mask | (tl.full([], (1 << width) - 1, tl.uint32) << shift)
    return prefix, hi_mask


@triton.jit
def fold_pass(hist_ptr, s_wc, num_chunks, prefix, hi_mask, want, refining, above, ties,
              PASS: tl.constexpr, BLOCK_P: tl.constexpr, BINS: tl.constexpr, RADIX_BITS: tl.constexpr):
    """A row's selection after pass PASS, from the one before it and that pass's chunk histograms.

    A row that has stopped refining has no histograms for the pass, and keeps its state.
    The histograms are read from L2 (".cg"): other programs wrote them, in this launch or
    the one before, and a line this multiprocessor cached earlier would be stale.
    """
    if refining:
        chunks = tl.arange(0, BLOCK_P)
        bins = tl.arange(0, BINS)
        hist = tl.load(hist_ptr + chunks[:, None] * s_wc + bins[None, :],
                       mask=(chunks < num_chunks)[:, None], other=0, cache_modifier=".cg")    # [BLOCK_P, BINS]
        total = tl.sum(hist, axis=0)
        chosen, in_bin, want = choose_digit(total, want, BINS)
        above += tl.sum(tl.where(bins[None, :] > chosen, hist, 0), axis=1)
        ties = tl.sum(tl.where(bins[None, :] == chosen, hist, 0), axis=1)
        prefix, hi_mask = narrow_bucket(prefix, hi_mask, chosen, PASS, RADIX_BITS)
        refining = in_bin > want
    return prefix, hi_mask, want, refining, above, ties


@triton.jit
def digit_of(key, PASS: tl.constexpr, RADIX_BITS: tl.constexpr):
    """Digit PASS of each key (int32), most significant first; the last digit is narrower
    when the width does not divide 32."""
    below = 32 - RADIX_BITS * (PASS + 1)
    shift = below * (below > 0)
    digit_mask = (1 << (32 - RADIX_BITS * PASS - shift)) - 1
    return ((key >> shift) & digit_mask).to(tl.int32)


@triton.jit
def add_tile_histogram(key, valid, prefix, hi_mask, hist, sparse_bins,
                       PASS: tl.constexpr, BLOCK: tl.constexpr, BINS: tl.constexpr, RADIX_BITS: tl.constexpr,
                       SPARSE_PATH: tl.constexpr, SPARSE_SHARE: tl.constexpr):
    """hist [BINS] plus the histogram of digit PASS over the tile's bucket keys (valid lanes of key [BLOCK]).

    With SPARSE_PATH a tile whose members are at most 1/SPARSE_SHARE of it adds them to the
    int32 bins at sparse_bins in memory instead, an atomic a member: past the first digit a
    bucket is usually a small share of the row, and the histogram costs its instructions for
    every key of the tile.
    """
    member = valid & ((key & hi_mask) == prefix)
    digit = digit_of(key, PASS, RADIX_BITS)
    if SPARSE_PATH:
        if tl.sum(member.to(tl.int32), axis=0) * SPARSE_SHARE <= BLOCK:
            tl.atomic_add(sparse_bins + digit, tl.full([BLOCK], 1, tl.int32), mask=member, sem="relaxed")
        else:
            hist += tl.histogram(digit, BINS, mask=member)
    else:
        hist += tl.histogram(digit, BINS, mask=member)
    return hist


@triton.jit
def chunk_histogram(row, s_sj, start, end, prefix, hi_mask, slot,
                    PASS: tl.constexpr, BLOCK: tl.constexpr, BINS: tl.constexpr, RADIX_BITS: tl.constexpr,
                    ALIGNED: tl.constexpr, SPARSE_PATH: tl.constexpr, SPARSE_SHARE: tl.constexpr):
    """Writes to slot [BINS] the histogram of digit PASS over the bucket's keys at positions [start, end)."""
    offs = tl.arange(0, BLOCK)
    bins = tl.arange(0, BINS)
    if SPARSE_PATH:
        # The program's own histogram slot takes the sparse tiles' atomic adds.
        tl.store(slot + bins, tl.zeros([BINS], dtype=tl.int32))
        tl.debug_barrier()
    hist = tl.zeros([BINS], dtype=tl.int32)
    for j0 in range(start, end, BLOCK):
        pos = j0 + offs
        key = load_keys(row, pos, end, s_sj, ALIGNED)
        hist = add_tile_histogram(key, pos < end, prefix, hi_mask, hist, slot, PASS, BLOCK, BINS, RADIX_BITS,
                                  SPARSE_PATH, SPARSE_SHARE)
    if SPARSE_PATH:
        tl.debug_barrier()
        tl.atomic_add(slot + bins, hist, sem="relaxed")
    else:
        tl.store(slot + bins, hist)


@triton.jit
def bucket_lanes(key, valid, prefix, hi_mask):
    """(is_above, tie) int32 per lane: valid keys above the bucket, and valid keys in it."""
    is_above = (valid & (key > (prefix | ~hi_mask))).to(tl.int32)
    tie = (valid & ((key & hi_mask) == prefix)).to(tl.int32)
    return is_above, tie


@triton.jit
def count_bucket(key, valid, prefix, hi_mask):
    """(keys above the bucket, keys in it) among the valid lanes of key."""
    is_above, tie = bucket_lanes(key, valid, prefix, hi_mask)
    return tl.sum(is_above, axis=0), tl.sum(tie, axis=0)


@triton.jit
def emit_keys(out_row, s_ok, pos, key, valid, prefix, hi_mask, want, above_seen, ties_seen, K: tl.constexpr):
    """Writes the selected positions of one tile (keys at pos, valid lanes) after the row's earlier
    tiles' (above_seen, ties_seen), and returns those counts with this tile's added."""
    is_above, tie = bucket_lanes(key, valid, prefix, hi_mask)
    return emit_tile(out_row, s_ok, pos, is_above, tie, want, above_seen, ties_seen, K)


@triton.jit
def chunk_start(above, ties, chunk, BLOCK_P: tl.constexpr):
    """(keys above the bucket, bucket keys) in the chunks before `chunk`: where its selections start."""
    before = tl.arange(0, BLOCK_P) < chunk
    return tl.sum(tl.where(before, above, 0), axis=0), tl.sum(tl.where(before, ties, 0), axis=0)


@triton.jit
def emit_chunk(row, s_sj, out_row, s_ok, n, chunk, chunk_len, prefix, hi_mask, want, above, ties,
               K: tl.constexpr, BLOCK: tl.constexpr, BLOCK_P: tl.constexpr, FILL_BLOCK: tl.constexpr,
               ALIGNED: tl.constexpr):
    """Writes a chunk's selected positions, from the row's final state, after the chunks before it."""
    # Keys above the bucket are all taken; of the bucket's, the first `want` by position.
    above_seen, ties_seen = chunk_start(above, ties, chunk, BLOCK_P)
    offs = tl.arange(0, BLOCK)
    start = tl.multiple_of(chunk * chunk_len, BLOCK)
    end = tl.minimum(start + chunk_len, n)
    for j0 in range(start, end, BLOCK):
        pos = j0 + offs
        key = load_keys(row, pos, end, s_sj, ALIGNED)
        above_seen, ties_seen = emit_keys(out_row, s_ok, pos, key, pos < end, prefix, hi_mask, want,
                                          above_seen, ties_seen, K)
    if chunk == 0:
        fill_unselected(out_row, s_ok, tl.minimum(n, K), K, FILL_BLOCK)
