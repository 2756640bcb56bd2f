"""Mixture-of-experts routing: each token's experts and their weights."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..checks import GROUP_LIMITED_METHODS, as_dtype, check_route_args, check_shape
from ..held_experts import HeldExperts


def route(
    x: torch.Tensor,
    gate: torch.Tensor,
    e_score_correction_bias: torch.Tensor | None,
    valid: torch.Tensor,
    *,
    top_k: int,
    scoring_func: str,
    topk_method: str,
    n_group: int | None,
    topk_group: int | None,
    norm_topk_prob: bool,
    routed_scaling_factor: float,
    num_shared: int = 0,
    fixed_ids: torch.Tensor | None = None,
    held: HeldExperts | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Choose each token's top_k experts (and, with num_shared, the shared experts after them).

    x:                       [T, D]
    gate:                    [E, D] router weight, float32 (float64 in a float64 model)
    e_score_correction_bias: [E] or None; added to the scores for the choice only
    valid:                   [T] bool, False for padded rows
    num_shared:              S shared experts to append to every row, as experts
                             E .. E + S - 1 of weight 1 (so that one fused MoE call
                             runs routed and shared experts together)
    fixed_ids:               [T, k] int expert ids in [0, E) chosen beforehand (DeepSeek-V4's
                             hash routing from the token id), or None to choose them here;
                             with them the bias and the method play no part, and the weights
                             are the chosen experts' scores as below
    held:                    an expert-parallel rank's experts (`held_experts`), or None for all:
                             a chosen expert it holds gets its id among them (e - first), one it
                             does not id -1 and weight 0, and the shared experts (ids count ..)
                             go to rows t with t % ranks == rank only (id -1 and weight 0 elsewhere)
    returns                  topk_weights [T, k + S] (float32, or float64 for float64 x) and
                             topk_ids [T, k + S] int64; padded rows get id -1 and weight 0,
                             so they take no expert.

    Routing runs in at least float32 whatever x's dtype (bf16 scores would tie and
    flip experts); float64 x routes in float64. Scores are the softmax, sigmoid or
    sqrt(softplus) (DeepSeek-V4's) of x @ gate^T. `greedy` takes the plain top-k;
    `group_limited_greedy` first keeps the topk_group groups (of E / n_group
    consecutive experts) with the best single score, `noaux_tc` those with the best
    sum of their two best scores. The bias
    only steers the choice: weights are the raw scores of the chosen experts,
    optionally normalised to sum 1, then multiplied by routed_scaling_factor.
    """
    num_tokens, hidden = x.shape
    num_experts = gate.shape[0]
    check_shape("gate", gate, (num_experts, hidden))
    check_shape("valid", valid, (num_tokens,))
    if e_score_correction_bias is not None:
        check_shape("e_score_correction_bias", e_score_correction_bias, (num_experts,))
    check_route_args(num_experts, top_k=top_k, scoring_func=scoring_func, topk_method=topk_method,
                     n_group=n_group, topk_group=topk_group, num_shared=num_shared)
    if fixed_ids is not None:
        check_shape("fixed_ids", fixed_ids, (num_tokens, top_k))
    if held is not None:
        held.check(num_experts)
    acc = torch.promote_types(x.dtype, torch.float32)
    logits = F.linear(as_dtype(x, acc), as_dtype(gate, acc))  # [T, E]
    scores = _scores(logits, scoring_func)
    if fixed_ids is not None:
        topk_ids = fixed_ids.long()
    else:
        choice = scores if e_score_correction_bias is None else scores + e_score_correction_bias
        # check_route_args made sure the group-limited methods have both group sizes.
        if topk_method in GROUP_LIMITED_METHODS and n_group and topk_group:
            choice = _limit_groups(choice, n_group, topk_group, top2=topk_method == "noaux_tc")
        topk_ids = choice.topk(top_k, dim=-1).indices
    topk_weights = scores.gather(1, topk_ids)
    if norm_topk_prob:
        topk_weights = topk_weights / (topk_weights.sum(dim=-1, keepdim=True) + 1e-20)
    if routed_scaling_factor != 1.0:
        topk_weights = topk_weights * routed_scaling_factor
    first, count = (0, num_experts) if held is None else (held.first, held.count)
    if held is not None:
        local = topk_ids - first
        kept = (local >= 0) & (local < count)
        topk_ids = torch.where(kept, local, -1)
        topk_weights = topk_weights.masked_fill(~kept, 0.0)
    if num_shared:
        shared_ids = torch.arange(count, count + num_shared, device=x.device).expand(num_tokens, num_shared)
        shared_weights = topk_weights.new_ones(num_tokens, num_shared)
        if held is not None:
            others = (torch.arange(num_tokens, device=x.device) % held.ranks != held.rank).unsqueeze(-1)
            shared_ids = shared_ids.masked_fill(others, -1)
            shared_weights = shared_weights.masked_fill(others, 0.0)
        topk_ids = torch.cat([topk_ids, shared_ids], dim=1)
        topk_weights = torch.cat([topk_weights, shared_weights], dim=1)
    padded = ~valid.unsqueeze(-1)                                       # [T, 1]
    topk_weights = topk_weights.masked_fill(padded, 0.0)
    topk_ids = topk_ids.masked_fill(padded, -1)
    return topk_weights, topk_ids


def _scores(logits: torch.Tensor, scoring_func: str) -> torch.Tensor:
    if scoring_func == "softmax":
        return logits.softmax(dim=-1)
    if scoring_func == "sigmoid":
        return logits.sigmoid()
    return F.softplus(logits).sqrt()


def _limit_groups(choice: torch.Tensor, n_group: int, topk_group: int, *, top2: bool) -> torch.Tensor:
    """choice [T, E] -> [T, E] with every expert outside the topk_group best groups at -inf.

    A group scores its best choice value, or with `top2` the sum of its best two.
    """
    grouped = choice.view(choice.shape[0], n_group, -1)                                   # [T, G, E / G]
    group_scores = grouped.topk(2, dim=-1).values.sum(dim=-1) if top2 else grouped.amax(dim=-1)  # [T, G]
    group_ids = group_scores.topk(topk_group, dim=-1).indices
    dropped = torch.ones_like(group_scores, dtype=torch.bool).scatter(1, group_ids, False)
    return grouped.masked_fill(dropped.unsqueeze(-1), float("-inf")).flatten(1)
