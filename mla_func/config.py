"""ModelConfig: the shapes and numerics of a DeepSeek-V2/V3 model, read from a Hugging Face config.json."""

from __future__ import annotations

import json
import math
import warnings
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

# The routing op validates the same names; one definition serves the config and the kernels.
from .kernels.checks import SCORING_FUNCS, TOPK_METHODS


class ConfigError(ValueError):
    """A config.json field has a value mla-func does not support."""


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


@dataclass(frozen=True, slots=True)
class RopeConfig:
    """Rotary embedding of the qk_rope_head_dim part; `kind` is "default" or "yarn"."""

    theta: float = 10000.0
    kind: str = "default"
    factor: float = 1.0
    original_max_position_embeddings: int | None = None
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float | None = None
    mscale_all_dim: float | None = None
    attention_factor: float | None = None
    truncate: bool = True


@dataclass(frozen=True, slots=True)
class ModelConfig:
    """Everything the pure forward needs to know about a model's shapes and numerics.

    Names follow DeepSeek's config.json. `n_routed_experts=None` means a dense model.
    """

    model_type: str
    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    intermediate_size: int
    q_lora_rank: int | None = None
    n_routed_experts: int | None = None
    num_experts_per_tok: int = 1
    n_shared_experts: int = 0
    moe_intermediate_size: int = 0
    first_k_dense_replace: int = 0
    moe_layer_freq: int = 1
    routed_scaling_factor: float = 1.0
    norm_topk_prob: bool = False
    scoring_func: str = "softmax"
    topk_method: str = "greedy"
    n_group: int | None = None
    topk_group: int | None = None
    rope: RopeConfig = field(default_factory=RopeConfig)
    rope_interleave: bool = True
    max_position_embeddings: int = 4096
    rms_norm_eps: float = 1e-6
    tie_word_embeddings: bool = False
    eos_token_ids: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        _validate(self)

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def kv_cache_dim(self) -> int:
        """Values cached per token per layer: the latent c_kv, then the rotated k_pe."""
        return self.kv_lora_rank + self.qk_rope_head_dim

    @property
    def softmax_scale(self) -> float:
        """1/sqrt(qk_head_dim), times YaRN's mscale(factor, mscale_all_dim)^2 when YaRN sets one."""
        scale = self.qk_head_dim ** -0.5
        if self.rope.kind == "yarn" and self.rope.mscale_all_dim:
            m = yarn_mscale(self.rope.factor, self.rope.mscale_all_dim)
            scale *= m * m
        return scale

    def is_moe_layer(self, layer: int) -> bool:
        return (
            self.n_routed_experts is not None
            and layer >= self.first_k_dense_replace
            and layer % self.moe_layer_freq == 0
        )

    @classmethod
    def from_hf_dict(cls, raw: Mapping[str, Any]) -> ModelConfig:
        """Read a Hugging Face config.json dict (model_type deepseek_v2 or deepseek_v3)."""
        return _from_hf_dict(raw)

    @classmethod
    def from_file(cls, path: str | Path) -> ModelConfig:
        with open(path) as f:
            return _from_hf_dict(json.load(f))

    def to_hf_dict(self) -> dict[str, Any]:
        """The config.json dict that `from_hf_dict` reads back to an equal config."""
        out: dict[str, Any] = {
            "architectures": ["DeepseekV3ForCausalLM" if self.model_type == "deepseek_v3" else "DeepseekV2ForCausalLM"],
            "model_type": self.model_type,
        }
        for name in (
            "vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "kv_lora_rank",
            "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim", "intermediate_size", "q_lora_rank",
            "n_routed_experts", "num_experts_per_tok", "n_shared_experts", "moe_intermediate_size",
            "first_k_dense_replace", "moe_layer_freq", "routed_scaling_factor", "norm_topk_prob",
            "scoring_func", "topk_method", "n_group", "topk_group", "rope_interleave",
            "max_position_embeddings", "rms_norm_eps", "tie_word_embeddings",
        ):
            out[name] = getattr(self, name)
        out["num_key_value_heads"] = self.num_attention_heads
        out["hidden_act"] = "silu"
        rope: dict[str, Any] = {"rope_type": self.rope.kind, "rope_theta": self.rope.theta}
        if self.rope.kind == "yarn":
            rope.update(
                factor=self.rope.factor,
                original_max_position_embeddings=self.rope.original_max_position_embeddings,
                beta_fast=self.rope.beta_fast,
                beta_slow=self.rope.beta_slow,
                truncate=self.rope.truncate,
            )
            for name in ("mscale", "mscale_all_dim", "attention_factor"):
                if getattr(self.rope, name) is not None:
                    rope[name] = getattr(self.rope, name)
        out["rope_parameters"] = rope
        if self.eos_token_ids:
            out["eos_token_id"] = list(self.eos_token_ids) if len(self.eos_token_ids) > 1 else self.eos_token_ids[0]
        return out


def yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    """YaRN's magnitude correction 0.1 * mscale * ln(factor) + 1 (1 for factor <= 1)."""
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def _refuse(field_name: str, value: Any, why: str) -> ConfigError:
    return ConfigError(f"config field {field_name!r} = {value!r}: {why}")


def _validate(c: ModelConfig) -> None:
    if c.model_type not in ("deepseek_v2", "deepseek_v3"):
        raise _refuse("model_type", c.model_type, "expected 'deepseek_v2' or 'deepseek_v3'")
    for name in ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "kv_lora_rank",
                 "qk_nope_head_dim", "v_head_dim", "max_position_embeddings"):
        if getattr(c, name) < 1:
            raise _refuse(name, getattr(c, name), "must be a positive integer")
    if c.qk_rope_head_dim < 2 or c.qk_rope_head_dim % 2:
        raise _refuse("qk_rope_head_dim", c.qk_rope_head_dim, "must be a positive even integer")
    if c.q_lora_rank is not None and c.q_lora_rank < 1:
        raise _refuse("q_lora_rank", c.q_lora_rank, "must be null or a positive integer")
    if c.n_routed_experts is None:
        return
    if c.n_routed_experts < 1:
        raise _refuse("n_routed_experts", c.n_routed_experts, "must be null or a positive integer")
    if not 1 <= c.num_experts_per_tok <= c.n_routed_experts:
        raise _refuse("num_experts_per_tok", c.num_experts_per_tok, f"must be in [1, n_routed_experts={c.n_routed_experts}]")
    if c.moe_intermediate_size < 1:
        raise _refuse("moe_intermediate_size", c.moe_intermediate_size, "must be positive for an MoE model")
    if c.moe_layer_freq != 1:
        # The reference implementations place an MoE block in every layer from
        # first_k_dense_replace on; other frequencies have no oracle to match.
        raise _refuse("moe_layer_freq", c.moe_layer_freq, "only 1 is supported")
    if c.scoring_func not in SCORING_FUNCS:
        raise _refuse("scoring_func", c.scoring_func, f"expected one of {SCORING_FUNCS}")
    if c.topk_method not in TOPK_METHODS:
        raise _refuse("topk_method", c.topk_method, f"expected one of {TOPK_METHODS}")
    if c.topk_method in ("group_limited_greedy", "noaux_tc"):
        if not c.n_group or c.n_routed_experts % c.n_group:
            raise _refuse("n_group", c.n_group, f"must divide n_routed_experts={c.n_routed_experts} for {c.topk_method}")
        if not c.topk_group or not 1 <= c.topk_group <= c.n_group:
            raise _refuse("topk_group", c.topk_group, f"must be in [1, n_group={c.n_group}]")
        if c.topk_group * (c.n_routed_experts // c.n_group) < c.num_experts_per_tok:
            raise _refuse("topk_group", c.topk_group, "the chosen groups hold fewer experts than num_experts_per_tok")
        if c.topk_method == "noaux_tc" and c.n_routed_experts // c.n_group < 2:
            raise _refuse("n_group", c.n_group, "noaux_tc scores a group by its top-2 experts: need >= 2 experts a group")


def _rope_from_hf(raw: Mapping[str, Any]) -> RopeConfig:
    params = raw.get("rope_parameters")
    if params is None:
        # Configs written before rope_parameters: rope_theta beside an optional rope_scaling.
        params = dict(raw.get("rope_scaling") or {})
        params.setdefault("rope_theta", raw.get("rope_theta", 10000.0))
        if "type" in params and "rope_type" not in params:
            params["rope_type"] = params.pop("type")
    kind = params.get("rope_type", "default")
    theta = float(params.get("rope_theta", raw.get("rope_theta", 10000.0)))
    if kind == "default":
        return RopeConfig(theta=theta)
    if kind != "yarn":
        raise _refuse("rope_parameters.rope_type", kind, "expected 'default' or 'yarn'")
    if params.get("partial_rotary_factor", 1.0) != 1.0:
        raise _refuse("rope_parameters.partial_rotary_factor", params["partial_rotary_factor"], "only 1.0 is supported")
    original = params.get("original_max_position_embeddings")
    if original is None:
        raise _refuse("rope_parameters.original_max_position_embeddings", None, "YaRN needs it")
    factor = params.get("factor")
    if factor is None:
        factor = raw["max_position_embeddings"] / original
    return RopeConfig(
        theta=theta,
        kind="yarn",
        factor=float(factor),
        original_max_position_embeddings=int(original),
        beta_fast=float(params.get("beta_fast") or 32.0),
        beta_slow=float(params.get("beta_slow") or 1.0),
        mscale=params.get("mscale"),
        mscale_all_dim=params.get("mscale_all_dim"),
        attention_factor=params.get("attention_factor"),
        truncate=bool(params.get("truncate", True)),
    )


_READ_FIELDS = frozenset({
    "vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
    "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim", "intermediate_size",
    "q_lora_rank", "n_routed_experts", "num_experts_per_tok", "n_shared_experts", "moe_intermediate_size",
    "first_k_dense_replace", "moe_layer_freq", "routed_scaling_factor", "norm_topk_prob", "scoring_func",
    "topk_method", "n_group", "topk_group", "rope_parameters", "rope_scaling", "rope_theta",
    "rope_interleave", "max_position_embeddings", "rms_norm_eps", "tie_word_embeddings", "eos_token_id",
    "hidden_act", "attention_bias", "mlp_bias", "quantization_config", "sliding_window", "use_sliding_window",
})


def _from_hf_dict(raw: Mapping[str, Any]) -> ModelConfig:
    model_type = raw.get("model_type")
    if model_type not in ("deepseek_v2", "deepseek_v3"):
        raise _refuse("model_type", model_type, "expected 'deepseek_v2' or 'deepseek_v3'")
    if raw.get("hidden_act", "silu") != "silu":
        raise _refuse("hidden_act", raw["hidden_act"], "only 'silu' is supported")
    for flag in ("attention_bias", "mlp_bias", "use_sliding_window"):
        if raw.get(flag):
            raise _refuse(flag, raw[flag], "not supported (must be false)")
    if raw.get("sliding_window") is not None and raw.get("use_sliding_window", True):
        raise _refuse("sliding_window", raw["sliding_window"], "not supported")
    if raw.get("quantization_config") is not None:
        method = raw["quantization_config"].get("quant_method") if isinstance(raw["quantization_config"], Mapping) else None
        raise _refuse("quantization_config", method, "quantized checkpoints are not supported; dequantize first")
    heads = raw["num_attention_heads"]
    kv_heads = raw.get("num_key_value_heads") or heads
    if kv_heads != heads:
        raise _refuse("num_key_value_heads", kv_heads, f"MLA has one latent per token: must equal num_attention_heads={heads}")
    if model_type == "deepseek_v2" and raw.get("rope_interleave") is False:
        raise _refuse("rope_interleave", False, "DeepSeek-V2 always rotates interleaved pairs")

    unknown = sorted(set(raw) - _READ_FIELDS - _IGNORED_FIELDS)
    if unknown:
        warnings.warn(f"config.json fields not used by mla-func: {unknown}", stacklevel=3)

    is_v3 = model_type == "deepseek_v3"
    eos = raw.get("eos_token_id")
    eos_ids = () if eos is None else tuple(eos) if isinstance(eos, (list, tuple)) else (int(eos),)
    return ModelConfig(
        model_type=model_type,
        vocab_size=raw["vocab_size"],
        hidden_size=raw["hidden_size"],
        num_hidden_layers=raw["num_hidden_layers"],
        num_attention_heads=heads,
        kv_lora_rank=raw["kv_lora_rank"],
        qk_nope_head_dim=raw["qk_nope_head_dim"],
        qk_rope_head_dim=raw["qk_rope_head_dim"],
        v_head_dim=raw["v_head_dim"],
        intermediate_size=raw["intermediate_size"],
        q_lora_rank=raw.get("q_lora_rank"),
        n_routed_experts=raw.get("n_routed_experts"),
        num_experts_per_tok=raw.get("num_experts_per_tok") or 1,
        n_shared_experts=raw.get("n_shared_experts") or 0,
        moe_intermediate_size=raw.get("moe_intermediate_size") or 0,
        first_k_dense_replace=raw.get("first_k_dense_replace", 0),
        moe_layer_freq=raw.get("moe_layer_freq", 1),
        routed_scaling_factor=float(raw.get("routed_scaling_factor", 1.0)),
        norm_topk_prob=bool(raw.get("norm_topk_prob", False)),
        scoring_func=raw.get("scoring_func", "sigmoid" if is_v3 else "softmax"),
        topk_method=raw.get("topk_method", "noaux_tc" if is_v3 else "greedy"),
        n_group=raw.get("n_group"),
        topk_group=raw.get("topk_group"),
        rope=_rope_from_hf(raw),
        rope_interleave=bool(raw.get("rope_interleave", True)),
        max_position_embeddings=raw.get("max_position_embeddings", 4096),
        rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
        tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
        eos_token_ids=eos_ids,
    )
