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
from mla_func.kernels.latent_cache import check_kv_cache_dtype
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
    max_num_seqs: int | None = None,
    max_num_batched_tokens: int | None = None,
    kv_cache_dtype: str = "auto",
) -> KVCacheState:
    """A zeroed state for a model: each layer's cache of its kind, in cache groups that hold as many
    tokens as `num_blocks - 1` blocks of `block_size` tokens (block 0 of each group is scratch). For
    an MLA layer the cache is [num_blocks, block_size, C + R]: one group, of num_blocks blocks.

    Each group has its own block count (`layers.cache_groups`, the one rule): a group of entries of r
    tokens the blocks that hold that many tokens' entries; a group 0 with a lookback (only the last
    tokens of a sequence are read there), given the engine's max_num_seqs and max_num_batched_tokens,
    only the blocks that many sequences hold at once, if fewer than num_blocks.

    model:  a `Model` (then dtype and device default to the model's, which the forward
            requires) or a `ModelConfig` (then they default to float32 on the CPU).
    layers: the layer kinds (default `layer_kinds(config)`).
    kv_cache_dtype: "auto" (default): the latent caches in `dtype`; "fp8": FP8 latent values with
            a float32 scale per 128 and the RoPE values in `dtype` (`kernels.latent_cache`), through
            the family's `fp8_cache_layer_kinds` (ValueError for a family without them, or with
            `layers` given: those kinds make their own caches).
    """
    check_kv_cache_dtype(kv_cache_dtype)
    if isinstance(model, Model):
        config = model.config
        dtype = dtype or model.dtype
        device = device or model.device
    else:
        config = model
    dtype = dtype or torch.float32
    device = device or "cpu"
    if layers is not None and kv_cache_dtype != "auto":
        raise ValueError(f"init_state: kv_cache_dtype={kv_cache_dtype!r} with layers given; the layer kinds make "
                         "their own caches")
    kinds = _cache_kinds(config, kv_cache_dtype) if layers is None else layers
    groups = cache_groups(config, CacheGroup(num_blocks=num_blocks, block_size=block_size), layers=kinds,
                          max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens)
    return KVCacheState.checked([k.init_cache(config, groups, dtype=dtype, device=device) for k in kinds],
                                groups=groups)


def _cache_kinds(config: ModelConfig, kv_cache_dtype: str) -> tuple[LayerKind, ...]:
    """The layer kinds whose caches are in `kv_cache_dtype` (checked by the caller)."""
    if kv_cache_dtype == "auto":
        return layer_kinds(config)
    fp8_kinds = config.family.fp8_cache_layer_kinds
    if fp8_kinds is None:
        raise ValueError(f"kv_cache_dtype: {config.family.title} models have no FP8 latent cache, got "
                         f"{kv_cache_dtype!r}; use 'auto'")
    return fp8_kinds(config)


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
    w8a8: bool = False,
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
    w8a8:         run FP8 weights' products with activations quantized per token and group
                  (`ForwardMode.w8a8`).
    Returns the batch (its tensors on the state's device) and the mode.
    """
    mode = ForwardMode.decide(
        plan, cache_groups=state.groups, backend=backend or default_backend(state.device), padding=padding,
        graphs=graphs, graph_kinds=graph_kinds, batch_invariant=batch_invariant, w8a8=w8a8,
    )
    batch = build_batch(
        plan, mode, block_size=state.block_size, device=state.device, num_blocks=state.num_blocks,
        vocab_size=config.vocab_size,
        max_position=config.max_position_embeddings if max_position is None else max_position,
    )
    return batch, mode


def state_bytes_per_block(model: Model, block_size: int, kv_cache_dtype: str = "auto") -> int:
    """Bytes one block of cache group 0 costs over every layer's cache, in the model's dtype and
    `kv_cache_dtype` (`init_state`'s).

    Measured on the leaves of a two-block state on the meta device (no memory), so it
    follows whatever the layer kinds cache.
    """
    probe = init_state(model, num_blocks=2, block_size=block_size, device="meta", kv_cache_dtype=kv_cache_dtype)
    return probe.bytes_per_block(0)
