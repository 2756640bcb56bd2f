"""RMSNorm, optionally fused with the residual add that precedes it."""

from __future__ import annotations

import torch


def rms_norm(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    residual: torch.Tensor | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """y = weight * x / sqrt(mean(x^2) + eps), statistics in at least float32.

    x, residual: [T, D]; weight: [D]
    returns      y [T, D]; with `residual`, (y, x + residual) where y normalises x + residual.
    """
    if residual is not None:
        x = x + residual
    acc = torch.promote_types(x.dtype, torch.float32)
    xf = x.to(acc)
    normed = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    y = weight * normed.to(x.dtype)
    return y if residual is None else (y, x)
