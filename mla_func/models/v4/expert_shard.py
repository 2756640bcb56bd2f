"""A V4 layer's MoE block across ranks: the feed-forward of every rank's share, and expert parallelism.

Tensor-parallel, a rank holds 1 / n of every expert's columns (`shard`), and its block's output is
a partial sum. Expert-parallel, rank r of n holds routed experts [r E / n, (r + 1) E / n) whole
(`models.expert_parallel`) and 1 / n of the shared experts' columns, read as tensor parallelism
reads them. The router and the hash table (`tid2eid`) are whole on every rank, so a learned
top-k and a hash layer alike give every rank the same experts a token; each rank runs those it
holds. Either way the ranks' partial sums meet in one all-reduce, or in the row exchange under
data-parallel attention, which brings each row's token id along for the hash table
(`core.exchange.shared_token_block`).
"""

from __future__ import annotations

import dataclasses

import torch

from mla_func.core.config import ModelConfig
from mla_func.core.exchange import shared_token_block
from mla_func.core.layers import LayerContext
from mla_func.core.params import Params, TensorFetch
from mla_func.kernels import Ops
from mla_func.models.expert_parallel import expert_range
from mla_func.models.v4.config import v4_fields
from mla_func.models.v4.hash_moe import route, shared_apart, v4_moe
from mla_func.models.v4.params import V4ExpertShardParams, V4LayerParams, V4MoEParams
from mla_func.models.v4.params_load import v4_params_from_hf


def expert_shard_moe(p: V4ExpertShardParams, x: torch.Tensor, input_ids: torch.Tensor, valid: torch.Tensor,
                     config: ModelConfig, ops: Ops) -> torch.Tensor:
    """This rank's partial sum of the MoE block: x [T, D], input_ids [T], valid [T] bool -> [T, D]."""
    v = v4_fields(config)
    weights, ids = route(p, x, input_ids, valid, config, ops)                   # [T, k], ids of the rank's own
    out = ops.v4.clamped_experts(x, p.w13, p.w2, weights, ids, limit=v.swiglu_limit)
    shared = shared_apart(p, x, valid, v.swiglu_limit, ops)
    return out if shared is None else out + shared


def v4_feed_forward(p: V4MoEParams | V4ExpertShardParams, x: torch.Tensor, ctx: LayerContext) -> torch.Tensor:
    """The layer's MoE block, its ranks' shares joined (identities with one process): x [T, D] -> [T, D]."""

    def block(rows: torch.Tensor, token_ids: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
        if isinstance(p, V4ExpertShardParams):
            return expert_shard_moe(p, rows, token_ids, valid, ctx.config, ctx.ops)
        return v4_moe(p, rows, token_ids, valid, ctx.config, ctx.ops)

    return shared_token_block(block, x, ctx.batch.input_ids, ctx.valid, ctx.exchange, ctx.ops.collectives)


def _expert_shard(p: V4MoEParams, held: range) -> V4ExpertShardParams:
    """p as `v4_params_from_hf(routed=held)` made it (w13 [E / n, 2I, D], the shared experts apart) ->
    this rank's share."""
    # The routed experts are this rank's already, the shared ones its columns (read so, FP4 and FP8 pairs alike).
    return V4ExpertShardParams(gate=p.gate, w13=p.w13, w2=p.w2, first_expert=held.start,
                               e_score_correction_bias=p.e_score_correction_bias, tid2eid=p.tid2eid,
                               shared_w13=p.shared_w13, shared_w2=p.shared_w2)


def v4_expert_parallel_params(config: ModelConfig, fetch: TensorFetch, *, rank: int, ranks: int, dtype: torch.dtype,
                              device: torch.device | str, progress: bool = False,
                              max_model_len: int | None = None) -> Params:
    """`Family.expert_parallel_params` of DeepSeek-V4: rank `rank` of `ranks`'s params, reading its own
    routed experts only (`fetch` reads this rank's shard of the other cut tensors, the shared experts'
    columns among them). ConfigError when `ranks` does not divide n_routed_experts."""
    held = expert_range(config, rank, ranks)
    params = v4_params_from_hf(config, fetch, dtype=dtype, device=device, progress=progress,
                               max_model_len=max_model_len, routed=held)
    return dataclasses.replace(params, layers=tuple(v4_expert_shard_layer(layer, held) for layer in params.layers))


def v4_expert_shard_layer(layer: V4LayerParams, held: range) -> V4LayerParams:
    """A layer read with `V4Reader.layer(routed=held)` (its routed experts `held` only, the shared ones
    apart) -> the same layer holding an expert-parallel rank's share of its MoE block."""
    if not isinstance(layer.mlp, V4MoEParams):
        raise ValueError(f"v4_expert_shard_layer: expected a V4MoEParams block, got {type(layer.mlp).__name__}")
    return dataclasses.replace(layer, mlp=_expert_shard(layer.mlp, held))
