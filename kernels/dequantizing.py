"""Products of a backend that has no FP8 kernel yet, made to take block-scaled FP8 weights.

Each wrapper turns a `BlockFP8Weight` into its dequantized tensor in the activations' dtype
(`out_dtype` where the op widens) and calls the backend's own product on it, so the result is
the reference's math (`reference.linear`, `reference.moe`) rounded as that backend's product
rounds; a plain tensor goes straight through. Dequantizing is per weight, never per row, so a
batch-invariant product stays batch-invariant. It materialises the dense weight on every call
(no memory saved while computing, only while held); FP8 kernels replace these wrappers op by op.
The `Dequantizing*` wrappers of the attention ops do the same for MLA's per-head up-projections
(W_UK, W_UV), in the tables whose own ops take them as tensors (batch-invariant, AITER).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, overload

import torch

from .latent_cache import LatentCache
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


@dataclass(frozen=True, slots=True)
class DequantizingAbsorbQuery:
    """`contracts.AbsorbQuery` from `fn(q_nope, q_pe, w_uk [H, Dn, C] tensor)`."""

    fn: Callable[..., Tensor]

    def __call__(self, q_nope: Tensor, q_pe: Tensor, w_uk: Weight, /) -> Tensor:
        """q_nope [T, H, Dn], q_pe [T, H, R] -> q [T, H, C + R] (see `contracts.AbsorbQuery`)."""
        return self.fn(q_nope, q_pe, dequantized(w_uk, q_nope.dtype))


@dataclass(frozen=True, slots=True)
class DequantizingWriteLatentAbsorb:
    """`contracts.WriteLatentAbsorb` from the same op taking W_UK [H, Dn, C] as a tensor."""

    fn: Callable[..., Any]

    def __call__(self, kv_cache: LatentCache, slot_mapping: Tensor, latent: Tensor, kv_a_norm: Tensor,
                 q_nope: Tensor, q_pe: Tensor, w_uk: Weight, positions: Tensor, cos: Tensor, sin: Tensor, /, *,
                 eps: float, interleaved: bool, absorb_from: int,
                 inplace: bool = True) -> tuple[LatentCache, Tensor, Tensor]:
        """-> (kv_cache, rotated q_pe [T, H, R], q [T - absorb_from, H, C + R]) (see `contracts.WriteLatentAbsorb`)."""
        out: tuple[LatentCache, Tensor, Tensor] = self.fn(
            kv_cache, slot_mapping, latent, kv_a_norm, q_nope, q_pe, dequantized(w_uk, q_nope.dtype), positions, cos,
            sin, eps=eps, interleaved=interleaved, absorb_from=absorb_from, inplace=inplace)
        return out


@dataclass(frozen=True, slots=True)
class DequantizingMlaDecode:
    """`contracts.MlaDecode` from the same op taking W_UV [H, Dv, C] as a tensor."""

    fn: Callable[..., tuple[Tensor, Tensor]]

    def __call__(self, q: Tensor, kv_cache: LatentCache, block_table: Tensor, seq_lens: Tensor, /, *,
                 softmax_scale: float, kv_lora_rank: int, w_uv: Weight | None = None,
                 q_len: int = 1) -> tuple[Tensor, Tensor]:
        """-> out [B * q_len, H, C or Dv], lse [B * q_len, H] (see `contracts.MlaDecode`)."""
        return self.fn(q, kv_cache, block_table, seq_lens, softmax_scale=softmax_scale, kv_lora_rank=kv_lora_rank,
                       w_uv=None if w_uv is None else dequantized(w_uv, q.dtype), q_len=q_len)


@dataclass(frozen=True, slots=True)
class DequantizingSparseMlaDecode:
    """`contracts.SparseMlaDecode` from the same op taking W_UV [H, Dv, C] as a tensor."""

    fn: Callable[..., tuple[Tensor, Tensor]]

    def __call__(self, q: Tensor, kv_cache: LatentCache, block_table: Tensor, indices: Tensor, /, *,
                 softmax_scale: float, kv_lora_rank: int, w_uv: Weight | None = None) -> tuple[Tensor, Tensor]:
        """-> out [T, H, C or Dv], lse [T, H] (see `contracts.SparseMlaDecode`)."""
        return self.fn(q, kv_cache, block_table, indices, softmax_scale=softmax_scale, kv_lora_rank=kv_lora_rank,
                       w_uv=None if w_uv is None else dequantized(w_uv, q.dtype))

