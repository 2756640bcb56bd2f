"""A linear layer without bias, optionally computed and returned in a wider dtype, or after an RMSNorm."""

from __future__ import annotations

from collections.abc import Callable
from typing import overload

import torch
import torch.nn.functional as F

from ..quantized import Weight, dequantized
from .norm import rms_norm


def linear(x: torch.Tensor, weight: Weight, *, out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """y = x @ weight^T.

    x [T, K], weight [N, K] -> y [T, N] in x's dtype, or computed from both inputs
    widened to `out_dtype` when that is given (router logits in float32). A block-scaled
    FP8 weight is dequantized into that dtype first: this is the math every backend's FP8
    product must match (`reference.w8a8` quantizes the activations too).
    """
    weight = dequantized(weight, out_dtype or x.dtype)
    if out_dtype is None or out_dtype == x.dtype == weight.dtype:
        return F.linear(x, weight)
    return F.linear(x.to(out_dtype), weight.to(out_dtype))


def logits_of(linear_fn: Callable[..., torch.Tensor]) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    """The LM head of a table whose products are `linear_fn`: its product, widened to at least float32."""

    def logits(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """x [N, D], weight [V, D] -> [N, V] in promote(x's dtype, float32): `linear_fn(x, weight)` widened."""
        y = linear_fn(x, weight)
        return y.to(torch.promote_types(y.dtype, torch.float32))

    return logits


@overload
def rms_norm_linear(x: torch.Tensor, norm_weight: torch.Tensor, eps: float, weight: Weight, residual: None = None
                    ) -> torch.Tensor: ...
@overload
def rms_norm_linear(x: torch.Tensor, norm_weight: torch.Tensor, eps: float, weight: Weight, residual: torch.Tensor
                    ) -> tuple[torch.Tensor, torch.Tensor]: ...


def rms_norm_linear(
    x: torch.Tensor,
    norm_weight: torch.Tensor,
    eps: float,
    weight: Weight,
    residual: torch.Tensor | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """A layer's input norm and its first projection: linear(rms_norm(x [+ residual]), weight).

    x, residual [T, K]; norm_weight [K]; weight [N, K] (a tensor or an FP8 pair, as `linear` takes it)
    returns y [T, N]; with `residual`, (y, x + residual) as `rms_norm` returns the sum.
    """
    if residual is None:
        return linear(rms_norm(x, norm_weight, eps), weight)
    normed, residual_out = rms_norm(x, norm_weight, eps, residual)
    return linear(normed, weight), residual_out
