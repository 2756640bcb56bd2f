"""The lightning indexer's ops over a paged key cache, in plain torch.

They follow the same contracts as the sparse-attention indexer ops (`index_scores`,
`top_k_indices`): a row is one query token with its own block table and key count.
For DeepSeek-V4's CSA the keys are the indexer's compressed entries and a row's key
count is the number of entries complete at its position.
"""

from __future__ import annotations

import torch


def index_scores(q: torch.Tensor, head_weights: torch.Tensor, index_cache: torch.Tensor, block_table: torch.Tensor,
                 key_lens: torch.Tensor) -> torch.Tensor:
    """scores[t, j] = sum_h head_weights[t, h] * relu(q[t, h] . key_j) for j < key_lens[t], else -inf.

    q [T, Hi, Di]; head_weights [T, Hi] float32 (every scale folded in); index_cache
    [num_blocks, bs, Di]; block_table [T, W] int32; key_lens [T] int32
    -> scores [T, W * bs] float32 (float64 for a float64 q). Dots in at least float32.
    """
    width = block_table.shape[1]
    block_size = index_cache.shape[1]
    positions = torch.arange(width * block_size, device=q.device)
    slots = block_table.to(torch.int64)[:, positions // block_size] * block_size + positions % block_size
    keys = index_cache.view(-1, index_cache.shape[-1])[slots]                       # [T, L, Di]
    acc = torch.promote_types(q.dtype, torch.float32)
    dots = torch.einsum("thd,tld->thl", q.to(acc), keys.to(acc))
    scores = (torch.relu(dots) * head_weights.to(acc).unsqueeze(-1)).sum(dim=1)     # [T, L]
    visible = positions.unsqueeze(0) < key_lens.unsqueeze(1)
    return scores.masked_fill(~visible, float("-inf"))


def top_k_indices(scores: torch.Tensor, key_lens: torch.Tensor, *, k: int) -> torch.Tensor:
    """The positions of the k best scores among j < key_lens[t]: [T, k] int32.

    Ties go to the lower position; the positions are listed in ascending order; -1 fills
    the tail when a row sees fewer than k keys (then every visible position is listed).
    """
    length = scores.shape[1]
    order = torch.sort(scores, dim=1, descending=True, stable=True).indices[:, : min(k, length)]
    chosen = torch.where(order < key_lens.unsqueeze(1).to(order.dtype), order, length)
    chosen = torch.sort(chosen, dim=1).values
    chosen = torch.where(chosen < length, chosen, -1)
    if k > length:
        chosen = torch.cat([chosen, chosen.new_full((chosen.shape[0], k - length), -1)], dim=1)
    return chosen.to(torch.int32)
