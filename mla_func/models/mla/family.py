"""The MLA family: DeepSeek-V2 and V3 (model_type deepseek_v2, deepseek_v3), as a `Family`.

Every layer is an MLA decoder layer (`layer.MLA_DECODER`) over one latent cache
group; params, checkpoint names and config.json are V2/V3's (`params`,
`tensor_shapes`, `config_hf` in this folder). V3.2 (`models.dsa.family`) reuses the
pieces here that it shares.
"""

from __future__ import annotations

from typing import Any

import torch

from mla_func.checkpoint.safetensors_file import TensorEntry, load_dtype
from mla_func.core.config import ModelConfig, refuse, validate_no_indexer, validate_v3_routing
from mla_func.core.family import Family
from mla_func.core.layers import LayerKind
from mla_func.models.mla.config_hf import config_from_hf_dict, config_to_hf_dict
from mla_func.models.mla.layer import MLA_DECODER, MLA_DECODER_FP8
from mla_func.models.mla.params import held_dtype, mla_params_from_hf, mla_with_max_positions
from mla_func.models.mla.expert_shard import mla_expert_parallel_params
from mla_func.models.mla.shard import mla_tensor_split
from mla_func.models.mtp.layer import mla_mtp
from mla_func.models.mla.tensor_shapes import mla_tensor_count, mla_tensor_shapes
from mla_func.state.layer_cache import CacheGroup

__all__ = ["MLA", "names_as_stored", "no_extra_groups", "one_rope_table_pair", "refuse_family_fields", "weight_dtype"]


def refuse_family_fields(c: ModelConfig) -> None:
    """A config of this family has no fields of its own (`family_fields` unset): V4's belong to V4 configs."""
    if c.family_fields is not None:
        raise refuse("model_type", c.model_type, "a deepseek_v4 config, and only one, carries V4's fields (family_fields)")


def _validate(c: ModelConfig) -> None:
    refuse_family_fields(c)
    validate_no_indexer(c)


def _layer_kinds(config: ModelConfig) -> tuple[LayerKind, ...]:
    return (MLA_DECODER,) * config.num_hidden_layers


def _fp8_cache_layer_kinds(config: ModelConfig) -> tuple[LayerKind, ...]:
    return (MLA_DECODER_FP8,) * config.num_hidden_layers


def no_extra_groups(config: ModelConfig, tokens: CacheGroup) -> tuple[CacheGroup, ...]:
    """Layers that cache only in the token group add none."""
    return ()


def names_as_stored(config: ModelConfig, located: dict[str, Any], where: object) -> dict[str, Any]:
    """A checkpoint whose tensors are stored under the names `tensor_shapes` lists."""
    return located


def weight_dtype(name: str, label: str, entry: TensorEntry, model_dtype: torch.dtype) -> torch.dtype:
    """Every tensor is a floating-point weight, read as `load_dtype` decides."""
    return load_dtype(label, entry, model_dtype)


def one_rope_table_pair(config: ModelConfig) -> int:
    """Every layer rotates with the model's one rope."""
    return 1


MLA = Family(
    name="mla",
    title="DeepSeek-V2/V3",
    model_types=("deepseek_v2", "deepseek_v3"),
    config_from_hf=config_from_hf_dict,
    config_to_hf=config_to_hf_dict,
    validate=_validate,
    validate_routing=validate_v3_routing,
    dense_mlp=True,
    layer_kinds=_layer_kinds,
    cache_groups=no_extra_groups,
    tensor_shapes=mla_tensor_shapes,
    tensor_count=mla_tensor_count,
    canonical_names=names_as_stored,
    checkpoint_dtype=weight_dtype,
    held_dtype=held_dtype,
    params_from_hf=mla_params_from_hf,
    with_max_positions=mla_with_max_positions,
    rope_table_pairs=one_rope_table_pair,
    attends_by_row=False,
    supports_batch_invariant=True,
    mtp=mla_mtp(MLA_DECODER),
    tensor_split=mla_tensor_split,
    expert_parallel_params=mla_expert_parallel_params,
    fp8_cache_layer_kinds=_fp8_cache_layer_kinds,
)
