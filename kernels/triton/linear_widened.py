"""Float32 products of a few hundred rows at most: router logits and head weights, y = x @ weight^T.

The router's weight (and V3.2's indexer head weights) are held in float32 while
the activations are bf16, and the reference widens both and runs a float32 GEMM.
At decode sizes (a [64, 2048] x [64, 2048]^T product) cuBLAS takes one 64 x 64
SIMT tile and a split-K reduce, ~11 us on an H200, after a launch that widens x.

Here the K axis is split over programs (each writes its partial product to a
slice of a workspace, and a second launch sums the slices in split order, so the
bits do not depend on timing), which spreads the weight over enough programs to
stream it. A program's product is, by row count:
* up to 32 rows: a broadcast product summed in float32 over [BLOCK_T, 2, BLOCK_K]
  tiles, two output columns a program;
* more: `tl.dot` on tensor cores in three TF32 passes (each float32 operand as the
  sum of two TF32 values; bf16 inputs are exact in one), accurate to about float32's
  own rounding. Single-pass TF32 would not do: these logits choose experts and keys.

Measured on an H200 (graph replays; bench/results/dsa-kernels/h200/logs-archive/widened-linear-sweep-h200-2026-11-23.log),
[T, 2048] x [64, 2048]^T: T = 4: 2.2 us, 8: 3.2, 32: 5.4, 64: 5.7, 256: 6.9 (cuBLAS 10-12).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from ._common import next_pow2, pdl

# Rows up to which `linear` takes this kernel for float32 output (decode batches,
# short prefill chunks); longer inputs go to cuBLAS, whose tiles then fill the GPU.
WIDENED_MAX_ROWS = 256
# Up to this many rows the broadcast product beats the tensor-core passes.
_BROADCAST_MAX_ROWS = 32
# The broadcast product's [BLOCK_T, BLOCK_N, BLOCK_K] float32 tile: 64 values a thread at 4 warps.
_PRODUCT_TILE = 8192


@dataclass(frozen=True, slots=True)
class WidenedConfig:
    block_t: int
    block_n: int
    block_k: int
    tensor_cores: bool    # three-pass TF32 tl.dot (else the broadcast product)
    split_k: int          # programs sharing one tile's K axis
    num_stages: int


def widened_config(num_rows: int, k_in: int) -> WidenedConfig:
    """The tiles and K split for a [num_rows, k_in] x [N, k_in]^T product (chosen on an H200 sweep)."""
    if num_rows <= _BROADCAST_MAX_ROWS:
        block_t = min(16, next_pow2(num_rows))
        block_k = min(next_pow2(k_in), _PRODUCT_TILE // (2 * block_t))
        split_k = 1 if num_rows <= 4 else 8 if num_rows <= 8 else 4
        return WidenedConfig(block_t, 2, block_k, False, split_k, 2)
    return WidenedConfig(32 if num_rows <= 128 else 64, 16, 64, True, 8, 3)


@triton.jit
def _tile(ptr, rows, row_mask, ks, k_hi, s_r, s_k):
    """[len(rows), len(ks)] values at (rows, ks) as float32, zero outside (ks >= k_hi included)."""
    mask = row_mask[:, None] & (ks < k_hi)[None, :]
    return tl.load(ptr + rows[:, None].to(tl.int64) * s_r + ks[None, :] * s_k, mask=mask, other=0.0).to(tl.float32)


@triton.jit
def _tile_product(x, w, TENSOR_CORES: tl.constexpr):
    """[BLOCK_T, BLOCK_N] float32 sums of x [BLOCK_T, BLOCK_K] times w [BLOCK_N, BLOCK_K], both float32."""
    if TENSOR_CORES:
        return tl.dot(x, tl.trans(w), input_precision="tf32x3")
    return tl.sum(x[:, None, :] * w[None, :, :], axis=2)


# The row count follows the step's batch: a plain argument, not one compile per count.
@triton.jit(do_not_specialize=["num_rows"])
def _widened_kernel(
    x_ptr, w_ptr, y_ptr,
    num_rows, n_out, k_in, k_per_split,
    s_xt, s_xk, s_wn, s_wk, s_ys, s_yt, s_yn,
    BLOCK_T: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, TENSOR_CORES: tl.constexpr,
    GDC: tl.constexpr,
):
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    rows = tl.program_id(1) * BLOCK_T + tl.arange(0, BLOCK_T)
    col_mask = cols < n_out
    row_mask = rows < num_rows
    # Split s sums K in [s * k_per_split, (s + 1) * k_per_split) into its own slice of y.
    k_lo = tl.program_id(2) * k_per_split
    k_hi = tl.minimum(k_lo + k_per_split, k_in)
    y_ptr += tl.program_id(2).to(tl.int64) * s_ys
    ks = k_lo + tl.arange(0, BLOCK_K)
    # The weight depends on no earlier kernel: its first slice is in flight before the wait.
    w = _tile(w_ptr, cols, col_mask, ks, k_hi, s_wn, s_wk)
    if GDC:
        gdc_wait()
        gdc_launch_dependents()
    x = _tile(x_ptr, rows, row_mask, ks, k_hi, s_xt, s_xk)
    acc = _tile_product(x, w, TENSOR_CORES)
    for k0 in range(BLOCK_K, k_per_split, BLOCK_K):
        kk = k0 + ks
        w = _tile(w_ptr, cols, col_mask, kk, k_hi, s_wn, s_wk)
        x = _tile(x_ptr, rows, row_mask, kk, k_hi, s_xt, s_xk)
        acc += _tile_product(x, w, TENSOR_CORES)
    tl.store(y_ptr + rows[:, None].to(tl.int64) * s_yt + cols[None, :] * s_yn, acc,
             mask=row_mask[:, None] & col_mask[None, :])


@triton.jit
def _sum_splits_kernel(part_ptr, y_ptr, numel, num_splits, s_ps, BLOCK: tl.constexpr, GDC: tl.constexpr):
    """y = the sum of the splits' partial products, in split order (the same bits every run), in y's dtype."""
    if GDC:
        gdc_wait()
        gdc_launch_dependents()
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < numel
    acc = tl.load(part_ptr + offs, mask=mask, other=0.0)
    for split in range(1, num_splits):
        acc += tl.load(part_ptr + split * s_ps + offs, mask=mask, other=0.0)
    tl.store(y_ptr + offs, acc.to(y_ptr.dtype.element_ty), mask=mask)


def widened_linear(x: torch.Tensor, weight: torch.Tensor, config: WidenedConfig | None = None) -> torch.Tensor:
    """x [T, K], weight [N, K] (float dtypes, may differ; any strides) -> y [T, N] float32.

    Both inputs are widened to float32 and the products summed in float32, as
    `F.linear(x.float(), weight.float())` computes (up to the order of the sums and,
    above 32 rows, the three-pass TF32 rounding). Checked by the caller (`linear`);
    meant for up to WIDENED_MAX_ROWS rows. `config` overrides `widened_config` (sweeps).
    """
    num_rows, k_in = x.shape
    n_out = weight.shape[0]
    y = torch.empty((num_rows, n_out), dtype=torch.float32, device=x.device)
    if num_rows == 0 or n_out == 0:
        return y
    c = config or widened_config(num_rows, k_in)
    # Each split's share of K is a whole number of BLOCK_K steps.
    k_per_split = triton.cdiv(triton.cdiv(k_in, c.split_k), c.block_k) * c.block_k
    split_k = triton.cdiv(k_in, k_per_split)
    out = y if split_k == 1 else torch.empty((split_k, num_rows, n_out), dtype=torch.float32, device=x.device)
    use_pdl = pdl(x.device)
    _widened_kernel[(triton.cdiv(n_out, c.block_n), triton.cdiv(num_rows, c.block_t), split_k)](
        x, weight, out,
        num_rows, n_out, k_in, k_per_split,
        *x.stride(), *weight.stride(), num_rows * n_out, *y.stride(),
        BLOCK_T=c.block_t, BLOCK_N=c.block_n, BLOCK_K=c.block_k, TENSOR_CORES=c.tensor_cores, GDC=use_pdl,
        num_warps=4, num_stages=c.num_stages, launch_pdl=use_pdl,
    )
    if split_k > 1:
        sum_splits(out, y, use_pdl)
    return y


def sum_splits(partial: torch.Tensor, y: torch.Tensor, use_pdl: bool) -> None:
    """y [T, N] (contiguous, any float dtype) = the sum over splits of partial [S, T, N] float32, in split order."""
    numel = y.numel()
    block = min(1024, next_pow2(numel))
    _sum_splits_kernel[(triton.cdiv(numel, block),)](
        partial, y, numel, partial.shape[0], partial.stride(0), BLOCK=block, GDC=use_pdl,
        num_warps=4, launch_pdl=use_pdl,
    )
