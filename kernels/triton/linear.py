"""Linear layers of a few rows (decode at small batch): a weight-streaming GEMV, tensor-core tiles, cuBLAS.

At one row a projection is a read of its weight and little else; cuBLAS reaches
under half the copy rate there (a 2048 x 2048 bf16 weight in 6.3 us on an H100).
Here each program owns a few output columns, loads the first slice of their weight
rows into registers *before* it waits for the previous kernel (see `_common.pdl`),
then multiplies every row of x by it: the weight's latency overlaps whatever ran
before. From two rows of 16-bit floats on (of large weights; from five rows of any),
`linear_rows` streams the weight through tensor-core tiles instead (this GEMV's
float32 pass a row costs more than the read, see `linear_rows.takes_rows`); float32
rows keep the GEMV up to LINEAR_MAX_ROWS. Longer inputs go to cuBLAS, whose tiles
then fill the GPU, except 17 to 64 rows of a wide weight (an LM head, V4's q_b), which
`linear_rows` reads faster.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import overload

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from ..checks import check_dtype, check_same_device, check_shape
from ..reference.linear import logits_of
from ._common import check_float, next_pow2, pdl
from .linear_rows import rows_linear, takes_rows
from .linear_widened import WIDENED_MAX_ROWS, widened_linear
from .norm import rms_norm

# Rows up to which the GEMV runs (16-bit rows of large weights go to `linear_rows` from two on); each row
# is one more pass over the weight tile in registers.
LINEAR_MAX_ROWS = 4
# Triton's interpreter runs a program's ops one numpy call each, whatever a tile's size: wide tiles
# (few programs) keep the CPU tests' time down, and 64-wide K slices still take several K steps there.
_INTERPRETER_BLOCK_N = 32
_INTERPRETER_BLOCK_K = 64


@dataclass(frozen=True, slots=True)
class GemvTiles:
    """A program's [block_n, block_k] weight tile and its warps."""

    block_n: int
    block_k: int
    num_warps: int


def gemv_tiles(k_in: int, on_gpu: bool) -> GemvTiles:
    """The GEMV's tiles for rows of k_in values.

    Swept on an H200 (bench/results/dsa-kernels/h200/logs-archive/gemv-tiles-h200-2026-11-24.log; one row, with and
    without programmatic dependent launch): about 8K weights a program, whole rows of K up
    to 4096, 4 warps. Against the earlier 16 x 2048 tiles at 8 warps: [4096] x [1024, 4096]^T
    3.3 us from 5.1, [4096] x [129280, 4096]^T (an LM head) 234 us from 279, [8192] x
    [4096, 8192]^T 17.9 from 20.8. Narrow tiles mean many programs: a weight of few columns
    still spreads over the multiprocessors.
    """
    if not on_gpu:
        return GemvTiles(block_n=_INTERPRETER_BLOCK_N, block_k=min(_INTERPRETER_BLOCK_K, next_pow2(k_in)),
                         num_warps=4)
    return GemvTiles(block_n=2 if k_in > 2048 else 4, block_k=min(4096, next_pow2(k_in)), num_warps=4)


@triton.jit
def _rows_times_tile(x_ptr, w, ks, k_mask, acc, num_rows, s_xt, s_xk, BLOCK_T: tl.constexpr):
    """acc[t, :] += w @ x[t, ks] for the first num_rows rows; w [BLOCK_N, BLOCK_K] float32."""
    rows = tl.arange(0, BLOCK_T)
    for t in tl.static_range(BLOCK_T):
        row_ok = tl.full(ks.shape, t, tl.int32) < num_rows
        x = tl.load(x_ptr + t * s_xt + ks * s_xk, mask=k_mask & row_ok, other=0.0).to(tl.float32)
        part = tl.sum(w * x[None, :], axis=1)
        acc = tl.where(rows[:, None] == t, acc + part[None, :], acc)
    return acc


@triton.jit
def _weight_tile(w_rows, col_mask, ks, k_in, s_wk):
    """The [BLOCK_N, BLOCK_K] weight slice at columns ks (zero past k_in), and the ks mask."""
    k_mask = ks < k_in
    return tl.load(w_rows + ks[None, :] * s_wk, mask=col_mask[:, None] & k_mask[None, :], other=0.0), k_mask


# The row count follows the step's batch: a plain argument, not one compile per count.
@triton.jit(do_not_specialize=["num_rows"])
def _linear_kernel(
    x_ptr, w_ptr, y_ptr,
    num_rows, n_out, k_in,
    s_xt, s_xk, s_wn, s_wk, s_yt, s_yn,
    BLOCK_T: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GDC: tl.constexpr,
):
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_mask = cols < n_out
    ks = tl.arange(0, BLOCK_K)
    w_rows = w_ptr + cols[:, None].to(tl.int64) * s_wn
    # The weight depends on no earlier kernel: its first slice is in flight before the wait.
    w, k_mask = _weight_tile(w_rows, col_mask, ks, k_in, s_wk)
    if GDC:
        gdc_wait()
        gdc_launch_dependents()
    acc = tl.zeros([BLOCK_T, BLOCK_N], dtype=tl.float32)
    acc = _rows_times_tile(x_ptr, w.to(tl.float32), ks, k_mask, acc, num_rows, s_xt, s_xk, BLOCK_T)
    for k0 in range(BLOCK_K, k_in, BLOCK_K):
        kk = k0 + ks
        w, k_mask = _weight_tile(w_rows, col_mask, kk, k_in, s_wk)
        acc = _rows_times_tile(x_ptr, w.to(tl.float32), kk, k_mask, acc, num_rows, s_xt, s_xk, BLOCK_T)
    rows = tl.arange(0, BLOCK_T)
    tl.store(y_ptr + rows[:, None] * s_yt + cols[None, :] * s_yn, acc.to(y_ptr.dtype.element_ty),
             mask=(rows < num_rows)[:, None] & col_mask[None, :])


def linear(x: torch.Tensor, weight: torch.Tensor, *, out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """Contract of `reference.linear.linear`: the GEMV, tensor-core tiles or cuBLAS, by rows and dtype.

    x [T, K], weight [N, K] (any strides) -> y [T, N] in x's dtype or `out_dtype`. One
    float dtype, except with out_dtype float32, where the inputs may differ (a float32
    router weight on bf16 activations) and both are widened. Every path multiplies in
    float32 (or exactly, 16-bit products on tensor cores) and rounds once, as cuBLAS
    does. One row takes the GEMV; 2..`linear_rows.ROWS_MAX_ROWS` rows of bf16 / fp16 `linear_rows`
    (up to 4 of them only on large weights), and so do 17 to 64 rows of weights of 8192+ outputs
    (`takes_rows`); other rows up to LINEAR_MAX_ROWS the GEMV; float32 outputs of up to
    WIDENED_MAX_ROWS rows that those do not take `linear_widened`; the rest cuBLAS.
    """
    num_rows, k_in = x.shape
    n_out = weight.shape[0]
    check_shape("weight", weight, (n_out, k_in))
    check_float("x", x)
    widened = out_dtype == torch.float32
    if widened:
        check_float("weight", weight)
    else:
        check_dtype("weight", weight, (x.dtype,))
    check_same_device(x=x, weight=weight)
    out_dtype = out_dtype or x.dtype
    same_dtype = out_dtype == x.dtype == weight.dtype
    if same_dtype and takes_rows(num_rows, n_out, k_in, x.dtype):
        return rows_linear(x, weight)
    if widened and (x.dtype != weight.dtype or num_rows > LINEAR_MAX_ROWS) and num_rows <= WIDENED_MAX_ROWS:
        return widened_linear(x, weight)
    if num_rows > LINEAR_MAX_ROWS:
        if same_dtype:
            return F.linear(x, weight)
        return F.linear(x.to(out_dtype), weight.to(out_dtype))
    y = torch.empty((num_rows, n_out), dtype=out_dtype, device=x.device)
    if num_rows == 0 or n_out == 0:
        return y
    tiles = gemv_tiles(k_in, x.device.type == "cuda")
    use_pdl = pdl(x.device)
    _linear_kernel[(triton.cdiv(n_out, tiles.block_n),)](
        x, weight, y,
        num_rows, n_out, k_in,
        *x.stride(), *weight.stride(), *y.stride(),
        BLOCK_T=next_pow2(num_rows), BLOCK_N=tiles.block_n, BLOCK_K=tiles.block_k, GDC=use_pdl,
        num_warps=tiles.num_warps, launch_pdl=use_pdl,
    )
    return y


_logits_by_linear = logits_of(linear)


def logits(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """Contract of the reference table's `logits`: x [N, D], weight [V, D] -> [N, V] in promote(x's dtype, float32).

    Rows the row tiles take (`takes_rows`: a decode batch's LM head) are stored in float32 by
    the product itself, each value rounded to x's dtype first as `linear` rounds it: no second
    pass over [N, V] to widen them (H100, v4-mini's B64 head: a 25 us cast of 33 MB written).
    Other shapes run `linear` and widen its output (`logits_of(linear)`).
    """
    num_rows, k_in = x.shape
    n_out = weight.shape[0]
    if x.dtype == weight.dtype and takes_rows(num_rows, n_out, k_in, x.dtype):
        check_shape("weight", weight, (n_out, k_in))
        check_same_device(x=x, weight=weight)
        return rows_linear(x, weight, out_dtype=torch.float32)
    return _logits_by_linear(x, weight)


@triton.jit
def _sum_row(x_ptr, res_ptr, t, ks, k_mask, s_xt, s_xk, s_rt, s_rk, HAS_RESIDUAL: tl.constexpr):
    """Row t of x (plus residual, rounded to the residual's dtype) at columns ks, as float32."""
    x = tl.load(x_ptr + t * s_xt + ks * s_xk, mask=k_mask, other=0.0)
    if HAS_RESIDUAL:
        r = tl.load(res_ptr + t * s_rt + ks * s_rk, mask=k_mask, other=0.0)
        x = (x.to(tl.float32) + r.to(tl.float32)).to(res_ptr.dtype.element_ty)
    return x.to(tl.float32)


@triton.jit
def _normed_rows_times_tile(x_ptr, res_ptr, nw_ptr, w_ptr, res_out_ptr, w, ks, k_mask, acc, inv_rms, num_rows,
                            write_sum, s_xt, s_xk, s_rt, s_rk, s_nw, s_ot,
                            HAS_RESIDUAL: tl.constexpr, BLOCK_T: tl.constexpr):
    """acc[t, :] += w @ rms_norm(x[t] (+ residual[t]))[ks] for the first num_rows rows.

    The normalised row is rounded as `rms_norm` rounds it (to the sum's dtype, then
    weight times that to the projection's dtype); w is the [BLOCK_N, BLOCK_K] tile in float32.
    Programs with write_sum also store the sum itself.
    """
    rows = tl.arange(0, BLOCK_T)
    nw = tl.load(nw_ptr + ks * s_nw, mask=k_mask, other=0.0).to(tl.float32)
    for t in tl.static_range(BLOCK_T):
        row_ok = k_mask & (tl.full(ks.shape, t, tl.int32) < num_rows)
        xs = _sum_row(x_ptr, res_ptr, t, ks, row_ok, s_xt, s_xk, s_rt, s_rk, HAS_RESIDUAL)
        if HAS_RESIDUAL:
            mine = tl.full(ks.shape, write_sum, tl.int32) != 0
            tl.store(res_out_ptr + t * s_ot + ks, xs.to(res_out_ptr.dtype.element_ty), mask=row_ok & mine)
        inv = tl.sum(tl.where(rows == t, inv_rms, 0.0), axis=0)
        normed = (xs * inv).to(res_ptr.dtype.element_ty).to(tl.float32)
        xn = (nw * normed).to(w_ptr.dtype.element_ty).to(tl.float32)
        acc = tl.where(rows[:, None] == t, acc + tl.sum(w * xn[None, :], axis=1)[None, :], acc)
    return acc


@triton.jit(do_not_specialize=["num_rows"])
def _norm_linear_kernel(
    x_ptr, res_ptr, nw_ptr, w_ptr, y_ptr, res_out_ptr,
    num_rows, n_out, k_in, eps,
    s_xt, s_xk, s_rt, s_rk, s_nw, s_wn, s_wk, s_yt, s_yn, s_ot,
    HAS_RESIDUAL: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    GDC: tl.constexpr,
):
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_mask = cols < n_out
    ks = tl.arange(0, BLOCK_K)
    w_rows = w_ptr + cols[:, None].to(tl.int64) * s_wn
    # As in `_linear_kernel`: the weight's first slice is in flight before the wait.
    w, k_mask = _weight_tile(w_rows, col_mask, ks, k_in, s_wk)
    if GDC:
        gdc_wait()
        gdc_launch_dependents()
    # Every program takes each row's statistics itself (a few K values a row, from
    # L2), which saves the norm its own launch and round trip through memory.
    rows = tl.arange(0, BLOCK_T)
    inv_rms = tl.zeros([BLOCK_T], dtype=tl.float32)
    for t in tl.static_range(BLOCK_T):
        sum_sq = tl.zeros([BLOCK_K], dtype=tl.float32)
        for k0 in range(0, k_in, BLOCK_K):
            kk = k0 + ks
            row_ok = (kk < k_in) & (tl.full(ks.shape, t, tl.int32) < num_rows)
            xs = _sum_row(x_ptr, res_ptr, t, kk, row_ok, s_xt, s_xk, s_rt, s_rk, HAS_RESIDUAL)
            sum_sq += xs * xs
        inv_rms = tl.where(rows == t, 1.0 / tl.sqrt(tl.sum(sum_sq, axis=0) / k_in + eps), inv_rms)
    write_sum = (tl.program_id(0) == 0).to(tl.int32)
    acc = tl.zeros([BLOCK_T, BLOCK_N], dtype=tl.float32)
    acc = _normed_rows_times_tile(x_ptr, res_ptr, nw_ptr, w_ptr, res_out_ptr, w.to(tl.float32), ks, k_mask, acc,
                                  inv_rms, num_rows, write_sum, s_xt, s_xk, s_rt, s_rk, s_nw, s_ot,
                                  HAS_RESIDUAL, BLOCK_T)
    for k0 in range(BLOCK_K, k_in, BLOCK_K):
        kk = k0 + ks
        w, k_mask = _weight_tile(w_rows, col_mask, kk, k_in, s_wk)
        acc = _normed_rows_times_tile(x_ptr, res_ptr, nw_ptr, w_ptr, res_out_ptr, w.to(tl.float32), kk, k_mask,
                                      acc, inv_rms, num_rows, write_sum, s_xt, s_xk, s_rt, s_rk, s_nw, s_ot,
                                      HAS_RESIDUAL, BLOCK_T)
    tl.store(y_ptr + rows[:, None] * s_yt + cols[None, :] * s_yn, acc.to(y_ptr.dtype.element_ty),
             mask=(rows < num_rows)[:, None] & col_mask[None, :])


@overload
def rms_norm_linear(x: torch.Tensor, norm_weight: torch.Tensor, eps: float, weight: torch.Tensor, residual: None = None
                    ) -> torch.Tensor: ...
@overload
def rms_norm_linear(x: torch.Tensor, norm_weight: torch.Tensor, eps: float, weight: torch.Tensor, residual: torch.Tensor
                    ) -> tuple[torch.Tensor, torch.Tensor]: ...


def rms_norm_linear(
    x: torch.Tensor,
    norm_weight: torch.Tensor,
    eps: float,
    weight: torch.Tensor,
    residual: torch.Tensor | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Contract of `reference.linear.rms_norm_linear`: one GEMV launch for up to LINEAR_MAX_ROWS rows.

    x, residual [T, K] (any strides); norm_weight [K]; weight [N, K], whose dtype must
    be that of the normalised rows, promote(norm_weight, residual or x).
    Above LINEAR_MAX_ROWS rows it is `rms_norm` then `linear`.
    """
    num_rows, k_in = x.shape
    if num_rows > LINEAR_MAX_ROWS or num_rows == 0:
        if residual is None:
            return linear(rms_norm(x, norm_weight, eps), weight)
        normed, residual_out = rms_norm(x, norm_weight, eps, residual)
        return linear(normed, weight), residual_out
    n_out = weight.shape[0]
    check_shape("norm_weight", norm_weight, (k_in,))
    check_shape("weight", weight, (n_out, k_in))
    check_float("x", x)
    check_float("norm_weight", norm_weight)
    sum_dtype = x.dtype
    if residual is not None:
        check_shape("residual", residual, (num_rows, k_in))
        check_float("residual", residual)
        check_same_device(x=x, norm_weight=norm_weight, weight=weight, residual=residual)
        sum_dtype = residual.dtype
    else:
        check_same_device(x=x, norm_weight=norm_weight, weight=weight)
    check_dtype("weight", weight, (torch.promote_types(norm_weight.dtype, sum_dtype),))
    y = torch.empty((num_rows, n_out), dtype=weight.dtype, device=x.device)
    res_out = torch.empty((num_rows, k_in), dtype=sum_dtype, device=x.device) if residual is not None else y
    res = residual if residual is not None else x
    tiles = gemv_tiles(k_in, x.device.type == "cuda")
    use_pdl = pdl(x.device)
    _norm_linear_kernel[(triton.cdiv(n_out, tiles.block_n),)](
        x, res, norm_weight, weight, y, res_out,
        num_rows, n_out, k_in, float(eps),
        *x.stride(), *res.stride(), norm_weight.stride(0), *weight.stride(), *y.stride(), res_out.stride(0),
        HAS_RESIDUAL=residual is not None, BLOCK_T=next_pow2(num_rows), BLOCK_N=tiles.block_n,
        BLOCK_K=tiles.block_k, GDC=use_pdl, num_warps=tiles.num_warps, launch_pdl=use_pdl,
    )
    return y if residual is None else (y, res_out)
