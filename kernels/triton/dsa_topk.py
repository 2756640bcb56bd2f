"""Top-k selection of the indexer's scores by radix select over row chunks: no sort.

`top_k_indices` is the op; rows short enough for one program's registers are selected
by `dsa_topk_row` where that is faster (`top_k_row_resident`), the rest here.

A row's k best positions are found without ordering the scores. Each float32
score maps to a uint32 key whose unsigned order is the float order; the k-th
largest key is then pinned down one byte at a time, most significant first. A
radix pass builds a 256-bin histogram of the next byte among the keys that share
the bytes fixed so far (the "bucket") and keeps the byte whose bin holds the
k-th largest. Every key above the final bucket is selected; the bucket's keys
fill the remaining places, lowest positions first. Refinement stops early once
the whole bucket is taken (no tie left to break), which for continuous scores
happens after three of the four bytes.

Each row is cut into chunks of whole tiles, and every pass is one launch over
(row, chunk) programs, so a few rows still fill the GPU. A program writes its
chunk's histogram to the workspace [T, 4, chunks + 1, 256]. The next launch's
programs fold their row's chunk histograms of the pass before into the row's
state (the bucket, how many of its keys are still wanted, and per chunk the keys
above the bucket and in it), each the same way, so no program waits for
another; its chunk-0 program stores that state in the pass's extra row, and the
launch after it starts from there, so every launch folds one pass, never
replays them all. The emit launch folds the last pass, which gives every chunk the
number of keys above the bucket and of bucket keys in the chunks before it: its
first output slot. It then writes its chunk's selected positions in ascending
order through one exclusive prefix sum per tile that counts both kinds. A row
whose key count is at most k never refines: its bucket is every visible key. -1
fills the slots after the last selection. Rows that finish early leave later
passes at once.

Triton 3.6 lowers a histogram with warp ballots (one per bit of the bin index,
then, per bin a lane owns, an AND of them and a population count): in the
compiled pass loop about 100 instructions a thread per score it holds at 256
bins, 80 at 128, 58 at 32. A pass is then bound by those instructions (on an
H100, by estimate, about twice the time of reading its scores) whatever the
digit width, so bytes, needing the fewest passes, cost least. Ballots never
serialise on the equal digits that ties and zeros produce, as shared-memory
atomics would. From the third pass on the bucket is usually a small share of the
row, and a tile with few members counts them with one atomic each instead: at
most 1/16 of a tile's keys, so equal digits serialise little there.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from ..checks import check_dtype, check_same_device, check_shape
from ._common import next_pow2, pdl, sm_count
from .dsa_topk_row import row_top_k_fits, row_top_k_indices
from .topk_shared import emit_tile, fill_unselected, load_keys

_RADIX_BITS = 8
_BINS = 1 << _RADIX_BITS
# A narrower last digit when the width does not divide 32.
_PASSES = -(-32 // _RADIX_BITS)
# Output slots per step of the -1 fill.
_FILL_BLOCK = 1024


@dataclass(frozen=True, slots=True)
class TopKConfig:
    """Scores per step of a program, and its warps."""

    block: int
    num_warps: int


# 16 scores a thread at 8 warps (four 16-byte loads).
_GPU_CONFIG = TopKConfig(block=4096, num_warps=8)
# The interpreter's cost is per step, and test rows are short.
_INTERPRETER_CONFIG = TopKConfig(block=32, num_warps=4)

# Programs aimed for per multiprocessor, and the most chunks of one row (each
# program of a pass sums all of its row's chunk histograms). A pass is bound by
# the histogram's instructions, not by memory: several 8-warp programs a
# multiprocessor keep its four schedulers busy.
_PROGRAMS_PER_SM = 4
_MAX_CHUNKS = 32
# A tile whose bucket members are at most 1/_SPARSE_SHARE of its keys counts them
# with atomics, from the third pass on. The first two digits are the sign, the
# exponent and the mantissa's top bits: after the first, the bucket still holds the
# keys of one or two binades (a large share of a row); after the second, few keys.
_SPARSE_SHARE = 16
_FIRST_SPARSE_PASS = 2


# Where one program a row (`dsa_topk_row`) beats the chunked passes, on an H100 (132
# multiprocessors; bench/results/logs/topk-row-h100-2026-11-23.log): rows up to 8K always
# (one launch instead of five: B1 x 2K 7.5 vs 18 us, B512 x 4K 26 vs 45 us). A program's
# search over a 32K row takes ~40 us however many rows run beside it (one a multiprocessor),
# while the chunked passes grow with the rows (B8 x 32K 24 us, B64 x 32K 55 us, about
# linearly): they cross near 50 rows, so longer rows go one a program from 3/8 of the
# multiprocessor count on (B64 x 32K: 45 us).
_ROW_ALWAYS_COLS = 8192


def top_k_row_resident(num_rows: int, num_cols: int, device: torch.device | str) -> bool:
    """Whether `top_k_indices` selects [num_rows, num_cols] scores one program a row by default."""
    device = torch.device(device)
    if not row_top_k_fits(num_cols):
        return False
    return num_cols <= _ROW_ALWAYS_COLS or 8 * num_rows >= 3 * sm_count(device)


def top_k_config(device: torch.device) -> TopKConfig:
    return _GPU_CONFIG if device.type == "cuda" else _INTERPRETER_CONFIG


def _chunking(num_rows: int, num_cols: int, device: torch.device, config: TopKConfig,
              num_chunks: int | None) -> tuple[int, int]:
    """(chunks per row, scores per chunk, a multiple of the block): static shapes and the device only."""
    if num_chunks is None:
        wanted = triton.cdiv(_PROGRAMS_PER_SM * sm_count(device), max(1, num_rows))
        num_chunks = max(1, min(wanted, triton.cdiv(num_cols, config.block), _MAX_CHUNKS))
    chunk_len = triton.cdiv(triton.cdiv(max(1, num_cols), num_chunks), config.block) * config.block
    return triton.cdiv(max(1, num_cols), chunk_len), chunk_len


def top_k_num_chunks(num_rows: int, num_cols: int, device: torch.device | str,
                     config: TopKConfig | None = None) -> int:
    """Chunks per row of `top_k_indices`: depends only on static shapes and the device."""
    device = torch.device(device)
    return _chunking(num_rows, num_cols, device, config or top_k_config(device), None)[0]


def top_k_workspace(num_rows: int, num_cols: int, device: torch.device | str,
                    config: TopKConfig | None = None) -> torch.Tensor:
    """Chunk histograms for `top_k_indices(..., workspace=...)`, to allocate once per static shape.

    returns [T, 4, P + 1, 256] int32, P = top_k_num_chunks(T, L, device): per pass, the chunk
    histograms and the row's state after that pass.
    """
    chunks = top_k_num_chunks(num_rows, num_cols, device, config)
    return torch.empty((num_rows, _PASSES, chunks + 1, _BINS), dtype=torch.int32, device=device)


# Where a pass's state row (chunk row P of its workspace slice) keeps the row's selection.
_STATE_ABOVE = tl.constexpr(8)
_STATE_TIES = tl.constexpr(128)
# Chunks a state row has room for.
_MAX_STATE_CHUNKS = 128 - 8


@triton.jit
def _initial_state(n, K, chunk_len, BLOCK_P: tl.constexpr):
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
def _load_state(state_ptr, num_chunks, BLOCK_P: tl.constexpr):
    chunks = tl.arange(0, BLOCK_P)
    chunk_mask = chunks < num_chunks
    prefix = tl.load(state_ptr).to(tl.uint32, bitcast=True)
    hi_mask = tl.load(state_ptr + 1).to(tl.uint32, bitcast=True)
    want = tl.load(state_ptr + 2)
    refining = tl.load(state_ptr + 3) != 0
    above = tl.load(state_ptr + _STATE_ABOVE + chunks, mask=chunk_mask, other=0)
    ties = tl.load(state_ptr + _STATE_TIES + chunks, mask=chunk_mask, other=0)
    return prefix, hi_mask, want, refining, above, ties


@triton.jit
def _store_state(state_ptr, num_chunks, prefix, hi_mask, want, refining, above, ties,
                 BLOCK_P: tl.constexpr, BINS: tl.constexpr):
    lane = tl.arange(0, BINS)
    scalars = tl.where(lane == 0, prefix.to(tl.int32, bitcast=True), 0)
    scalars = tl.where(lane == 1, hi_mask.to(tl.int32, bitcast=True), scalars)
    scalars = tl.where(lane == 2, want, scalars)
    scalars = tl.where(lane == 3, refining.to(tl.int32), scalars)
    tl.store(state_ptr + lane, scalars, mask=lane < 4)
    chunks = tl.arange(0, BLOCK_P)
    tl.store(state_ptr + _STATE_ABOVE + chunks, above, mask=chunks < num_chunks)
    tl.store(state_ptr + _STATE_TIES + chunks, ties, mask=chunks < num_chunks)


@triton.jit
def _fold_pass(hist_ptr, s_wc, num_chunks, prefix, hi_mask, want, refining, above, ties,
               PASS: tl.constexpr, BLOCK_P: tl.constexpr, BINS: tl.constexpr, RADIX_BITS: tl.constexpr):
    """A row's selection after pass PASS, from the one before it and that pass's chunk histograms.

    The bucket is the keys whose bits under hi_mask equal prefix; `want` of its keys are
    still to be taken after every key above it; refining says whether another pass is
    needed; per chunk, `above` counts its keys above the bucket and `ties` its keys in it.
    A row that has stopped refining has no histograms for the pass, and keeps its state.
    """
    if refining:
        chunks = tl.arange(0, BLOCK_P)
        bins = tl.arange(0, BINS)
        hist = tl.load(hist_ptr + chunks[:, None] * s_wc + bins[None, :],
                       mask=(chunks < num_chunks)[:, None], other=0)                        # [BLOCK_P, BINS]
        total = tl.sum(hist, axis=0)
        # at_least[b]: bucket keys whose next digit is >= b (non-increasing in b);
        # the k-th largest lies in the highest bin where it reaches `want`.
        at_least = tl.cumsum(total, axis=0, reverse=True)
        chosen = tl.sum((at_least >= want).to(tl.int32), axis=0) - 1
        in_bin = tl.sum(tl.where(bins == chosen, total, 0), axis=0)
        want -= tl.sum(tl.where(bins == chosen, at_least, 0), axis=0) - in_bin
        above += tl.sum(tl.where(bins[None, :] > chosen, hist, 0), axis=1)
        ties = tl.sum(tl.where(bins[None, :] == chosen, hist, 0), axis=1)
        # Digit PASS covers bits [shift, shift + width): the last digit is narrower.
        below = 32 - RADIX_BITS * (PASS + 1)
        shift = below * (below > 0)
        width = 32 - RADIX_BITS * PASS - shift
        prefix = prefix | (chosen.to(tl.uint32) << shift)
        hi_mask = hi_mask | (tl.full([], (1 << width) - 1, tl.uint32) << shift)
        refining = in_bin > want
    return prefix, hi_mask, want, refining, above, ties


@triton.jit
def _state_before(ws_row, s_wp, s_wc, n, K, chunk_len, num_chunks, chunk,
                  PASS: tl.constexpr, STORE: tl.constexpr, BLOCK_P: tl.constexpr, BINS: tl.constexpr,
                  RADIX_BITS: tl.constexpr):
    """A row's selection before pass PASS (PASS = the pass count: after the last one).

    Launch PASS folds the previous pass's histograms into the state the launch before
    it stored (one pass of arithmetic, the same in every program of the row, so no
    program waits for another), and its chunk-0 program stores the result for the next.
    """
    if PASS == 0:
        prefix, hi_mask, want, refining, above, ties = _initial_state(n, K, chunk_len, BLOCK_P)
    else:
        if PASS == 1:
            prefix, hi_mask, want, refining, above, ties = _initial_state(n, K, chunk_len, BLOCK_P)
        else:
            prefix, hi_mask, want, refining, above, ties = _load_state(
                ws_row + (PASS - 1) * s_wp + num_chunks * s_wc, num_chunks, BLOCK_P)
        prefix, hi_mask, want, refining, above, ties = _fold_pass(
            ws_row + (PASS - 1) * s_wp, s_wc, num_chunks, prefix, hi_mask, want, refining, above, ties,
            PASS - 1, BLOCK_P, BINS, RADIX_BITS)
        if STORE and chunk == 0:
            _store_state(ws_row + PASS * s_wp + num_chunks * s_wc, num_chunks, prefix, hi_mask, want, refining,
                         above, ties, BLOCK_P, BINS)
    return prefix, hi_mask, want, refining, above, ties


@triton.jit
def _histogram_kernel(
    scores_ptr, key_lens_ptr, ws_ptr,
    num_cols, chunk_len, num_chunks,
    s_st, s_sj, s_kl, s_wt, s_wp, s_wc,
    K: tl.constexpr, PASS: tl.constexpr, BLOCK: tl.constexpr, BLOCK_P: tl.constexpr,
    BINS: tl.constexpr, RADIX_BITS: tl.constexpr, ALIGNED: tl.constexpr,
    SPARSE_PATH: tl.constexpr, SPARSE_SHARE: tl.constexpr, GDC: tl.constexpr,
):
    t = tl.program_id(0)
    chunk = tl.program_id(1)
    if GDC:
        gdc_wait()
        gdc_launch_dependents()
    n = tl.minimum(tl.maximum(tl.load(key_lens_ptr + t * s_kl), 0), num_cols)
    ws_row = ws_ptr + t.to(tl.int64) * s_wt
    prefix, hi_mask, want, refining, above, ties = _state_before(
        ws_row, s_wp, s_wc, n, K, chunk_len, num_chunks, chunk, PASS, True, BLOCK_P, BINS, RADIX_BITS)
    if refining:
        row = scores_ptr + t.to(tl.int64) * s_st
        offs = tl.arange(0, BLOCK)
        start = tl.multiple_of(chunk * chunk_len, BLOCK)
        end = tl.minimum(start + chunk_len, n)
        below = 32 - RADIX_BITS * (PASS + 1)
        shift = below * (below > 0)
        digit_mask = (1 << (32 - RADIX_BITS * PASS - shift)) - 1
        slot = ws_row + PASS * s_wp + chunk * s_wc
        bins = tl.arange(0, BINS)
        if SPARSE_PATH:
            # The program's own histogram slot takes the sparse tiles' atomic adds.
            tl.store(slot + bins, tl.zeros([BINS], dtype=tl.int32))
            tl.debug_barrier()
        hist = tl.zeros([BINS], dtype=tl.int32)
        for j0 in range(start, end, BLOCK):
            pos = j0 + offs
            key = load_keys(row, pos, end, s_sj, ALIGNED)
            member = (pos < end) & ((key & hi_mask) == prefix)
            digit = ((key >> shift) & digit_mask).to(tl.int32)
            if SPARSE_PATH:
                # Past the first digit a bucket is usually a small share of the row: a
                # tile with few members adds them one by one (an atomic per member, where
                # the histogram costs its instructions for every key of the tile).
                if tl.sum(member.to(tl.int32), axis=0) * SPARSE_SHARE <= BLOCK:
                    tl.atomic_add(slot + digit, tl.full([BLOCK], 1, tl.int32), mask=member, sem="relaxed")
                else:
                    hist += tl.histogram(digit, BINS, mask=member)
            else:
                hist += tl.histogram(digit, BINS, mask=member)
        if SPARSE_PATH:
            tl.debug_barrier()
            tl.atomic_add(slot + bins, hist, sem="relaxed")
        else:
            tl.store(slot + bins, hist)


@triton.jit
def _emit_kernel(
    scores_ptr, key_lens_ptr, ws_ptr, out_ptr,
    num_cols, chunk_len, num_chunks,
    s_st, s_sj, s_kl, s_wt, s_wp, s_wc, s_ot, s_ok,
    K: tl.constexpr, PASSES: tl.constexpr, BLOCK: tl.constexpr, BLOCK_P: tl.constexpr,
    BINS: tl.constexpr, RADIX_BITS: tl.constexpr, FILL_BLOCK: tl.constexpr, ALIGNED: tl.constexpr,
    GDC: tl.constexpr,
):
    t = tl.program_id(0)
    chunk = tl.program_id(1)
    if GDC:
        gdc_wait()
        gdc_launch_dependents()
    n = tl.minimum(tl.maximum(tl.load(key_lens_ptr + t * s_kl), 0), num_cols)
    prefix, hi_mask, want, refining, above, ties = _state_before(
        ws_ptr + t.to(tl.int64) * s_wt, s_wp, s_wc, n, K, chunk_len, num_chunks, chunk, PASSES, False, BLOCK_P,
        BINS, RADIX_BITS)
    bucket_max = prefix | ~hi_mask
    before = tl.arange(0, BLOCK_P) < chunk
    # Keys above the bucket are all taken; of the bucket's, the first `want` by position.
    above_seen = tl.sum(tl.where(before, above, 0), axis=0)
    ties_seen = tl.sum(tl.where(before, ties, 0), axis=0)

    row = scores_ptr + t.to(tl.int64) * s_st
    out_row = out_ptr + t.to(tl.int64) * s_ot
    offs = tl.arange(0, BLOCK)
    start = tl.multiple_of(chunk * chunk_len, BLOCK)
    end = tl.minimum(start + chunk_len, n)
    for j0 in range(start, end, BLOCK):
        pos = j0 + offs
        valid = pos < end
        key = load_keys(row, pos, end, s_sj, ALIGNED)
        is_above = (valid & (key > bucket_max)).to(tl.int32)
        tie = (valid & ((key & hi_mask) == prefix)).to(tl.int32)
        above_seen, ties_seen = emit_tile(out_row, s_ok, pos, is_above, tie, want, above_seen, ties_seen, K)
    if chunk == 0:
        fill_unselected(out_row, s_ok, tl.minimum(n, K), K, FILL_BLOCK)


def top_k_indices(
    scores: torch.Tensor,
    key_lens: torch.Tensor,
    *,
    k: int,
    out: torch.Tensor | None = None,
    workspace: torch.Tensor | None = None,
    num_chunks: int | None = None,
    config: TopKConfig | None = None,
    row_resident: bool | None = None,
) -> torch.Tensor:
    """The positions of each row's k largest scores, in ascending position order.

    scores:     [T, L] float32 (any strides); only j < key_lens[t] are candidates
    key_lens:   [T] int32 candidates per row (clamped to [0, L]); 0 marks a padded row
    k:          positions per row, >= 1
    out:        [T, k] int32 to write into, or None
    workspace:  [T, 4, P + 1, 256] int32 from `top_k_workspace` (a captured graph then
                allocates nothing), or None to allocate it here
    num_chunks: overrides `top_k_num_chunks` (tests); must match the workspace
    config:     overrides the block size and warps (benchmark sweeps)
    row_resident: True selects with one program a row holding the row in registers
                (`dsa_topk_row`; rows of at most 32K + 4K scores), False with the chunked radix
                passes here; None (the default) picks by the static shape and the device
                (`top_k_row_resident`) unless num_chunks is given. The first uses no workspace.
    returns     indices [T, k] int32: the k best of j < key_lens[t], ties broken toward
                the lower position, listed in ascending order; when key_lens[t] < k every
                visible position in order, then -1.
    """
    if k < 1:
        raise ValueError(f"k: expected >= 1, got {k}")
    if num_chunks is not None and not 1 <= num_chunks <= _MAX_STATE_CHUNKS:
        raise ValueError(f"num_chunks: expected 1..{_MAX_STATE_CHUNKS}, got {num_chunks}")
    num_rows, num_cols = scores.shape
    check_shape("key_lens", key_lens, (num_rows,))
    check_dtype("scores", scores, (torch.float32,))
    check_dtype("key_lens", key_lens, (torch.int32,))
    check_same_device(scores=scores, key_lens=key_lens)
    device = scores.device
    config = config or top_k_config(device)
    if not 1 <= config.block < 1 << 16:
        # The emit's scan counts a block's keys in 16-bit halves of one int32.
        raise ValueError(f"config.block: expected 1..{(1 << 16) - 1}, got {config.block}")
    if out is None:
        out = torch.empty((num_rows, k), dtype=torch.int32, device=device)
    else:
        check_shape("out", out, (num_rows, k))
        check_dtype("out", out, (torch.int32,))
        check_same_device(scores=scores, out=out)
    if row_resident is None:
        row_resident = num_chunks is None and top_k_row_resident(num_rows, num_cols, device)
    if row_resident:
        if num_chunks is not None:
            raise ValueError(f"num_chunks: a row-resident top-k has no chunks, got {num_chunks}")
        return row_top_k_indices(scores, key_lens, k, out)
    chunks, chunk_len = _chunking(num_rows, num_cols, device, config, num_chunks)
    if workspace is None:
        workspace = torch.empty((num_rows, _PASSES, chunks + 1, _BINS), dtype=torch.int32, device=device)
    else:
        check_shape("workspace", workspace, (num_rows, _PASSES, chunks + 1, _BINS))
        check_dtype("workspace", workspace, (torch.int32,))
        check_same_device(scores=scores, workspace=workspace)
        if workspace.stride(3) != 1:
            raise ValueError(f"workspace: expected unit stride along its bins, got strides {workspace.stride()}")
    if num_rows == 0:
        return out
    aligned = num_cols % 4 == 0 and scores.stride(1) == 1 and scores.stride(0) % 4 == 0
    use_pdl = pdl(device)
    grid = (num_rows, chunks)
    common = dict(BLOCK=config.block, BLOCK_P=max(2, next_pow2(chunks)), BINS=_BINS, RADIX_BITS=_RADIX_BITS,
                  ALIGNED=aligned, GDC=use_pdl, num_warps=config.num_warps, launch_pdl=use_pdl)
    for radix_pass in range(_PASSES):
        _histogram_kernel[grid](
            scores, key_lens, workspace,
            num_cols, chunk_len, chunks,
            *scores.stride(), key_lens.stride(0), *workspace.stride()[:3],
            K=k, PASS=radix_pass, SPARSE_PATH=radix_pass >= _FIRST_SPARSE_PASS, SPARSE_SHARE=_SPARSE_SHARE,
            **common,
        )
    _emit_kernel[grid](
        scores, key_lens, workspace, out,
        num_cols, chunk_len, chunks,
        *scores.stride(), key_lens.stride(0), *workspace.stride()[:3], *out.stride(),
        K=k, PASSES=_PASSES, FILL_BLOCK=_FILL_BLOCK, **common,
    )
    return out
