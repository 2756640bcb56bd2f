"""What expert parallelism is the same for in every MoE family: a rank's range of whole experts,
and the shared experts every token takes.

Rank r of n holds routed experts [r E / n, (r + 1) E / n) whole. The router is whole on every
rank and sees the same bits everywhere (the all-reduce gives every rank the same sum), so every
rank chooses the same experts; each runs those it holds (the route op's `held`,
`kernels.held_experts`) and the layer's all-reduce adds the ranks' partial sums. No token moves:
every rank holds every token already.
"""

from __future__ import annotations

import torch

from mla_func.core.config import ModelConfig, refuse


def expert_range(config: ModelConfig, rank: int, ranks: int) -> range:
    """The routed experts rank `rank` of `ranks` holds whole; ConfigError when `ranks` does not divide
    n_routed_experts."""
    experts = config.n_routed_experts or 0
    if experts % ranks:
        raise refuse("n_routed_experts", experts, f"expert parallelism over {ranks} ranks holds whole experts: "
                     f"must be a multiple of {ranks}")
    per_rank = experts // ranks
    return range(rank * per_rank, (rank + 1) * per_rank)


def every_shared_expert(valid: torch.Tensor, num_shared: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """The choice of S shared experts, which every real row takes with weight 1: valid [T] bool ->
    (weights [T, S] in `dtype`, ids [T, S] int64 0..S-1); a padded row gets ids -1 and weights 0."""
    ids = torch.arange(num_shared, device=valid.device).expand(valid.shape[0], num_shared)
    ids = torch.where(valid.unsqueeze(-1), ids, -1)
    return valid.unsqueeze(-1).expand(-1, num_shared).to(dtype), ids
