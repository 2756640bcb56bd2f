"""The Triton table's products, taking block-scaled FP8 weights to the FP8 kernels.

Each op of the `Linear`, `RmsNormLinear` and `FusedMoe` contracts sends a plain weight to the
table's 16-bit kernel and a `BlockFP8Weight` to `fp8_linear` / `fp8_fused_moe`, which read its
one byte a value and apply the scales in the accumulator: the reference's dequantized-weight math
(activations stay in their dtype), as the contracts define it. A weight whose K block the FP8
kernels cannot step through (`check_block_k`: a power of two of at least 32; only a regrouped
weight of a tiny test shape has another) is dequantized into the 16-bit kernel instead.

The batch-invariant table builds the same wrappers with `batch_invariant=True`: every row count takes
the block GEMM (`fp8_linear(batch_invariant=True)`, one K order), and the fused MoE the tiled path in a
configuration of the invariant table's (`invariant.invariant_fp8_moe_config`), never the per-pair path.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, overload

import torch

from ..quantized import BlockFP8Weight, Weight, dequantized
from .fp8_linear import fp8_linear
from .fp8_moe import Fp8MoeConfig, fp8_fused_moe
from .norm import rms_norm

Tensor = torch.Tensor


def fp8_pair(w: Weight) -> BlockFP8Weight | None:
    """`w` when the FP8 kernels take it as it is (an FP8 pair whose K block they can step through), else None."""
    if not isinstance(w, BlockFP8Weight):
        return None
    bk = w.block[1]
    return w if bk >= 32 and bk & (bk - 1) == 0 else None


def _product(x: Tensor, weight: Weight, dense: Callable[..., Tensor], out_dtype: torch.dtype | None,
             batch_invariant: bool) -> Tensor:
    if (pair := fp8_pair(weight)) is not None:
        return fp8_linear(x, pair.values, pair.scale_inv, block=pair.block, out_dtype=out_dtype,
                          batch_invariant=batch_invariant)
    return dense(x, dequantized(weight, out_dtype or x.dtype), out_dtype=out_dtype)


@dataclass(frozen=True, slots=True)
class Fp8Linear:
    """`contracts.Linear`: `dense(x, weight [N, K] tensor, *, out_dtype)` for plain weights; batch_invariant
    sends FP8 pairs through `fp8_linear`'s batch-invariant path."""

    dense: Callable[..., Tensor]
    batch_invariant: bool = False

    def __call__(self, x: Tensor, weight: Weight, /, *, out_dtype: torch.dtype | None = None) -> Tensor:
        """x [T, K], weight [N, K] -> [T, N] (see `contracts.Linear`)."""
        return _product(x, weight, self.dense, out_dtype, self.batch_invariant)


@dataclass(frozen=True, slots=True)
class Fp8RmsNormLinear:
    """`contracts.RmsNormLinear`: `dense(x, norm_weight, eps, weight, residual)` for plain weights; an FP8
    weight takes the norm, then `fp8_linear` (no fused kernel reads FP8 weights; batch_invariant as
    `Fp8Linear`'s)."""

    dense: Callable[..., Any]
    linear: Callable[..., Tensor]
    batch_invariant: bool = False

    @overload
    def __call__(self, x: Tensor, norm_weight: Tensor, eps: float, weight: Weight, /, residual: None = None
                 ) -> Tensor: ...
    @overload
    def __call__(self, x: Tensor, norm_weight: Tensor, eps: float, weight: Weight, /, residual: Tensor
                 ) -> tuple[Tensor, Tensor]: ...

    def __call__(self, x: Tensor, norm_weight: Tensor, eps: float, weight: Weight, /,
                 residual: Tensor | None = None) -> Tensor | tuple[Tensor, Tensor]:
        """x, residual [T, K]; weight [N, K] -> y [T, N] (and x + residual); see `contracts.RmsNormLinear`."""
        if not isinstance(weight, BlockFP8Weight):
            out: Tensor | tuple[Tensor, Tensor] = self.dense(x, norm_weight, eps, weight, residual)
            return out
        if residual is None:
            return _product(rms_norm(x, norm_weight, eps), weight, self.linear, None, self.batch_invariant)
        normed, summed = rms_norm(x, norm_weight, eps, residual)
        return _product(normed, weight, self.linear, None, self.batch_invariant), summed


@dataclass(frozen=True, slots=True)
class Fp8FusedMoe:
    """`contracts.FusedMoe`: `dense(x, w13, w2, topk_weights, topk_ids, *, out_dtype)` for plain weights;
    `config(x, w13 values, topk_ids)`, when given, picks each call's FP8 launch configuration (the
    batch-invariant table's), else `fp8_fused_moe` does."""

    dense: Callable[..., Tensor]
    config: Callable[[Tensor, Tensor, Tensor], Fp8MoeConfig] | None = None

    def __call__(self, x: Tensor, w13: Weight, w2: Weight, topk_weights: Tensor, topk_ids: Tensor, /, *,
                 out_dtype: torch.dtype | None = None) -> Tensor:
        """x [T, D] -> [T, D] in out_dtype (see `contracts.FusedMoe`)."""
        up, down = fp8_pair(w13), fp8_pair(w2)
        if up is not None and down is not None and up.block == down.block:
            config = None if self.config is None else self.config(x, up.values, topk_ids)
            return fp8_fused_moe(x, up.values, up.scale_inv, down.values, down.scale_inv, topk_weights, topk_ids,
                                 block=up.block, out_dtype=out_dtype, config=config)
        return self.dense(x, dequantized(w13, x.dtype), dequantized(w2, x.dtype), topk_weights, topk_ids,
                          out_dtype=out_dtype)
