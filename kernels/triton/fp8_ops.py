"""The Triton table's products, taking block-scaled FP8 weights to the FP8 kernels.

Each op of the `Linear`, `RmsNormLinear` and `FusedMoe` contracts sends a plain weight to the
table's 16-bit kernel and a `BlockFP8Weight` to `fp8_linear` / `fp8_fused_moe`, which read its
one byte a value and apply the scales in the accumulator: the reference's dequantized-weight math
(activations stay in their dtype), as the contracts define it. A weight whose K block the FP8
kernels cannot step through (`check_block_k`: a power of two of at least 32; only a regrouped
weight of a tiny test shape has another) is dequantized into the 16-bit kernel instead, and so is every
FP8 weight of a product at prefill sizes without w8a8 (`FP8_DEQUANTIZE_ROWS`; `fp8_dequantize`, one pass):
there the FP8 block GEMM, which widens each tile for every tile of rows, took 1.6-2.9x the time of the
dequantization and cuBLAS's product together (H200, 512-8192 rows), for the same math.

The batch-invariant table builds the same wrappers with `batch_invariant=True`: every row count takes
the block GEMM (`fp8_linear(batch_invariant=True)`, one K order), and the fused MoE the tiled path in a
configuration of the invariant table's (`invariant.invariant_fp8_moe_config`), never the per-pair path.

`w8a8_ops` is the Triton counterpart of `reference.w8a8.w8a8_ops`: the same wrappers with `w8a8=True`,
whose FP8 products quantize their activations per token and group of the pair's K block (DeepSeek's
"dynamic" activation scheme) and multiply FP8 by FP8 on the tensor cores, the math of
`reference.w8a8`: the table `ops_for("triton", w8a8=True)` gives, which steps decided with `w8a8=True`
(`ForwardMode.w8a8`, `Engine(w8a8=True)`) run.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, overload

import torch

from ..ops import Ops
from ..quantized import BlockFP8Weight, Weight, dequantized, shared_scale_fmt
from .fp8_dequant import fp8_dequantize
from .fp8_linear import fp8_linear
from .fp8_moe import Fp8MoeConfig, fp8_fused_moe
from .norm import rms_norm

Tensor = torch.Tensor

# From this many rows, a product without w8a8 dequantizes its FP8 weight in one pass (`fp8_dequantize`) and
# runs the table's 16-bit product on it (cuBLAS at these sizes): the same math as the FP8 block GEMM (the
# dequantized weight's), which widens every tile for every tile of rows. On an H200, seven of v2-lite's and
# V3's projections at 2048-8192 rows took 0.34-0.61x the block GEMM's time, at 1024 rows 0.39-0.60x (one
# outlier), at 512 0.32-0.57x for five (1.75-1.86x for two small ones, timed alone); the engine's prefill
# chunks of 512 tokens (`long_prefill_token_threshold`) made the difference: v2-lite's throughput run took
# 0.84x bf16's tokens/s with 512 and 64 below, 0.73x with 1024 and 160 (bench/notes/fp8.md). Above the rows
# of most decode steps, where the dense copy would cost more than the product (and live in graphs).
FP8_DEQUANTIZE_ROWS = 512
# The fused MoE likewise, from this many (token, expert) pairs an expert on average (v2-lite's 64 experts on
# an H200, timed alone: 1.19x the FP8 kernel's time at 96, 0.84x at 192, 0.55x at 768), while the dense copy
# of both stacks stays under FP8_DEQUANTIZE_MAX_BYTES (v2-lite's: 1.1 GB in bf16; V3's 256 experts: 22.5 GB,
# so V3's keep the FP8 tiles).
FP8_DEQUANTIZE_PAIRS_PER_EXPERT = 64
FP8_DEQUANTIZE_MAX_BYTES = 2 << 30


def fp8_pair(w: Weight) -> BlockFP8Weight | None:
    """`w` when the FP8 kernels take it as it is (an FP8 pair whose K block they can step through), else None."""
    if not isinstance(w, BlockFP8Weight):
        return None
    bk = w.block[1]
    return w if bk >= 32 and bk & (bk - 1) == 0 else None


def _product(x: Tensor, weight: Weight, dense: Callable[..., Tensor], out_dtype: torch.dtype | None,
             batch_invariant: bool, w8a8: bool) -> Tensor:
    pair = fp8_pair(weight)
    if pair is not None and (w8a8 or batch_invariant or x.shape[0] < FP8_DEQUANTIZE_ROWS):
        return fp8_linear(x, pair.values, pair.scale_inv, block=pair.block, out_dtype=out_dtype,
                          batch_invariant=batch_invariant, w8a8=w8a8, scale_fmt=pair.activation_scale_fmt)
    if isinstance(weight, BlockFP8Weight):
        return dense(x, fp8_dequantize(weight, out_dtype or x.dtype), out_dtype=out_dtype)
    return dense(x, dequantized(weight, out_dtype or x.dtype), out_dtype=out_dtype)


@dataclass(frozen=True, slots=True)
class Fp8Linear:
    """`contracts.Linear`: `dense(x, weight [N, K] tensor, *, out_dtype)` for plain weights; batch_invariant
    sends FP8 pairs through `fp8_linear`'s batch-invariant path, w8a8 through its w8a8 product."""

    dense: Callable[..., Tensor]
    batch_invariant: bool = False
    w8a8: bool = False

    def __call__(self, x: Tensor, weight: Weight, /, *, out_dtype: torch.dtype | None = None) -> Tensor:
        """x [T, K], weight [N, K] -> [T, N] (see `contracts.Linear`)."""
        return _product(x, weight, self.dense, out_dtype, self.batch_invariant, self.w8a8)


@dataclass(frozen=True, slots=True)
class Fp8RmsNormLinear:
    """`contracts.RmsNormLinear`: `dense(x, norm_weight, eps, weight, residual)` for plain weights; an FP8
    weight takes the norm, then `fp8_linear` (no fused kernel reads FP8 weights; batch_invariant and w8a8
    as `Fp8Linear`'s)."""

    dense: Callable[..., Any]
    linear: Callable[..., Tensor]
    batch_invariant: bool = False
    w8a8: bool = False

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
            return _product(rms_norm(x, norm_weight, eps), weight, self.linear, None, self.batch_invariant, self.w8a8)
        normed, summed = rms_norm(x, norm_weight, eps, residual)
        return _product(normed, weight, self.linear, None, self.batch_invariant, self.w8a8), summed


@dataclass(frozen=True, slots=True)
class Fp8FusedMoe:
    """`contracts.FusedMoe`: `dense(x, w13, w2, topk_weights, topk_ids, *, out_dtype)` for plain weights;
    `config(x, w13 values, topk_ids)`, when given, picks each call's FP8 launch configuration (the
    batch-invariant table's), else `fp8_fused_moe` does; w8a8 quantizes the activations (its tiled path).
    Without either, prefill sizes dequantize the stacks into `dense` (`FP8_DEQUANTIZE_PAIRS_PER_EXPERT`)."""

    dense: Callable[..., Tensor]
    config: Callable[[Tensor, Tensor, Tensor], Fp8MoeConfig] | None = None
    w8a8: bool = False

    def __call__(self, x: Tensor, w13: Weight, w2: Weight, topk_weights: Tensor, topk_ids: Tensor, /, *,
                 out_dtype: torch.dtype | None = None) -> Tensor:
        """x [T, D] -> [T, D] in out_dtype (see `contracts.FusedMoe`)."""
        up, down = fp8_pair(w13), fp8_pair(w2)
        if up is not None and down is not None and up.block == down.block and not self._dequantizes(x, up, down,
                                                                                                   topk_ids):
            config = None if self.config is None else self.config(x, up.values, topk_ids)
            return fp8_fused_moe(x, up.values, up.scale_inv, down.values, down.scale_inv, topk_weights, topk_ids,
                                 block=up.block, out_dtype=out_dtype, config=config, w8a8=self.w8a8,
                                 scale_fmt=shared_scale_fmt("fused_moe", (up, down)))
        return self.dense(x, _dense(w13, x.dtype), _dense(w2, x.dtype), topk_weights, topk_ids, out_dtype=out_dtype)

    def _dequantizes(self, x: Tensor, w13: BlockFP8Weight, w2: BlockFP8Weight, topk_ids: Tensor) -> bool:
        """Whether these stacks are dequantized for the 16-bit kernel: prefill sizes, no w8a8, not the
        batch-invariant table (its `config`), a dense copy within FP8_DEQUANTIZE_MAX_BYTES."""
        num_experts = w13.shape[0]
        dense_bytes = (w13.values.numel() + w2.values.numel()) * x.element_size()
        return (not self.w8a8 and self.config is None and dense_bytes <= FP8_DEQUANTIZE_MAX_BYTES
                and topk_ids.numel() >= FP8_DEQUANTIZE_PAIRS_PER_EXPERT * num_experts)


def _dense(w: Weight, dtype: torch.dtype) -> Tensor:
    """A dense weight in `dtype`: an FP8 pair through the one-pass kernel, anything else as `dequantized`."""
    return fp8_dequantize(w, dtype) if isinstance(w, BlockFP8Weight) else dequantized(w, dtype)


def w8a8_ops(base: Ops) -> Ops:
    """`base`, the Triton table (`kernels.triton.ops()`, with or without its collectives), whose products of
    FP8 weights quantize their activations: `reference.w8a8.w8a8_ops`'s math on the FP8 kernels. The
    absorbed W_UK / W_UV (`fp8_heads`) keep their dequantized tiles, as DeepSeek's own inference code
    dequantizes kv_b. ValueError for another table (or the batch-invariant one, whose FP8 products keep
    one K order with 16-bit activations)."""
    linear, norm_linear, moe = base.dense.linear, base.dense.rms_norm_linear, base.moe.fused_moe
    if not (isinstance(linear, Fp8Linear) and isinstance(norm_linear, Fp8RmsNormLinear)
            and isinstance(moe, Fp8FusedMoe)) or base.batch_invariant:
        raise ValueError(f"w8a8_ops: expected the Triton table (ops_for('triton')), got the {base.backend!r} "
                         f"table{' (batch-invariant)' if base.batch_invariant else ''}")
    return dataclasses.replace(
        base,
        w8a8=True,
        dense=dataclasses.replace(base.dense, linear=dataclasses.replace(linear, w8a8=True),
                                  rms_norm_linear=dataclasses.replace(norm_linear, w8a8=True)),
        moe=dataclasses.replace(base.moe, fused_moe=dataclasses.replace(moe, w8a8=True)),
    )
