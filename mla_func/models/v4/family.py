"""The V4 family: DeepSeek-V4 (model_type deepseek_v4), as a `Family`.

Sliding-window, CSA and HCA layers with hyper-connections (`layers`), whose
compressed entries live in cache groups past the token group; V4's own config
fields (`config`, `config_hf`, and `config_released` for DeepSeek's config.json
spellings), params and checkpoint names (`params`, `params_load`), its released
FP8 / FP4 layout (`quant_layout`) and its multi-token-prediction layer (`mtp`), all in this
folder. Its batch-invariant ops are the invariant tables' (`kernels.reference.v4_invariant`,
`kernels.triton.v4_invariant`).
"""

from __future__ import annotations

from mla_func.core.config import ModelConfig
from mla_func.core.family import Family
from mla_func.models.v4.config import SLIDING, v4_fields, validate_v4_config, validate_v4_routing
from mla_func.models.v4.config_hf import v4_config_from_hf_dict, v4_config_to_hf_dict
from mla_func.models.v4.layers import v4_cache_groups, v4_fp8_cache_layer_kinds, v4_layer_kinds
from mla_func.models.v4.mtp import V4_MTP
from mla_func.models.v4.params import canonical_names, checkpoint_dtype, v4_held_dtype, v4_tensor_count, v4_tensor_shapes
from mla_func.models.v4.params_load import v4_params_from_hf, v4_with_max_positions
from mla_func.models.v4.quant_layout import v4_quant_layout
from mla_func.models.v4.expert_shard import v4_expert_parallel_params
from mla_func.models.v4.shard import v4_tensor_split
from mla_func.state.layer_cache import CacheGroup

__all__ = ["V4"]


def _cache_groups(config: ModelConfig, tokens: CacheGroup) -> tuple[CacheGroup, ...]:
    return v4_cache_groups(v4_fields(config), tokens)


def _rope_table_pairs(config: ModelConfig) -> int:
    # CSA and HCA layers (and their compressors and indexer), the MTP layer's too, share a second pair:
    # their own rope.
    return 1 if all(kind == SLIDING for kind in v4_fields(config).attention_types) else 2


V4 = Family(
    name="v4",
    title="DeepSeek-V4",
    model_types=("deepseek_v4",),
    config_from_hf=v4_config_from_hf_dict,
    config_to_hf=v4_config_to_hf_dict,
    validate=validate_v4_config,
    validate_routing=validate_v4_routing,
    dense_mlp=False,
    layer_kinds=v4_layer_kinds,
    cache_groups=_cache_groups,
    tensor_shapes=v4_tensor_shapes,
    tensor_count=v4_tensor_count,
    canonical_names=canonical_names,
    checkpoint_dtype=checkpoint_dtype,
    held_dtype=v4_held_dtype,
    params_from_hf=v4_params_from_hf,
    with_max_positions=v4_with_max_positions,
    rope_table_pairs=_rope_table_pairs,
    attends_by_row=True,
    supports_batch_invariant=True,
    mtp=V4_MTP,
    quant_layout=v4_quant_layout,
    tensor_split=v4_tensor_split,
    expert_parallel_params=v4_expert_parallel_params,
    fp8_cache_layer_kinds=v4_fp8_cache_layer_kinds,
)
