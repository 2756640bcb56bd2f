"""Mixture-of-experts combination given the router's choice."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..checks import as_dtype, check_shape
from ..quantized import Weight, dequantized


def fused_moe(
    x: torch.Tensor,
    w13: Weight,
    w2: Weight,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    *,
    out_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """Sum over each token's chosen experts of weight * down(silu(gate(x)) * up(x)).

    x:            [T, D]
    w13:          [E, 2I, D], rows [0, I) the gate projection, [I, 2I) the up projection
    w2:           [E, D, I]; both tensors, or stacked block-scaled FP8 pairs, which are
                  dequantized into x's dtype first (the math FP8 kernels must match)
    topk_weights: [T, k] float32
    topk_ids:     [T, k] integer; -1 takes no expert (padded rows)
    out_dtype:    dtype of the result, by default x's; a wider one takes the
                  weighted sum over experts in it
    returns       [T, D] in out_dtype

    The reference runs every expert on every token and weights the results, so it
    has static shapes and no data-dependent indexing; it reads all experts.
    """
    w13, w2 = dequantized(w13, x.dtype), dequantized(w2, x.dtype)
    num_tokens, hidden = x.shape
    num_experts, two_inter, _ = w13.shape
    check_shape("w13", w13, (num_experts, two_inter, hidden))
    check_shape("w2", w2, (num_experts, hidden, two_inter // 2))
    check_shape("topk_ids", topk_ids, tuple(topk_weights.shape))
    check_shape("topk_weights", topk_weights, (num_tokens, None))
    # -1 goes to a spare column that is dropped, so padded rows combine nothing.
    ids = torch.where(topk_ids >= 0, topk_ids, num_experts).long()
    combine = torch.zeros(num_tokens, num_experts + 1, dtype=topk_weights.dtype, device=x.device)
    combine = combine.scatter_add(1, ids, topk_weights)[:, :num_experts]
    # The contractions are GEMMs, the einsum each computes in its comment: einsum's
    # equation parsing costs more than the product itself at decode sizes.
    gate_up = F.linear(x, w13.flatten(0, 1)).view(num_tokens, num_experts, two_inter)  # td,efd->tef
    gate, up = gate_up.chunk(2, dim=-1)
    act = F.silu(gate) * up                                             # [T, E, I]
    expert_out = torch.bmm(act.transpose(0, 1), w2.transpose(1, 2)).transpose(0, 1)  # tei,edi->ted
    out_dtype = out_dtype or x.dtype
    return torch.bmm(as_dtype(combine, out_dtype)[:, None, :], as_dtype(expert_out, out_dtype))[:, 0]  # ted,te->td
