"""The batch-invariant Triton op table: every op's output row depends on its own inputs only.

What changes against the default table, and why:

* products (`linear`, `rms_norm_linear`, the W_UK absorption, W_UV):
  `invariant_matmul`, one K order for every row count, instead of the few-row
  GEMV / cuBLAS pair, whose choice (and cuBLAS's split-K) follows the rows; a
  block-scaled FP8 weight of `linear` / `rms_norm_linear` takes `fp8_linear`'s block
  GEMM for every row count, instead of the one-row product and the weight stream;
* `mla_decode`: `decode_invariant`, splits sized by each row's own length and
  merged in order, instead of a split count that follows the batch size;
* `fused_moe`: always the tiled path in K steps of 64, instead of the per-pair
  path (float32 atomics) for few tokens and K steps that follow the token count;
  over FP8 experts the FP8 tiled path in K steps of the scale block's (at most 128),
  never its per-pair path (`invariant_fp8_moe_config`);
* `route`: one launch configuration (token tile, split of the router logits over D)
  for every batch size, instead of one chosen by the token count;
* `sparse_mla_decode` (DeepSeek-V3.2): one kernel, a split count set by top-k alone and
  W_UV by the invariant `bmm`, instead of a kernel, splits and a fused projection by the
  row count;
* `index_scores` (V3.2's and V4's indexer): one tile configuration, instead of one
  chosen by the chunk length, which follows the row count (`v4_invariant`);
* DeepSeek-V4 (`v4_invariant`): `window_entry_attention` with one split a row and one
  tile configuration, instead of a split count and tiles that follow the rows and the
  widest table; the mHC sites, write-backs and hyper head (`hc_site`, `hc_write_back`,
  `hc_write_back_site`, `hc_head`) with their streams pass in one layout, instead of a
  kernel and a slicing of D that follow the token count; `clamped_experts` in the tiled
  path of `fused_moe` here, K steps of 64, instead of K steps that follow the token count.

Row-local ops keep their kernels: `rms_norm`, `rope`, the latent write and the
sampler's `gumbel_max` run one program per row with tiles sized by the model's
dimensions; so do V4's `rope_tail`, `unit_rms` and `compress_entries` (a program a
completing row). `top_k_indices` keeps its paths: each is an exact selection with the
contract's tie rule, so a row's indices do not depend on which one runs; `write_index_key`
is a copy. `prefill_attention` stays in the table for its contract but the
batch-invariant forward does not call it: prefill rows take `mla_decode` like
decode rows, so a token's bits do not depend on the step kind (see
`mla_func.models.mla.attention`); V4's layers take one per-row path for every step kind
already (`mla_func.models.v4.attention`).
"""

from __future__ import annotations

import dataclasses
from typing import overload

import torch

from ..dequantizing import (DequantizingAbsorbQuery, DequantizingClampedExperts, DequantizingMlaDecode,
                           DequantizingSparseMlaDecode, DequantizingWriteLatentAbsorb)
from ..held_experts import HeldExperts
from ..latent_cache import LatentCache
from ..ops import Ops
from ..reference.linear import logits_of
from . import v4_invariant
from .decode_invariant import mla_decode
from .dsa_decode import sparse_mla_decode, sparse_op_config
from .fp8_moe import Fp8MoeConfig
from .fp8_ops import Fp8FusedMoe, Fp8Linear, Fp8RmsNormLinear
from .invariant_matmul import bmm, linear
from .latent import write_latent
from .moe import MoeConfig, fused_moe
from .norm import rms_norm
from .routing import route, route_config
from .v4_experts import clamped_experts

# The tiled path in K steps of 64, as every batch-invariant product takes; rows and
# columns of a tile follow the token count for speed (they do not change a row's
# arithmetic: checked bit for bit across configurations by the GPU tests).
_FEW_PAIRS_MOE = MoeConfig(block_m=16, block_n=32, block_k=64, num_warps=4, num_stages=3)
_MANY_PAIRS_MOE = MoeConfig(block_m=64, block_n=128, block_k=64, num_warps=4, num_stages=3)
_INTERPRETER_MOE = MoeConfig(block_m=16, block_n=32, block_k=32, num_warps=4, num_stages=1)
# FP8 experts: the tiled path, K steps of 128 (capped at the scale block's K), four warps, 16-row tiles for
# every token count. Tiles by the pairs an expert gets (64 rows past 16 pairs an expert, as 16-bit experts
# take) gave a row other bits among many tokens than alone on an H100 (the v2-lite-fp8 probes of
# `test_batch_invariance_gpu.py`, at their prefill): each K step's product is scaled before it is added,
# and the two tile shapes' products round apart.
_FP8_MOE = Fp8MoeConfig(block_m=16, block_n=64, block_k=128, num_warps=4, num_stages=3)
_INTERPRETER_FP8_MOE = Fp8MoeConfig(block_m=16, block_n=32, block_k=32, num_warps=4, num_stages=1)
# Tokens whose router logits one routing program computes: the route kernel's own
# logits (split over D, partial sums added in split order) with the split fixed by
# the model's shapes, for every batch size.
_ROUTE_TILE_TOKENS = 4


@overload
def invariant_rms_norm_linear(x: torch.Tensor, norm_weight: torch.Tensor, eps: float, weight: torch.Tensor,
                              residual: None = None) -> torch.Tensor: ...
@overload
def invariant_rms_norm_linear(x: torch.Tensor, norm_weight: torch.Tensor, eps: float, weight: torch.Tensor,
                              residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]: ...


def invariant_rms_norm_linear(x: torch.Tensor, norm_weight: torch.Tensor, eps: float, weight: torch.Tensor,
                              residual: torch.Tensor | None = None) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Contract of `reference.linear.rms_norm_linear`: the row-wise norm, then the invariant product."""
    if residual is None:
        return linear(rms_norm(x, norm_weight, eps), weight)
    normed, residual_out = rms_norm(x, norm_weight, eps, residual)
    return linear(normed, weight), residual_out


def invariant_absorb_query(q_nope: torch.Tensor, q_pe: torch.Tensor, w_uk: torch.Tensor) -> torch.Tensor:
    """Contract of `reference.attention.absorb_query`: q_nope [B, H, Dn] @ w_uk [H, Dn, C] per head by
    the invariant `bmm`, then q_pe [B, H, R] -> q [B, H, C + R]."""
    num_heads, _, kv_lora_rank = w_uk.shape
    out = torch.empty((q_nope.shape[0], num_heads, kv_lora_rank + q_pe.shape[2]), dtype=q_nope.dtype,
                      device=q_nope.device)
    bmm(q_nope.transpose(0, 1), w_uk, out=out[..., :kv_lora_rank].transpose(0, 1))
    out[..., kv_lora_rank:] = q_pe
    return out


def invariant_write_latent_absorb(kv_cache: LatentCache, slot_mapping: torch.Tensor, latent: torch.Tensor,
                                  kv_a_norm: torch.Tensor, q_nope: torch.Tensor, q_pe: torch.Tensor,
                                  w_uk: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, *,
                                  eps: float, interleaved: bool, absorb_from: int,
                                  inplace: bool = True) -> tuple[LatentCache, torch.Tensor, torch.Tensor]:
    """Contract of `reference.latent.write_latent_absorb`: the latent write, then the invariant absorption."""
    if not 0 <= absorb_from <= q_pe.shape[0]:
        raise ValueError(f"absorb_from: expected in [0, {q_pe.shape[0]}], got {absorb_from}")
    kv_cache, q_pe = write_latent(kv_cache, slot_mapping, latent, kv_a_norm, q_pe, positions, cos, sin, eps=eps,
                                  interleaved=interleaved, inplace=inplace)
    return kv_cache, q_pe, invariant_absorb_query(q_nope[absorb_from:], q_pe[absorb_from:], w_uk)


def _moe_config(x: torch.Tensor, w13: torch.Tensor, topk_ids: torch.Tensor) -> MoeConfig:
    """The tiled path's configuration: K steps of 64 (on the GPU), tiles by the pairs an expert gets."""
    if x.device.type != "cuda":
        return _INTERPRETER_MOE
    pairs_per_expert = topk_ids.numel() / w13.shape[0]
    return _FEW_PAIRS_MOE if pairs_per_expert <= 16 else _MANY_PAIRS_MOE


def invariant_fp8_moe_config(x: torch.Tensor, w13: torch.Tensor, topk_ids: torch.Tensor) -> Fp8MoeConfig:
    """The FP8 fused MoE's configuration for x [T, D], w13 values [E, 2I, D], topk_ids [T, k]: the tiled
    path with one tile shape and K step for every token count."""
    return _FP8_MOE if x.device.type == "cuda" else _INTERPRETER_FP8_MOE


def invariant_fused_moe(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
                        topk_ids: torch.Tensor, *, out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """Contract of `reference.moe.fused_moe`: the tiled path with one K step for every token count."""
    return fused_moe(x, w13, w2, topk_weights, topk_ids, out_dtype=out_dtype, config=_moe_config(x, w13, topk_ids))


def invariant_clamped_experts(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
                              topk_ids: torch.Tensor, *, limit: float) -> torch.Tensor:
    """Contract of `reference.v4_moe.clamped_experts` (DeepSeek-V4's experts): the fused MoE's tiled path
    with the same configuration as `invariant_fused_moe`: x [T, D] -> [T, D]."""
    return clamped_experts(x, w13, w2, topk_weights, topk_ids, limit=limit, config=_moe_config(x, w13, topk_ids))


def invariant_route(x: torch.Tensor, gate: torch.Tensor, e_score_correction_bias: torch.Tensor | None,
                    valid: torch.Tensor, *, top_k: int, scoring_func: str, topk_method: str, n_group: int | None,
                    topk_group: int | None, norm_topk_prob: bool, routed_scaling_factor: float,
                    num_shared: int = 0, fixed_ids: torch.Tensor | None = None,
                    held: HeldExperts | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Contract of `reference.routing.route`: one launch configuration for every batch size."""
    # The decode configuration (the kernel's own logits, D split in a fixed order),
    # whose sizes follow the model's shapes only: a token's sums over D and its
    # reductions over experts then have one order and one layout.
    groups = n_group if topk_method != "greedy" and n_group else 1
    config = route_config(_ROUTE_TILE_TOKENS, gate.shape[0], groups, top_k, gate.shape[1])
    return route(x, gate, e_score_correction_bias, valid, top_k=top_k, scoring_func=scoring_func,
                 topk_method=topk_method, n_group=n_group, topk_group=topk_group, norm_topk_prob=norm_topk_prob,
                 routed_scaling_factor=routed_scaling_factor, num_shared=num_shared, fixed_ids=fixed_ids,
                 held=held, config=config)


# Selected keys a split of the sparse decode covers: top-k 2048 takes 4 splits at any batch size.
_SPARSE_SPLIT_KEYS = 512


def invariant_sparse_mla_decode(q: torch.Tensor, kv_cache: LatentCache, block_table: torch.Tensor,
                                indices: torch.Tensor, *, softmax_scale: float, kv_lora_rank: int,
                                w_uv: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Contract of `reference.dsa.sparse_mla_decode`: one kernel and splits by top-k alone at any row count, then
    the invariant W_UV.

    q [T, H, C + R]; indices [T, k] -> out [T, H, C] (with w_uv [H, Dv, C]: [T, H, Dv]), lse [T, H].
    """
    splits = max(1, indices.shape[1] // _SPARSE_SPLIT_KEYS)
    # One kernel at every row count: the op's own choice would follow the step's rows x k.
    out, lse = sparse_mla_decode(q, kv_cache, block_table, indices, softmax_scale=softmax_scale,
                                 kv_lora_rank=kv_lora_rank, num_splits=splits,
                                 config=sparse_op_config(q, kv_cache, kv_lora_rank, slots=None))
    if w_uv is None:
        return out, lse
    value = torch.empty((out.shape[0], out.shape[1], w_uv.shape[1]), dtype=out.dtype, device=out.device)
    bmm(out.transpose(0, 1), w_uv.transpose(1, 2), out=value.transpose(0, 1))
    return value, lse


def invariant_ops(base: Ops) -> Ops:
    """`base` (the Triton table) with every op whose rows could depend on their batch-mates replaced."""
    return dataclasses.replace(
        base,
        batch_invariant=True,
        dense=dataclasses.replace(base.dense, linear=Fp8Linear(linear, batch_invariant=True), logits=logits_of(linear),
                                  rms_norm_linear=Fp8RmsNormLinear(invariant_rms_norm_linear, linear,
                                                                   batch_invariant=True)),
        mla=dataclasses.replace(base.mla,
                                write_latent_absorb=DequantizingWriteLatentAbsorb(invariant_write_latent_absorb),
                                absorb_query=DequantizingAbsorbQuery(invariant_absorb_query),
                                mla_decode=DequantizingMlaDecode(mla_decode)),
        moe=dataclasses.replace(base.moe, route=invariant_route,
                                fused_moe=Fp8FusedMoe(invariant_fused_moe, config=invariant_fp8_moe_config)),
        dsa=dataclasses.replace(base.dsa, index_scores=v4_invariant.invariant_index_scores,
                                sparse_mla_decode=DequantizingSparseMlaDecode(invariant_sparse_mla_decode)),
        v4=dataclasses.replace(base.v4, window_entry_attention=v4_invariant.invariant_window_entry_attention,
                               hc_site=v4_invariant.invariant_hc_site,
                               hc_write_back=v4_invariant.invariant_hc_write_back,
                               hc_write_back_site=v4_invariant.invariant_hc_write_back_site,
                               hc_head=v4_invariant.invariant_hc_head,
                               clamped_experts=DequantizingClampedExperts(invariant_clamped_experts)),
    )
