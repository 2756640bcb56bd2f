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

from mla_func.core.config import ModelConfig
from mla_func.kernels import Ops
from mla_func.kernels.held_experts import HeldExperts
from mla_func.models.v4.config import v4_fields
from mla_func.models.expert_parallel import every_shared_expert
from mla_func.models.v4.params import V4ExpertShardParams, V4MoEParams


def route(p: V4MoEParams | V4ExpertShardParams, x: torch.Tensor, input_ids: torch.Tensor, valid: torch.Tensor,
          config: ModelConfig, ops: Ops, *, num_shared: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """x [T, D], input_ids [T], valid [T] bool -> (weights [T, k + S] float32, ids [T, k + S] int64).

    The routed experts come first (from `tid2eid` for a hash layer, else the top-k of
    score + bias), then num_shared = S shared experts (stacked after the routed ones in
    w13 / w2) with weight 1. Padded rows get id -1 and weight 0: they take no expert. An
    expert-parallel rank's ids are among the experts it holds (the others' -1). One op,
    `moe.route`, the routing of every MoE model here, with V4's scoring and fixed ids.
    """
    fixed = p.tid2eid[input_ids] if p.tid2eid is not None else None
    # An expert-parallel rank's ids come numbered among the experts it holds, -1 for the others'.
    held = HeldExperts(p.first_expert, p.w13.shape[0]) if isinstance(p, V4ExpertShardParams) else None
    return ops.moe.route(x, p.gate, p.e_score_correction_bias if fixed is None else None, valid,
                         top_k=config.num_experts_per_tok, scoring_func=config.scoring_func, topk_method="greedy",
                         n_group=None, topk_group=None, norm_topk_prob=True,
                         routed_scaling_factor=config.routed_scaling_factor, num_shared=num_shared, fixed_ids=fixed,
                         held=held)


def shared_apart(p: V4MoEParams | V4ExpertShardParams, x: torch.Tensor, valid: torch.Tensor, limit: float,
                 ops: Ops) -> torch.Tensor | None:
    """The shared experts held apart from the routed ones (`shared_w13`), every real row with weight 1:
    x [T, D] -> [T, D], or None where the params hold none apart."""
    if p.shared_w13 is None or p.shared_w2 is None:
        return None
    # The routing weights' dtype: float32, float64 in a float64 model.
    weights, ids = every_shared_expert(valid, p.shared_w13.shape[0], torch.promote_types(x.dtype, torch.float32))
    return ops.v4.clamped_experts(x, p.shared_w13, p.shared_w2, weights, ids, limit=limit)


def v4_moe(p: V4MoEParams, x: torch.Tensor, input_ids: torch.Tensor, valid: torch.Tensor, config: ModelConfig,
           ops: Ops) -> torch.Tensor:
    """The routed experts' weighted sum plus the shared experts, in one expert launch (two where the shared
    experts are held apart, `V4MoEParams`): x [T, D] -> [T, D]."""
    v = v4_fields(config)
    weights, ids = route(p, x, input_ids, valid, config, ops, num_shared=p.w13.shape[0] - p.num_routed)
    out = ops.v4.clamped_experts(x, p.w13, p.w2, weights, ids, limit=v.swiglu_limit)
    shared = shared_apart(p, x, valid, v.swiglu_limit, ops)
    return out if shared is None else out + shared
