"""DeepSeek-V4's configuration: the fields V2/V3 do not have, and their Hugging Face config.json form.

A V4 model is a `ModelConfig` whose `family_fields` hold a `V4Config`. The shared
fields keep their meaning where V4 has one (hidden_size, heads, q_lora_rank,
experts, `rope` = the "main" rope of sliding-window layers); the MLA fields are
derived from V4's single shared-KV head: `qk_rope_head_dim` is the rotated
slice, `qk_nope_head_dim = kv_lora_rank = head_dim - qk_rope_head_dim` and
`v_head_dim = head_dim`, so `kv_cache_dim` and `qk_head_dim` are `head_dim`.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from mla_func.core.config import V4_SCORING_FUNCS, ConfigError, FamilyFields, ModelConfig, RopeConfig, is_number, refuse
from mla_func.checkpoint.files import CheckpointError
from mla_func.core.config_fields import (as_float, at_most, check_choice, check_entries, check_int, check_positive,
                                          is_int)
from mla_func.models.v4.quantization_config import v4_quantization

__all__ = ["ATTENTION_TYPES", "CSA", "HCA", "MAX_SINKHORN_ITERS", "MLP_TYPES", "SLIDING", "V4Config",
           "V4_IGNORED", "V4_SCORING_FUNCS", "refuse_unsupported_v4", "rope_block", "v4_from_hf", "v4_to_hf",
           "validate_v4", "v4_fields", "validate_v4_config", "validate_v4_routing"]

SLIDING = "sliding_attention"
CSA = "compressed_sparse_attention"
HCA = "heavily_compressed_attention"
ATTENTION_TYPES = (SLIDING, CSA, HCA)
MLP_TYPES = ("hash_moe", "moe")

# Sinkhorn normalisation of each token's hc_mult x hc_mult mixing matrix runs hc_sinkhorn_iters
# passes at every hyper-connection site (two a layer) of every step, one after another: the count
# is a loop bound, and 10**9 hung the first step. A model must run with the count it was trained
# with, and DeepSeek-V4 uses 20; 1000, fifty times that, leaves room for models trained with more
# while bounding the cost (on one CPU thread, a 4-layer test model's step took 0.12 s at 1000
# passes against 0.01 s at 20).
MAX_SINKHORN_ITERS = 1000


@dataclass(frozen=True, slots=True)
class V4Config(FamilyFields):
    """What DeepSeek-V4 adds to a `ModelConfig` (names as in config.json).

    layer_types:     per layer, one of ATTENTION_TYPES (every layer has a sliding window;
                     CSA and HCA layers add compressed entries)
    mlp_layer_types: per layer, "hash_moe" (experts from the token id, `tid2eid`) or "moe"
    csa_rate, hca_rate: tokens pooled into one compressed entry (compress_rates)
    compress_rope:   the rope of CSA/HCA layers, their compressors and the indexer
    mtp_compress_ratio: tokens pooled into one compressed entry by the first multi-token-prediction
                     (MTP) layer: 0 (the default, for configs that give none) a sliding-window layer,
                     csa_rate a CSA layer, hca_rate an HCA layer (`mtp_layer_type`). DeepSeek's released
                     configs give it as compress_ratios[num_hidden_layers] (`config_released`).
    """

    head_dim: int
    layer_types: tuple[str, ...]
    mlp_layer_types: tuple[str, ...]
    csa_rate: int
    hca_rate: int
    sliding_window: int
    hc_mult: int
    hc_sinkhorn_iters: int
    hc_eps: float
    swiglu_limit: float
    o_groups: int
    o_lora_rank: int
    index_n_heads: int
    index_head_dim: int
    index_topk: int
    num_nextn_predict_layers: int = 0
    compress_rope: RopeConfig = field(default_factory=RopeConfig)
    mtp_compress_ratio: int = 0

    def rate(self, layer_type: str) -> int:
        """Tokens per compressed entry of a CSA or HCA layer."""
        if layer_type == CSA:
            return self.csa_rate
        if layer_type == HCA:
            return self.hca_rate
        raise ValueError(f"rate: {layer_type!r} layers have no compressor")

    @property
    def mtp_layer_type(self) -> str:
        """The attention type of the first MTP layer, one of ATTENTION_TYPES, from `mtp_compress_ratio`
        (ValueError for a ratio that is neither 0 nor a rate: `validate_v4` refuses it by name)."""
        if self.mtp_compress_ratio == 0:
            return SLIDING
        kinds = [kind for kind in (CSA, HCA) if self.rate(kind) == self.mtp_compress_ratio]
        if len(kinds) != 1:
            raise ValueError(f"mtp_layer_type: mtp_compress_ratio {self.mtp_compress_ratio} names no one layer type "
                             f"(csa_rate {self.csa_rate}, hca_rate {self.hca_rate})")
        return kinds[0]

    @property
    def attention_types(self) -> tuple[str, ...]:
        """The attention types of the layers a model of these fields can run: the decoder layers', then the
        first MTP layer's (a drafter's caches live in the target's state geometry). A config that names a
        compressing MTP layer is taken at its word even where num_nextn_predict_layers says 0, since
        `load_model(..., mtp=True)` reads the layer whatever that count says."""
        return (*self.layer_types, self.mtp_layer_type)


def v4_fields(config: ModelConfig) -> V4Config:
    """DeepSeek-V4's own fields (`config.family_fields`); ValueError for a config of another family."""
    fields = config.family_fields
    if not isinstance(fields, V4Config):
        raise ValueError(f"expected a deepseek_v4 config, got model_type {config.model_type!r}")
    return fields


def validate_v4_config(c: ModelConfig) -> None:
    """The V4 family's own checks (`Family.validate`): a V4 config, and only one, carries `V4Config` fields."""
    if not isinstance(c.family_fields, V4Config):
        raise refuse("model_type", c.model_type, "a deepseek_v4 config, and only one, carries V4's fields (family_fields)")
    validate_v4(c.family_fields, num_layers=c.num_hidden_layers, num_heads=c.num_attention_heads, rope_dim=c.qk_rope_head_dim,
                max_positions=c.max_position_embeddings)


def validate_v4_routing(c: ModelConfig, experts: int) -> None:
    """What V4's MoE (`hash_moe.route`) fixes whatever the config says: a value that would be ignored is refused."""
    check_choice("scoring_func", c.scoring_func, V4_SCORING_FUNCS)
    if c.topk_method != "greedy":
        raise refuse("topk_method", c.topk_method, "DeepSeek-V4 takes the top-k over all experts: must be 'greedy'")
    for name in ("n_group", "topk_group"):
        if getattr(c, name) is not None:
            raise refuse(name, getattr(c, name), "DeepSeek-V4 routes without expert groups: must be null")
    if c.norm_topk_prob is not True:
        raise refuse("norm_topk_prob", c.norm_topk_prob,
                     "DeepSeek-V4 always normalises the chosen weights: must be true")
    if c.n_shared_experts != 1:
        # The reference builds exactly one shared expert of moe_intermediate_size, whatever this says.
        raise refuse("n_shared_experts", c.n_shared_experts, "DeepSeek-V4 has exactly one shared expert: must be 1")
    if c.first_k_dense_replace != 0:
        raise refuse("first_k_dense_replace", c.first_k_dense_replace,
                     "every DeepSeek-V4 layer is an MoE layer (mlp_layer_types): must be 0")
    if c.intermediate_size != c.moe_intermediate_size:
        raise refuse("intermediate_size", c.intermediate_size, "DeepSeek-V4 has no dense MLP: must equal "
                     f"moe_intermediate_size={c.moe_intermediate_size}, its shared expert's width")



def validate_v4(v: V4Config, *, num_layers: int, num_heads: int, rope_dim: int, max_positions: int) -> None:
    """Check every V4 field's type and range against the shared fields; ConfigError names the field.

    (V4's MoE fields are the shared `ModelConfig` ones, checked with V2/V3's by `config`.)
    """
    check_entries("layer_types", v.layer_types, ATTENTION_TYPES, num_layers)
    check_entries("mlp_layer_types", v.mlp_layer_types, MLP_TYPES, num_layers)
    for name in ("head_dim", "hc_mult", "o_groups", "o_lora_rank", "index_n_heads", "index_head_dim", "index_topk"):
        check_int(name, getattr(v, name), 1)
    check_int(f"compress_rates.{CSA}", v.csa_rate, 1)
    check_int(f"compress_rates.{HCA}", v.hca_rate, 1)
    # The window's keys are positions [p - sliding_window + 1, p] of a sequence of at most
    # max_position_embeddings tokens, so a longer window sees nothing more; the attention op builds
    # [rows, sliding_window] offsets, so 10**12 asked for 8 TB. The config.json reader clamps it
    # (`v4_from_hf`); a config built here is refused instead of silently changed.
    check_int("sliding_window", v.sliding_window, 1, max_positions, why="max_position_embeddings")
    check_int("hc_sinkhorn_iters", v.hc_sinkhorn_iters, 1, MAX_SINKHORN_ITERS)
    check_int("num_nextn_predict_layers", v.num_nextn_predict_layers, 0)
    _check_mtp_compress_ratio(v)
    check_positive("hc_eps", v.hc_eps)
    check_positive("swiglu_limit", v.swiglu_limit)
    if num_heads % v.o_groups:
        raise refuse("o_groups", v.o_groups, f"must divide num_attention_heads={num_heads}")
    if not rope_dim < v.head_dim:
        raise refuse("partial_rotary_factor", rope_dim / v.head_dim,
                     f"must leave a non-rotated part of head_dim={v.head_dim} (rotated: {rope_dim})")
    if CSA in v.attention_types and v.index_head_dim < rope_dim:
        raise refuse("index_head_dim", v.index_head_dim, f"the indexer rotates {rope_dim} channels: must be >= that")


def _check_mtp_compress_ratio(v: V4Config) -> None:
    """mtp_compress_ratio is 0 or exactly one of the two rates: it says the MTP layer's type by its rate."""
    ratio = v.mtp_compress_ratio
    allowed = sorted({0, v.csa_rate, v.hca_rate})
    if not is_int(ratio) or ratio not in allowed:
        raise refuse("mtp_compress_ratio", ratio, f"expected one of {allowed} (0: sliding window only, "
                     f"compress_rates.{CSA}={v.csa_rate}: CSA, compress_rates.{HCA}={v.hca_rate}: HCA)")
    if ratio and v.csa_rate == v.hca_rate:
        raise refuse("mtp_compress_ratio", ratio, f"names no one layer type: compress_rates.{CSA} and "
                     f"compress_rates.{HCA} are both {ratio}")


def rope_block(name: str, raw: Any, theta_default: float) -> tuple[RopeConfig, Any]:
    """One of V4's two rope blocks (config field `name`) -> (RopeConfig, its partial_rotary_factor as read:
    checked by `v4_from_hf`); ConfigError naming `name` for a block that is not an object or of another rope_type."""
    if not isinstance(raw, Mapping):
        raise refuse(name, raw, "must be a JSON object")
    kind = raw.get("rope_type", raw.get("type", "default"))
    theta = raw.get("rope_theta", theta_default)
    partial = raw.get("partial_rotary_factor", 1.0)
    if kind == "default":
        return RopeConfig(theta=as_float(theta)), partial
    if kind != "yarn":
        raise refuse(f"{name}.rope_type", kind, "expected 'default' or 'yarn'")

    def num(key: str, default: Any) -> Any:
        return as_float(raw.get(key, default))

    return RopeConfig(
        theta=as_float(theta), kind="yarn", factor=num("factor", None),
        original_max_position_embeddings=raw.get("original_max_position_embeddings"),
        beta_fast=num("beta_fast", 32.0), beta_slow=num("beta_slow", 1.0), mscale=num("mscale", None),
        mscale_all_dim=num("mscale_all_dim", None), attention_factor=num("attention_factor", None),
        truncate=raw.get("truncate", True),
    ), partial


# Fields V4 configs carry that inference does not read (training knobs, bookkeeping).
V4_IGNORED = frozenset({
    "architectures", "model_type", "transformers_version", "dtype", "torch_dtype", "initializer_range", "use_cache",
    "pad_token_id", "bos_token_id", "output_router_logits", "router_aux_loss_coef", "router_jitter_noise",
    "attention_dropout", "rope_theta", "compress_rope_theta", "partial_rotary_factor", "qk_rope_head_dim",
    "return_dict", "output_hidden_states", "output_attentions", "tie_encoder_decoder", "is_encoder_decoder",
    "id2label", "label2id", "problem_type", "chunk_size_feed_forward", "name_or_path", "_name_or_path",
    "num_key_value_heads", "hidden_act", "attention_bias", "mlp_bias", "norm_topk_prob",
})


def refuse_unsupported_v4(raw: Mapping[str, Any]) -> None:
    """Raise ConfigError for what mla-func does not run, naming the field."""
    if raw.get("hidden_act", "silu") != "silu":
        raise refuse("hidden_act", raw["hidden_act"], "only 'silu' is supported")
    for flag in ("attention_bias", "mlp_bias"):
        if raw.get(flag):
            raise refuse(flag, raw[flag], "not supported (must be false)")
    if raw.get("num_key_value_heads", 1) != 1:
        raise refuse("num_key_value_heads", raw["num_key_value_heads"], "DeepSeek-V4 shares one KV head: must be 1")
    try:
        # DeepSeek-V4's released layout (FP8 linears, FP4 or FP8 routed experts) loads as it ships.
        v4_quantization(raw)
    except CheckpointError as e:
        field = "expert_dtype" if "expert_dtype" in str(e) else "quantization_config"
        raise refuse(field, raw.get(field, raw.get("quantization_config")), str(e)) from None
    if raw.get("topk_method", "noaux_tc") != "noaux_tc":
        # DeepSeek's released configs say "noaux_tc": score layers pick the top-k of all experts by score plus
        # e_score_correction_bias, which is what `hash_moe.route` does (transformers reads no topk_method).
        raise refuse("topk_method", raw["topk_method"], "DeepSeek-V4 routes by 'noaux_tc' (bias-corrected top-k "
                     "over all experts): must be 'noaux_tc' or absent")


def v4_from_hf(raw: Mapping[str, Any], max_positions: Any) -> tuple[V4Config, RopeConfig, int]:
    """(V4Config, the main rope, qk_rope_head_dim) from a deepseek_v4 config.json dict whose
    max_position_embeddings is `max_positions` (as read: checked later, by `ModelConfig`)."""
    for name in ("head_dim", "layer_types", "mlp_layer_types", "compress_rates", "rope_parameters"):
        if raw.get(name) is None:
            raise refuse(name, None, "missing (required for deepseek_v4)")
    rates = raw["compress_rates"]
    if not isinstance(rates, Mapping):
        raise refuse("compress_rates", rates, "must be a JSON object of layer type -> rate")
    unknown_rates = sorted(str(key) for key in set(rates) - {CSA, HCA})
    if unknown_rates:
        raise refuse("compress_rates", unknown_rates, f"keys must be {CSA!r} or {HCA!r}")
    ropes = raw["rope_parameters"]
    if not isinstance(ropes, Mapping) or not isinstance(ropes.get("main"), Mapping) \
            or not isinstance(ropes.get("compress"), Mapping):
        raise refuse("rope_parameters", ropes, "expected an object with 'main' and 'compress' rope blocks")
    main, main_partial = rope_block("rope_parameters.main", ropes["main"], raw.get("rope_theta", 10000.0))
    if main.kind != "default":
        raise refuse("rope_parameters.main.rope_type", main.kind, "sliding-window layers use plain rope ('default')")
    compress, compress_partial = rope_block("rope_parameters.compress", ropes["compress"],
                                            raw.get("compress_rope_theta", 160000.0))
    if main_partial != compress_partial:
        raise refuse("rope_parameters.compress.partial_rotary_factor", compress_partial,
                     f"must equal the main rope's {main_partial}")
    check_int("head_dim", raw["head_dim"], 1)
    head_dim: int = raw["head_dim"]
    rope_dim = head_dim * main_partial if is_number(main_partial) else -1
    if not (math.isfinite(rope_dim) and rope_dim == int(rope_dim) and int(rope_dim) >= 2 and int(rope_dim) % 2 == 0):
        raise refuse("partial_rotary_factor", main_partial, f"must rotate an even number of head_dim={head_dim} channels")
    if int(rope_dim) >= head_dim:
        raise refuse("partial_rotary_factor", main_partial, f"must leave a non-rotated part of head_dim={head_dim}")
    for name in ("layer_types", "mlp_layer_types"):
        if not isinstance(raw[name], list):
            raise refuse(name, raw[name], "must be a list")
    v4 = V4Config(
        head_dim=head_dim,
        layer_types=tuple(raw["layer_types"]),
        mlp_layer_types=tuple(raw["mlp_layer_types"]),
        csa_rate=rates.get(CSA, 4),
        hca_rate=rates.get(HCA, 128),
        # Clamped for the reason `validate_v4` gives: the same keys, the same logits, no 8 TB request.
        sliding_window=at_most(raw.get("sliding_window", 128), max_positions),
        hc_mult=raw.get("hc_mult", 4),
        hc_sinkhorn_iters=raw.get("hc_sinkhorn_iters", 20),
        hc_eps=as_float(raw.get("hc_eps", 1e-6)),
        swiglu_limit=as_float(raw.get("swiglu_limit", 10.0)),
        o_groups=raw.get("o_groups", 8),
        o_lora_rank=raw.get("o_lora_rank", 1024),
        index_n_heads=raw.get("index_n_heads", 64),
        index_head_dim=raw.get("index_head_dim", 128),
        index_topk=raw.get("index_topk", 512),
        num_nextn_predict_layers=raw.get("num_nextn_predict_layers", 0),
        compress_rope=compress,
        mtp_compress_ratio=raw.get("mtp_compress_ratio", 0),
    )
    return v4, main, int(rope_dim)


def _rope_to_hf(r: RopeConfig, partial: float) -> dict[str, Any]:
    out: dict[str, Any] = {"rope_type": r.kind, "rope_theta": r.theta, "partial_rotary_factor": partial}
    if r.kind == "yarn":
        out.update(factor=r.factor, original_max_position_embeddings=r.original_max_position_embeddings,
                   beta_fast=r.beta_fast, beta_slow=r.beta_slow, truncate=r.truncate)
        for name in ("mscale", "mscale_all_dim", "attention_factor"):
            if getattr(r, name) is not None:
                out[name] = getattr(r, name)
    return out


def v4_to_hf(v: V4Config, main: RopeConfig, rope_dim: int) -> dict[str, Any]:
    """The V4 part of config.json (the reader's inverse)."""
    if not isinstance(v, V4Config):
        raise ConfigError(f"v4: expected a V4Config, got {type(v).__name__}")
    partial = rope_dim / v.head_dim
    return {
        "head_dim": v.head_dim, "layer_types": list(v.layer_types), "mlp_layer_types": list(v.mlp_layer_types),
        "compress_rates": {CSA: v.csa_rate, HCA: v.hca_rate}, "sliding_window": v.sliding_window,
        "hc_mult": v.hc_mult, "hc_sinkhorn_iters": v.hc_sinkhorn_iters, "hc_eps": v.hc_eps,
        "swiglu_limit": v.swiglu_limit, "o_groups": v.o_groups, "o_lora_rank": v.o_lora_rank,
        "index_n_heads": v.index_n_heads, "index_head_dim": v.index_head_dim, "index_topk": v.index_topk,
        "num_nextn_predict_layers": v.num_nextn_predict_layers, "mtp_compress_ratio": v.mtp_compress_ratio,
        "num_key_value_heads": 1,
        "rope_parameters": {"main": _rope_to_hf(main, partial), "compress": _rope_to_hf(v.compress_rope, partial)},
    }
