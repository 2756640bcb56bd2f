"""DeepSeek-V4's experts: fused MoE GEMMs with the clamped SwiGLU (`swiglu_limit`), reading only chosen experts.

The reference runs every expert over every row (E launches of GEMMs, every expert's
weights read whatever the routing). This is the tiled fused MoE of `moe` (pairs
sorted by expert, one expert per program's rows) with its gate/up kernel clamping
the pre-activations before the SwiGLU: gate at `limit` from above, up to
[-limit, limit].
"""

from __future__ import annotations

import torch

from ..checks import check_dtype, check_same_device, check_shape
from ._common import check_float
from .moe import MoeConfig, tiled_config, tiled_moe


def clamped_experts(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
                    topk_ids: torch.Tensor, *, limit: float, config: MoeConfig | None = None) -> torch.Tensor:
    """sum_k topk_weights[t, k] * expert_{topk_ids[t, k]}(x[t]) with clamped SwiGLU (see
    `reference.v4_moe.clamped_experts`): x [T, D]; w13 [E, 2I, D]; w2 [E, D, I]; topk_weights [T, k]
    (any float dtype); topk_ids [T, k] int (-1: none) -> [T, D] in x's dtype. Products and the k-way
    sum in float32. config: the tiled path's launch configuration, by default `tiled_config` of T * k
    pairs."""
    num_tokens, hidden = x.shape
    num_experts, two_inter, _ = w13.shape
    inter = two_inter // 2
    check_float("x", x)
    check_shape("w13", w13, (num_experts, 2 * inter, hidden))
    check_shape("w2", w2, (num_experts, hidden, inter))
    check_shape("topk_ids", topk_ids, (num_tokens, None))
    top_k = topk_ids.shape[1]
    check_shape("topk_weights", topk_weights, (num_tokens, top_k))
    check_dtype("w13", w13, (x.dtype,))
    check_dtype("w2", w2, (x.dtype,))
    check_dtype("topk_ids", topk_ids, (torch.int32, torch.int64))
    check_float("topk_weights", topk_weights)
    check_same_device(x=x, w13=w13, w2=w2, topk_weights=topk_weights, topk_ids=topk_ids)
    if num_tokens * top_k == 0:
        return torch.zeros((num_tokens, hidden), dtype=x.dtype, device=x.device)
    config = config or tiled_config(num_tokens * top_k, num_experts, x.device, x.dtype)
    return tiled_moe(x, w13, w2, topk_weights.float(), topk_ids, config, x.dtype, limit=limit)
