"""DeepSeek-V4's attention ops, in plain torch: every query row with its own key sets.

Rows are single query tokens; each carries the keys of one scope it attends to (its
sliding window, or its compressed entries: all complete ones, or the indexer's
top-k of them) gathered into a [n, L, D] tensor with a [n, L] validity mask, so
prefill and decode rows, and rows of different sequences, go through the same
function. Scopes meet, with the sink, in the one LSE merge (`merge_attn_states`).
"""

from __future__ import annotations

import torch


def rope_tail(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, *, positions: torch.Tensor | None = None,
              unit_rms_eps: float | None = None, inverse: bool = False) -> torch.Tensor:
    """Rotate the trailing R channels of x [..., D] by interleaved pairs (x0, x1), (x2, x3), ...

    cos, sin: [..., R / 2] broadcastable to x's leading dims (one angle per pair); or,
    with positions [T] (integers, x [T, ..., D]), tables [P, R / 2] whose row
    positions[t] holds token t's angles. With unit_rms_eps, x is first
    `unit_rms(x, unit_rms_eps)` (V4's queries: normalised per head, then rotated).
    The rotated slice keeps its interleaved layout (the output projection reads it
    as is); `inverse` rotates by the opposite angle (V4 undoes the value's rotation
    on the attention output). Products in at least float32.
    """
    if unit_rms_eps is not None:
        x = unit_rms(x, unit_rms_eps)
    if positions is not None:
        angles_shape = (x.shape[0],) + (1,) * (x.dim() - 2) + (cos.shape[-1],)
        cos, sin = cos[positions].view(angles_shape), sin[positions].view(angles_shape)
    half = cos.shape[-1]
    nope, pe = x[..., : x.shape[-1] - 2 * half], x[..., x.shape[-1] - 2 * half :]
    acc = torch.promote_types(x.dtype, torch.float32)
    x1, x2 = pe[..., 0::2].to(acc), pe[..., 1::2].to(acc)
    c, s = cos.to(acc), sin.to(acc)
    if inverse:
        s = -s
    rotated = torch.stack([x1 * c - x2 * s, x2 * c + x1 * s], dim=-1).flatten(-2)
    return torch.cat([nope, rotated.to(x.dtype)], dim=-1)


def unit_rms(x: torch.Tensor, eps: float) -> torch.Tensor:
    """x / sqrt(mean(x^2) + eps) over the last dim, statistics in at least float32 (no weight)."""
    acc = torch.promote_types(x.dtype, torch.float32)
    return x * torch.rsqrt(x.to(acc).square().mean(-1, keepdim=True) + eps).to(x.dtype)


def scope_attention(q: torch.Tensor, keys: torch.Tensor, valid: torch.Tensor, *, softmax_scale: float
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of each row over one scope of its own keys (values are the keys).

    q [n, H, D]; keys [n, L, D]; valid [n, L] bool
    returns (out [n, H, D] in q's dtype, lse [n, H] float32 natural log). A row with no valid
    key in the scope gets out 0 and lse -inf (so a merge ignores it), never NaN.
    """
    acc = torch.promote_types(q.dtype, torch.float32)
    scores = torch.einsum("nhd,nld->nhl", q, keys).to(acc) * softmax_scale
    scores = scores.masked_fill(~valid.unsqueeze(1), float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)                                         # [n, H]
    finite = torch.where(torch.isinf(lse), torch.zeros_like(lse), lse)
    probs = torch.exp(scores - finite.unsqueeze(-1))
    # Masked keys may be anything a padded row left in the scratch block: 0 * inf must not reach a row.
    values = keys.masked_fill(~valid.unsqueeze(-1), 0)
    out = torch.einsum("nhl,nld->nhd", probs.to(keys.dtype), values).to(q.dtype)
    return out, lse.float()


def pool_entries(kv: torch.Tensor, gate: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """Gated pooling of S source slots into one entry per row and channel.

    kv [n, S, Dc]; gate [n, S, Dc] (position bias already added); valid [n, S] bool
    -> [n, Dc] = sum_s softmax_s(gate)[s] * kv[s] over valid slots (softmax in float32); 0 for a
    row without a valid slot (a padded row), never NaN.
    """
    weights = gate.float().masked_fill(~valid.unsqueeze(-1), float("-inf")).softmax(dim=1)
    weights = weights.masked_fill(~valid.unsqueeze(-1), 0.0)
    return (kv.masked_fill(~valid.unsqueeze(-1), 0) * weights.to(kv.dtype)).sum(dim=1)
