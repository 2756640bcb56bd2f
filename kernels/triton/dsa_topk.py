"""Top-k selection of the indexer's scores by radix select over row chunks: no sort.

`top_k_indices` is the op; `top_k_path` says which kernel selects a shape by default:
rows of up to 8K one program each (`dsa_topk_row`); on a GPU, longer rows by the keys
above a sampled threshold (`dsa_topk_filtered`), or a lone row by the radix select below
in one launch (`dsa_topk_synced`); in the interpreter, this module's launch per radix pass.

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
from typing import Literal

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from ..checks import check_dtype, check_same_device, check_shape
from ._common import next_pow2, pdl, sm_count
from .dsa_topk_filtered import MAX_CHUNKS as _MAX_FILTERED_CHUNKS
from .dsa_topk_filtered import filtered_region, filtered_top_k, filtered_workspace_width
from .dsa_topk_row import row_top_k_fits, row_top_k_indices
from .dsa_topk_synced import synced_max_chunks, synced_top_k
from .topk_radix import chunk_histogram, emit_chunk, fold_pass, initial_state
from .topk_shared import visible_keys

_RADIX_BITS = 8
_BINS = 1 << _RADIX_BITS
# A narrower last digit when the width does not divide 32.
_PASSES = -(-32 // _RADIX_BITS)
# Output slots per step of the -1 fill.
_FILL_BLOCK = 1024


@dataclass(frozen=True, slots=True)
class TopKConfig:
    """Scores per step of a program, its warps, and (synced path) the registers a thread may use:
    at 8 warps and 128, two programs a multiprocessor stay resident."""

    block: int
    num_warps: int
    max_registers: int = 128


# 16 scores a thread at 8 warps (four 16-byte loads).
_GPU_CONFIG = TopKConfig(block=4096, num_warps=8)
# The synced path's tiles where more rows share the GPU: four 4-warp programs a multiprocessor.
_GPU_NARROW_CONFIG = TopKConfig(block=2048, num_warps=4)
_NARROW_MAX_TILES = 3
# The interpreter's cost is per step, and test rows are short.
_INTERPRETER_CONFIG = TopKConfig(block=32, num_warps=4)

# Programs aimed for per multiprocessor, and the most chunks of one row (each
# program of a pass sums all of its row's chunk histograms). A pass is bound by
# the histogram's instructions, not by memory: several 8-warp programs a
# multiprocessor keep its four schedulers busy.
_PROGRAMS_PER_SM = 4
_MAX_CHUNKS = 32
# The synced path's chunks a row: at most 64 (they trade their counts once, in one tile).
_MAX_SYNCED_CHUNKS = 64
# A tile whose bucket members are at most 1/_SPARSE_SHARE of its keys counts them
# with atomics, from the third pass on. The first two digits are the sign, the
# exponent and the mantissa's top bits: after the first, the bucket still holds the
# keys of one or two binades (a large share of a row); after the second, few keys.
_SPARSE_SHARE = 16
_FIRST_SPARSE_PASS = 2


# Where one program a row (`dsa_topk_row`) beats the chunked passes, on an H100 (132
# multiprocessors; bench/results/dsa-kernels/h100/logs-archive/topk-row-h100-2026-11-23.log): rows up to 8K always
# (one launch instead of five: B1 x 2K 7.5 vs 18 us, B512 x 4K 26 vs 45 us). A program's
# search over a 32K row takes ~40 us however many rows run beside it (one a multiprocessor),
# while the chunked passes grow with the rows (B8 x 32K 24 us, B64 x 32K 55 us, about
# linearly): they cross near 50 rows. On a GPU the filtered path now beats both on longer
# rows (`top_k_path`); the interpreter's default keeps the crossing.
_ROW_ALWAYS_COLS = 8192


# The filtered path's list launch: light per key (a compare, a scan), so 4-warp programs
# of 1K-key tiles, several a multiprocessor.
_GPU_FILTER_CONFIG = TopKConfig(block=1024, num_warps=4)
# Swept on an H200 (bench/results/dsa-kernels/h200/logs-archive/topk-filtered-h200-2026-11-26.log): about four
# programs a multiprocessor (B64 x 128K 49.8 us, two 55.1, eight 53.0); the rest measured in
# the path's earlier three-launch form: each loop's loads three tiles ahead (B64 x 128K 69
# us against 89 with none ahead), a search of 8 warps over up to 8K candidates (16 were no
# faster), and the next launch let in only once a program's reads are done (56.4 us, 60.1
# when let in at the start, where its waiting programs hold the multiprocessors' slots).
_FILTER_PROGRAMS_PER_SM = 4
_FILTER_STAGES = 3
_FILTER_SELECT_WARPS = 8
# The sample reads runs of 8 neighbours, a 32-byte sector each: a row's programs all
# read it, and 2048 single keys would be 2048 sectors (B64 x 128K 68.1 -> 60.1 us, in the
# three-launch form).
_SAMPLE_SEGMENT = 8
# The synced path takes fewer rows than this, of more scores than that, where it fits (`top_k_path`).
_SYNCED_MAX_ROWS = 16
_SYNCED_MIN_COLS = 24 * 1024
# Its sample of a row: 2048 keys put the k-th key's share of a 32K row (k 2048) at 128 of them.
_GPU_SAMPLE = 2048
_INTERPRETER_SAMPLE = 64
# Its fallback (a whole row by one program) reads tiles of this many keys.
_GPU_FALLBACK_BLOCK = 1024


def filter_sizes(k: int, device: torch.device) -> tuple[int, int]:
    """The filtered path's (cap, sample): candidates a row may keep (a power of two, >= 4k) and sampled keys."""
    cap = max(1024 if device.type == "cuda" else 32, 4 * next_pow2(k))
    return cap, min(cap, _GPU_SAMPLE if device.type == "cuda" else _INTERPRETER_SAMPLE)


TopKPath = Literal["row", "passes", "synced", "filtered"]
TOP_K_PATHS: tuple[TopKPath, ...] = ("row", "passes", "synced", "filtered")


def _synced_gpu_config(num_rows: int, num_cols: int, device: torch.device) -> TopKConfig | None:
    """The synced path's tiles on a GPU by default: None where it should not take the shape.

    Every 4K tile a program of 8 warps where all of them stay resident (few rows); else 2K
    tiles, at most 3 a program of 4 warps. H200, k 2048, decode rows (ctx + 64 scores),
    indexer scores, us, synced vs a launch a pass: B1 x 128K 18.2 vs 30.3; B8 x 128K 26.8
    vs 46.1; B16 x 128K 42.9 vs 57.5; B32 x 32K 31.4 vs 44.7; B64 x 16K 31.2 vs 43.7; B64 x
    32K (3 tiles a program) 47.1 vs 62.2; B64 x 64K (4) 92.4 vs 89.7; B64 x 128K (8) 168.8 vs
    147.0 (bench/results/dsa-kernels/h200/logs-archive/topk-synced-sums-h200-2026-11-26.log).
    """
    for config, most_tiles in ((_GPU_CONFIG, 1), (_GPU_NARROW_CONFIG, _NARROW_MAX_TILES)):
        resident = synced_max_chunks(1, device, config.num_warps, config.max_registers)
        if num_rows * triton.cdiv(num_cols, config.block) <= most_tiles * resident:
            return config
    return None


def top_k_path(num_rows: int, num_cols: int, device: torch.device | str) -> TopKPath:
    """The path `top_k_indices` selects [num_rows, num_cols] scores by, by default.

    "row": one program a row holding it in registers (`dsa_topk_row`); "synced": the radix
    passes in one launch (`dsa_topk_synced`), on a GPU when few rows' tiles fall to each
    resident program; "filtered": a sampled threshold's candidates, then a search over them
    (`dsa_topk_filtered`), on a GPU otherwise; "passes": a launch per radix pass (here).
    """
    device = torch.device(device)
    fits = row_top_k_fits(num_cols)
    if device.type != "cuda":
        if fits and (num_cols <= _ROW_ALWAYS_COLS or 8 * num_rows >= 3 * sm_count(device)):
            return "row"
        return "passes"
    if num_cols <= _ROW_ALWAYS_COLS:
        return "row"
    # The filtered path reads the scores once and histograms none; only few long rows, each
    # one program's search over a few thousand candidates after a launch over the row's
    # chunks, are slower than the synced path's passes. H200, indexer scores of decode rows,
    # us, filtered / synced (passes, row): B1 x 128K 20.9 / 17.7; B8 x 128K 27.4 / 26.4; B16
    # x 128K 29.7 / 44.5; B8 x 32K 18.9 / 16.3; B32 x 32K 28.4 / 30.9; B64 x 32K 27.5 / 46.2;
    # B64 x 128K 49.2 / (145.9); B128 x 32K 34.3 / (row 49.0); at k 512 (V4's CSA at 64K), B1
    # x 16K 10.8 / 15.5, B64 18.7 / 31.0, B128 22.0 / (row 38.3)
    # (bench/results/dsa-kernels/h200/logs-archive/topk-filtered-h200-2026-11-26.log).
    if (num_rows < _SYNCED_MAX_ROWS and num_cols > _SYNCED_MIN_COLS
            and _synced_gpu_config(num_rows, num_cols, device) is not None):
        return "synced"
    return "filtered"


def top_k_config(device: torch.device, num_rows: int = 0, num_cols: int = 0,
                 path: TopKPath = "passes") -> TopKConfig:
    """The tiles `top_k_indices` takes by default on `path` for [num_rows, num_cols] scores."""
    if device.type != "cuda":
        return _INTERPRETER_CONFIG
    if path == "synced":
        return _synced_gpu_config(num_rows, num_cols, device) or _GPU_CONFIG
    if path == "filtered":
        return _GPU_FILTER_CONFIG
    return _GPU_CONFIG


def _chunking(num_rows: int, num_cols: int, device: torch.device, config: TopKConfig, path: TopKPath,
              num_chunks: int | None) -> tuple[int, int]:
    """(chunks per row, scores per chunk, a multiple of the block): static shapes and the device only."""
    if num_chunks is None:
        tiles = triton.cdiv(num_cols, config.block)
        if path == "synced":
            # As many as stay resident: each program's passes are bound by its histogram's instructions.
            num_chunks = max(1, min(synced_max_chunks(num_rows, device, config.num_warps, config.max_registers),
                                    tiles, _MAX_SYNCED_CHUNKS))
        elif path == "filtered":
            wanted = triton.cdiv(_FILTER_PROGRAMS_PER_SM * sm_count(device), max(1, num_rows))
            num_chunks = max(1, min(wanted, tiles, _MAX_FILTERED_CHUNKS))
        else:
            wanted = triton.cdiv(_PROGRAMS_PER_SM * sm_count(device), max(1, num_rows))
            num_chunks = max(1, min(wanted, tiles, _MAX_CHUNKS))
    chunk_len = triton.cdiv(triton.cdiv(max(1, num_cols), num_chunks), config.block) * config.block
    return triton.cdiv(max(1, num_cols), chunk_len), chunk_len


def top_k_num_chunks(num_rows: int, num_cols: int, device: torch.device | str,
                     config: TopKConfig | None = None, path: TopKPath | None = None) -> int:
    """Chunks per row of `top_k_indices` on `path` (by default `top_k_path`'s; the row path has
    one): depends only on static shapes and the device."""
    device = torch.device(device)
    path = path or top_k_path(num_rows, num_cols, device)
    if path == "row":
        return 1
    config = config or top_k_config(device, num_rows, num_cols, path)
    return _chunking(num_rows, num_cols, device, config, path, None)[0]


def top_k_workspace(num_rows: int, num_cols: int, device: torch.device | str,
                    config: TopKConfig | None = None, path: TopKPath | None = None, *, k: int) -> torch.Tensor:
    """Chunk histograms for `top_k_indices(..., workspace=...)`, to allocate once per static shape.

    returns [T, 4, P + 1, 256] int32, P = top_k_num_chunks(T, L, device, config, path): per
    pass, the chunk histograms and the row's state after that pass; for the synced path
    [T, 5, 1, 256]: per pass the row's histogram, then the chunks' final counts; for the
    filtered path [T, 1, 1, W]: a row's threshold, chunk counts, candidates (their room
    depends on k) and fallback histograms (`dsa_topk_filtered`).
    """
    if k < 1:
        raise ValueError(f"k: expected >= 1, got {k}")
    device = torch.device(device)
    path = path or top_k_path(num_rows, num_cols, device)
    chunks, chunk_len = 1, num_cols
    if path != "row":
        config = config or top_k_config(device, num_rows, num_cols, path)
        chunks, chunk_len = _chunking(num_rows, num_cols, device, config, path, None)
    return torch.empty(_workspace_shape(num_rows, chunks, chunk_len, path, k, device), dtype=torch.int32,
                       device=device)


def _workspace_shape(num_rows: int, chunks: int, chunk_len: int, path: TopKPath, k: int,
                     device: torch.device) -> tuple[int, int, int, int]:
    if path == "synced":
        # Its chunks add into the row's histograms, and trade their counts in a plane more.
        return num_rows, _PASSES + 1, 1, _BINS
    if path == "filtered":
        region = filtered_region(chunk_len, filter_sizes(k, device)[0])
        return num_rows, 1, 1, filtered_workspace_width(chunks, region, _PASSES, _BINS)
    return num_rows, _PASSES, chunks + 1, _BINS


# Where a pass's state row (chunk row P of its workspace slice) keeps the row's selection.
_STATE_ABOVE = tl.constexpr(8)
_STATE_TIES = tl.constexpr(128)
# Chunks a state row has room for.
_MAX_STATE_CHUNKS = 128 - 8


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
def _state_before(ws_row, s_wp, s_wc, n, K, chunk_len, num_chunks, chunk,
                  PASS: tl.constexpr, STORE: tl.constexpr, BLOCK_P: tl.constexpr, BINS: tl.constexpr,
                  RADIX_BITS: tl.constexpr):
    """A row's selection before pass PASS (PASS = the pass count: after the last one).

    Launch PASS folds the previous pass's histograms into the state the launch before
    it stored (one pass of arithmetic, the same in every program of the row, so no
    program waits for another), and its chunk-0 program stores the result for the next.
    """
    if PASS == 0:
        prefix, hi_mask, want, refining, above, ties = initial_state(n, K, chunk_len, BLOCK_P)
    else:
        if PASS == 1:
            prefix, hi_mask, want, refining, above, ties = initial_state(n, K, chunk_len, BLOCK_P)
        else:
            prefix, hi_mask, want, refining, above, ties = _load_state(
                ws_row + (PASS - 1) * s_wp + num_chunks * s_wc, num_chunks, BLOCK_P)
        prefix, hi_mask, want, refining, above, ties = fold_pass(
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
    n = visible_keys(key_lens_ptr, t, s_kl, num_cols)
    ws_row = ws_ptr + t.to(tl.int64) * s_wt
    prefix, hi_mask, want, refining, above, ties = _state_before(
        ws_row, s_wp, s_wc, n, K, chunk_len, num_chunks, chunk, PASS, True, BLOCK_P, BINS, RADIX_BITS)
    if refining:
        start = tl.multiple_of(chunk * chunk_len, BLOCK)
        chunk_histogram(scores_ptr + t.to(tl.int64) * s_st, s_sj, start, tl.minimum(start + chunk_len, n),
                        prefix, hi_mask, ws_row + PASS * s_wp + chunk * s_wc, PASS, BLOCK, BINS, RADIX_BITS,
                        ALIGNED, SPARSE_PATH, SPARSE_SHARE)


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
    n = visible_keys(key_lens_ptr, t, s_kl, num_cols)
    prefix, hi_mask, want, refining, above, ties = _state_before(
        ws_ptr + t.to(tl.int64) * s_wt, s_wp, s_wc, n, K, chunk_len, num_chunks, chunk, PASSES, False, BLOCK_P,
        BINS, RADIX_BITS)
    emit_chunk(scores_ptr + t.to(tl.int64) * s_st, s_sj, out_ptr + t.to(tl.int64) * s_ot, s_ok, n, chunk, chunk_len,
               prefix, hi_mask, want, above, ties, K, BLOCK, BLOCK_P, FILL_BLOCK, ALIGNED)


def top_k_indices(
    scores: torch.Tensor,
    key_lens: torch.Tensor,
    *,
    k: int,
    out: torch.Tensor | None = None,
    workspace: torch.Tensor | None = None,
    num_chunks: int | None = None,
    config: TopKConfig | None = None,
    path: TopKPath | None = None,
) -> torch.Tensor:
    """The positions of each row's k largest scores, in ascending position order.

    scores:     [T, L] float32 (any strides); only j < key_lens[t] are candidates
    key_lens:   [T] int32 candidates per row (clamped to [0, L]); 0 marks a padded row
    k:          positions per row, >= 1
    out:        [T, k] int32 to write into, or None
    workspace:  int32 from `top_k_workspace` for the same path (a captured graph then
                allocates nothing), or None to allocate it here; the row path uses none
    num_chunks: overrides `top_k_num_chunks` (tests, sweeps); must match the workspace
    config:     overrides the tiles of `top_k_config` (benchmark sweeps)
    path:       "row" (one program a row holding it in registers, `dsa_topk_row`: rows of at
                most 32K + 4K scores), "passes" (a launch per radix pass), "synced" (the
                passes in one launch, `dsa_topk_synced`) or "filtered" (the keys above a
                sampled threshold, then a search over them: `dsa_topk_filtered`); None (the
                default) takes `top_k_path`'s, or "passes" when num_chunks is given.
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
    if config is not None and not 1 <= config.block < 1 << 16:
        # The emit's scan counts a block's keys in 16-bit halves of one int32.
        raise ValueError(f"config.block: expected 1..{(1 << 16) - 1}, got {config.block}")
    if out is None:
        out = torch.empty((num_rows, k), dtype=torch.int32, device=device)
    else:
        check_shape("out", out, (num_rows, k))
        check_dtype("out", out, (torch.int32,))
        check_same_device(scores=scores, out=out)
    if path is None:
        path = "passes" if num_chunks is not None else top_k_path(num_rows, num_cols, device)
    if path not in TOP_K_PATHS:
        raise ValueError(f"path: expected one of {TOP_K_PATHS}, got {path!r}")
    if path == "row":
        if num_chunks is not None:
            raise ValueError(f"num_chunks: the row path has no chunks, got {num_chunks}")
        return row_top_k_indices(scores, key_lens, k, out)
    config = config or top_k_config(device, num_rows, num_cols, path)
    chunks, chunk_len = _chunking(num_rows, num_cols, device, config, path, num_chunks)
    shape = _workspace_shape(num_rows, chunks, chunk_len, path, k, device)
    if workspace is None:
        workspace = torch.empty(shape, dtype=torch.int32, device=device)
    else:
        check_shape("workspace", workspace, shape)
        check_dtype("workspace", workspace, (torch.int32,))
        check_same_device(scores=scores, workspace=workspace)
        if workspace.stride(3) != 1:
            raise ValueError(f"workspace: expected unit stride along its bins, got strides {workspace.stride()}")
    if num_rows == 0:
        return out
    use_pdl = pdl(device)
    if path == "synced":
        return synced_top_k(scores, key_lens, k, out, workspace, chunks, chunk_len, block=config.block,
                            num_warps=config.num_warps, max_registers=config.max_registers, passes=_PASSES,
                            bins=_BINS, radix_bits=_RADIX_BITS, fill_block=_FILL_BLOCK,
                            first_sparse_pass=_FIRST_SPARSE_PASS, sparse_share=_SPARSE_SHARE, use_pdl=use_pdl)
    if path == "filtered":
        cap, sample = filter_sizes(k, device)
        on_gpu = device.type == "cuda"
        return filtered_top_k(scores, key_lens, k, out, workspace, chunks, chunk_len, block=config.block,
                              num_warps=config.num_warps, cap=cap, sample=sample,
                              select_warps=_FILTER_SELECT_WARPS if cap >= 4096 else 4, stages=_FILTER_STAGES,
                              segment=min(_SAMPLE_SEGMENT, sample),
                              fallback_block=_GPU_FALLBACK_BLOCK if on_gpu else config.block, passes=_PASSES,
                              bins=_BINS, radix_bits=_RADIX_BITS, first_sparse_pass=_FIRST_SPARSE_PASS,
                              sparse_share=_SPARSE_SHARE, fill_block=_FILL_BLOCK, use_pdl=use_pdl)
    aligned = num_cols % 4 == 0 and scores.stride(1) == 1 and scores.stride(0) % 4 == 0
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
