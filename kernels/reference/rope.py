"""Rotary position embedding of the decoupled rope parts of queries and keys."""

from __future__ import annotations

import torch

from ..checks import as_dtype


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleaved: bool) -> torch.Tensor:
    if interleaved:
        x1, x2 = x[..., 0::2], x[..., 1::2]
    else:
        x1, x2 = x.chunk(2, dim=-1)
    acc = torch.promote_types(x.dtype, torch.float32)
    x1, x2 = as_dtype(x1, acc), as_dtype(x2, acc)
    cos, sin = as_dtype(cos, acc), as_dtype(sin, acc)
    return as_dtype(torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1), x.dtype)


def rope(
    q_pe: torch.Tensor,
    k_pe: torch.Tensor,
    positions: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    *,
    interleaved: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate q_pe [T, H, R] and k_pe [T, R] by the angles at `positions` [T].

    cos, sin: [max_positions, R / 2] tables (YaRN attention factor already applied).
    interleaved: input pairs are (x0, x1), (x2, x3), ... (DeepSeek's layout) rather
    than (x_i, x_{i + R/2}). The output is always in the half-split layout: queries
    and keys get the same permutation, so their dot products are unchanged.
    """
    c, s = cos[positions], sin[positions]                               # [T, R/2]
    if q_pe.dtype != k_pe.dtype:
        return (
            _rotate(q_pe, c.unsqueeze(1), s.unsqueeze(1), interleaved),
            _rotate(k_pe, c, s, interleaved),
        )
    # The key as one more head: one rotation instead of two (the same products, element by element).
    num_heads = q_pe.shape[1]
    rotated = _rotate(torch.cat([q_pe, k_pe.unsqueeze(1)], dim=1), c.unsqueeze(1), s.unsqueeze(1), interleaved)
    return rotated[:, :num_heads], rotated[:, num_heads]


def partial_rope(
    q: torch.Tensor,
    k: torch.Tensor,
    positions: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    *,
    rotary_dim: int,
    interleaved: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`rope` of the first rotary_dim dims of q [T, H, D] and k [T, D]; the rest passed through.

    cos, sin: [max_positions, rotary_dim / 2]. Returns new (q [T, H, D], k [T, D]); the
    rotated dims come out half-split, as `rope` gives them (DeepSeek-V3.2's indexer).
    """
    q_pe, k_pe = rope(q[..., :rotary_dim], k[:, :rotary_dim], positions, cos, sin, interleaved=interleaved)
    return torch.cat([q_pe, q[..., rotary_dim:]], dim=-1), torch.cat([k_pe, k[:, rotary_dim:]], dim=-1)
