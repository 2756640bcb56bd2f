"""ModelConfig: the shapes and numerics of a model, and the validation of the fields every family shares.

A config carries its `Family` (`family`), which checks the family's own fields and reads
and writes its config.json dicts (`families.config_from_hf_dict` picks it by model_type).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # annotations only: the family modules import this one
    from mla_func.core.family import Family

# The routing op validates the same method names; one definition serves the config and the kernels.
from mla_func.core.config_fields import ConfigError, check_bool, check_choice, check_int, check_positive, is_int, is_number, refuse
from mla_func.kernels.checks import GROUP_LIMITED_METHODS, TOPK_METHODS

__all__ = ["FamilyFields", "V3_SCORING_FUNCS", "V4_SCORING_FUNCS", "ConfigError", "ModelConfig", "RopeConfig", "is_int",
           "validate_indexer", "validate_no_indexer", "validate_v3_routing",
           "is_number", "refuse", "yarn_mscale"]

# The scorings DeepSeek-V2/V3 define. The routing op also takes V4's sqrt(softplus),
# which a V2/V3 checkpoint has no reference for.
V3_SCORING_FUNCS = ("softmax", "sigmoid")
# DeepSeek-V4's scorings (its config.json default is sqrtsoftplus).
V4_SCORING_FUNCS = ("sqrtsoftplus", "sigmoid")


@dataclass(frozen=True, slots=True)
class FamilyFields:
    """The base of a family's own config fields, beyond those every family shares.

    A family with fields of its own (names as in its config.json) subclasses this and its config
    reader fills `ModelConfig.family_fields`; only that family's modules read them.
    """


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

    def __post_init__(self) -> None:
        _validate_rope(self)

    @property
    def attention_scale(self) -> float:
        """What cos and sin are multiplied by: 1, or YaRN's attention factor."""
        if self.kind == "default":
            return 1.0
        if self.attention_factor is not None:
            return float(self.attention_factor)
        if self.mscale and self.mscale_all_dim:
            denominator = yarn_mscale(self.factor, self.mscale_all_dim)
            return yarn_mscale(self.factor, self.mscale) / denominator if denominator else math.inf
        return yarn_mscale(self.factor)


@dataclass(frozen=True, slots=True)
class ModelConfig:
    """Everything the pure forward needs to know about a model's shapes and numerics.

    Names follow DeepSeek's config.json. `n_routed_experts=None` means a dense model. V3.2's
    indexer (`index_*`, None for V2/V3): `index_n_heads` heads of `index_head_dim` score every
    earlier token; each query attends to the `index_topk` best. Every field is checked on construction (type and range); a bad one raises
    `ConfigError` naming it. `family` is the model's `Family`: the shared fields are checked here,
    the family's own by `family.validate`.
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
    index_n_heads: int | None = None
    index_head_dim: int | None = None
    index_topk: int | None = None
    family_fields: FamilyFields | None = None  # the family's own fields, when it has any (its FamilyFields)
    family: Family = field(kw_only=True, repr=False)

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

    @property
    def has_indexer(self) -> bool:
        """Every layer has an indexer and attends to its top-k keys (DeepSeek Sparse Attention, V3.2's)."""
        return self.index_topk is not None

    def is_moe_layer(self, layer: int) -> bool:
        return (
            self.n_routed_experts is not None
            and layer >= self.first_k_dense_replace
            and layer % self.moe_layer_freq == 0
        )

    def to_hf_dict(self) -> dict[str, Any]:
        """The config.json dict that `families.config_from_hf_dict` reads back to an equal config."""
        return self.family.config_to_hf(self)


def yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    """YaRN's magnitude correction 0.1 * mscale * ln(factor) + 1 (1 for factor <= 1)."""
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


_FLOAT32_MAX = 3.4028234663852886e38


def _rope_fields(r: RopeConfig) -> dict[str, Any]:
    return {"factor": r.factor, "mscale": r.mscale, "mscale_all_dim": r.mscale_all_dim,
            "attention_factor": r.attention_factor}


def _validate_rope(r: RopeConfig) -> None:
    if r.kind not in ("default", "yarn"):
        raise refuse("rope_parameters.rope_type", r.kind, "expected 'default' or 'yarn'")
    # theta^(-2i/R) must fall with i; theta = 1 would also divide YaRN's correction dims by log(1).
    check_positive("rope_parameters.rope_theta", r.theta, above=1.0)
    check_positive("rope_parameters.factor", r.factor)
    check_int("rope_parameters.original_max_position_embeddings", r.original_max_position_embeddings, 1,
               optional=True)
    if r.kind == "yarn" and r.original_max_position_embeddings is None:
        raise refuse("rope_parameters.original_max_position_embeddings", None, "YaRN needs it")
    check_positive("rope_parameters.beta_fast", r.beta_fast)
    check_positive("rope_parameters.beta_slow", r.beta_slow)
    for name in ("mscale", "mscale_all_dim"):
        value = getattr(r, name)
        if value is not None and (not is_number(value) or not math.isfinite(value)):
            raise refuse(f"rope_parameters.{name}", value, "must be null or a finite number")
    check_positive("rope_parameters.attention_factor", r.attention_factor, optional=True)
    check_bool("rope_parameters.truncate", r.truncate)
    if r.kind == "yarn" and r.factor < 1:
        raise refuse("rope_parameters.factor", r.factor, "YaRN stretches positions: must be >= 1")
    # Finite fields can still combine into an infinite or negative scale, and NaN tables.
    if r.kind == "yarn" and not 0 < r.attention_scale <= _FLOAT32_MAX:
        raise refuse("rope_parameters", _rope_fields(r), f"give a YaRN attention factor of {r.attention_scale}, "
                     "not a positive float32 (check factor, mscale, mscale_all_dim, attention_factor)")


def _validate(c: ModelConfig) -> None:
    check_choice("model_type", c.model_type, c.family.model_types)
    for name in ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "kv_lora_rank",
                 "qk_nope_head_dim", "v_head_dim", "max_position_embeddings"):
        check_int(name, getattr(c, name), 1)
    if c.family.dense_mlp:  # otherwise it is the shared expert's width, moe_intermediate_size, checked with the MoE fields
        check_int("intermediate_size", c.intermediate_size, 1)
    if not is_int(c.qk_rope_head_dim) or c.qk_rope_head_dim < 2 or c.qk_rope_head_dim % 2:
        raise refuse("qk_rope_head_dim", c.qk_rope_head_dim, "must be a positive even integer")
    check_int("q_lora_rank", c.q_lora_rank, 1, optional=True)
    check_positive("rms_norm_eps", c.rms_norm_eps)
    for name in ("rope_interleave", "tie_word_embeddings", "norm_topk_prob"):
        check_bool(name, getattr(c, name))
    if not isinstance(c.rope, RopeConfig):
        raise refuse("rope_parameters", c.rope, "must be a RopeConfig")
    if not isinstance(c.eos_token_ids, tuple) or not all(is_int(t) and 0 <= t < c.vocab_size for t in c.eos_token_ids):
        raise refuse("eos_token_id", c.eos_token_ids, f"must be token ids in [0, vocab_size={c.vocab_size})")
    if not (math.isfinite(c.softmax_scale) and c.softmax_scale > 0):
        raise refuse("rope_parameters.mscale_all_dim", c.rope.mscale_all_dim,
                     f"makes the softmax scale {c.softmax_scale}, not a finite positive number")
    check_int("first_k_dense_replace", c.first_k_dense_replace, 0)
    check_int("moe_layer_freq", c.moe_layer_freq, 1)
    # n_routed_experts=None is a dense model, in a family whose layers may be dense.
    check_int("n_routed_experts", c.n_routed_experts, 1, optional=c.family.dense_mlp)
    c.family.validate(c)
    if c.n_routed_experts is not None:
        _validate_moe(c, c.n_routed_experts)


def _validate_moe(c: ModelConfig, experts: int) -> None:
    """The MoE fields of every model with experts, then its family's routing."""
    check_int("num_experts_per_tok", c.num_experts_per_tok, 1, experts, why="n_routed_experts")
    check_int("moe_intermediate_size", c.moe_intermediate_size, 1)
    check_int("n_shared_experts", c.n_shared_experts, 0)
    check_positive("routed_scaling_factor", c.routed_scaling_factor)
    if c.moe_layer_freq != 1:
        # The reference implementations place an MoE block in every layer from
        # first_k_dense_replace on; other frequencies have no oracle to match.
        raise refuse("moe_layer_freq", c.moe_layer_freq, "only 1 is supported")
    c.family.validate_routing(c, experts)


def validate_v3_routing(c: ModelConfig, experts: int) -> None:
    """DeepSeek-V2/V3's routing fields (V3.2 routes as V3 does)."""
    check_choice("scoring_func", c.scoring_func, V3_SCORING_FUNCS)
    check_choice("topk_method", c.topk_method, TOPK_METHODS)
    check_int("n_group", c.n_group, 1, optional=True)
    check_int("topk_group", c.topk_group, 1, optional=True)
    if c.topk_method in GROUP_LIMITED_METHODS:
        if c.n_group is None or experts % c.n_group:
            raise refuse("n_group", c.n_group, f"must divide n_routed_experts={experts} for {c.topk_method}")
        if c.topk_group is None or not 1 <= c.topk_group <= c.n_group:
            raise refuse("topk_group", c.topk_group, f"must be in [1, n_group={c.n_group}]")
        if c.topk_group * (experts // c.n_group) < c.num_experts_per_tok:
            raise refuse("topk_group", c.topk_group, "the chosen groups hold fewer experts than num_experts_per_tok")
        if c.topk_method == "noaux_tc" and experts // c.n_group < 2:
            raise refuse("n_group", c.n_group, "noaux_tc scores a group by its top-2 experts: need >= 2 experts a group")


def validate_no_indexer(c: ModelConfig) -> None:
    """A model without V3.2's indexer leaves its fields null."""
    for name in ("index_n_heads", "index_head_dim", "index_topk"):
        if getattr(c, name) is not None:
            raise refuse(name, getattr(c, name), "only deepseek_v32 models have an indexer (must be null)")


def validate_indexer(c: ModelConfig) -> None:
    """V3.2's indexer fields, against the shared ones."""
    check_int("index_n_heads", c.index_n_heads, 1)
    check_int("index_head_dim", c.index_head_dim, 1)
    # A row attends to at most max_position_embeddings keys, and the top-k's output is [tokens, index_topk]:
    # a larger k selects nothing more and only allocates more (10**12 asked for 8 TB). The config.json
    # reader clamps it (`config_hf`); a config built here is refused instead of silently changed.
    check_int("index_topk", c.index_topk, 1, c.max_position_embeddings, why="max_position_embeddings")
    if c.index_head_dim is not None and c.index_head_dim < c.qk_rope_head_dim:
        raise refuse("index_head_dim", c.index_head_dim,
                     f"the indexer rotates its first qk_rope_head_dim={c.qk_rope_head_dim} dims: must be at least that")
    if c.q_lora_rank is None:
        raise refuse("q_lora_rank", None, "the V3.2 indexer's query comes from the low-rank query: must be set")
    if not c.rope_interleave:
        raise refuse("rope_interleave", False, "DeepSeek-V3.2 rotates MLA's rope dims in interleaved pairs")
