"""RMSNorm, optionally fused with the residual add that precedes it."""

from __future__ import annotations

from typing import overload

import torch
import torch.nn.functional as F

from ..checks import as_dtype


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
    """y = weight * x / sqrt(mean(x^2) + eps), statistics in at least float32.

    x, residual: [T, D]; weight: [D]
    returns      y [T, D]; with `residual`, (y, x + residual) where y normalises x + residual.
    The sum is rounded to residual's dtype (the residual stream keeps its dtype;
    a wider x, e.g. float32 expert sums, is added before that one rounding).
    """
    if residual is not None:
        wide = torch.promote_types(torch.promote_types(x.dtype, residual.dtype), torch.float32)
        x = as_dtype(as_dtype(x, wide) + as_dtype(residual, wide), residual.dtype)
    acc = torch.promote_types(x.dtype, torch.float32)
    xf = as_dtype(x, acc)
    normed = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    y = weight * as_dtype(normed, x.dtype)
    return y if residual is None else (y, x)


def layer_norm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, eps: float) -> torch.Tensor:
    """y = (x - mean) / sqrt(var + eps) * weight + bias over the last dim of x [T, D]; weight, bias [D]."""
    return F.layer_norm(x, (x.shape[-1],), weight, bias, eps)
