"""Family: what differs between the model families mla-func runs, as one value.

A family (dense MLA, MLA with sparse attention, ...) is a frozen record of
the functions and facts that differ between them: how its config is read, written and
checked, which tensors its checkpoints hold and how they become params, its layer kinds
and cache groups, and which modes it supports. Every `ModelConfig` carries its family
(`config.family`), so generic code (the forward, the step, the loader, the memory
check) asks the record and never which model it runs. `families` maps each
config.json `model_type` to its record; a new family is a new module that builds one
and one line there.

This module imports no other mla_func module at run time: every family module and
every generic one may import it.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # annotations only: the records' functions take and return these
    import torch

    from mla_func.core.config import ModelConfig
    from mla_func.core.layers import LayerKind
    from mla_func.core.model import Model
    from mla_func.core.params import Params, TensorFetch
    from mla_func.parallel.config import Parallel, Sharding
    from mla_func.checkpoint.safetensors_file import TensorEntry
    from mla_func.checkpoint.quant_layout import QuantLayout
    from mla_func.state.layer_cache import CacheGroup

__all__ = ["Family", "MTPFamily"]


@dataclass(frozen=True, slots=True)
class MTPFamily:
    """How a family's multi-token-prediction (MTP) layer is stored, loaded and run as a drafter
    (`models.mtp`: the drafter is the forward over params whose one layer is the MTP layer).

    layer_kind:      config -> the drafter's one layer kind, whose `enter` reads `Batch.hidden`
    prefix:          config -> the prefix of every checkpoint name of the first MTP layer (after
                     `Family.canonical_names`), by which a checkpoint without one is told
    tensor_shapes:   config -> the first MTP layer's required tensors, by name, with their shapes
    optional_shapes: config -> the tensors it may hold beside them (copies of the model's), with shapes
    load:            (config, the model's params, fetch, dtype, device, the tensor names present,
                     parallel) -> its params pytree, `Model.mtp`
    drafter_params:  Model -> the drafter's `Params` (its layer, final norm and head)
    hidden_size:     config -> H, the width of the hidden state [T, H] a drafter step reads
                     (`Batch.hidden`) and the model's and the drafter's steps return (`ForwardOutput.hidden`)
    """

    layer_kind: Callable[[ModelConfig], LayerKind]
    prefix: Callable[[ModelConfig], str]
    tensor_shapes: Callable[[ModelConfig], dict[str, tuple[int, ...]]]
    optional_shapes: Callable[[ModelConfig], dict[str, tuple[int, ...]]]
    load: Callable[[ModelConfig, Params, TensorFetch, torch.dtype, torch.device | str, frozenset[str],
                    Parallel | None], Any]
    drafter_params: Callable[[Model], Params]
    hidden_size: Callable[[ModelConfig], int]


@dataclass(frozen=True, slots=True)
class Family:
    """The parts of a model family that generic code asks for (names as the rest of mla-func uses them).

    name:            the family's one name, as its modules and op groups say it
    title:           how messages name its models
    model_types:     the config.json `model_type`s it reads
    config_from_hf:  (config.json dict, this family) -> ModelConfig; ConfigError names a bad field
    config_to_hf:    ModelConfig -> the config.json dict `config_from_hf` reads back to an equal config
    validate:        the family's own checks of a config, run after the shared fields' (ConfigError)
    validate_routing: (config, n_routed_experts) -> None: the family's MoE routing fields
    dense_mlp:       its layers may be dense MLPs (n_routed_experts optional, intermediate_size their width)
    layer_kinds:     config -> the `LayerKind` of each layer
    cache_groups:    (config, token group) -> the cache groups its layer kinds add past the token group, each
                     with the blocks that hold the entries of as many tokens as the token group's usable
                     blocks hold (`CacheGroup.sized_for`); how far back group 0 is read is the layer
                     kinds' `lookback`
    tensor_shapes:   config -> every checkpoint tensor's name and shape
    tensor_count:    config -> len(tensor_shapes(config)), counted without listing them
    canonical_names: (config, tensors by checkpoint name, where) -> the same under the names
                     `tensor_shapes` uses (CheckpointError naming `where` on a clash)
    checkpoint_dtype: (name, file label, header entry, model dtype) -> the dtype the tensor is read as
    held_dtype:      (name, model dtype) -> the dtype the params hold checkpoint tensor `name` in
    params_from_hf:  (config, fetch, *, dtype, device, progress, max_model_len) -> Params
    with_max_positions: (params, positions) -> the params with RoPE tables of that many positions
    rope_table_pairs: config -> how many float32 (cos, sin) pairs of [positions, R / 2] its params hold
    attends_by_row:  its layers read `LayerContext.rows` in every step, not only batch-invariant ones
    supports_batch_invariant: it has batch-invariant ops for every layer kind
    mtp:             how its multi-token-prediction (MTP) layer is loaded and drafts (`MTPFamily`), or None
                     where its MTP layers are not run (speculative decoding is then refused by name)
    tensor_split:    (config, `parallel.Sharding`) -> a rule (checkpoint tensor name -> the dim a rank
                     reads an even share of, or None for a tensor it reads whole), after checking the
                     config divides (ValueError naming the field); None: the family cannot be
                     sharded yet (`mla_func.parallel`)
    expert_parallel_params: (config, fetch, *, rank, ranks, dtype, device, progress, max_model_len)
                     -> the params of an expert-parallel rank (whole routed experts, E / ranks of them;
                     `fetch` reads the rank's shard by `tensor_split`); None: not supported
    quant_layout:    (config, config.json dict, its label) -> which checkpoint tensors are stored quantized
                     and how (`checkpoint.quant_layout.QuantLayout`), or None for float weights;
                     CheckpointError naming a bad field. None: the FP8 layout of `checkpoint.fp8`
                     (`checkpoint.fp8_pairs.released_fp8_layout`)
    fp8_cache_layer_kinds: config -> the layer kinds whose caches hold FP8 latents
                     (`init_state(kv_cache_dtype="fp8")`, `kernels.latent_cache.FP8LatentCache`); they
                     differ from `layer_kinds`' in the cache they make only, so the forward runs either
                     state. None: the family has no FP8 cache (refused by name)
    """

    name: str
    title: str
    model_types: tuple[str, ...]
    config_from_hf: Callable[[Mapping[str, Any], Family], ModelConfig]
    config_to_hf: Callable[[ModelConfig], dict[str, Any]]
    validate: Callable[[ModelConfig], None]
    validate_routing: Callable[[ModelConfig, int], None]
    dense_mlp: bool
    layer_kinds: Callable[[ModelConfig], tuple[LayerKind, ...]]
    cache_groups: Callable[[ModelConfig, CacheGroup], tuple[CacheGroup, ...]]
    tensor_shapes: Callable[[ModelConfig], dict[str, tuple[int, ...]]]
    tensor_count: Callable[[ModelConfig], int]
    canonical_names: Callable[[ModelConfig, dict[str, Any], object], dict[str, Any]]
    checkpoint_dtype: Callable[[str, str, TensorEntry, torch.dtype], torch.dtype]
    held_dtype: Callable[[str, torch.dtype], torch.dtype]
    params_from_hf: Callable[..., Params]
    with_max_positions: Callable[[Params, int], Params]
    rope_table_pairs: Callable[[ModelConfig], int]
    attends_by_row: bool
    supports_batch_invariant: bool
    mtp: MTPFamily | None
    tensor_split: Callable[[ModelConfig, Sharding], Callable[[str], int | None]] | None = None
    expert_parallel_params: Callable[..., Params] | None = None
    quant_layout: Callable[[ModelConfig, Mapping[str, Any], str], QuantLayout | None] | None = None
    fp8_cache_layer_kinds: Callable[[ModelConfig], tuple[LayerKind, ...]] | None = None

    def __repr__(self) -> str:
        # The functions' reprs would drown every config's.
        return f"Family({self.name!r})"
