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

from mla_func.kernels import Ops
from mla_func.kernels.index_cache import IndexCache
from mla_func.models.v4.config import V4Config
from mla_func.models.v4.params import IndexerParams


def index_query(p: IndexerParams, q_index: torch.Tensor, x: torch.Tensor, positions: torch.Tensor,
                cos: torch.Tensor, sin: torch.Tensor, v: V4Config, ops: Ops) -> tuple[torch.Tensor, torch.Tensor]:
    """(queries [n, Hi, Di] rotated at `positions`, head weights [n, Hi] float32).

    q_index [n, Hi * Di] the query latent's indexer projection (the last columns of the attention's
    query product, any row stride); x [n, D] the layer's input; cos, sin [P, R / 2] the compress rope
    tables. The score's scales, 1/sqrt(Hi) and 1/sqrt(Di), are left to `select_entries` (the indexer
    op applies them to the weights).
    """
    n = x.shape[0]
    q = ops.v4.rope_tail(q_index.view(n, v.index_n_heads, v.index_head_dim), cos, sin, positions=positions)
    # Float32 products straight from the op: no bf16 rounding of the weights, no widening copy.
    return q, ops.dense.linear(x, p.weights_proj, out_dtype=torch.float32)


def select_entries(q: torch.Tensor, head_weights: torch.Tensor, index_keys: IndexCache, group_table: torch.Tensor,
                   counts: torch.Tensor, v: V4Config, ops: Ops) -> torch.Tensor:
    """The entries each row attends to: [n, min(index_topk, L)] int32 entry numbers, -1 for none.

    q, head_weights from `index_query`; index_keys [num_blocks_g, bs_g, Di]; group_table [n, Wg]
    int32 (L = Wg * bs_g candidates);
    counts [n] entries complete at the row's position. A row with fewer than index_topk
    complete entries keeps all of them.
    """
    key_lens = counts.to(torch.int32)
    # The same ops as V3.2's indexer (`ops.dsa`), over compressed entries instead of tokens.
    scores = ops.dsa.index_scores(q, head_weights, index_keys, group_table, key_lens,
                                  weight_scale=v.index_n_heads ** -0.5 * v.index_head_dim ** -0.5)
    return ops.dsa.top_k_indices(scores, key_lens, k=min(v.index_topk, scores.shape[1]))
