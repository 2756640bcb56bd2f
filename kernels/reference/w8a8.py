"""The w8a8 variant of the FP8 products as ops: activations quantized too, as the checkpoints' "dynamic" scheme does.

DeepSeek's FP8 linear layers quantize each token's activations at run time, per group of input
features (one float32 scale a group: its largest magnitude / 448, rounded up to a power of two where the
checkpoint's `scale_fmt` is "ue8m0", as each weight's `activation_scale_fmt` records), multiply FP8 by FP8,
and apply both scales to each group's partial sum. `reference.fp8` defines that math on raw tensors
(`fp8_linear(..., w8a8=True)`, `fp8_fused_moe(..., w8a8=True)`); here it takes the params' leaf
pairs, with the activation groups as wide as the pair's column block (128 as loaded from a
checkpoint; narrower only where loading regrouped a cut matrix, see `kernels.quantized`).
`w8a8_ops` is a table with these products (plain weights take the reference's).

Against the dequantized-weight products (`reference.linear`), quantizing the activations adds
a relative error of up to 2^-4 per element (e4m3's 3 mantissa bits); over a sum of K products
of random signs it stays within a few percent of the output's largest entry, which
tests/checkpoint/test_fp8_ops.py states and checks.
"""

from __future__ import annotations

import dataclasses
import math
from typing import overload

import torch

from ..ops import Ops
from ..quantized import BlockFP8Weight, Weight, regrouped, shared_scale_fmt
from . import linear as ref_linear
from . import moe as ref_moe
from .fp8 import fp8_fused_moe, fp8_linear
from .norm import rms_norm


def linear(x: torch.Tensor, weight: Weight, *, out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """`contracts.Linear` with w8a8 math for an FP8 weight: x [T, K], weight [N, K] -> [T, N] in
    out_dtype (x's by default); a plain weight takes `reference.linear.linear`."""
    if not isinstance(weight, BlockFP8Weight):
        return ref_linear.linear(x, weight, out_dtype=out_dtype)
    return fp8_linear(x, weight.values, weight.scale_inv, block=weight.block, w8a8=True, out_dtype=out_dtype,
                      scale_fmt=weight.activation_scale_fmt)


@overload
def rms_norm_linear(x: torch.Tensor, norm_weight: torch.Tensor, eps: float, weight: Weight, residual: None = None
                    ) -> torch.Tensor: ...
@overload
def rms_norm_linear(x: torch.Tensor, norm_weight: torch.Tensor, eps: float, weight: Weight, residual: torch.Tensor
                    ) -> tuple[torch.Tensor, torch.Tensor]: ...


def rms_norm_linear(x: torch.Tensor, norm_weight: torch.Tensor, eps: float, weight: Weight,
                    residual: torch.Tensor | None = None) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """`reference.linear.rms_norm_linear` with the w8a8 `linear`: x, residual [T, K] -> y [T, N] (and the sum)."""
    if residual is None:
        return linear(rms_norm(x, norm_weight, eps), weight)
    normed, residual_out = rms_norm(x, norm_weight, eps, residual)
    return linear(normed, weight), residual_out


def fused_moe(x: torch.Tensor, w13: Weight, w2: Weight, topk_weights: torch.Tensor, topk_ids: torch.Tensor, *,
              out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """`contracts.FusedMoe` with w8a8 math for stacked FP8 experts (`reference.fp8.fp8_fused_moe`):
    x [T, D]; w13 [E, 2I, D]; w2 [E, D, I] -> [T, D] in out_dtype (x's by default). Plain experts
    take `reference.moe.fused_moe`."""
    if not (isinstance(w13, BlockFP8Weight) and isinstance(w2, BlockFP8Weight)):
        return ref_moe.fused_moe(x, w13, w2, topk_weights, topk_ids, out_dtype=out_dtype)
    # fp8_fused_moe takes one block for both (they differ only where loading regrouped one).
    block = (math.gcd(w13.block[0], w2.block[0]), math.gcd(w13.block[1], w2.block[1]))
    w13, w2 = regrouped(w13, block), regrouped(w2, block)
    return fp8_fused_moe(x, w13.values, w13.scale_inv, w2.values, w2.scale_inv, topk_weights, topk_ids,
                         block=block, w8a8=True, out_dtype=out_dtype,
                         scale_fmt=shared_scale_fmt("fused_moe", (w13, w2)))


def w8a8_ops(base: Ops) -> Ops:
    """`base` whose products of FP8 weights quantize their activations (this module's ops)."""
    return dataclasses.replace(
        base,
        w8a8=True,
        dense=dataclasses.replace(base.dense, linear=linear, rms_norm_linear=rms_norm_linear),
        moe=dataclasses.replace(base.moe, fused_moe=fused_moe),
    )
