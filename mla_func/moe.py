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


def route(p: MoEParams, x: torch.Tensor, valid: torch.Tensor, config: ModelConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """Choose each token's experts.

    x [T, D]; valid [T] bool (False for padded rows)
    returns topk_weights [T, k] (float32, or float64 for a float64 model) and topk_ids [T, k] int64; padded rows get
    id -1 and weight 0, so they take no expert.

    Routing runs in at least float32 whatever the model dtype (bf16 scores would
    tie and flip experts); a float64 model routes in float64.
    Scores are softmax or sigmoid; `group_limited_greedy` keeps the topk_group
    groups with the best single expert, `noaux_tc` those with the best sum of two
    bias-corrected scores; the bias only steers the choice, weights use raw scores.
    """
    c = config
    acc = torch.promote_types(x.dtype, torch.float32)
    logits = F.linear(x.to(acc), p.gate if p.gate.dtype == acc else p.gate.to(acc))  # [T, E]
    scores = logits.softmax(dim=-1) if c.scoring_func == "softmax" else logits.sigmoid()
    choice = scores if p.e_score_correction_bias is None else scores + p.e_score_correction_bias
    if c.topk_method in ("group_limited_greedy", "noaux_tc"):
        grouped = choice.view(x.shape[0], c.n_group, -1)
        if c.topk_method == "noaux_tc":
            group_scores = grouped.topk(2, dim=-1).values.sum(dim=-1)
        else:
            group_scores = grouped.amax(dim=-1)
        group_ids = group_scores.topk(c.topk_group, dim=-1).indices
        keep = torch.zeros_like(group_scores, dtype=torch.bool).scatter(1, group_ids, True)
        choice = grouped.masked_fill(~keep.unsqueeze(-1), float("-inf")).flatten(1)
    topk_ids = choice.topk(c.num_experts_per_tok, dim=-1).indices
    topk_weights = scores.gather(1, topk_ids)
    if c.norm_topk_prob:
        topk_weights = topk_weights / (topk_weights.sum(dim=-1, keepdim=True) + 1e-20)
    if c.routed_scaling_factor != 1.0:
        topk_weights = topk_weights * c.routed_scaling_factor
    topk_weights = topk_weights.masked_fill(~valid.unsqueeze(-1), 0.0)
    topk_ids = topk_ids.masked_fill(~valid.unsqueeze(-1), -1)
    return topk_weights, topk_ids


def moe(p: MoEParams, x: torch.Tensor, valid: torch.Tensor, config: ModelConfig, ops: Ops) -> torch.Tensor:
    """Routed experts plus shared experts: x [T, D] -> [T, D]."""
    topk_weights, topk_ids = route(p, x, valid, config)
    out = ops.fused_moe(x, p.w13, p.w2, topk_weights, topk_ids)
    if p.shared is not None:
        out = out + mlp(p.shared, x)
    return out


def feed_forward(p: MLPParams | MoEParams, x: torch.Tensor, valid: torch.Tensor, config: ModelConfig, ops: Ops) -> torch.Tensor:
    """The layer's feed-forward block, dense or MoE, x [T, D] -> [T, D]."""
    if isinstance(p, MoEParams):
        return moe(p, x, valid, config, ops)
    return mlp(p, x)
