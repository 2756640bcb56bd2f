"""Products of a backend that has no FP8 kernel yet, made to take block-scaled FP8 weights.

Each wrapper turns a `BlockFP8Weight` into its dequantized tensor in the activations' dtype
(`out_dtype` where the op widens) and calls the backend's own product on it, so the result is
the reference's math (`reference.linear`, `reference.moe`) rounded as that backend's product
rounds; a plain tensor goes straight through. Dequantizing is per weight, never per row, so a
batch-invariant product stays batch-invariant. It materialises the dense weight on every call
(no memory saved while computing, only while held); FP8 kernels replace these wrappers op by op.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, overload

import torch

from .quantized import Weight, dequantized

Tensor = torch.Tensor


@dataclass(frozen=True, slots=True)
class DequantizingLinear:
    """`contracts.Linear` from a product `fn(x, weight [N, K] tensor, *, out_dtype)`."""

    fn: Callable[..., Tensor]

    def __call__(self, x: Tensor, weight: Weight, /, *, out_dtype: torch.dtype | None = None) -> Tensor:
        """x [T, K], weight [N, K] -> [T, N] (see `contracts.Linear`)."""
        return self.fn(x, dequantized(weight, out_dtype or x.dtype), out_dtype=out_dtype)


@dataclass(frozen=True, slots=True)
class DequantizingRmsNormLinear:
    """`contracts.RmsNormLinear` from `fn(x, norm_weight, eps, weight [N, K] tensor, residual)`."""

    fn: Callable[..., Any]

    @overload
    def __call__(self, x: Tensor, norm_weight: Tensor, eps: float, weight: Weight, /, residual: None = None
                 ) -> Tensor: ...
    @overload
    def __call__(self, x: Tensor, norm_weight: Tensor, eps: float, weight: Weight, /, residual: Tensor
                 ) -> tuple[Tensor, Tensor]: ...

    def __call__(self, x: Tensor, norm_weight: Tensor, eps: float, weight: Weight, /,
                 residual: Tensor | None = None) -> Tensor | tuple[Tensor, Tensor]:
        """x, residual [T, K]; weight [N, K] -> y [T, N] (and x + residual); see `contracts.RmsNormLinear`."""
        dense = dequantized(weight, x.dtype)
        if residual is None:
            out: Tensor = self.fn(x, norm_weight, eps, dense)
            return out
        pair: tuple[Tensor, Tensor] = self.fn(x, norm_weight, eps, dense, residual)
        return pair


@dataclass(frozen=True, slots=True)
class DequantizingFusedMoe:
    """`contracts.FusedMoe` from `fn(x, w13 [E, 2I, D], w2 [E, D, I] tensors, topk_weights, topk_ids, *, out_dtype)`."""

    fn: Callable[..., Tensor]

    def __call__(self, x: Tensor, w13: Weight, w2: Weight, topk_weights: Tensor, topk_ids: Tensor, /, *,
                 out_dtype: torch.dtype | None = None) -> Tensor:
        """x [T, D] -> [T, D] in out_dtype (see `contracts.FusedMoe`)."""
        return self.fn(x, dequantized(w13, x.dtype), dequantized(w2, x.dtype), topk_weights, topk_ids,
                       out_dtype=out_dtype)


@dataclass(frozen=True, slots=True)
class DequantizingClampedExperts:
    """`contracts.ClampedExperts` from `fn(x, w13 [E, 2I, D], w2 [E, D, I] tensors, topk_weights, topk_ids, *, limit)`:
    FP8 and FP4 experts dequantized into x's dtype (no kernel reads them packed yet)."""

    fn: Callable[..., Tensor]

    def __call__(self, x: Tensor, w13: Weight, w2: Weight, topk_weights: Tensor, topk_ids: Tensor, /, *,
                 limit: float) -> Tensor:
        """x [T, D] -> [T, D] in x's dtype (see `contracts.ClampedExperts`)."""
        return self.fn(x, dequantized(w13, x.dtype), dequantized(w2, x.dtype), topk_weights, topk_ids, limit=limit)
