"""deepseek_v4 config.json <-> ModelConfig (with its `V4Config`).

DeepSeek's released spellings (`compress_ratios`, `num_hash_layers`, `rope_scaling`, ...) are first
folded into transformers' fields (`config_released`). What mla-func does not run is refused by name
(`refuse_unsupported_v4`); fields it neither reads nor knows to be inert are reported in one warning,
as for V2/V3.
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from mla_func.core.config import ModelConfig, refuse
from mla_func.core.config_fields import as_float
from mla_func.models.v4.config import V4_IGNORED, V4Config, refuse_unsupported_v4, v4_from_hf, v4_to_hf
from mla_func.models.v4.config_released import MTP_RATIO_FIELD, RELEASED_FIELDS, transformers_form

if TYPE_CHECKING:
    from mla_func.core.family import Family

_REQUIRED = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "q_lora_rank",
             "moe_intermediate_size", "n_routed_experts", "num_experts_per_tok")
_READ = frozenset({
    *_REQUIRED, "head_dim", "layer_types", "mlp_layer_types", "compress_rates", "rope_parameters", "sliding_window",
    "hc_mult", "hc_sinkhorn_iters", "hc_eps", "swiglu_limit", "o_groups", "o_lora_rank", "index_n_heads",
    "index_head_dim", "index_topk", "num_nextn_predict_layers", "n_shared_experts", "scoring_func",
    "routed_scaling_factor", "max_position_embeddings", "rms_norm_eps", "tie_word_embeddings", "eos_token_id",
    "quantization_config", "expert_dtype", "topk_method", MTP_RATIO_FIELD, *RELEASED_FIELDS,
})


def _eos(value: Any) -> tuple[Any, ...]:
    if value is None:
        return ()
    return tuple(value) if isinstance(value, (list, tuple)) else (value,)


def v4_config_from_hf_dict(raw: Mapping[str, Any], family: Family) -> ModelConfig:
    """Read a deepseek_v4 config.json dict, in transformers' spelling or DeepSeek's released one, into a
    config of `family` (V4's); ConfigError names the field."""
    unknown = sorted(str(name) for name in set(raw) - _READ - V4_IGNORED)
    raw = transformers_form(raw)
    refuse_unsupported_v4(raw)
    for name in _REQUIRED:
        if raw.get(name) is None:
            raise refuse(name, None, "missing (required for deepseek_v4)")
    max_positions = raw.get("max_position_embeddings", 1048576)
    v4, main_rope, rope_dim = v4_from_hf(raw, max_positions)
    if unknown:
        warnings.warn(f"config.json fields not used by mla-func: {unknown}", stacklevel=3)
    moe_inter = raw["moe_intermediate_size"]
    nope = v4.head_dim - rope_dim
    return ModelConfig(
        family=family,
        model_type="deepseek_v4",
        vocab_size=raw["vocab_size"],
        hidden_size=raw["hidden_size"],
        num_hidden_layers=raw["num_hidden_layers"],
        num_attention_heads=raw["num_attention_heads"],
        kv_lora_rank=nope,
        qk_nope_head_dim=nope,
        qk_rope_head_dim=rope_dim,
        v_head_dim=v4.head_dim,
        # The shared expert's width (V4 has no dense layers).
        intermediate_size=moe_inter,
        q_lora_rank=raw["q_lora_rank"],
        n_routed_experts=raw["n_routed_experts"],
        num_experts_per_tok=raw["num_experts_per_tok"],
        n_shared_experts=raw.get("n_shared_experts", 1),
        moe_intermediate_size=moe_inter,
        routed_scaling_factor=as_float(raw.get("routed_scaling_factor", 1.5)),
        # V4 always normalises the chosen experts' weights.
        norm_topk_prob=True,
        scoring_func=raw.get("scoring_func", "sqrtsoftplus"),
        rope=main_rope,
        rope_interleave=True,
        max_position_embeddings=max_positions,
        rms_norm_eps=as_float(raw.get("rms_norm_eps", 1e-6)),
        tie_word_embeddings=raw.get("tie_word_embeddings", False),
        eos_token_ids=_eos(raw.get("eos_token_id")),
        family_fields=v4,
    )


def v4_config_to_hf_dict(c: ModelConfig) -> dict[str, Any]:
    """The config.json dict that `v4_config_from_hf_dict` reads back to an equal config."""
    if not isinstance(c.family_fields, V4Config):
        raise refuse("model_type", c.model_type, "not a deepseek_v4 config")
    out: dict[str, Any] = {"architectures": ["DeepseekV4ForCausalLM"], "model_type": "deepseek_v4"}
    for name in (*_REQUIRED, "n_shared_experts", "routed_scaling_factor", "scoring_func", "max_position_embeddings",
                 "rms_norm_eps", "tie_word_embeddings"):
        out[name] = getattr(c, name)
    out.update(v4_to_hf(c.family_fields, c.rope, c.qk_rope_head_dim))
    out["hidden_act"] = "silu"
    if c.eos_token_ids:
        out["eos_token_id"] = list(c.eos_token_ids) if len(c.eos_token_ids) > 1 else c.eos_token_ids[0]
    return out
