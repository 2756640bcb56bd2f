"""Linear layers of block-scaled FP8 weights: a block GEMM on FP8 tensor cores, and a weight stream for decode.

Both kernels step K in tiles that lie inside one scale block, take the tile's product on tensor
cores into a fresh float32 tile, and add it to the accumulator times its scales: the weight
block's scale per output column (a gather of ceil(BLOCK_N / bn) values), and with w8a8 the
activation group's scale per row. That is `reference.fp8.fp8_linear`'s math; only the order of
the float32 additions differs (and Hopper's FP8 products accumulate inside one tile in fewer
bits than float32, which is why the scaled sum is taken per K tile, never over the whole K).

* `_block_gemm_kernel` (more than STREAM_MAX_ROWS rows: prefill, large batches): output tiles in
  grouped order, so that GROUP_M row tiles reuse a band of weight columns from L2. With w8a8 both
  operands are FP8 (x quantized first by `fp8_quant`); otherwise x stays 16-bit and the weight
  tile is widened to it in registers (FP8 values are exact in bf16 and fp16).
* `_row_kernel` (one row of 16-bit activations: batch-1 decode; up to ROW_MAX_ROWS rows over small
  weights, `takes_rows`): CUDA-core products, each FP8 tile widened to float32 once and multiplied by
  each row, summed over K in registers, a few weight rows a program over 512-column steps (several
  scale blocks a step), one launch. Only a narrow weight with a long K splits K over programs, summed as
  the stream's splits are. No tensor-core tile is filled with one live row, and no bf16 widening.
* `_stream_kernel` (up to STREAM_MAX_ROWS rows: decode): a program owns BLOCK_N weight rows and
  streams them once, as the product's wide side ([BLOCK_N, BLOCK_K] x [BLOCK_K, 16 rows]), so a
  handful of rows still fills a tensor-core tile; a weight of few column tiles splits K over
  programs and sums the splits in a second launch in split order (`linear_widened.sum_splits`),
  so the bits do not depend on timing. Over a weight of at least _FP8_ROWS_MIN_VALUES, bf16 rows are
  first written exactly as two FP8 parts (`fp8_split`), and each K step takes two FP8 products with no
  weight tile widened (the widening, not the bytes, had set the stream's pace); over a smaller weight the
  extra pass costs more than it saves, and bf16 rows meet the weight as fp16, lifted exactly
  (`fp16_lift`), since e4m3 widens to fp16 in fewer instructions than to bf16. On Hopper the FP8-row
  stream loads its weight tiles by TMA (a tensor descriptor of the weight; `StreamTiles.tma`) where the
  weight's rows are 16-byte aligned: the same products, fewer instructions a step.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
from triton.tools.tensor_descriptor import TensorDescriptor

from ..checks import check_same_device, check_shape
from ..hardware import hopper
from ..reference.fp8 import DEFAULT_BLOCK, check_fp8_weight, check_scale_fmt
from ._common import FLOAT_DTYPES, check_float, dot_precision, h200, next_pow2, pdl, sm_count
from .fp16_lift import lift_to_fp16
from .fp8_quant import quantize_activations
from .fp8_split import split_rows
from .linear_widened import sum_splits

# Rows up to which the weight stream runs; its tile holds them all (padded to a power of two from 16). Past
# 16 rows the block GEMM's 128 x 128 tiles leave most multiprocessors idle on decode batches (v2-lite's
# [3072, 2048] at 64 rows: 24 programs), where the stream splits K to fill them.
STREAM_MAX_ROWS = 64


@dataclass(frozen=True, slots=True)
class GemmTiles:
    """The block GEMM's [block_m, block_n] output tile, its K step, tile grouping, warps and stages."""

    block_m: int
    block_n: int
    block_k: int
    group_m: int
    num_warps: int
    num_stages: int


@dataclass(frozen=True, slots=True)
class StreamTiles:
    """The weight stream's [block_n, block_k] weight tile, its K split, warps and stages; fp8_rows: bf16 rows
    written as two FP8 parts (`fp8_split`) rather than the weight widened to them; tma: FP8-row and w8a8
    streams of up to _TMA_MAX_ROWS rows load the weight's tiles by TMA where its rows are 16-byte aligned
    (Hopper)."""

    block_n: int
    block_k: int
    split_k: int
    num_warps: int
    num_stages: int
    fp8_rows: bool = True
    tma: bool = False


# H100, w8a8, GEMM alone: [1024 | 4096, 7168] x [7168 | 18432, 7168]^T at 475-584 TFLOP/s; 128 x 256
# tiles 319 and 64-deep K steps 387 at [4096] x [18432]^T (2026-11-27).
_GPU_GEMM_W8A8 = GemmTiles(block_m=128, block_n=128, block_k=128, group_m=8, num_warps=8, num_stages=4)
# A 16-bit x tile takes twice the shared memory of an FP8 one: one stage less.
_GPU_GEMM_WIDE = GemmTiles(block_m=128, block_n=128, block_k=64, group_m=8, num_warps=8, num_stages=3)
_INTERPRETER_GEMM = GemmTiles(block_m=16, block_n=32, block_k=32, group_m=2, num_warps=4, num_stages=1)
# The stream splits K until there are this many programs a multiprocessor: fewer leave too few
# loads in flight. H100, one bf16 row, 64-wide tiles, three stages (a sweep of tile width, split,
# stages and warps, bench/results/step-fp8/h100/logs-archive/fp8-step-profile-h100-2026-11-27.log):
# [7168, 7168] best at 8 splits (896 programs) 26.5 us against 30.6 at 2 splits and four stages,
# [18432, 7168] at 4 splits (1152 programs) 56.6 against 77.2 unsplit; 8 warps or 128-wide tiles
# were slower.
_STREAM_PROGRAMS_PER_SM = 6
_STREAM_STAGES = 3
# bf16 rows as two FP8 parts (`fp8_split`), H200, graph replays, against the widened stream in one process
# (bench/results/kernels/h200/logs-archive/fp8-rows-split-h200-2026-11-29.log): over a weight too large for
# tails ([147456, 7168], 16 rows) 94% of copy against 78%; with 5 programs a multiprocessor, K splits of at
# least 4 blocks and three stages, [18432, 7168] at 4 / 16 / 64 rows 39.3 / 43.5 / 88.7 us against 46.9 / 48.3
# / 166.9, [7168, 7168] 20.0 / 21.9 / 39.6 against 21.9 / 22.6 / 71.0, [3072, 2048] 7.1 / 9.2 / 9.9 against 9.4
# / 9.8 / 19.1. A sixth program a multiprocessor at three stages makes a second wave ([18432, 7168] split in
# three: 52.5 us). Below about 4M values the split pass's launch costs more than the widening saves: at 16
# rows [2048, 1408] 6.6 against 5.5 us at the best of a sweep, [576, 2048] 8.3 against 5.6
# (bench/results/kernels/h200/logs-archive/fp8-rows-split-sweep-h200-2026-11-29.log).
_FP8_ROWS_MIN_VALUES = 4 << 20
_FP8_ROWS_PROGRAMS_PER_SM = 5
_FP8_ROWS_MIN_BLOCKS = 4
_FP8_ROWS_STAGES = 3
# Weight tiles by TMA in the FP8-row and w8a8 streams: H200, graph replays, against the same kernel's pointer
# loads in one process, outputs equal bit for bit (bench/results/kernels/h200/logs-archive/
# fp8-stream-tma-h200-2026-11-29.log, two rounds): where the grid holds at least 3 programs a multiprocessor, at 16
# rows [18432, 7168] 39.2-39.3 against 40.3-40.4 us, [7168, 18432] 42.0 against 43.7, [7168, 7168] 18.9 against
# 19.6, [7168, 2048] 8.9 against 9.1; at 32 rows [7168, 7168] 24.4 against 26.6-26.9, [32768, 512] 8.7 against
# 11.1 (one wave where pointer loads' shared memory made two); at 2-4 rows from 5% faster to 2% slower. With fewer
# programs a multiprocessor each program's start costs more than TMA saves: [24576, 1536] (2.9) 1-2% slower,
# [4096, 2048] (1.9) 2%, [2048, 2048] (1.0) 5%. At 64 rows from 2% faster to 5% slower: pointer loads.
# Loading the rows' parts by TMA too made 64 rows 12-14% slower (a prototype, one process).
_TMA_MIN_PROGRAMS_PER_SM = 3
_TMA_MAX_ROWS = 32


@dataclass(frozen=True, slots=True)
class RowTiles:
    """The one-row product's [block_n, block_k] weight tile (block_k may span several scale blocks), its K
    split and warps."""

    block_n: int
    block_k: int
    split_k: int
    num_warps: int


# H100, one bf16 row, graph replays (bench/results/kernels/h100/logs-archive/fp8-row-sweep-h100-2026-11-28.log):
# 4 weight rows a program, 512-column steps, 2 warps, K unsplit, one launch: [7168, 7168] 20.0 us against
# 21.4 for 64-row tiles with 8 splits and their sum, [18432, 7168] 45.3 against 48.4, [7168, 18432] 47.5
# against 49.3, v2-lite's projections 2.3-17.4 against 4.8-18.4 (narrower steps, or 1, 8 or 16 rows a
# program at other warps, were no faster). A narrow weight with a long K leaves too few loads in flight
# unsplit ([2048, 10944]: 16.6 against 14.0 split): it keeps the split tiles below.
_ROW_UNSPLIT = RowTiles(block_n=4, block_k=512, split_k=1, num_warps=2)
# Rows the one-row kernel also takes, one accumulator each, over weights below these sizes (values): H200, graph
# replays, against the stream in one process (bench/results/kernels/h200/logs-archive/fp8-few-rows-h200-2026-11-29.log),
# with `row_tiles`' tiles: 2 rows of [3072, 2048] 4.8 against 6.4 us, [2048, 2048] 3.8 against 5.8, [576, 7168]
# 8.0 against 13.6, [7168, 2048] 7.5 against 8.6, [1536, 7168] 8.9 against 9.2; 3 and 4 rows of [576, 7168]
# 10.6 / 11.3 against 13.7 / 13.9, [4096, 512] 3.2 / 3.3 against 3.6 / 3.7. The stream's split pass and sum set
# those small products' pace; over larger weights the CUDA cores' products do ([32768, 512] at 2 rows 10.6
# against 7.2, [7168, 7168] 21.4 against 18.4; 3 rows of [1536, 7168] 13.0 against 9.4).
ROW_MAX_ROWS = 4
_ROW_TWO_MAX_VALUES = 16 << 20
_ROW_FOUR_MAX_VALUES = _FP8_ROWS_MIN_VALUES
_ROW_SPLIT_MAX_K = 4096
_ROW_SPLIT_PROGRAMS_PER_SM = 4
# H200, one bf16 row, graph replays, the tiles above beside others in one process
# (bench/results/kernels/h200/logs-archive/fp8-row-shapes-h200-2026-11-28.log): the H200's 4.8 TB/s on the H100's
# multiprocessors wants more bytes in flight a program: 8 rows in 1024-column steps over 4 warps, where K is
# whole steps, read [7168, 7168] in 14.2 us against 19.3 (85% of copy against 63%), [7168, 18432] 33.0 against
# 42.7, [18432, 7168] 34.1 against 35.5, [7168, 2048] 5.3 against 7.1, v2-lite's [2048 | 2816 | 3072, 2048]
# 3.2-3.6 against 4.0-4.2, [1536, 7168] 7.1 against the split tiles' 8.5; one loss, [10944, 2048] 7.9 against
# 7.5. A K of part steps (512, 1536, 10944) lost more and keeps the rule below.
_H200_ROW_STEPS = RowTiles(block_n=8, block_k=1024, split_k=1, num_warps=4)
# The split tiles (a sweep of tile width, split and warps, bench/results/step-fp8/h100/logs-archive/
# fp8-step-profile-h100-2026-11-27.log): 16- or 32-wide tiles for v2-lite's narrow projections.
_ROW_WIDE_MIN_N = 7168
_ROW_MID_MIN_N = 4096


def gemm_tiles(w8a8: bool, on_gpu: bool) -> GemmTiles:
    """The block GEMM's tiles (its K step is further capped at the scale block's K)."""
    if not on_gpu:
        return _INTERPRETER_GEMM
    return _GPU_GEMM_W8A8 if w8a8 else _GPU_GEMM_WIDE


def stream_tiles(n_out: int, k_in: int, block_k: int, device: torch.device) -> StreamTiles:
    """The weight stream's tiles for an [n_out, k_in] weight in blocks of block_k columns.

    K splits are whole scale blocks. A weight of at least _FP8_ROWS_MIN_VALUES takes bf16 rows as FP8 parts,
    split until _FP8_ROWS_PROGRAMS_PER_SM programs a multiprocessor with at least _FP8_ROWS_MIN_BLOCKS K blocks
    a split; a smaller one widens its tiles, split until _STREAM_PROGRAMS_PER_SM programs a multiprocessor (at
    most one split a K block).
    """
    if device.type != "cuda":
        # Under the interpreter bf16 rows are FP8 parts, and K splits as the widened stream's rule says.
        col_tiles = triton.cdiv(n_out, 16)
        split_k = max(1, min(triton.cdiv(_STREAM_PROGRAMS_PER_SM * sm_count(device), col_tiles),
                             triton.cdiv(k_in, block_k)))
        return StreamTiles(block_n=16, block_k=min(32, block_k), split_k=split_k, num_warps=4, num_stages=1)
    block_n, step = 64, min(128, block_k)
    col_tiles = triton.cdiv(n_out, block_n)
    k_blocks = triton.cdiv(k_in, block_k)
    sms = sm_count(device)
    if n_out * k_in >= _FP8_ROWS_MIN_VALUES:
        split_k = max(1, min(_FP8_ROWS_PROGRAMS_PER_SM * sms // col_tiles, k_blocks // _FP8_ROWS_MIN_BLOCKS))
        tma = hopper(device) and col_tiles * split_k >= _TMA_MIN_PROGRAMS_PER_SM * sms
        return StreamTiles(block_n=block_n, block_k=step, split_k=split_k, num_warps=4,
                           num_stages=_FP8_ROWS_STAGES, tma=tma)
    wanted = triton.cdiv(_STREAM_PROGRAMS_PER_SM * sms, col_tiles)
    split_k = max(1, min(wanted, k_blocks))
    return StreamTiles(block_n=block_n, block_k=step, split_k=split_k, num_warps=4, num_stages=_STREAM_STAGES,
                       fp8_rows=False)


def tma_weight(values: torch.Tensor) -> bool:
    """Whether a TMA descriptor can cover the FP8 weight values [N, K]: rows contiguous and 16-byte aligned."""
    return values.stride(1) == 1 and values.stride(0) % 16 == 0 and values.data_ptr() % 16 == 0


def takes_rows(num_rows: int, n_out: int, k_in: int) -> bool:
    """Whether num_rows rows of 16-bit activations over an [n_out, k_in] FP8 weight take the one-row kernel
    (every row of one, up to ROW_MAX_ROWS over small weights) rather than the stream."""
    values = n_out * k_in
    return num_rows == 1 or (num_rows == 2 and values < _ROW_TWO_MAX_VALUES) or (
        2 < num_rows <= ROW_MAX_ROWS and values < _ROW_FOUR_MAX_VALUES)


def row_tiles(n_out: int, k_in: int, block_k: int, device: torch.device) -> RowTiles:
    """The one-row product's tiles for an [n_out, k_in] weight in blocks of block_k columns: a few rows a
    program and K whole, unless the weight is too narrow for _ROW_SPLIT_PROGRAMS_PER_SM programs a
    multiprocessor and K is long: then wider tiles and K split in whole scale blocks as `stream_tiles`
    splits it. On an H200, a K of whole 1024-column steps takes wider tiles (`_H200_ROW_STEPS`)."""
    if device.type != "cuda":
        return RowTiles(block_n=16, block_k=min(32, block_k), split_k=1, num_warps=4)
    if k_in % _H200_ROW_STEPS.block_k == 0 and h200(device):
        return _H200_ROW_STEPS
    sms = sm_count(device)
    if triton.cdiv(n_out, _ROW_UNSPLIT.block_n) >= _ROW_SPLIT_PROGRAMS_PER_SM * sms or k_in <= _ROW_SPLIT_MAX_K:
        return _ROW_UNSPLIT
    block_n = 64 if n_out >= _ROW_WIDE_MIN_N else 32 if n_out > _ROW_MID_MIN_N else 16
    wanted = triton.cdiv(_STREAM_PROGRAMS_PER_SM * sms, triton.cdiv(n_out, block_n))
    split_k = max(1, min(wanted, triton.cdiv(k_in, block_k)))
    return RowTiles(block_n=block_n, block_k=min(128, block_k), split_k=split_k, num_warps=4)


@triton.jit
def scaled_dot(a, b, acc, a_scale, b_scale, W8A8: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """acc + (a @ b) * a_scale[:, None] * b_scale[None, :], the product in a fresh float32 tile.

    a [M, K], b [K, N]; with W8A8 both FP8; otherwise b (FP8) is widened to a's dtype and
    a_scale is not read (pass b_scale again).
    """
    if W8A8:
        return acc + tl.dot(a, b) * (a_scale[:, None] * b_scale[None, :])
    return acc + tl.dot(a, b.to(a.dtype), input_precision=DOT_PRECISION) * b_scale[None, :]


# The row count follows the step's batch: a plain argument, not one compile per count.
@triton.jit(do_not_specialize=["num_rows"])
def _block_gemm_kernel(
    a_ptr, as_ptr, w_ptr, ws_ptr, y_ptr,
    num_rows, n_out, k_in,
    s_at, s_ak, s_ast, s_asb, s_wn, s_wk, s_wsn, s_wsb, s_yt, s_yn,
    SCALE_N: tl.constexpr, SCALE_K: tl.constexpr, W8A8: tl.constexpr, EVEN_K: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    DOT_PRECISION: tl.constexpr, GDC: tl.constexpr,
):
    pid = tl.program_id(0)
    tiles_m = tl.cdiv(num_rows, BLOCK_M)
    tiles_n = tl.cdiv(n_out, BLOCK_N)
    # GROUP_M row tiles in a row walk one band of weight columns together (L2 reuse).
    band = pid // (GROUP_M * tiles_n)
    first_m = band * GROUP_M
    band_m = tl.minimum(tiles_m - first_m, GROUP_M)
    pid_m = first_m + (pid % (GROUP_M * tiles_n)) % band_m
    pid_n = (pid % (GROUP_M * tiles_n)) // band_m
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    # Out-of-range rows and columns read row / column 0 and are never stored: no masks on M and N.
    safe_rows = tl.where(rows < num_rows, rows, 0)
    safe_cols = tl.where(cols < n_out, cols, 0)
    offs_k = tl.arange(0, BLOCK_K)
    a_ptrs = a_ptr + safe_rows[:, None].to(tl.int64) * s_at + offs_k[None, :] * s_ak
    w_ptrs = w_ptr + safe_cols[None, :].to(tl.int64) * s_wn + offs_k[:, None] * s_wk
    ws_ptrs = ws_ptr + (safe_cols // SCALE_N) * s_wsn
    as_ptrs = as_ptr + safe_rows * s_ast
    if GDC:
        gdc_wait()
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, k_in, BLOCK_K):
        if EVEN_K:
            a = tl.load(a_ptrs)
            w = tl.load(w_ptrs)
        else:
            k_mask = k0 + offs_k < k_in
            a = tl.load(a_ptrs, mask=k_mask[None, :], other=0.0)
            w = tl.load(w_ptrs, mask=k_mask[:, None], other=0.0)
        w_scale = tl.load(ws_ptrs + (k0 // SCALE_K) * s_wsb)
        a_scale = w_scale
        if W8A8:
            a_scale = tl.load(as_ptrs + (k0 // SCALE_K) * s_asb)
        acc = scaled_dot(a, w, acc, a_scale, w_scale, W8A8, DOT_PRECISION)
        a_ptrs += BLOCK_K * s_ak
        w_ptrs += BLOCK_K * s_wk
    if GDC:
        gdc_launch_dependents()
    tl.store(y_ptr + rows[:, None].to(tl.int64) * s_yt + cols[None, :] * s_yn, acc.to(y_ptr.dtype.element_ty),
             mask=(rows < num_rows)[:, None] & (cols < n_out)[None, :])


@triton.jit
def _stream_scales(ws_row, ws_rows, xs_ptr, rows, row_mask, col_mask, kb, s_xsp, s_xst, s_xsb, s_wsb,
                   FP8_PARTS: tl.constexpr, ONE_SCALE_ROW: tl.constexpr):
    """The scales of K block kb for the stream's step: (weight scale: a scalar where the tile's columns
    share one scale row, else [BLOCK_N]; the rows' first and second part unscales [BLOCK_T], or w8a8's
    activation scales and their copy; ones where the rows are not FP8)."""
    if ONE_SCALE_ROW:
        w_scale = tl.load(ws_row + kb * s_wsb)
    else:
        w_scale = tl.load(ws_rows + kb * s_wsb, mask=col_mask, other=0.0)
    if FP8_PARTS >= 1:
        x_scale = tl.load(xs_ptr + rows * s_xst + kb * s_xsb, mask=row_mask, other=0.0)
    else:
        x_scale = tl.full([rows.shape[0]], 1.0, tl.float32)
    if FP8_PARTS == 2:
        lo_scale = tl.load(xs_ptr + s_xsp + rows * s_xst + kb * s_xsb, mask=row_mask, other=0.0)
    else:
        lo_scale = x_scale
    return w_scale, x_scale, lo_scale


@triton.jit(do_not_specialize=["num_rows"])
def _stream_kernel(
    x_ptr, xs_ptr, w, ws_ptr, y_ptr,
    num_rows, n_out, k_in, k_per_split,
    s_xp, s_xt, s_xk, s_xsp, s_xst, s_xsb, s_wn, s_wk, s_wsn, s_wsb, s_ys, s_yt, s_yn,
    SCALE_N: tl.constexpr, SCALE_K: tl.constexpr, FP8_PARTS: tl.constexpr,
    BLOCK_T: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    DOT_PRECISION: tl.constexpr, LIFT: tl.constexpr, W_TMA: tl.constexpr, GDC: tl.constexpr,
):
    # w: the weight values' pointer, or where W_TMA a tensor descriptor of them in [BLOCK_N, BLOCK_K] tiles (the
    # tiles past N or K read as zeros; a split's K steps end on its k_hi, which is a step's end or K's).
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    rows = tl.arange(0, BLOCK_T)
    col_mask = cols < n_out
    row_mask = rows < num_rows
    # Split s sums K in [s * k_per_split, (s + 1) * k_per_split) into its own slice of y.
    k_lo = tl.program_id(1) * k_per_split
    k_hi = tl.minimum(k_lo + k_per_split, k_in)
    y_ptr += tl.program_id(1).to(tl.int64) * s_ys
    if not W_TMA:
        w_rows = w + cols[:, None].to(tl.int64) * s_wn
    ws_rows = ws_ptr + (cols // SCALE_N) * s_wsn
    # A tile no wider than a scale block and aligned to it reads one scale a step, not one a column.
    ONE_SCALE_ROW: tl.constexpr = SCALE_N % BLOCK_N == 0
    ws_row = ws_ptr + (tl.program_id(0) * BLOCK_N // SCALE_N) * s_wsn
    offs_k = tl.arange(0, BLOCK_K)
    if GDC:
        gdc_wait()
        gdc_launch_dependents()
    # Each step's scales are loaded a step ahead, carried around the loop, so that no step waits on a scale's
    # load after its tiles arrived (the pipeliner stages the tiles, not these): H200, 16 rows of [18432, 7168],
    # 39.2 against 40.6 us; 64 rows 82.2 against 89.1 (bench/notes/fp8.md).
    w_scale, x_scale, lo_scale = _stream_scales(ws_row, ws_rows, xs_ptr, rows, row_mask, col_mask, k_lo // SCALE_K,
                                                s_xsp, s_xst, s_xsb, s_wsb, FP8_PARTS, ONE_SCALE_ROW)
    acc = tl.zeros([BLOCK_N, BLOCK_T], dtype=tl.float32)
    for k0 in range(k_lo, k_hi, BLOCK_K):
        ks = k0 + offs_k
        k_mask = ks < k_hi
        if W_TMA:
            w_tile = w.load([tl.program_id(0) * BLOCK_N, k0])
        else:
            w_tile = tl.load(w_rows + ks[None, :] * s_wk, mask=col_mask[:, None] & k_mask[None, :], other=0.0)
        x = tl.load(x_ptr + rows[None, :] * s_xt + ks[:, None] * s_xk, mask=row_mask[None, :] & k_mask[:, None],
                    other=0.0)
        if FP8_PARTS == 2:
            x_lo = tl.load(x_ptr + s_xp + rows[None, :] * s_xt + ks[:, None] * s_xk,
                           mask=row_mask[None, :] & k_mask[:, None], other=0.0)
        # The last step loads its own block's scales again: never past the split's K.
        next_scales = _stream_scales(ws_row, ws_rows, xs_ptr, rows, row_mask, col_mask,
                                     tl.minimum(k0 + BLOCK_K, k_hi - 1) // SCALE_K, s_xsp, s_xst, s_xsb, s_wsb,
                                     FP8_PARTS, ONE_SCALE_ROW)
        if ONE_SCALE_ROW:
            w_scale_col = w_scale
        else:
            w_scale_col = w_scale[:, None]
        if FP8_PARTS == 1:
            acc += tl.dot(w_tile, x) * (w_scale_col * x_scale[None, :])
        elif FP8_PARTS == 2:
            # bf16 rows as two e4m3 parts (`fp8_split`): two FP8 products, no weight tile widened.
            acc += (tl.dot(w_tile, x) * x_scale[None, :] + tl.dot(w_tile, x_lo) * lo_scale[None, :]) * w_scale_col
        elif LIFT:
            # bf16 rows lifted to fp16 (`fp16_lift`): the FP8 tile widens to fp16 in half the instructions.
            x16, unscale = lift_to_fp16(x, 0)
            acc += tl.dot(w_tile.to(tl.float16), x16) * (w_scale_col * unscale[None, :])
        else:
            acc += tl.dot(w_tile.to(x.dtype), x, input_precision=DOT_PRECISION) * w_scale_col
        w_scale, x_scale, lo_scale = next_scales
    tl.store(y_ptr + rows[None, :] * s_yt + cols[:, None] * s_yn, acc.to(y_ptr.dtype.element_ty),
             mask=row_mask[None, :] & col_mask[:, None])


@triton.jit
def row_step_scales(ws_rows, k0, k_hi, s_wsb, BLOCK_K: tl.constexpr, SCALE_K: tl.constexpr, GROUP_K: tl.constexpr):
    """[BLOCK_N, BLOCK_K // GROUP_K] weight scales of one K step of a one-row product (columns k0 ..): one a run of
    GROUP_K columns, each run inside one scale block (ws_rows [BLOCK_N]: each weight row's scale-row pointer,
    blocks s_wsb apart). Runs at or past k_hi read no scale."""
    run_k = k0 + tl.arange(0, BLOCK_K // GROUP_K) * GROUP_K
    return tl.load(ws_rows[:, None] + (run_k // SCALE_K)[None, :] * s_wsb, mask=(run_k < k_hi)[None, :], other=0.0)


@triton.jit
def scaled_row_sums(w, x, scale, GROUP_K: tl.constexpr):
    """[BLOCK_N, BLOCK_K // GROUP_K] partial sums of one K step of a one-row product: the widened tile w
    [BLOCK_N, BLOCK_K] (float32) times the row x [BLOCK_K] (float32), summed in runs of GROUP_K columns, each
    times its scale (`row_step_scales`)."""
    BLOCK_N: tl.constexpr = w.shape[0]
    GROUPS: tl.constexpr = w.shape[1] // GROUP_K
    return tl.sum(tl.reshape(w * x[None, :], [BLOCK_N, GROUPS, GROUP_K]), axis=2) * scale


@triton.jit
def scaled_row_step(w, x, ws_rows, k0, k_hi, s_wsb, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                    SCALE_K: tl.constexpr, GROUP_K: tl.constexpr):
    """`scaled_row_sums` of the FP8 tile w [BLOCK_N, BLOCK_K] (columns k0 ..) widened to float32 and the row x
    [BLOCK_K] (float32), with the step's scales (`row_step_scales`)."""
    scale = row_step_scales(ws_rows, k0, k_hi, s_wsb, BLOCK_K, SCALE_K, GROUP_K)
    return scaled_row_sums(w.to(tl.float32), x, scale, GROUP_K)


@triton.jit(do_not_specialize=["num_rows"])
def _row_kernel(
    x_ptr, w_ptr, ws_ptr, y_ptr,
    num_rows, n_out, k_in, k_per_split,
    s_xt, s_xk, s_wn, s_wk, s_wsn, s_wsb, s_ys, s_yt, s_yn,
    SCALE_N: tl.constexpr, SCALE_K: tl.constexpr, ROWS: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr, GROUP_K: tl.constexpr, GDC: tl.constexpr,
):
    # ROWS: 1, 2 or 4 (num_rows rounded up); each row its own accumulator, the widened tile shared by all.
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_mask = cols < n_out
    # Out-of-range columns read row 0 and are never stored: no mask on the weight rows.
    safe_cols = tl.where(col_mask, cols, 0)
    # Split s sums K in [s * k_per_split, (s + 1) * k_per_split) into its own slice of y.
    k_lo = tl.program_id(1) * k_per_split
    k_hi = tl.minimum(k_lo + k_per_split, k_in)
    y_ptr += tl.program_id(1).to(tl.int64) * s_ys
    w_rows = w_ptr + safe_cols[:, None].to(tl.int64) * s_wn
    ws_rows = ws_ptr + (safe_cols // SCALE_N) * s_wsn
    offs_k = tl.arange(0, BLOCK_K)
    # Rows past num_rows read nothing (their K range is empty) and store nothing.
    k_hi1 = tl.where(num_rows > 1, k_hi, k_lo)
    k_hi2 = tl.where(num_rows > 2, k_hi, k_lo)
    k_hi3 = tl.where(num_rows > 3, k_hi, k_lo)
    if GDC:
        gdc_wait()
        gdc_launch_dependents()
    # A step is runs of GROUP_K columns, each inside one scale block (k_lo is a block's start).
    acc0 = tl.zeros([BLOCK_N, BLOCK_K // GROUP_K], dtype=tl.float32)
    acc1 = tl.zeros_like(acc0)
    acc2 = tl.zeros_like(acc0)
    acc3 = tl.zeros_like(acc0)
    for k0 in range(k_lo, k_hi, BLOCK_K):
        ks = k0 + offs_k
        k_mask = ks < k_hi
        w = tl.load(w_rows + ks[None, :] * s_wk, mask=k_mask[None, :], other=0.0).to(tl.float32)
        scale = row_step_scales(ws_rows, k0, k_hi, s_wsb, BLOCK_K, SCALE_K, GROUP_K)
        x = tl.load(x_ptr + ks * s_xk, mask=k_mask, other=0.0).to(tl.float32)
        acc0 += scaled_row_sums(w, x, scale, GROUP_K)
        if ROWS > 1:
            x = tl.load(x_ptr + s_xt + ks * s_xk, mask=ks < k_hi1, other=0.0).to(tl.float32)
            acc1 += scaled_row_sums(w, x, scale, GROUP_K)
        if ROWS > 2:
            x = tl.load(x_ptr + 2 * s_xt + ks * s_xk, mask=ks < k_hi2, other=0.0).to(tl.float32)
            acc2 += scaled_row_sums(w, x, scale, GROUP_K)
            x = tl.load(x_ptr + 3 * s_xt + ks * s_xk, mask=ks < k_hi3, other=0.0).to(tl.float32)
            acc3 += scaled_row_sums(w, x, scale, GROUP_K)
    tl.store(y_ptr + cols * s_yn, tl.sum(acc0, axis=1).to(y_ptr.dtype.element_ty), mask=col_mask)
    if ROWS > 1:
        tl.store(y_ptr + s_yt + cols * s_yn, tl.sum(acc1, axis=1).to(y_ptr.dtype.element_ty),
                 mask=cols < tl.where(num_rows > 1, n_out, 0))
    if ROWS > 2:
        tl.store(y_ptr + 2 * s_yt + cols * s_yn, tl.sum(acc2, axis=1).to(y_ptr.dtype.element_ty),
                 mask=cols < tl.where(num_rows > 2, n_out, 0))
        tl.store(y_ptr + 3 * s_yt + cols * s_yn, tl.sum(acc3, axis=1).to(y_ptr.dtype.element_ty),
                 mask=cols < tl.where(num_rows > 3, n_out, 0))


def check_block_k(block: tuple[int, int]) -> None:
    """Raise ValueError unless the scale block's K (bk) suits the kernels' K steps: a power of two,
    at least 32 (the narrowest FP8 tensor-core step), so that a step never straddles two blocks."""
    if block[1] < 32 or block[1] != next_pow2(block[1]):
        raise ValueError(f"block: the K block must be a power of two of at least 32 for the FP8 kernels, got {block}")


def fp8_linear(x: torch.Tensor, values: torch.Tensor, scale_inv: torch.Tensor, *,
               block: tuple[int, int] = DEFAULT_BLOCK, w8a8: bool = False, out_dtype: torch.dtype | None = None,
               gemm: GemmTiles | None = None, stream: StreamTiles | None = None,
               row: RowTiles | None = None, batch_invariant: bool = False,
               scale_fmt: str = "fp32") -> torch.Tensor:
    """Contract of `reference.fp8.fp8_linear`: y = x @ w^T for a block-scaled FP8 weight.

    x [T, K] bf16 / fp16 / fp32 (any strides); values [N, K] float8_e4m3fn; scale_inv
    [ceil(N/bn), ceil(K/bk)] float32 (bk a power of two >= 32) -> y [T, N] in out_dtype (x's
    by default). w8a8 quantizes x per token and group of bk (`fp8_quant`, its scales as `scale_fmt`
    says) and multiplies FP8 by FP8; otherwise x's dtype meets the widened weight. One row without w8a8 takes the one-row
    product (up to ROW_MAX_ROWS rows over small weights: `takes_rows`), up to STREAM_MAX_ROWS rows the
    weight stream, more the block GEMM. `gemm` / `stream` / `row` override the tiles (sweeps; `stream`
    also takes the one-row product's rows through the stream).
    batch_invariant: every row count takes the block GEMM, whose K order is one for every row: a row's
    bits then do not depend on its batch-mates or their number (slower at decode sizes).
    """
    num_rows, k_in = x.shape
    n_out = values.shape[0]
    check_float("x", x)
    check_fp8_weight("values", values, scale_inv, block)
    check_shape("values", values, (n_out, k_in))
    check_same_device(x=x, values=values, scale_inv=scale_inv)
    check_block_k(block)
    check_scale_fmt(scale_fmt)
    out_dtype = out_dtype or x.dtype
    if out_dtype not in FLOAT_DTYPES:
        raise ValueError(f"out_dtype: expected one of {FLOAT_DTYPES}, got {out_dtype}")
    if num_rows == 0 or n_out == 0:
        return torch.zeros((num_rows, n_out), dtype=out_dtype, device=x.device)
    if takes_rows(num_rows, n_out, k_in) and not w8a8 and stream is None and not batch_invariant:
        return _row(x, values, scale_inv, block, out_dtype, row)
    if num_rows <= STREAM_MAX_ROWS and not batch_invariant:
        return _stream(x, values, scale_inv, block, w8a8, out_dtype, stream, scale_fmt)
    if w8a8:
        a, a_scales = quantize_activations(x, block[1], scale_fmt=scale_fmt)
    else:
        a, a_scales = x, scale_inv
    return block_gemm(a, a_scales, values, scale_inv, block, w8a8, out_dtype, x.dtype, gemm)


def block_gemm(a: torch.Tensor, a_scales: torch.Tensor, values: torch.Tensor, scale_inv: torch.Tensor,
               block: tuple[int, int], w8a8: bool, out_dtype: torch.dtype, x_dtype: torch.dtype,
               tiles: GemmTiles | None = None) -> torch.Tensor:
    """The block GEMM alone, on inputs `fp8_linear` checked: a [T, K] (FP8 with scales [T, kb] under
    w8a8, else x itself and any float32 tensor for a_scales) times values [N, K] -> y [T, N]."""
    num_rows, k_in = a.shape
    n_out = values.shape[0]
    t = tiles or gemm_tiles(w8a8, a.device.type == "cuda")
    block_k = min(t.block_k, block[1])
    y = torch.empty((num_rows, n_out), dtype=out_dtype, device=a.device)
    use_pdl = pdl(a.device)
    grid = (triton.cdiv(num_rows, t.block_m) * triton.cdiv(n_out, t.block_n),)
    _block_gemm_kernel[grid](
        a, a_scales, values, scale_inv, y,
        num_rows, n_out, k_in,
        *a.stride(), *a_scales.stride(), *values.stride(), *scale_inv.stride(), *y.stride(),
        SCALE_N=block[0], SCALE_K=block[1], W8A8=w8a8, EVEN_K=k_in % block_k == 0,
        BLOCK_M=t.block_m, BLOCK_N=t.block_n, BLOCK_K=block_k, GROUP_M=t.group_m,
        DOT_PRECISION=dot_precision(x_dtype), GDC=use_pdl,
        num_warps=t.num_warps, num_stages=t.num_stages, launch_pdl=use_pdl,
    )
    return y


def _stream(x: torch.Tensor, values: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int], w8a8: bool,
            out_dtype: torch.dtype, tiles: StreamTiles | None, scale_fmt: str) -> torch.Tensor:
    """The weight stream for x [T <= STREAM_MAX_ROWS, K] -> y [T, N]. Under w8a8 its rows meet the FP8 weight
    quantized; bf16 rows meet it as two exact FP8 parts (`fp8_split`) where the tiles say `fp8_rows`, else
    lifted to fp16; fp16 and float32 rows meet the weight widened to their dtype."""
    num_rows, k_in = x.shape
    n_out = values.shape[0]
    c = tiles or stream_tiles(n_out, k_in, block[1], x.device)
    if w8a8:
        a, a_scales = quantize_activations(x, block[1], scale_fmt=scale_fmt)
        a, a_scales, fp8_parts = a[None], a_scales[None], 1
    elif x.dtype == torch.bfloat16 and c.fp8_rows:
        a, a_scales = split_rows(x, block[1])
        fp8_parts = 2
    else:
        # The scales argument is not read without FP8 rows.
        a, a_scales, fp8_parts = x[None], scale_inv[None], 0
    block_k = min(c.block_k, block[1])
    # Each split's share of K is a whole number of scale blocks.
    k_per_split = triton.cdiv(triton.cdiv(k_in, c.split_k), block[1]) * block[1]
    split_k = triton.cdiv(k_in, k_per_split)
    y = torch.empty((num_rows, n_out), dtype=out_dtype, device=x.device)
    out = y if split_k == 1 else torch.empty((split_k, num_rows, n_out), dtype=torch.float32, device=x.device)
    use_pdl = pdl(x.device)
    # TMA only where the rows are FP8 (parts or w8a8): the widened streams keep pointer loads.
    w_tma = c.tma and fp8_parts >= 1 and num_rows <= _TMA_MAX_ROWS and tma_weight(values)
    w = TensorDescriptor.from_tensor(values, [c.block_n, block_k]) if w_tma else values
    _stream_kernel[(triton.cdiv(n_out, c.block_n), split_k)](
        a, a_scales, w, scale_inv, out,
        num_rows, n_out, k_in, k_per_split,
        *a.stride(), *a_scales.stride(), *values.stride(), *scale_inv.stride(), num_rows * n_out, *y.stride(),
        SCALE_N=block[0], SCALE_K=block[1], FP8_PARTS=fp8_parts,
        BLOCK_T=max(16, next_pow2(num_rows)), BLOCK_N=c.block_n, BLOCK_K=block_k,
        DOT_PRECISION=dot_precision(x.dtype), LIFT=fp8_parts == 0 and x.dtype == torch.bfloat16, W_TMA=w_tma,
        GDC=use_pdl,
        num_warps=c.num_warps, num_stages=c.num_stages, launch_pdl=use_pdl,
    )
    if split_k > 1:
        sum_splits(out, y, use_pdl)
    return y


def _row(x: torch.Tensor, values: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int],
         out_dtype: torch.dtype, tiles: RowTiles | None) -> torch.Tensor:
    """The one-row product for x [T <= ROW_MAX_ROWS, K] (16-bit or float32) -> y [T, N], each row as alone; K
    split as `row_tiles` says."""
    num_rows, k_in = x.shape
    n_out = values.shape[0]
    if num_rows > ROW_MAX_ROWS:
        raise ValueError(f"x: the one-row product takes at most {ROW_MAX_ROWS} rows, got {num_rows}")
    c = tiles or row_tiles(n_out, k_in, block[1], x.device)
    # The columns of a step that share one scale: the whole step when it lies inside one block.
    group_k = min(c.block_k, block[1])
    if c.block_k % group_k or block[1] % group_k:
        raise ValueError(f"row tiles: block_k {c.block_k} must divide the scale block's K {block[1]} or be a "
                         f"multiple of it")
    # Each split's share of K is a whole number of scale blocks.
    k_per_split = triton.cdiv(triton.cdiv(k_in, c.split_k), block[1]) * block[1]
    split_k = triton.cdiv(k_in, k_per_split)
    y = torch.empty((num_rows, n_out), dtype=out_dtype, device=x.device)
    out = y if split_k == 1 else torch.empty((split_k, num_rows, n_out), dtype=torch.float32, device=x.device)
    use_pdl = pdl(x.device)
    _row_kernel[(triton.cdiv(n_out, c.block_n), split_k)](
        x, values, scale_inv, out,
        num_rows, n_out, k_in, k_per_split,
        *x.stride(), *values.stride(), *scale_inv.stride(), num_rows * n_out, *out.stride()[-2:],
        SCALE_N=block[0], SCALE_K=block[1], ROWS=next_pow2(num_rows), BLOCK_N=c.block_n, BLOCK_K=c.block_k,
        GROUP_K=group_k, GDC=use_pdl,
        num_warps=c.num_warps, launch_pdl=use_pdl,
    )
    if split_k > 1:
        sum_splits(out, y, use_pdl)
    return y
