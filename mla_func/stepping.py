"""Conveniences that tie a model, a state and a plan together for one step."""

from __future__ import annotations

import torch

from .batch import Batch, build_batch
from .config import ModelConfig
from .kernels import default_backend
from .mode import ForwardMode, PaddingPolicy
from .plan import StepPlan
from .state.kv_cache import KVCacheState
from .state.kv_cache import init_state as _init_cache


def init_state(
    config: ModelConfig,
    *,
    num_blocks: int,
    block_size: int = 16,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
) -> KVCacheState:
    """A zeroed paged latent cache for `config`: per layer [num_blocks, block_size, C + R].

    Block 0 is scratch, so `num_blocks - 1` blocks hold sequences.
    """
    return _init_cache(
        config.num_hidden_layers, config.kv_cache_dim,
        num_blocks=num_blocks, block_size=block_size, dtype=dtype, device=device,
    )


def plan_step(
    config: ModelConfig,
    state: KVCacheState,
    plan: StepPlan,
    *,
    backend: str | None = None,
    padding: PaddingPolicy | None = None,
    graphs: bool = False,
) -> tuple[Batch, ForwardMode]:
    """Decide the mode of `plan` and build its batch, checking it against the model and cache.

    backend defaults to "triton" on CUDA and "torch" elsewhere.
    """
    mode = ForwardMode.decide(
        plan,
        block_size=state.block_size,
        backend=backend or default_backend(state.device),
        padding=padding,
        graphs=graphs,
    )
    batch = build_batch(
        plan,
        mode,
        block_size=state.block_size,
        device=state.device,
        num_blocks=state.num_blocks,
        vocab_size=config.vocab_size,
        max_position=config.max_position_embeddings,
    )
    return batch, mode
