"""The embedding and the logits of a vocab-parallel model: each rank holds V / n rows of each.

A rank whose embedding (or LM head) holds fewer rows than the vocabulary holds the rank-th of n
even row ranges (`Family.tensor_split`). Its embedding gives the rows of the tokens it holds and
zeros elsewhere, and one all-reduce makes every token's row (one nonzero term: exact); its LM head
gives the logits of its own range, and one all-gather joins them in rank order. With the whole
table (one process, or a vocabulary the ranks do not divide) both are the plain ops.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from mla_func.kernels import CollectiveOps


def embed_tokens(input_ids: torch.Tensor, embed: torch.Tensor, vocab_size: int,
                 collectives: CollectiveOps) -> torch.Tensor:
    """input_ids [T] int64; embed [V, D] or this rank's [V / n, D] -> [T, D] in embed's dtype."""
    rows = embed.shape[0]
    if rows == vocab_size:
        return F.embedding(input_ids, embed)
    local = input_ids - collectives.rank * rows
    held = (local >= 0) & (local < rows)
    out = torch.where(held.unsqueeze(-1), F.embedding(local.clamp(0, rows - 1), embed), 0.0)
    return collectives.all_reduce(out.to(embed.dtype))


def whole_logits(logits: torch.Tensor, vocab_size: int, collectives: CollectiveOps) -> torch.Tensor:
    """logits [N, V] or this rank's [N, V / n] -> [N, V], the ranks' columns in rank order."""
    if logits.shape[-1] == vocab_size:
        return logits
    return collectives.all_gather(logits, dim=-1)
