"""Expert parallelism for DeepSeek-V2/V3/V3.2: each rank holds whole routed experts, E / n of them.

Rank r of n holds routed experts [r E / n, (r + 1) E / n) whole, and 1 / n of the shared experts'
columns (as tensor parallelism cuts them). Attention and dense layers are cut as tensor
parallelism cuts them (`shard`). The router is whole on every rank and sees the same bits
everywhere, so every rank makes the same choice; a rank runs the chosen experts it holds (the
others' ids become -1, which take no expert) and its share of the shared experts, and the layer's
all-reduce sums the ranks' partial sums: the collective is the tensor-parallel one, and no token
moves (every rank holds every token already). A rank reads only its own experts' bytes; the
shared experts, a few per layer, are read whole one layer at a time and cut in memory (an FP8
pair with the scales of its own blocks, `parallel.shard.cut_weight`, which refuses a cut inside a
block). The MTP layer's MoE block is cut the same way (`expert_parallel_layer`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
import torch

from mla_func.core.config import ModelConfig
from mla_func.core.params import Params, TensorFetch, TensorGet
from mla_func.kernels import Ops
from mla_func.kernels.quantized import Weight, cat_rows, slice_block
from mla_func.models.expert_parallel import every_shared_expert, expert_range, held_expert_ids
from mla_func.models.mla.moe import feed_forward
from mla_func.models.mla.params import LayerParams, MLPParams, MoEParams, layer_params, mla_params_from_hf
from mla_func.parallel.shard import Shard, cut_weight
from mla_func.pytree import register_dataclass, static_field, tree_map


@register_dataclass
@dataclass(frozen=True, slots=True)
class ExpertShardParams:
    """One rank's share of a MoE block under expert parallelism (float weights or FP8 pairs).

    E routed experts in all, n ranks, S shared experts of I columns.
    """

    gate: torch.Tensor                    # [E, D] the whole router, float32 (float64 in a float64 model)
    w13: Weight                           # [E / n, 2I, D] routed experts first_expert.., gate rows then up rows
    w2: Weight                            # [E / n, D, I]
    first_expert: int = static_field()    # the router's id of w13[0]
    shared_w13: Weight | None = None      # [S, 2I / n, D] this rank's columns of each shared expert
    shared_w2: Weight | None = None       # [S, D, I / n]
    e_score_correction_bias: torch.Tensor | None = None  # [E] float32, noaux_tc only


def expert_shard_moe(p: ExpertShardParams, x: torch.Tensor, valid: torch.Tensor, config: ModelConfig,
                     ops: Ops) -> torch.Tensor:
    """This rank's partial sum of the MoE block: x [T, D]; valid [T] bool -> [T, D] in at least float32."""
    c = config
    out_dtype = torch.promote_types(x.dtype, torch.float32)
    topk_weights, topk_ids = ops.moe.route(
        x, p.gate, p.e_score_correction_bias, valid, top_k=c.num_experts_per_tok, scoring_func=c.scoring_func,
        topk_method=c.topk_method, n_group=c.n_group, topk_group=c.topk_group, norm_topk_prob=c.norm_topk_prob,
        routed_scaling_factor=c.routed_scaling_factor)                                  # [T, k], ids of all E
    held = range(p.first_expert, p.first_expert + p.w13.shape[0])
    out = ops.moe.fused_moe(x, p.w13, p.w2, topk_weights, held_expert_ids(topk_ids, held), out_dtype=out_dtype)
    if p.shared_w13 is None or p.shared_w2 is None:
        return out
    weights, ids = every_shared_expert(valid, p.shared_w13.shape[0], topk_weights.dtype)
    return out + ops.moe.fused_moe(x, p.shared_w13, p.shared_w2, weights, ids, out_dtype=out_dtype)


def feed_forward_of(p: MLPParams | MoEParams | ExpertShardParams, x: torch.Tensor, valid: torch.Tensor,
                    config: ModelConfig, ops: Ops) -> torch.Tensor:
    """The layer's feed-forward block, an expert-parallel rank's share included: x [T, D] -> [T, D]."""
    if isinstance(p, ExpertShardParams):
        return expert_shard_moe(p, x, valid, config, ops)
    return feed_forward(p, x, valid, config, ops)


def _first_experts(w: Weight, count: int) -> Weight:
    """The first `count` experts of a stacked [E, N, K] weight (a pair's values and scales alike), in
    storage of their own: a view would keep the shared experts' whole bytes alive beside their cut."""
    first: Weight = tree_map(lambda t: t[:count].contiguous(), w)
    return first


def _expert_shard(p: MoEParams, first: int, per_rank: int, rank: int, ranks: int, what: str) -> ExpertShardParams:
    """p as `layer_params(routed=range(first, first + per_rank))` made it (w13 [per_rank + S, 2I, D], the
    shared experts whole) -> this rank's share; `what` names the block in an error."""
    w13, w2 = p.w13, p.w2
    shared_w13: Weight | None = None
    shared_w2: Weight | None = None
    if w13.shape[0] > per_rank:
        shared, inter = w13[per_rank:], w13.shape[1] // 2                      # [S, 2I, D]
        rows = Shard(dim=-2, index=rank, count=ranks)
        gate, up = slice_block(shared, -2, 0, inter), slice_block(shared, -2, inter, 2 * inter)  # [S, I, D] each
        gate_cut = cut_weight(gate, rows, f"{what} shared experts' gate")
        up_cut = cut_weight(up, rows, f"{what} shared experts' up")
        # Rows of stacked experts (dim -2): `cat_rows` joins a pair's there, but plain tensors along dim 0.
        if isinstance(gate_cut, torch.Tensor) and isinstance(up_cut, torch.Tensor):
            shared_w13 = torch.cat([gate_cut, up_cut], dim=-2)
        else:
            shared_w13 = cat_rows([gate_cut, up_cut])
        shared_w2 = cut_weight(w2[per_rank:], Shard(dim=-1, index=rank, count=ranks), f"{what} shared experts' down")
    return ExpertShardParams(gate=p.gate, w13=_first_experts(w13, per_rank), w2=_first_experts(w2, per_rank),
                             first_expert=first, shared_w13=shared_w13, shared_w2=shared_w2,
                             e_score_correction_bias=p.e_score_correction_bias)


def expert_parallel_layer(config: ModelConfig, rank: int, ranks: int
                          ) -> Callable[[ModelConfig, int, TensorGet, torch.dtype], LayerParams]:
    """The builder of rank `rank` of `ranks`'s decoder layer `i` (`layer_params`' arguments): its own routed
    experts read whole, its columns of the shared experts. ConfigError when `ranks` does not divide
    n_routed_experts."""
    routed = expert_range(config, rank, ranks)

    def layer(c: ModelConfig, i: int, get: TensorGet, layer_dtype: torch.dtype) -> LayerParams:
        p = layer_params(c, i, get, layer_dtype, routed=routed)
        if not isinstance(p.mlp, MoEParams):
            return p
        share = _expert_shard(p.mlp, routed.start, len(routed), rank, ranks, f"layer {i}'s")
        return dataclasses.replace(p, mlp=share)

    return layer


def mla_expert_parallel_params(config: ModelConfig, fetch: TensorFetch, *, rank: int, ranks: int, dtype: torch.dtype,
                               device: torch.device | str, progress: bool = False,
                               max_model_len: int | None = None) -> Params:
    """`Family.expert_parallel_params` of DeepSeek-V2/V3/V3.2: rank `rank` of `ranks`'s params, reading
    its own routed experts only (`fetch` reads this rank's shard of the other cut tensors)."""
    return mla_params_from_hf(config, fetch, dtype=dtype, device=device, progress=progress,
                              max_model_len=max_model_len, layer=expert_parallel_layer(config, rank, ranks))

