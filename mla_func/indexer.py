"""CSA's lightning indexer: which compressed entries each query row attends to.

The indexer has its own compressor (the same overlapping-window pooling at
`index_head_dim`; its keys live in the layer's `index_keys`), and its own
queries, `index_n_heads` of them per row from the attention's query latent,
rotated with the compress rope at the row's position. A row scores each entry
complete at its position as sum_h w_h * relu(q_h . k) (head weights from the
row's input) and keeps the `index_topk` best; with fewer complete entries it
keeps them all.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .kernels.reference.v4_attention import index_scores, rope_tail
from .v4_config import V4Config
from .v4_params import IndexerParams
from .v4_rows import slots_of


def index_query(p: IndexerParams, q_residual: torch.Tensor, x: torch.Tensor, positions: torch.Tensor,
                cos: torch.Tensor, sin: torch.Tensor, v: V4Config) -> tuple[torch.Tensor, torch.Tensor]:
    """(queries [n, Hi, Di] rotated at `positions`, head weights [n, Hi] float32 with 1/sqrt(Hi) folded in).

    q_residual [n, Q] the attention's normalised query latent; x [n, D] the layer's input;
    cos, sin [P, R / 2] the compress rope tables.
    """
    n = x.shape[0]
    q = F.linear(q_residual, p.q_b_proj).view(n, v.index_n_heads, v.index_head_dim)
    q = rope_tail(q, cos[positions].unsqueeze(1), sin[positions].unsqueeze(1))
    weights = F.linear(x, p.weights_proj).float() * v.index_n_heads ** -0.5
    return q, weights


def select_entries(q: torch.Tensor, head_weights: torch.Tensor, index_keys: torch.Tensor, group_table: torch.Tensor,
                   candidates: torch.Tensor, counts: torch.Tensor, v: V4Config) -> torch.Tensor:
    """The entries each row attends to: [n, min(index_topk, L)] int64 entry numbers.

    index_keys [num_blocks_g, bs_g, Di]; group_table [n, Wg]; candidates [n, L] the entry
    numbers a row may see (0..L-1); counts [n] complete entries at the row's position.
    Entries at or past a row's count are never chosen over a complete one; the caller
    masks them (a row with fewer than index_topk complete entries keeps all of them).
    """
    slots = slots_of(group_table, candidates, index_keys.shape[1])
    keys = index_keys.view(-1, index_keys.shape[-1])[slots]                            # [n, L, Di]
    valid = candidates < counts.unsqueeze(1)
    scores = index_scores(q, head_weights, keys, valid, softmax_scale=v.index_head_dim ** -0.5)
    k = min(v.index_topk, candidates.shape[1])
    return torch.gather(candidates, 1, scores.topk(k, dim=-1).indices)
