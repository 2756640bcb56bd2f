"""Products of 2 to 16 rows of 16-bit floats on tensor cores (up to 64 on wide weights): decode projections.

The register GEMV in `linear` holds a weight tile and runs one float32 pass over
it a row; from two rows on, on weights of more than a few MB, that costs more
than reading the weight (see `takes_rows`), and cuBLAS
picks tiles that reach under half the copy rate on weights of a few MB. Here a
program owns BLOCK_N output columns and streams their weight rows through
`tl.dot` against all the rows at once (padded to 16, the narrowest tensor-core
tile), pipelined over K. A weight of few column tiles splits K over programs as
well; a second launch sums their partial products in split order
(`linear_widened`'s reduction), so the bits do not depend on timing. 16-bit
products are exact and summed in float32, as cuBLAS sums them.

Swept on an H200 (graph replays; bench/results/dsa-kernels/h200/logs-archive/gemv-tiles-h200-2026-11-24.log),
rows x [N, K]^T in bf16, 8 rows, us (cuBLAS), with the tiles `rows_config` picks: [2240, 2048]
5.4 (6.1), [11264, 1536] 10.5 (11.2), [2048, 2048] 5.3 (6.0), [576, 2048] 4.1 (5.7),
[32768, 1024] 19.2 (19.9).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from ._common import next_pow2, pdl
from .linear_widened import sum_splits

# Rows this kernel takes (from 2: one row is the GEMV's); more go to cuBLAS, except below.
ROWS_MAX_ROWS = 16
# 17 to 64 rows take it on weights of at least _WIDE_MIN_OUT output columns: 128 column tiles
# or more, one split each, 64 rows a tile. us, cuBLAS / these tiles, H100 and H200:
#   64 rows: [129280, 4096] (V4's LM head) 391 / 367 and 283 / 261; [102400, 2048] (V2's)
#            170 / 153 and 115 / 113; [32768, 1024] (V4's q_b) 29.1 / 27.3 and 21.2 / 21.1;
#   17 rows: [129280, 4096] 385 / 354 and 268 / 246; [8192, 1024] 8.2 / 7.6 and 6.7 / 6.4.
# [16384, 4096] at 17 to 32 rows lost on the H200 (34.8 / 37.8); none of the presets' weights
# has that shape. Narrower weights split K and lost as often as they won (H100, 64 rows: [4096, 4096]
# 14.8 / 16.6, [2048, 4096] 11.0 / 9.6; bench/results/v4-step/h100/logs-archive/rows-wide-h100-2026-11-26.log,
# bench/results/v4-step/h100-h200/logs-archive/rows-wide-steps-2026-11-26.log).
WIDE_ROWS_MAX_ROWS = 64
_WIDE_MIN_OUT = 8192
_ROWS_DTYPES = (torch.bfloat16, torch.float16)
# Column tiles below which K is split: fewer would leave most multiprocessors idle.
_SPLIT_BELOW_TILES = 16
_SPLIT_K = 4
# Few rows of a small weight: the register GEMV's (see `takes_rows`).
_GEMV_MAX_ROWS = 4
_GEMV_MAX_WEIGHT = 1 << 22


@dataclass(frozen=True, slots=True)
class RowsConfig:
    block_n: int
    block_k: int
    split_k: int
    num_stages: int


_INTERPRETER_WIDE_OUT = 1024


def takes_rows(num_rows: int, n_out: int, k_in: int, dtype: torch.dtype) -> bool:
    """Whether `rows_linear` is the product for num_rows rows of dtype times an [n_out, k_in] weight.

    17 to 64 rows only on weights of at least 8192 output columns (see WIDE_ROWS_MAX_ROWS).
    Up to 4 rows a weight of up to 4M values stays with the register GEMV: these tiles
    cost ~4 us whatever the weight, the GEMV's extra passes less (H200, 4 rows: [1024, 4096]
    4.7 us against 5.6, [2048, 2048] 4.9 against 5.3; [3072, 2048] 8.0 against 5.7).
    """
    if dtype not in _ROWS_DTYPES or not 2 <= num_rows <= WIDE_ROWS_MAX_ROWS:
        return False
    if num_rows > ROWS_MAX_ROWS:
        return n_out >= _WIDE_MIN_OUT
    return num_rows > _GEMV_MAX_ROWS or n_out * k_in > _GEMV_MAX_WEIGHT


def rows_config(n_out: int, k_in: int, on_gpu: bool, num_rows: int = ROWS_MAX_ROWS) -> RowsConfig:
    """Tiles for a [num_rows, k_in] x [n_out, k_in]^T product (the sweeps' best, rounded to one rule)."""
    if not on_gpu:
        # Triton's interpreter pays a program's ops, not its tile's size: wide weights (LM heads) take
        # 64-column tiles there, narrow ones 16 (which keeps the K split in the CPU tests' shapes).
        block_n = 64 if n_out >= _INTERPRETER_WIDE_OUT else 16
        return RowsConfig(block_n, 32, _SPLIT_K if triton.cdiv(n_out, block_n) <= _SPLIT_BELOW_TILES else 1, 1)
    if num_rows > ROWS_MAX_ROWS:
        # A row tile as wide as the weight's: K steps of 128 three deep keep both in 96 KB.
        return RowsConfig(64, 128, _SPLIT_K if triton.cdiv(n_out, 64) <= _SPLIT_BELOW_TILES else 1, 3)
    # Short rows take shorter K steps, three deep: [11264, 1536] at 8 rows 10.5 us, 12.1 with 4 stages.
    block_k, num_stages = (256, 4) if k_in >= 2048 else (128, 3)
    split_k = _SPLIT_K if triton.cdiv(n_out, 64) <= _SPLIT_BELOW_TILES else 1
    return RowsConfig(64, block_k, split_k, num_stages)


# The row count follows the step's batch: a plain argument, not one compile per count.
@triton.jit(do_not_specialize=["num_rows"])
def _rows_kernel(
    x_ptr, w_ptr, y_ptr,
    num_rows, n_out, k_in, k_per_split,
    s_xt, s_xk, s_wn, s_wk, s_ys, s_yt, s_yn,
    BLOCK_T: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GDC: tl.constexpr,
):
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    rows = tl.arange(0, BLOCK_T)
    col_mask = cols < n_out
    row_mask = rows < num_rows
    # Split s sums K in [s * k_per_split, (s + 1) * k_per_split) into its own slice of y.
    k_lo = tl.program_id(1) * k_per_split
    k_hi = tl.minimum(k_lo + k_per_split, k_in)
    y_ptr += tl.program_id(1).to(tl.int64) * s_ys
    w_rows = w_ptr + cols[:, None].to(tl.int64) * s_wn
    if GDC:
        gdc_wait()
        gdc_launch_dependents()
    # The weight as the product's rows: [BLOCK_N, BLOCK_K] x [BLOCK_K, BLOCK_T], so a
    # handful of rows fills the narrow side of the tile.
    acc = tl.zeros([BLOCK_N, BLOCK_T], dtype=tl.float32)
    for k0 in range(k_lo, k_hi, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_mask = ks < k_hi
        w = tl.load(w_rows + ks[None, :] * s_wk, mask=col_mask[:, None] & k_mask[None, :], other=0.0)
        x = tl.load(x_ptr + rows[:, None] * s_xt + ks[None, :] * s_xk, mask=row_mask[:, None] & k_mask[None, :],
                    other=0.0)
        acc = tl.dot(w, tl.trans(x), acc)
    # Rounded to x's dtype, then to y's: a float32 y (the LM head's logits) holds the 16-bit product exactly.
    y = acc.to(x_ptr.dtype.element_ty).to(y_ptr.dtype.element_ty)
    tl.store(y_ptr + rows[None, :] * s_yt + cols[:, None] * s_yn, y, mask=row_mask[None, :] & col_mask[:, None])


def rows_linear(x: torch.Tensor, weight: torch.Tensor, config: RowsConfig | None = None, *,
                out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """x [T, K], weight [N, K] (one 16-bit dtype, any strides; T <= WIDE_ROWS_MAX_ROWS) -> y [T, N] in that dtype,
    or in out_dtype (float32: the same values, each rounded to x's dtype, widened in the store).

    Checked by the caller (`linear`, `logits`). `config` overrides `rows_config` (sweeps).
    """
    num_rows, k_in = x.shape
    n_out = weight.shape[0]
    out_dtype = out_dtype or x.dtype
    if num_rows == 0 or n_out == 0:
        return torch.empty((num_rows, n_out), dtype=out_dtype, device=x.device)
    c = config or rows_config(n_out, k_in, x.device.type == "cuda", num_rows)
    # Each split's share of K is a whole number of BLOCK_K steps.
    k_per_split = triton.cdiv(triton.cdiv(k_in, c.split_k), c.block_k) * c.block_k
    split_k = triton.cdiv(k_in, k_per_split)
    if split_k > 1 and out_dtype != x.dtype:
        # The split sums are rounded to x's dtype in their own launch: widen after it.
        return rows_linear(x, weight, config).to(out_dtype)
    y = torch.empty((num_rows, n_out), dtype=out_dtype, device=x.device)
    out = y if split_k == 1 else torch.empty((split_k, num_rows, n_out), dtype=torch.float32, device=x.device)
    use_pdl = pdl(x.device)
    _rows_kernel[(triton.cdiv(n_out, c.block_n), split_k)](
        x, weight, out,
        num_rows, n_out, k_in, k_per_split,
        *x.stride(), *weight.stride(), num_rows * n_out, *y.stride(),
        BLOCK_T=max(16, next_pow2(num_rows)), BLOCK_N=c.block_n, BLOCK_K=c.block_k, GDC=use_pdl,
        num_warps=4, num_stages=c.num_stages, launch_pdl=use_pdl,
    )
    if split_k > 1:
        sum_splits(out, y, use_pdl)
    return y
