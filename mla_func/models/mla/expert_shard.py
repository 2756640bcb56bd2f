"""Expert parallelism for DeepSeek-V2/V3/V3.2: each rank holds whole routed experts, E / n of them.

Rank r of n holds routed experts [r E / n, (r + 1) E / n) whole, and every shared expert whole,
which it runs for rows t with t % n == r (`kernels.held_experts`). Attention and dense layers are
cut as tensor parallelism cuts them (`shard`). The router is whole on every rank and sees the same
bits everywhere, so every rank makes the same choice; the route op keeps the chosen experts a rank
holds, numbered among them, and its share of the rows' shared experts, and one fused call runs
them: the block is a `MoEParams` whose `held` says which (its w13 [E / n + S, 2I, D]). The layer's
all-reduce sums the ranks' partial sums: the collective is the tensor-parallel one, and no token
moves (every rank holds every token already). A rank reads only its own routed experts' bytes and
the shared experts' (a few a layer; whole, an FP8 pair needs no cut inside its blocks). The MTP
layer's MoE block is held the same way (`expert_parallel_layer`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import torch

from mla_func.core.config import ModelConfig
from mla_func.core.params import Params, TensorFetch, TensorGet
from mla_func.kernels.held_experts import HeldExperts
from mla_func.models.expert_parallel import expert_range
from mla_func.models.mla.params import LayerParams, MoEParams, layer_params, mla_params_from_hf


def expert_parallel_layer(config: ModelConfig, rank: int, ranks: int
                          ) -> Callable[[ModelConfig, int, TensorGet, torch.dtype], LayerParams]:
    """The builder of rank `rank` of `ranks`'s decoder layer `i` (`layer_params`' arguments): its own routed
    experts and every shared expert read whole, the MoE block marked with what it holds. ConfigError when
    `ranks` does not divide n_routed_experts."""
    routed = expert_range(config, rank, ranks)
    held = HeldExperts(first=routed.start, count=len(routed), rank=rank, ranks=ranks)

    def layer(c: ModelConfig, i: int, get: TensorGet, layer_dtype: torch.dtype) -> LayerParams:
        p = layer_params(c, i, get, layer_dtype, routed=routed)
        if not isinstance(p.mlp, MoEParams):
            return p
        return dataclasses.replace(p, mlp=dataclasses.replace(p.mlp, held=held))

    return layer


def mla_expert_parallel_params(config: ModelConfig, fetch: TensorFetch, *, rank: int, ranks: int, dtype: torch.dtype,
                               device: torch.device | str, progress: bool = False,
                               max_model_len: int | None = None) -> Params:
    """`Family.expert_parallel_params` of DeepSeek-V2/V3/V3.2: rank `rank` of `ranks`'s params, reading
    its own routed experts only (`fetch` reads this rank's shard of the other cut tensors)."""
    return mla_params_from_hf(config, fetch, dtype=dtype, device=device, progress=progress,
                              max_model_len=max_model_len, layer=expert_parallel_layer(config, rank, ranks))
