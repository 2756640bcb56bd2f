"""From a model, a state and a host plan to what one step runs on: the state, the mode and the batch.

`init_state` makes a model's state (every layer's cache of its kind, in the
model's dtype and on its device by default); `plan_step` decides a plan's mode
for the state's cache groups and builds its batch, checked against the model and
the state: at exact sizes by default, and `Step.prepare` calls it with the step's
padding ladders and graph settings.
"""

from __future__ import annotations

from collections.abc import Collection

import torch

from mla_func.core.batch import Batch
from mla_func.core.batch_build import build_batch
from mla_func.core.config import ModelConfig
from mla_func.core.layers import LayerKind, cache_groups, layer_kinds
from mla_func.core.mode import SEGMENT_KINDS, ForwardMode, PaddingPolicy
from mla_func.core.model import Model
from mla_func.core.plan import StepPlan
from mla_func.kernels import default_backend
from mla_func.state.kv_cache import KVCacheState
from mla_func.state.layer_cache import CacheGroup


def init_state(
    model: Model | ModelConfig,
    *,
    num_blocks: int,
    block_size: int = 16,
    dtype: torch.dtype | None = None,
    device: torch.device | str | None = None,
    layers: tuple[LayerKind, ...] | None = None,
) -> KVCacheState:
    """A zeroed state for a model: each layer's cache of its kind, in cache group 0 of
    `num_blocks` blocks of `block_size` tokens (block 0 is scratch, so `num_blocks - 1`
    blocks hold sequences). For an MLA layer the cache is [num_blocks, block_size, C + R].

    model:  a `Model` (then dtype and device default to the model's, which the forward
            requires) or a `ModelConfig` (then they default to float32 on the CPU).
    layers: the layer kinds (default `layer_kinds(config)`).
    """
    if isinstance(model, Model):
        config = model.config
        dtype = dtype or model.dtype
        device = device or model.device
    else:
        config = model
    dtype = dtype or torch.float32
    device = device or "cpu"
    groups = cache_groups(config, CacheGroup(num_blocks=num_blocks, block_size=block_size))
    kinds = layer_kinds(config) if layers is None else layers
    return KVCacheState.checked([k.init_cache(config, groups, dtype=dtype, device=device) for k in kinds],
                                groups=groups)


def plan_step(
    config: ModelConfig,
    state: KVCacheState,
    plan: StepPlan,
    *,
    backend: str | None = None,
    padding: PaddingPolicy | None = None,
    graphs: bool = False,
    graph_kinds: Collection[str] = SEGMENT_KINDS,
    max_position: int | None = None,
    batch_invariant: bool = False,
) -> tuple[Batch, ForwardMode]:
    """Decide the mode of `plan` for `state`'s cache groups and build its batch, checking it
    against the model and the state.

    backend:      defaults to "triton" on CUDA and "torch" elsewhere.
    padding:      the ladders sizes are padded to (default: none, exact sizes).
    graphs, graph_kinds: whether the step may replay a graph, and for which segment kinds
                  (`ForwardMode.decide`); `Step.prepare` passes its own with its ladders.
    max_position: positions must stay below it: the RoPE tables' length (`Model.max_positions`,
                  below the config's max_position_embeddings when the model was loaded with a
                  smaller `max_model_len`); defaults to the config's max_position_embeddings.
    batch_invariant: run the step with the backend's batch-invariant ops and attention path
                  (`ForwardMode.batch_invariant`).
    Returns the batch (its tensors on the state's device) and the mode.
    """
    mode = ForwardMode.decide(
        plan, cache_groups=state.groups, backend=backend or default_backend(state.device), padding=padding,
        graphs=graphs, graph_kinds=graph_kinds, batch_invariant=batch_invariant,
    )
    batch = build_batch(
        plan, mode, block_size=state.block_size, device=state.device, num_blocks=state.num_blocks,
        vocab_size=config.vocab_size,
        max_position=config.max_position_embeddings if max_position is None else max_position,
    )
    return batch, mode


def state_bytes_per_block(model: Model, block_size: int) -> int:
    """Bytes one block of cache group 0 costs over every layer's cache, in the model's dtype.

    Measured on the leaves of a two-block state on the meta device (no memory), so it
    follows whatever the layer kinds cache.
    """
    probe = init_state(model, num_blocks=2, block_size=block_size, device="meta")
    return probe.bytes_per_block(0)
