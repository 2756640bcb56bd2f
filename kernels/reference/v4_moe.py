"""DeepSeek-V4's experts in plain torch: SwiGLU with clamped pre-activations (`swiglu_limit`)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..quantized import Weight, dequantized


def clamped_swiglu(gate_up: torch.Tensor, limit: float) -> torch.Tensor:
    """gate_up [..., 2I] (gate then up) -> silu(min(gate, limit)) * clamp(up, -limit, limit) [..., I]."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate.clamp(max=limit)) * up.clamp(min=-limit, max=limit)


def clamped_experts(x: torch.Tensor, w13: Weight, w2: Weight, topk_weights: torch.Tensor,
                    topk_ids: torch.Tensor, *, limit: float) -> torch.Tensor:
    """sum_k topk_weights[t, k] * expert_{topk_ids[t, k]}(x[t]) -> [T, D] in x's dtype.

    x [T, D]; w13 [E, 2I, D]; w2 [E, D, I] (tensors, or FP8 / FP4 pairs: dequantized into x's dtype
    first, the math quantized kernels must match); topk_weights [T, k]; topk_ids [T, k] int64
    (-1: no expert, as padded rows have). Every expert runs over every row, weighted 0 where
    not chosen: static shapes and no host sync, at E times the FLOPs (a reference, not a kernel).
    """
    w13, w2 = dequantized(w13, x.dtype), dequantized(w2, x.dtype)
    out = torch.zeros_like(x)
    for e in range(w13.shape[0]):
        weight = (topk_weights * (topk_ids == e)).sum(dim=-1, keepdim=True)         # [T, 1]
        h = clamped_swiglu(F.linear(x, w13[e]), limit)
        out += (F.linear(h, w2[e]) * weight).to(out.dtype)
    return out
