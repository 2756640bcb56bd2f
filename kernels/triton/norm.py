"""RMSNorm, optionally fused with the residual add that precedes it; LayerNorm of strided rows."""

from __future__ import annotations

from typing import overload

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from ..checks import check_same_device, check_shape
from ._common import check_float, next_pow2, pdl


@triton.jit
def _rms_norm_kernel(
    x_ptr, res_ptr, w_ptr, y_ptr, res_out_ptr,
    dim, eps,
    stride_xt, stride_xd, stride_rt, stride_rd, stride_w,
    stride_yt, stride_ot,
    HAS_RESIDUAL: tl.constexpr,
    BLOCK_D: tl.constexpr,
    GDC: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK_D)
    mask = cols < dim
    w = tl.load(w_ptr + cols * stride_w, mask=mask, other=0.0).to(tl.float32)
    if GDC:
        gdc_wait()
        gdc_launch_dependents()
    x = tl.load(x_ptr + row * stride_xt + cols * stride_xd, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        r = tl.load(res_ptr + row * stride_rt + cols * stride_rd, mask=mask, other=0.0)
        # Round the sum to the residual's dtype before taking statistics, as the
        # unfused `x + residual` would; the rounded sum is also what is returned.
        x = (x.to(tl.float32) + r.to(tl.float32)).to(res_ptr.dtype.element_ty)
        tl.store(res_out_ptr + row * stride_ot + cols, x, mask=mask)
    xf = x.to(tl.float32)
    inv_rms = 1.0 / tl.sqrt(tl.sum(xf * xf, axis=0) / dim + eps)
    # res_ptr is x_ptr when there is no residual: the dtype of what is normalised.
    normed = (xf * inv_rms).to(res_ptr.dtype.element_ty).to(tl.float32)
    tl.store(y_ptr + row * stride_yt + cols, (w * normed).to(y_ptr.dtype.element_ty), mask=mask)


@overload
def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: None = None) -> torch.Tensor: ...
@overload
def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor
             ) -> tuple[torch.Tensor, torch.Tensor]: ...


def rms_norm(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    residual: torch.Tensor | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """y = weight * x / sqrt(mean(x^2) + eps), statistics in float32.

    x, residual: [T, D] (any strides); weight: [D]
    returns      y [T, D] in promote(weight, x) dtype; with `residual`,
                 (y, x + residual) where the sum is rounded to residual's dtype,
                 y normalises it and is in promote(weight, residual) dtype.
    """
    num_tokens, dim = x.shape
    check_shape("weight", weight, (dim,))
    check_float("x", x)
    check_float("weight", weight)
    if residual is not None:
        check_shape("residual", residual, (num_tokens, dim))
        check_float("residual", residual)
        check_same_device(x=x, weight=weight, residual=residual)
    else:
        check_same_device(x=x, weight=weight)
    sum_dtype = x.dtype if residual is None else residual.dtype
    y = torch.empty((num_tokens, dim), dtype=torch.promote_types(weight.dtype, sum_dtype), device=x.device)
    res_out = torch.empty((num_tokens, dim), dtype=sum_dtype, device=x.device) if residual is not None else y
    if num_tokens > 0:
        block_d = next_pow2(dim)
        res = residual if residual is not None else x
        use_pdl = pdl(x.device)
        _rms_norm_kernel[(num_tokens,)](
            x, res, weight, y, res_out,
            dim, float(eps),
            *x.stride(), *res.stride(), weight.stride(0),
            y.stride(0), res_out.stride(0),
            HAS_RESIDUAL=residual is not None,
            BLOCK_D=block_d,
            GDC=use_pdl,
            launch_pdl=use_pdl,
            # A whole row per program; wider rows get more warps so each thread
            # holds at most ~16 values.
            num_warps=max(1, min(16, block_d // 512)),
        )
    return y if residual is None else (y, res_out)


@triton.jit
def _layer_norm_kernel(
    x_ptr, w_ptr, b_ptr, y_ptr,
    dim, eps,
    stride_xt, stride_xd, stride_w, stride_b, stride_yt,
    BLOCK_D: tl.constexpr, GDC: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK_D)
    mask = cols < dim
    w = tl.load(w_ptr + cols * stride_w, mask=mask, other=0.0).to(tl.float32)
    b = tl.load(b_ptr + cols * stride_b, mask=mask, other=0.0).to(tl.float32)
    if GDC:
        gdc_wait()
        gdc_launch_dependents()
    x = tl.load(x_ptr + row * stride_xt + cols * stride_xd, mask=mask, other=0.0).to(tl.float32)
    mean = tl.sum(x, axis=0) / dim
    centred = tl.where(mask, x - mean, 0.0)
    inv_std = 1.0 / tl.sqrt(tl.sum(centred * centred, axis=0) / dim + eps)
    tl.store(y_ptr + row * stride_yt + cols, (centred * inv_std * w + b).to(y_ptr.dtype.element_ty), mask=mask)


def layer_norm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, eps: float) -> torch.Tensor:
    """Contract of `reference.norm.layer_norm`, one program a row, rows read in place.

    x [T, D] (any strides: the indexer normalises its key columns of a wider projection
    without the copy torch's layer_norm makes first); weight, bias [D] -> y [T, D] contiguous
    in promote(x, weight) dtype.
    """
    num_tokens, dim = x.shape
    check_shape("weight", weight, (dim,))
    check_shape("bias", bias, (dim,))
    check_float("x", x)
    check_float("weight", weight)
    check_float("bias", bias)
    check_same_device(x=x, weight=weight, bias=bias)
    y = torch.empty((num_tokens, dim), dtype=torch.promote_types(x.dtype, weight.dtype), device=x.device)
    if num_tokens > 0:
        block_d = next_pow2(dim)
        use_pdl = pdl(x.device)
        _layer_norm_kernel[(num_tokens,)](
            x, weight, bias, y,
            dim, float(eps),
            *x.stride(), weight.stride(0), bias.stride(0), y.stride(0),
            BLOCK_D=block_d, GDC=use_pdl, launch_pdl=use_pdl,
            num_warps=max(1, min(16, block_d // 512)),
        )
    return y
