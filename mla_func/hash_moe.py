"""DeepSeek-V4's MoE block: hash-routed or score-routed experts with clamped SwiGLU, plus shared experts.

Routing scores are `sqrtsoftplus` (sqrt(softplus(logit))) or `sigmoid` of the
router's logits. A `hash_moe` layer takes each token's experts from a fixed table
of its token id (`tid2eid`); a `moe` layer takes the top-k of score + bias (the
bias only steers the choice). Either way the chosen experts are weighted by
their scores, normalised to sum 1, times `routed_scaling_factor`. Every expert,
shared ones included, clamps its gate and up pre-activations to `swiglu_limit`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .config import ModelConfig
from .kernels import Ops
from .v4_params import V4MoEParams


def routing_scores(logits: torch.Tensor, scoring_func: str) -> torch.Tensor:
    """Per-expert scores [T, E] from router logits [T, E]."""
    if scoring_func == "sqrtsoftplus":
        return torch.sqrt(F.softplus(logits))
    if scoring_func == "sigmoid":
        return torch.sigmoid(logits)
    raise ValueError(f"scoring_func: expected 'sqrtsoftplus' or 'sigmoid', got {scoring_func!r}")


def route(p: V4MoEParams, x: torch.Tensor, input_ids: torch.Tensor, valid: torch.Tensor, config: ModelConfig
          ) -> tuple[torch.Tensor, torch.Tensor]:
    """x [T, D], input_ids [T], valid [T] bool -> (topk_weights [T, k], topk_ids [T, k] int64).

    Padded rows get id -1 and weight 0 (they take no expert).
    """
    scores = routing_scores(F.linear(x, p.gate), config.scoring_func)                    # [T, E]
    if p.tid2eid is not None:
        ids = p.tid2eid[input_ids]
    else:
        bias = p.e_score_correction_bias
        choice = scores if bias is None else scores + bias
        ids = choice.topk(config.num_experts_per_tok, dim=-1, sorted=False).indices
    weights = scores.gather(1, ids)
    weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20) * config.routed_scaling_factor
    ids = torch.where(valid.unsqueeze(1), ids, -1)
    return torch.where(valid.unsqueeze(1), weights, 0.0), ids


def v4_moe(p: V4MoEParams, x: torch.Tensor, input_ids: torch.Tensor, valid: torch.Tensor, config: ModelConfig,
           ops: Ops) -> torch.Tensor:
    """The routed experts' weighted sum plus the shared experts: x [T, D] -> [T, D]."""
    v = config.v4
    if v is None:
        raise ValueError(f"v4_moe: expected a deepseek_v4 config, got {config.model_type!r}")
    weights, ids = route(p, x, input_ids, valid, config)
    num_shared = p.w13.shape[0] - p.num_routed
    if num_shared:
        # Every valid token also takes every shared expert (stacked after the routed
        # ones) with weight 1: one launch over all experts, summed in float32.
        shared = torch.arange(p.num_routed, p.w13.shape[0], device=x.device, dtype=ids.dtype).expand(x.shape[0], -1)
        ids = torch.cat([ids, torch.where(valid.unsqueeze(1), shared, -1)], dim=1)
        weights = torch.cat([weights, valid.unsqueeze(1).to(weights.dtype).expand(-1, num_shared)], dim=1)
    return ops.v4.clamped_experts(x, p.w13, p.w2, weights, ids, limit=v.swiglu_limit)
