"""DeepSeek-V3.2's lightning indexer: each query token's scores over earlier tokens, and reading its choice.

For row t (a query token) and key position j of its sequence:

    score[t, j] = sum_h w[t, h] * relu(q[t, h] . k[j])        (Hi heads, dims Di)

with q from the low-rank query residual (`wq_b`), one key per token (`wk`, a
LayerNorm with bias, then rope), and w = weights_proj(x) * Hi^-0.5 * Di^-0.5 (the
reference scales each dot by Di^-0.5 before the ReLU; a positive factor passes
through it, so it goes with the weights, and `ops.dsa.index_scores` applies it).
The rope of the indexer rotates the first qk_rope_head_dim dims of q and k in the
half-split layout (x_i paired with x_{i + R/2}), unlike MLA's interleaved pairs,
with the same angle tables.
"""

from __future__ import annotations

import dataclasses

import torch

from mla_func.core.config import ModelConfig
from mla_func.kernels import Ops
from mla_func.models.mla.indexer_params import INDEX_KEY_NORM_EPS, IndexerParams

__all__ = ["index_query_key", "index_weight_scale", "record_index_choice"]


def index_query_key(
    p: IndexerParams,
    x: torch.Tensor,
    q_proj: torch.Tensor,
    k_proj: torch.Tensor,
    positions: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    config: ModelConfig,
    ops: Ops,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The indexer's queries, keys and head weights of one step's rows.

    x [T, D] the layer's normalised input; q_proj [T, Hi * Di] = wq_b(the normalised low-rank
    query residual) and k_proj [T, Di] = wk(x), the rows of the attention's GEMMs that are the
    indexer's (see `indexer_params`); positions [T]; cos, sin [P, R / 2] the rope tables
    -> q [T, Hi, Di] and key [T, Di] (first R dims rotated half-split), head_weights [T, Hi]
       float32 (float64 in a float64 model) to be scaled by `index_weight_scale` (the
       indexer op applies it).
    """
    heads, dim, rope_dim = p.weights_proj.shape[0], p.k_norm.shape[0], config.qk_rope_head_dim
    q = q_proj.view(x.shape[0], heads, dim)
    key = ops.dense.layer_norm(k_proj, p.k_norm, p.k_norm_bias, INDEX_KEY_NORM_EPS)
    q, key = ops.dense.partial_rope(q, key, positions, cos, sin, rotary_dim=rope_dim, interleaved=False)
    # Products in the weights' float32 (float64) with the input widened to it, as the reference computes.
    head_weights = ops.dense.linear(x, p.weights_proj, out_dtype=p.weights_proj.dtype)
    return q, key, head_weights


def index_weight_scale(p: IndexerParams) -> float:
    """The scores' constant factor Hi^-0.5 * Di^-0.5, which `ops.dsa.index_scores` applies to the head weights."""
    return (p.weights_proj.shape[0] * p.k_norm.shape[0]) ** -0.5


def record_index_choice(ops: Ops) -> tuple[Ops, list[torch.Tensor]]:
    """`ops` whose top-k also appends each call's choice, indices [T, k] int32, to the returned list.

    For reading which tokens sparse attention used, from the same forward that made the
    logits (through the forward's public `ops=` argument): one entry per sparse-attention
    layer, in layer order. Row t of an entry lists the key positions (in row t's own
    sequence, ascending; -1 past the end when fewer than k keys are visible) that the
    step's row t attended to; rows follow the batch ([prefill tokens | padding | decode
    rows | padding]; padded rows list only -1). The list fills when the op runs, so read it
    from eager calls (`mf.forward(..., ops=ops)`); a replayed CUDA graph runs no Python.
    """
    chosen: list[torch.Tensor] = []
    top_k = ops.dsa.top_k_indices

    def recording_top_k(scores: torch.Tensor, key_lens: torch.Tensor, /, *, k: int) -> torch.Tensor:
        indices = top_k(scores, key_lens, k=k)
        chosen.append(indices)
        return indices

    return dataclasses.replace(ops, dsa=dataclasses.replace(ops.dsa, top_k_indices=recording_top_k)), chosen
