"""A linear layer without bias, optionally computed and returned in a wider dtype."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def linear(x: torch.Tensor, weight: torch.Tensor, *, out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """y = x @ weight^T.

    x [T, K], weight [N, K] -> y [T, N] in x's dtype, or computed from both inputs
    widened to `out_dtype` when that is given (router logits in float32).
    """
    if out_dtype is None or out_dtype == x.dtype == weight.dtype:
        return F.linear(x, weight)
    return F.linear(x.to(out_dtype), weight.to(out_dtype))
