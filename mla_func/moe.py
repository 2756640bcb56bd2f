"""The feed-forward blocks: dense SiLU MLP, and routed + shared experts."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .config import ModelConfig
from .kernels import Ops
from .params import MLPParams, MoEParams


def mlp(p: MLPParams, x: torch.Tensor) -> torch.Tensor:
    """x [T, D] -> down(silu(gate(x)) * up(x)) [T, D]."""
    gate, up = F.linear(x, p.gate_up).chunk(2, dim=-1)
    return F.linear(F.silu(gate) * up, p.down)


def route(p: MoEParams, x: torch.Tensor, valid: torch.Tensor, config: ModelConfig, ops: Ops
          ) -> tuple[torch.Tensor, torch.Tensor]:
    """Choose each token's experts, with the backend's `route` op.

    x [T, D]; valid [T] bool (False for padded rows)
    returns topk_weights [T, k] (float32, or float64 for a float64 model) and topk_ids [T, k] int64; padded rows get
    id -1 and weight 0, so they take no expert.

    Routing runs in at least float32 whatever the model dtype (bf16 scores would
    tie and flip experts); a float64 model routes in float64 (torch backend only).
    Scores are softmax or sigmoid; `group_limited_greedy` keeps the topk_group
    groups with the best single expert, `noaux_tc` those with the best sum of two
    bias-corrected scores; the bias only steers the choice, weights use raw scores.
    """
    c = config
    return ops.route(
        x, p.gate, p.e_score_correction_bias, valid,
        top_k=c.num_experts_per_tok, scoring_func=c.scoring_func, topk_method=c.topk_method,
        n_group=c.n_group, topk_group=c.topk_group, norm_topk_prob=c.norm_topk_prob,
        routed_scaling_factor=c.routed_scaling_factor,
    )


def moe(p: MoEParams, x: torch.Tensor, valid: torch.Tensor, config: ModelConfig, ops: Ops) -> torch.Tensor:
    """Routed experts plus shared experts: x [T, D] -> [T, D]."""
    topk_weights, topk_ids = route(p, x, valid, config, ops)
    out = ops.fused_moe(x, p.w13, p.w2, topk_weights, topk_ids)
    if p.shared is not None:
        out = out + mlp(p.shared, x)
    return out


def feed_forward(p: MLPParams | MoEParams, x: torch.Tensor, valid: torch.Tensor, config: ModelConfig, ops: Ops) -> torch.Tensor:
    """The layer's feed-forward block, dense or MoE, x [T, D] -> [T, D]."""
    if isinstance(p, MoEParams):
        return moe(p, x, valid, config, ops)
    return mlp(p, x)
