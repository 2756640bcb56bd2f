"""Hugging Face config.json <-> ModelConfig, for DeepSeek-V2/V3 and V3.2 (the MLA and DSA families).

The reader checks what JSON can get wrong (a missing field, a string where a
number belongs, an object that is a list); `ModelConfig` checks every value's
type and range on construction. Either raises `ConfigError` naming the field;
`families.read_config` adds the file.
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from mla_func.checkpoint.files import CheckpointError
from mla_func.checkpoint.fp8 import block_size
from mla_func.core.config import ModelConfig, RopeConfig, is_int, refuse
from mla_func.core.config_fields import as_float, at_most, check_entries

if TYPE_CHECKING:
    from mla_func.core.family import Family

# Fields that carry no meaning for inference (training knobs, bookkeeping, values
# derived from other fields). Anything neither read nor listed here is reported.
_IGNORED_FIELDS = frozenset({
    "architectures", "auto_map", "model_type", "transformers_version", "dtype", "torch_dtype",
    "initializer_range", "use_cache", "pad_token_id", "bos_token_id", "pretraining_tp",
    "head_dim", "qk_head_dim", "num_nextn_predict_layers", "ep_size", "aux_loss_alpha", "seq_aux",
    "output_router_logits", "router_aux_loss_coef", "attention_dropout", "return_dict",
    "output_hidden_states", "output_attentions", "tie_encoder_decoder", "is_encoder_decoder",
    "id2label", "label2id", "problem_type", "chunk_size_feed_forward", "name_or_path",
    "_name_or_path", "use_return_dict", "base_model_tp_plan", "base_model_pp_plan", "base_model_ep_plan",
})

_READ_FIELDS = frozenset({
    "vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
    "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim", "intermediate_size",
    "q_lora_rank", "n_routed_experts", "num_experts_per_tok", "n_shared_experts", "moe_intermediate_size",
    "first_k_dense_replace", "moe_layer_freq", "routed_scaling_factor", "norm_topk_prob", "scoring_func",
    "topk_method", "n_group", "topk_group", "rope_parameters", "rope_scaling", "rope_theta",
    "rope_interleave", "max_position_embeddings", "rms_norm_eps", "tie_word_embeddings", "eos_token_id",
    "hidden_act", "attention_bias", "mlp_bias", "quantization_config", "sliding_window", "use_sliding_window",
    "index_n_heads", "index_head_dim", "index_topk", "layer_types", "mlp_layer_types",
})

_REQUIRED = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "kv_lora_rank",
             "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim", "intermediate_size")


def _or_default(raw: Mapping[str, Any], name: str, default: Any) -> Any:
    """The field, or `default` when it is absent or null."""
    value = raw.get(name)
    return default if value is None else value


def _mapping(name: str, value: Any) -> Mapping[str, Any]:
    if not isinstance(value, Mapping):
        raise refuse(name, value, "must be a JSON object")
    return value


def _rope_from_hf(raw: Mapping[str, Any]) -> RopeConfig:
    if raw.get("rope_parameters") is not None:
        params = dict(_mapping("rope_parameters", raw["rope_parameters"]))
    else:
        # Configs written before rope_parameters: rope_theta beside an optional rope_scaling.
        params = dict(_mapping("rope_scaling", raw.get("rope_scaling") or {}))
        params.setdefault("rope_theta", raw.get("rope_theta", 10000.0))
        if "type" in params and "rope_type" not in params:
            params["rope_type"] = params.pop("type")
    kind = params.get("rope_type", "default")
    theta = as_float(_or_default(params, "rope_theta", raw.get("rope_theta", 10000.0)))
    if kind == "default":
        return RopeConfig(theta=theta)
    if kind != "yarn":
        raise refuse("rope_parameters.rope_type", kind, "expected 'default' or 'yarn'")
    if params.get("partial_rotary_factor", 1.0) != 1.0:
        raise refuse("rope_parameters.partial_rotary_factor", params["partial_rotary_factor"], "only 1.0 is supported")
    original = params.get("original_max_position_embeddings")
    factor = params.get("factor")
    if factor is None:
        maximum = raw.get("max_position_embeddings")
        if not (isinstance(original, int) and is_int(original) and original >= 1 and isinstance(maximum, int)):
            raise refuse("rope_parameters.factor", None,
                         "YaRN needs it, or integer max_position_embeddings and original_max_position_embeddings")
        factor = as_float(maximum) / original
    return RopeConfig(
        theta=theta,
        kind="yarn",
        factor=as_float(factor),
        original_max_position_embeddings=original,
        beta_fast=as_float(_or_default(params, "beta_fast", 32.0)),
        beta_slow=as_float(_or_default(params, "beta_slow", 1.0)),
        mscale=as_float(params.get("mscale")),
        mscale_all_dim=as_float(params.get("mscale_all_dim")),
        attention_factor=as_float(params.get("attention_factor")),
        truncate=_or_default(params, "truncate", True),
    )


def _eos_ids(value: Any) -> Any:
    if value is None:
        return ()
    if isinstance(value, (list, tuple)):
        return tuple(value)
    return (value,)


def _refuse_unsupported(raw: Mapping[str, Any]) -> None:
    if raw.get("hidden_act", "silu") != "silu":
        raise refuse("hidden_act", raw["hidden_act"], "only 'silu' is supported")
    for flag in ("attention_bias", "mlp_bias", "use_sliding_window"):
        if raw.get(flag):
            raise refuse(flag, raw[flag], "not supported (must be false)")
    if raw.get("sliding_window") is not None and raw.get("use_sliding_window", True):
        raise refuse("sliding_window", raw["sliding_window"], "not supported")
    try:
        # DeepSeek's block-scaled FP8 (its released checkpoints' layout) loads as it ships; nothing else does.
        block_size(raw)
    except CheckpointError as e:
        raise refuse("quantization_config", raw.get("quantization_config"),
                     f"only the block-scaled FP8 format of DeepSeek's checkpoints is supported ({e})") from None


# What transformers names the sparse-attention layer in config.json (its name changed once).
_DSA_LAYER_NAMES = ("indexed_attention", "deepseek_sparse_attention")


def _refuse_unsupported_v32(raw: Mapping[str, Any]) -> None:
    """What DeepSeek-V3.2's config can say that mla-func does not run (or that changes the math unseen)."""
    for name in ("index_n_heads", "index_head_dim", "index_topk"):
        if raw.get(name) is None:
            raise refuse(name, None, "missing (required for deepseek_v32)")
    # V3.2's router is sigmoid scores with noaux_tc groups whatever these say; only the agreeing value is read.
    for name, value in (("scoring_func", "sigmoid"), ("topk_method", "noaux_tc")):
        if raw.get(name, value) != value:
            raise refuse(name, raw[name], f"deepseek_v32 routes with {value!r} only")
    layers = raw.get("num_hidden_layers")
    if raw.get("layer_types") is not None and is_int(layers):  # a bad num_hidden_layers is named by ModelConfig
        # Only sparse attention: every V3.2 layer has an indexer.
        check_entries("layer_types", raw["layer_types"], _DSA_LAYER_NAMES, layers)
    mlp_kinds, first = raw.get("mlp_layer_types"), _or_default(raw, "first_k_dense_replace", 0)
    if mlp_kinds is not None and is_int(layers) and is_int(first):
        dense = min(first, layers)
        if mlp_kinds != ["dense"] * dense + ["sparse"] * (layers - dense):
            raise refuse("mlp_layer_types", mlp_kinds,
                         f"only dense layers before first_k_dense_replace={dense} and MoE layers after are supported")


def config_from_hf_dict(raw: Mapping[str, Any], family: Family) -> ModelConfig:
    """Read a Hugging Face config.json dict of `family` (model_type deepseek_v2, deepseek_v3 or deepseek_v32)."""
    model_type = raw["model_type"]  # `families.config_from_hf_dict` picked this family by it
    _refuse_unsupported(raw)
    is_v32 = model_type == "deepseek_v32"
    if is_v32:
        _refuse_unsupported_v32(raw)
    for name in _REQUIRED:
        if name not in raw:
            raise refuse(name, None, "missing (required)")
    heads = raw["num_attention_heads"]
    kv_heads = _or_default(raw, "num_key_value_heads", heads)
    if kv_heads != heads:
        raise refuse("num_key_value_heads", kv_heads, f"MLA has one latent per token: must equal num_attention_heads={heads}")
    if model_type == "deepseek_v2" and raw.get("rope_interleave") is False:
        raise refuse("rope_interleave", False, "DeepSeek-V2 always rotates interleaved pairs")

    unknown = sorted(str(name) for name in set(raw) - _READ_FIELDS - _IGNORED_FIELDS)
    if unknown:
        warnings.warn(f"config.json fields not used by mla-func: {unknown}", stacklevel=3)

    is_v3 = model_type in ("deepseek_v3", "deepseek_v32")
    max_positions = _or_default(raw, "max_position_embeddings", 4096)
    return ModelConfig(
        family=family,
        model_type=model_type,
        **{name: raw[name] for name in _REQUIRED},
        q_lora_rank=raw.get("q_lora_rank"),
        n_routed_experts=raw.get("n_routed_experts"),
        num_experts_per_tok=_or_default(raw, "num_experts_per_tok", 1),
        n_shared_experts=_or_default(raw, "n_shared_experts", 0),
        moe_intermediate_size=_or_default(raw, "moe_intermediate_size", 0),
        first_k_dense_replace=_or_default(raw, "first_k_dense_replace", 0),
        moe_layer_freq=_or_default(raw, "moe_layer_freq", 1),
        routed_scaling_factor=as_float(_or_default(raw, "routed_scaling_factor", 1.0)),
        norm_topk_prob=_or_default(raw, "norm_topk_prob", is_v32),
        scoring_func=_or_default(raw, "scoring_func", "sigmoid" if is_v3 else "softmax"),
        topk_method=_or_default(raw, "topk_method", "noaux_tc" if is_v3 else "greedy"),
        n_group=raw.get("n_group"),
        topk_group=raw.get("topk_group"),
        rope=_rope_from_hf(raw),
        rope_interleave=_or_default(raw, "rope_interleave", True),
        max_position_embeddings=max_positions,
        rms_norm_eps=as_float(_or_default(raw, "rms_norm_eps", 1e-6)),
        tie_word_embeddings=_or_default(raw, "tie_word_embeddings", False),
        eos_token_ids=_eos_ids(raw.get("eos_token_id")),
        index_n_heads=raw.get("index_n_heads") if is_v32 else None,
        index_head_dim=raw.get("index_head_dim") if is_v32 else None,
        # Clamped for the reason `config._validate_indexer` gives: the same keys, the same logits.
        index_topk=at_most(raw.get("index_topk"), max_positions) if is_v32 else None,
    )


def config_to_hf_dict(c: ModelConfig) -> dict[str, Any]:
    """The config.json dict that `config_from_hf_dict` reads back to an equal config."""
    architecture = {"deepseek_v2": "DeepseekV2ForCausalLM", "deepseek_v3": "DeepseekV3ForCausalLM",
                    "deepseek_v32": "DeepseekV32ForCausalLM"}[c.model_type]
    out: dict[str, Any] = {"architectures": [architecture], "model_type": c.model_type}
    for name in (
        *_REQUIRED, "q_lora_rank", "n_routed_experts", "num_experts_per_tok", "n_shared_experts",
        "moe_intermediate_size", "first_k_dense_replace", "moe_layer_freq", "routed_scaling_factor",
        "norm_topk_prob", "scoring_func", "topk_method", "n_group", "topk_group", "rope_interleave",
        "max_position_embeddings", "rms_norm_eps", "tie_word_embeddings",
    ):
        out[name] = getattr(c, name)
    if c.index_topk is not None:
        out.update(index_n_heads=c.index_n_heads, index_head_dim=c.index_head_dim, index_topk=c.index_topk)
    out["num_key_value_heads"] = c.num_attention_heads
    out["hidden_act"] = "silu"
    rope: dict[str, Any] = {"rope_type": c.rope.kind, "rope_theta": c.rope.theta}
    if c.rope.kind == "yarn":
        rope.update(
            factor=c.rope.factor,
            original_max_position_embeddings=c.rope.original_max_position_embeddings,
            beta_fast=c.rope.beta_fast,
            beta_slow=c.rope.beta_slow,
            truncate=c.rope.truncate,
        )
        for name in ("mscale", "mscale_all_dim", "attention_factor"):
            if getattr(c.rope, name) is not None:
                rope[name] = getattr(c.rope, name)
    out["rope_parameters"] = rope
    if c.eos_token_ids:
        out["eos_token_id"] = list(c.eos_token_ids) if len(c.eos_token_ids) > 1 else c.eos_token_ids[0]
    return out
