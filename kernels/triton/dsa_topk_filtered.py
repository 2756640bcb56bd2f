"""Top-k of long rows by a threshold from a sample: the few keys above it, then a search over those.

The radix select (`dsa_topk`, `dsa_topk_synced`) counts a ballot histogram over every key
of a row at least twice, since its first byte (the sign and most of the exponent) leaves
a bucket of one or two binades: a large share of the row. Here a row's keys are read
once, into no histogram, in two launches:

1. `_list_kernel`, (row, chunk) programs: each takes the same sample of its row
   (`sample_positions`) and searches it, in registers, for a key tau that a few more
   sample keys reach than the k-th key's expected share of the sample, mu = sample * k / n:
   between r = mu + 5 sqrt(mu) + 2 and 1.5 r of them. A row of at most `cap` keys takes
   tau = 0: every key. Then it writes its chunk's keys reaching tau, with their positions,
   in order into the chunk's own region of the workspace, and their count.
2. `_select_kernel`, a program a row: when the chunks' lists hold at least min(n, k) keys
   and at most `cap` together, every key from the k-th up is in them (at least k keys reach
   tau), so the row's top-k is theirs. The program gathers them into registers in position
   order (each lane finds its chunk by a binary search over the chunks' running counts),
   the bracket search of `dsa_topk_row` finds the k-th key among them, and the emit writes
   the positions of the keys above it and of the first ones equal to it, in order (the
   other kernels' rule). Otherwise (a sample far off its expectation, about a 5-sigma
   event on smooth scores; or a row of mostly equal keys) the program runs the radix
   select over its whole row alone: slow, and exact.

The sample's margin puts tau below the k-th key unless more than r sample keys lie above
the k-th where mu are expected. A row's list holds about 1.25 r * n / sample keys: on
indexer scores at k = 2048, 3.6K of 32K and 4.5K of 128K on average, at most 6.0K, where
the cap is 8192 (bench/results/dsa-kernels/h200/logs-archive/topk-filtered-h200-2026-11-26.log).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from ._common import next_pow2
from .topk_radix import chunk_histogram, emit_chunk, fold_pass, initial_state
from .topk_shared import (above_kth, bracket_search, emit_tile, fill_unselected, load_keys, sortable_key,
                          tie_kth, visible_keys)

# A row's workspace (int32): tau, the chunks' counts, the counts before each chunk, then
# the chunks' lists (a region of keys per chunk, then one of their positions) or, in a row
# whose lists missed, the fallback's radix histograms (a pass each) in their room.
MAX_CHUNKS = 64
_TAU = tl.constexpr(0)
_COUNTS = tl.constexpr(1)
_BEFORE = tl.constexpr(1 + 64)
_LISTS = tl.constexpr(1 + 2 * 64)


def filtered_workspace_width(num_chunks: int, region: int, passes: int, bins: int) -> int:
    """Int32 slots a row's workspace holds with num_chunks chunks of `region` candidates at most each."""
    return _LISTS.value + max(passes * bins, 2 * num_chunks * region)


@triton.jit
def sample_positions(n, SAMPLE: tl.constexpr, SEGMENT: tl.constexpr):
    """[SAMPLE] positions of a row of n keys that its sample reads: SAMPLE // SEGMENT runs of SEGMENT
    neighbours (a 32-byte sector at 8), spread evenly over the row; all < n when n >= SAMPLE."""
    i = tl.arange(0, SAMPLE)
    return ((i // SEGMENT).to(tl.int64) * n) // (SAMPLE // SEGMENT) + i % SEGMENT


@triton.jit
def _threshold(row, n, s_sj, K: tl.constexpr, SAMPLE: tl.constexpr, SEGMENT: tl.constexpr, CAP: tl.constexpr):
    """tau: a key that a few more than the k-th key's share of the row's sample reach (0: keep all)."""
    tau = tl.zeros([], dtype=tl.uint32)
    if n > CAP:
        keys = sortable_key(tl.load(row + sample_positions(n, SAMPLE, SEGMENT) * s_sj))
        mu = (SAMPLE * K) / n.to(tl.float32)
        r = tl.minimum(tl.ceil(mu + 5.0 * tl.sqrt(mu) + 2.0).to(tl.int32), SAMPLE)
        # The sample's own extremes bound the search: every key reaches its least, none passes its greatest.
        lo, c_lo, c_hi = bracket_search(keys, keys, SAMPLE, r, r + r // 2, True, tl.min(keys, axis=0).to(tl.int64),
                                        tl.max(keys, axis=0).to(tl.int64) + 1, False)
        tau = lo.to(tl.uint32)
    return tau


@triton.jit
def _list_kernel(
    scores_ptr, key_lens_ptr, ws_ptr,
    num_cols, chunk_len, num_chunks, region,
    s_st, s_sj, s_kl, s_wt,
    K: tl.constexpr, SAMPLE: tl.constexpr, SEGMENT: tl.constexpr, CAP: tl.constexpr, BLOCK: tl.constexpr,
    ALIGNED: tl.constexpr, STAGES: tl.constexpr, DEPENDENTS: tl.constexpr,
):
    t = tl.program_id(0)
    chunk = tl.program_id(1)
    n = visible_keys(key_lens_ptr, t, s_kl, num_cols)
    row = scores_ptr + t.to(tl.int64) * s_st
    ws_row = ws_ptr + t.to(tl.int64) * s_wt
    tau = _threshold(row, n, s_sj, K, SAMPLE, SEGMENT, CAP)
    keys_out = ws_row + _LISTS + chunk * region
    positions_out = keys_out + num_chunks * region
    start = tl.multiple_of(chunk * chunk_len, BLOCK)
    end = tl.minimum(start + chunk_len, n)
    offs = tl.arange(0, BLOCK)
    count = tl.zeros([], dtype=tl.int32)
    for j0 in tl.range(start, end, BLOCK, num_stages=STAGES):
        pos = j0 + offs
        key = load_keys(row, pos, end, s_sj, ALIGNED)
        member = ((pos < end) & (key >= tau)).to(tl.int32)
        # A chunk past its region's room makes the row's list longer than cap: the row
        # falls back, so what did not fit is never read.
        at = count + tl.cumsum(member, axis=0) - member
        kept = (member != 0) & (at < region)
        tl.store(keys_out + at, key.to(tl.int32, bitcast=True), mask=kept)
        tl.store(positions_out + at, pos, mask=kept)
        count += tl.sum(member, axis=0)
    tl.store(ws_row + _COUNTS + chunk, count)
    if chunk == 0:
        tl.store(ws_row + _TAU, tau.to(tl.int32, bitcast=True))
    if DEPENDENTS:
        # The select's programs let in only now: waiting early, they would hold the
        # multiprocessors' slots while these programs stream.
        gdc_launch_dependents()


@triton.jit
def _row_list(ws_row, n, num_chunks, K: tl.constexpr, CAP: tl.constexpr, BLOCK_P: tl.constexpr):
    """(chunk counts [BLOCK_P], their total, whether the chunks' lists hold the row's top-k)."""
    chunks = tl.arange(0, BLOCK_P)
    counts = tl.load(ws_row + _COUNTS + chunks, mask=chunks < num_chunks, other=0)
    total = tl.sum(counts, axis=0)
    return counts, total, (total <= CAP) & (total >= tl.minimum(n, K))


@triton.jit
def _select_kernel(
    scores_ptr, key_lens_ptr, ws_ptr, out_ptr,
    num_cols, row_len, num_chunks, region,
    s_st, s_sj, s_kl, s_wt, s_ot, s_ok,
    K: tl.constexpr, CAP: tl.constexpr, BLOCK_P: tl.constexpr, LOG_P: tl.constexpr, PASSES: tl.constexpr,
    BINS: tl.constexpr, RADIX_BITS: tl.constexpr, FIRST_SPARSE_PASS: tl.constexpr, SPARSE_SHARE: tl.constexpr,
    FALLBACK_BLOCK: tl.constexpr, FILL_BLOCK: tl.constexpr, ALIGNED: tl.constexpr, GDC: tl.constexpr,
):
    t = tl.program_id(0)
    if GDC:
        gdc_wait()
        gdc_launch_dependents()
    n = visible_keys(key_lens_ptr, t, s_kl, num_cols)
    row = scores_ptr + t.to(tl.int64) * s_st
    ws_row = ws_ptr + t.to(tl.int64) * s_wt
    out_row = out_ptr + t.to(tl.int64) * s_ot
    counts, total, listed = _row_list(ws_row, n, num_chunks, K, CAP, BLOCK_P)
    if listed:
        # The candidates before each chunk's, for the lanes' search; past the last chunk the
        # total, above every lane. The block's barrier makes them visible to every lane.
        chunks = tl.arange(0, BLOCK_P)
        before = tl.where(chunks < num_chunks, tl.cumsum(counts, axis=0) - counts, total)
        tl.store(ws_row + _BEFORE + chunks, before)
        tl.debug_barrier()
        # Most lists fill well under the cap: half as many lanes halve the search's work.
        if total <= CAP // 2:
            _select_listed(ws_row, out_row, s_ok, total, num_chunks, region, K, CAP // 2, BLOCK_P, LOG_P,
                           FILL_BLOCK)
        else:
            _select_listed(ws_row, out_row, s_ok, total, num_chunks, region, K, CAP, BLOCK_P, LOG_P, FILL_BLOCK)
    else:
        _select_whole_row(row, s_sj, ws_row + _LISTS, out_row, s_ok, n, row_len, K, PASSES, BINS, RADIX_BITS,
                          FIRST_SPARSE_PASS, SPARSE_SHARE, FALLBACK_BLOCK, FILL_BLOCK, ALIGNED)


@triton.jit
def _select_listed(ws_row, out_row, s_ok, total, num_chunks, region, K: tl.constexpr, LANES: tl.constexpr,
                   BLOCK_P: tl.constexpr, LOG_P: tl.constexpr, FILL_BLOCK: tl.constexpr):
    """The row's top-k from its chunks' lists, `total` (<= LANES) keys that hold it: positions in order,
    then -1."""
    lane = tl.arange(0, LANES)
    valid = lane < total
    # Each lane's chunk: the last whose candidates start at or before the lane (an empty
    # chunk starts where the next one does, so it is never the last such).
    chunk = tl.zeros([LANES], dtype=tl.int32)
    for b in tl.static_range(LOG_P):
        probe = chunk + (BLOCK_P >> (b + 1))
        chunk = tl.where(tl.load(ws_row + _BEFORE + probe) <= lane, probe, chunk)
    at = ws_row + _LISTS + chunk * region + lane - tl.load(ws_row + _BEFORE + chunk)
    # Lanes past the list key as 0, below every point the search tries.
    keys = tl.where(valid, tl.load(at, mask=valid, other=0).to(tl.uint32, bitcast=True), 0)
    positions = tl.load(at + num_chunks * region, mask=valid, other=0)
    refine = total > K
    # Every listed key reaches tau; none passes the greatest of them.
    tau = tl.load(ws_row + _TAU).to(tl.uint32, bitcast=True).to(tl.int64)
    lo, c_lo, c_hi = bracket_search(keys, keys, total, K, K, refine, tau, tl.max(keys, axis=0).to(tl.int64) + 1,
                                    False)
    exact = c_lo == K
    kth = tl.where(exact, lo - 1, lo).to(tl.uint32)
    want = tl.where(exact, 0, K - c_hi)
    above, ties = emit_tile(out_row, s_ok, positions, above_kth(keys, valid, kth, total <= K),
                            tie_kth(keys, valid, kth, refine), want, 0, 0, K)
    fill_unselected(out_row, s_ok, tl.minimum(above + tl.minimum(ties, want), K), K, FILL_BLOCK)


@triton.jit
def _select_whole_row(row, s_sj, hist, out_row, s_ok, n, row_len, K: tl.constexpr, PASSES: tl.constexpr,
                      BINS: tl.constexpr, RADIX_BITS: tl.constexpr, FIRST_SPARSE_PASS: tl.constexpr,
                      SPARSE_SHARE: tl.constexpr, BLOCK: tl.constexpr, FILL_BLOCK: tl.constexpr,
                      ALIGNED: tl.constexpr):
    """The row's top-k by the radix select, this program its one chunk (hist: a pass's 256 bins each)."""
    prefix, hi_mask, want, refining, above, ties = initial_state(n, K, row_len, 2)
    for p in tl.static_range(PASSES):
        if refining:
            chunk_histogram(row, s_sj, 0, n, prefix, hi_mask, hist + p * BINS, p, BLOCK, BINS, RADIX_BITS, ALIGNED,
                            p >= FIRST_SPARSE_PASS, SPARSE_SHARE)
            # The histogram's other lanes wrote it: the block's barrier makes their stores visible.
            tl.debug_barrier()
        prefix, hi_mask, want, refining, above, ties = fold_pass(
            hist + p * BINS, BINS, 1, prefix, hi_mask, want, refining, above, ties, p, 2, BINS, RADIX_BITS)
    emit_chunk(row, s_sj, out_row, s_ok, n, 0, row_len, prefix, hi_mask, want, above, ties, K, BLOCK, 2,
               FILL_BLOCK, ALIGNED)


def filtered_region(chunk_len: int, cap: int) -> int:
    """Candidates a chunk's list has room for: all of its keys, or cap (more and the row falls back anyway)."""
    return min(chunk_len, cap)


def filtered_top_k(scores: torch.Tensor, key_lens: torch.Tensor, k: int, out: torch.Tensor, workspace: torch.Tensor,
                   num_chunks: int, chunk_len: int, *, block: int, num_warps: int, cap: int, sample: int,
                   segment: int, stages: int, select_warps: int, fallback_block: int, passes: int, bins: int,
                   radix_bits: int, first_sparse_pass: int, sparse_share: int, fill_block: int,
                   use_pdl: bool) -> torch.Tensor:
    """`dsa_topk.top_k_indices` by a sampled threshold, in two launches; arguments checked by it.

    scores [T, L] float32, key_lens [T] int32, out [T, k] int32, workspace [T, W] int32 with unit
    stride along W = `filtered_workspace_width(num_chunks, filtered_region(chunk_len, cap), passes,
    bins)`; num_chunks <= MAX_CHUNKS chunks of chunk_len scores (a multiple of block) a row; cap (a
    power of two, < 2^16) candidates a row at most; sample (a power of two, at most cap) keys of a
    row's sample, in runs of `segment` neighbours (a power of two at most sample).
    """
    num_rows, num_cols = scores.shape
    if not 1 <= num_chunks <= MAX_CHUNKS:
        raise ValueError(f"num_chunks: expected 1..{MAX_CHUNKS}, got {num_chunks}")
    if cap & (cap - 1) or not k <= cap < 1 << 16:
        raise ValueError(f"cap: expected a power of two in [k, 2^16), got {cap} (k = {k})")
    if sample & (sample - 1) or not 1 <= sample <= cap:
        # Rows of more than cap keys are sampled: at most cap positions stay inside them.
        raise ValueError(f"sample: expected a power of two at most cap = {cap}, got {sample}")
    if segment & (segment - 1) or not 1 <= segment <= sample:
        raise ValueError(f"segment: expected a power of two in [1, sample = {sample}], got {segment}")
    region = filtered_region(chunk_len, cap)
    aligned = num_cols % 4 == 0 and scores.stride(1) == 1 and scores.stride(0) % 4 == 0
    strides = (*scores.stride(), key_lens.stride(0), workspace.stride(0))
    # The list launch waits for the whole of the kernel before it (the scores' writer)
    # anyway; launched as its dependent, its programs would sit on the multiprocessors
    # while that kernel still streams. H200, indexer + top-k + sparse decode, B8 x 128K:
    # 116.8 / 121.7 us against 124.2 / 127.4 us with it a dependent
    # (bench/results/dsa-kernels/h200/logs-archive/topk-filtered-h200-2026-11-26.log).
    _list_kernel[(num_rows, num_chunks)](
        scores, key_lens, workspace, num_cols, chunk_len, num_chunks, region, *strides,
        K=k, SAMPLE=sample, SEGMENT=segment, CAP=cap, BLOCK=block, ALIGNED=aligned, STAGES=stages,
        DEPENDENTS=use_pdl, num_warps=num_warps,
    )
    row_len = triton.cdiv(max(1, num_cols), fallback_block) * fallback_block
    block_p = max(2, next_pow2(num_chunks))
    _select_kernel[(num_rows,)](
        scores, key_lens, workspace, out, num_cols, row_len, num_chunks, region, *strides, *out.stride(),
        K=k, CAP=cap, BLOCK_P=block_p, LOG_P=block_p.bit_length() - 1, PASSES=passes, BINS=bins,
        RADIX_BITS=radix_bits, FIRST_SPARSE_PASS=first_sparse_pass, SPARSE_SHARE=sparse_share,
        FALLBACK_BLOCK=fallback_block, FILL_BLOCK=fill_block, ALIGNED=aligned, GDC=use_pdl, num_warps=select_warps,
        launch_pdl=use_pdl,
    )
    return out
