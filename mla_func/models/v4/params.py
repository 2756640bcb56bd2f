"""DeepSeek-V4's params pytree: per-layer leaves of each kind, and the checkpoint's tensor names.

Names are DeepSeek's (`attn.wq_a`, `attn.compressor.ape`, `ffn.experts.N.w1`,
`hc_attn_fn`, ...), as `save_pretrained` writes them; params keep transformers'
names for the modules they build. Experts are stacked as for V2/V3: `w13`
[E + S, 2I, D] (w1 rows then w3 rows) and `w2` [E + S, D, I], shared experts last.
Hyper-connection weights, sinks, position biases, norms and the router bias stay
in float32 whatever the model dtype (the reference keeps them there).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import TypeVar

import torch

from mla_func.checkpoint.files import CheckpointError
from mla_func.checkpoint.safetensors_file import TensorEntry, load_dtype
from mla_func.core.config import ModelConfig
from mla_func.kernels.quantized import Weight
from mla_func.models.v4.config import CSA, SLIDING, V4Config, v4_fields
from mla_func.pytree import register_dataclass, static_field


@register_dataclass
@dataclass(frozen=True, slots=True)
class HyperConnectionParams:
    """One mHC site (N = hc_mult streams of width D): pre, post and comb weights from all streams."""

    fn: torch.Tensor      # [(2 + N) * N, N * D] float32
    base: torch.Tensor    # [(2 + N) * N] float32
    scale: torch.Tensor   # [3] float32 (pre, post, comb)


@register_dataclass
@dataclass(frozen=True, slots=True)
class HyperHeadParams:
    """The final collapse of the N streams into one hidden state."""

    fn: torch.Tensor      # [N, N * D] float32
    base: torch.Tensor    # [N] float32
    scale: torch.Tensor   # [1] float32


@register_dataclass
@dataclass(frozen=True, slots=True)
class CompressorParams:
    """A gated-pooling compressor of `rate` tokens into one entry of width Dc.

    c = 2 with overlap (CSA and its indexer: series Ca | Cb), 1 without (HCA). Its kv and
    gate projections (checkpoint `wkv`, `wgate`) are rows of the attention's `in_proj`.
    """

    position_bias: torch.Tensor  # [rate, c * Dc] float32
    kv_norm: torch.Tensor        # [Dc]

    @property
    def input_width(self) -> int:
        """2 * c * Dc: the kv projection's c * Dc values of a token, then the gate's."""
        return 2 * self.position_bias.shape[1]


@register_dataclass
@dataclass(frozen=True, slots=True)
class IndexerParams:
    """CSA's lightning indexer: its own compressor at Di, queries from the query latent (its `wq_b`
    is the last rows of the attention's `q_b_proj`: one product makes both queries)."""

    compressor: CompressorParams
    weights_proj: torch.Tensor   # [Hi, D]


@register_dataclass
@dataclass(frozen=True, slots=True)
class V4AttentionParams:
    """Shared-KV attention (H heads of Dh; G output groups of rank Og).

    Every projection of the layer's input is one product, one launch: `in_proj` stacks the
    query's low rank (checkpoint `wq_a`), the shared key-value (`wkv`), then the compressor's
    kv and gate (`compressor.wkv`, `compressor.wgate`) and the indexer compressor's, where the
    layer has them; `input_widths` splits its output. `q_b_proj` likewise stacks the indexer's
    query rows (`indexer.wq_b`) under the attention's (`wq_b`).
    """

    in_proj: Weight              # [Q + Dh + Cc + Ci, D]
    q_a_norm: torch.Tensor       # [Q]
    q_b_proj: Weight             # [H * Dh + Hi * Di, Q] (Hi * Di = 0 without an indexer)
    kv_norm: torch.Tensor        # [Dh]
    o_a_proj: torch.Tensor       # [G * Og, H * Dh / G] (dequantized at load: read per group)
    o_b_proj: Weight             # [D, G * Og]
    sinks: torch.Tensor          # [H] float32
    rope_cos: torch.Tensor       # [P, R / 2] float32: main rope (sliding) or compress rope (CSA / HCA)
    rope_sin: torch.Tensor       # [P, R / 2] float32
    compressor: CompressorParams | None = None
    indexer: IndexerParams | None = None

    @property
    def input_widths(self) -> tuple[int, int, int, int]:
        """(Q, Dh, Cc, Ci): `in_proj`'s rows for the query, the key-value, the compressor and the indexer's
        compressor (0 for a part the layer lacks), in that order."""
        return (self.q_a_norm.shape[0], self.kv_norm.shape[0],
                0 if self.compressor is None else self.compressor.input_width,
                0 if self.indexer is None else self.indexer.compressor.input_width)


@register_dataclass
@dataclass(frozen=True, slots=True)
class V4MoEParams:
    """Routed experts (learned top-k, or hash-routed by `tid2eid`) and shared experts.

    The shared experts are stacked after the routed ones in `w13` / `w2` (one expert launch), unless
    the two are stored in different formats (FP4 routed, FP8 shared, as DeepSeek-V4 ships): then
    `w13` / `w2` hold the routed experts and `shared_w13` / `shared_w2` the shared ones.
    """

    gate: torch.Tensor                                   # [E, D]
    w13: Weight                                          # [E + S, 2I, D] (or [E, 2I, D], see above)
    w2: Weight                                           # [E + S, D, I] (or [E, D, I])
    e_score_correction_bias: torch.Tensor | None = None  # [E] float32, learned routing only
    tid2eid: torch.Tensor | None = None                  # [V, k] int64, hash routing only
    shared_w13: Weight | None = None                     # [S, 2I', D] when held apart
    shared_w2: Weight | None = None                      # [S, D, I'] when held apart

    @property
    def num_routed(self) -> int:
        return self.gate.shape[0]


@register_dataclass
@dataclass(frozen=True, slots=True)
class V4ExpertShardParams:
    """An expert-parallel rank's share of a MoE block (float weights or quantized pairs; `expert_shard`):
    E / n routed experts whole, and 1 / n of the shared experts' columns. The router and the hash table
    are whole, so every rank picks the same experts; `first_expert` is the router's id of w13[0]."""

    gate: torch.Tensor                                   # [E, D]
    w13: Weight                                          # [E / n, 2I, D]
    w2: Weight                                           # [E / n, D, I]
    first_expert: int = static_field()
    e_score_correction_bias: torch.Tensor | None = None  # [E] float32, learned routing only
    tid2eid: torch.Tensor | None = None                  # [V, k] int64, hash routing only
    shared_w13: Weight | None = None                     # [S, 2I' / n, D]
    shared_w2: Weight | None = None                      # [S, D, I' / n]


@register_dataclass
@dataclass(frozen=True, slots=True)
class V4LayerParams:
    attn_norm: torch.Tensor      # [D]
    attn: V4AttentionParams
    ffn_norm: torch.Tensor       # [D]
    mlp: V4MoEParams | V4ExpertShardParams
    attn_hc: HyperConnectionParams
    ffn_hc: HyperConnectionParams
    # The model's final stream collapse, held by the last layer (see `layers`).
    hc_head: HyperHeadParams | None = None


def _compressor_shapes(prefix: str, d: int, width: int, rate: int, overlap: bool) -> dict[str, tuple[int, ...]]:
    c = 2 if overlap else 1
    return {prefix + "wkv.weight": (c * width, d), prefix + "wgate.weight": (c * width, d),
            prefix + "ape": (rate, c * width), prefix + "norm.weight": (width,)}


def v4_tensor_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor of a DeepSeek-V4 checkpoint of `config`, by name, with its shape."""
    c, v = config, v4_fields(config)
    d, n = c.hidden_size, v.hc_mult
    shapes: dict[str, tuple[int, ...]] = {
        "model.embed_tokens.weight": (c.vocab_size, d), "model.norm.weight": (d,),
        "model.hc_head.hc_fn": (n, n * d), "model.hc_head.hc_base": (n,), "model.hc_head.hc_scale": (1,),
    }
    if not c.tie_word_embeddings:
        shapes["head.weight"] = (c.vocab_size, d)
    for i, (kind, mlp) in enumerate(zip(v.layer_types, v.mlp_layer_types)):
        shapes.update(v4_layer_shapes(config, f"model.layers.{i}.", kind, mlp))
    return shapes


def v4_layer_shapes(config: ModelConfig, p: str, kind: str, mlp: str) -> dict[str, tuple[int, ...]]:
    """The tensors of one V4 layer of attention type `kind` and MoE type `mlp`, named under prefix `p`."""
    c, v = config, v4_fields(config)
    d, h, n, q = c.hidden_size, c.num_attention_heads, v.hc_mult, c.q_lora_rank or 0
    e, inter = c.n_routed_experts or 0, c.moe_intermediate_size
    hc = (2 + n) * n
    shapes: dict[str, tuple[int, ...]] = {p + "attn_norm.weight": (d,), p + "ffn_norm.weight": (d,)}
    for site in ("attn", "ffn"):
        shapes.update({f"{p}hc_{site}_fn": (hc, n * d), f"{p}hc_{site}_base": (hc,), f"{p}hc_{site}_scale": (3,)})
    a = p + "attn."
    shapes.update({
        a + "wq_a.weight": (q, d), a + "q_norm.weight": (q,), a + "wq_b.weight": (h * v.head_dim, q),
        a + "wkv.weight": (v.head_dim, d), a + "norm.weight": (v.head_dim,),
        a + "wo_a.weight": (v.o_groups * v.o_lora_rank, h * v.head_dim // v.o_groups),
        a + "wo_b.weight": (d, v.o_groups * v.o_lora_rank), a + "attn_sink": (h,),
    })
    if kind != SLIDING:
        shapes.update(_compressor_shapes(a + "compressor.", d, v.head_dim, v.rate(kind), kind == CSA))
    if kind == CSA:
        di, hi = v.index_head_dim, v.index_n_heads
        shapes.update(_compressor_shapes(a + "indexer.compressor.", d, di, v.csa_rate, True))
        shapes.update({a + "indexer.wq_b.weight": (hi * di, q), a + "indexer.weights_proj.weight": (hi, d)})
    f = p + "ffn."
    shapes[f + "gate.weight"] = (e, d)
    shapes[f + ("gate.tid2eid" if mlp == "hash_moe" else "gate.bias")] = (
        (c.vocab_size, c.num_experts_per_tok) if mlp == "hash_moe" else (e,))
    for j in range(e):
        shapes.update(_expert_shapes(f"{f}experts.{j}.", d, inter))
    if c.n_shared_experts:
        shapes.update(_expert_shapes(f + "shared_experts.", d, inter * c.n_shared_experts))
    return shapes


def v4_tensor_count(config: ModelConfig) -> int:
    """len(v4_tensor_shapes(config)), counted without listing them."""
    c, v = config, v4_fields(config)
    per_layer = 2 + 6 + 8 + 2 + 3 * (c.n_routed_experts or 0) + 3 * bool(c.n_shared_experts)
    compressed = sum(t != SLIDING for t in v.layer_types)
    csa = sum(t == CSA for t in v.layer_types)
    return 5 + (not c.tie_word_embeddings) + c.num_hidden_layers * per_layer + 4 * compressed + 6 * csa


def _expert_shapes(prefix: str, d: int, inter: int) -> dict[str, tuple[int, ...]]:
    return {prefix + "w1.weight": (inter, d), prefix + "w3.weight": (inter, d), prefix + "w2.weight": (d, inter)}



# Tensors the reference keeps in float32 in every model dtype.
FLOAT32_SUFFIXES = ("hc_attn_fn", "hc_attn_base", "hc_attn_scale", "hc_ffn_fn", "hc_ffn_base", "hc_ffn_scale",
                    "hc_head.hc_fn", "hc_head.hc_base", "hc_head.hc_scale", "attn_sink", ".ape", "gate.bias")


def keeps_float32(name: str) -> bool:
    return name.endswith(FLOAT32_SUFFIXES)


def is_index_table(name: str) -> bool:
    """Integer tensors of a checkpoint that are tables, not weights: hash routing's token -> experts."""
    return name.endswith(".gate.tid2eid")


def v4_held_dtype(name: str, dtype: torch.dtype) -> torch.dtype:
    """The dtype the params of a `dtype` V4 model hold checkpoint tensor `name` in: an index table's
    expert ids as int64, the tensors the reference keeps in float32 in at least float32, the rest in `dtype`."""
    if is_index_table(name):
        return torch.int64
    return torch.promote_types(dtype, torch.float32) if keeps_float32(name) else dtype


def checkpoint_dtype(name: str, label: str, entry: TensorEntry, model_dtype: torch.dtype) -> torch.dtype:
    """The dtype a checkpoint tensor reads as: an index table's integers (int32 or int64) as they are,
    a weight as `load_dtype` decides; CheckpointError naming the tensor otherwise."""
    if not is_index_table(name):
        return load_dtype(label, entry, model_dtype)
    dtype = {"I32": torch.int32, "I64": torch.int64}.get(entry.dtype)
    if dtype is None:
        raise CheckpointError(f"{label}: tensor {entry.name!r} has dtype {entry.dtype!r}: expected integer expert "
                              "ids (I32 or I64)")
    return dtype


# DeepSeek's own top-level names, which save_pretrained writes under `model.`.
_DEEPSEEK_TOP = {"embed.weight": "model.embed_tokens.weight", "norm.weight": "model.norm.weight",
                 "hc_head_fn": "model.hc_head.hc_fn", "hc_head_base": "model.hc_head.hc_base",
                 "hc_head_scale": "model.hc_head.hc_scale"}
_KV_NORM = re.compile(r"^((model\.layers|mtp)\.\d+)\.attn\.kv_norm\.weight$")
# DeepSeek's names of an MTP layer's own hyper head (`mtp.N.hc_head_fn`), as the model's is named.
_MTP_HEAD = re.compile(r"^(mtp\.\d+)\.hc_head_(fn|base|scale)$")
_T = TypeVar("_T")


def canonical_names(config: ModelConfig, located: dict[str, _T], where: object) -> dict[str, _T]:
    """A V4 checkpoint's tensors under the names save_pretrained writes, whether written so or with
    DeepSeek's own names (`embed.weight`, `layers.N.`, `hc_head_fn`, `attn.kv_norm`); other models' unchanged.
    An MTP layer keeps DeepSeek's prefix `mtp.N.` (transformers saves none), its layer's tensors named as
    a decoder layer's and its hyper head as the model's (`mtp.N.hc_head.hc_fn`).
    CheckpointError when one tensor is there under both names."""
    if not isinstance(config.family_fields, V4Config):
        return located
    out: dict[str, _T] = {}
    for name, value in located.items():
        canonical = _DEEPSEEK_TOP.get(name) or ("model." + name if name.startswith("layers.") else name)
        # DeepSeek's files name the attention's key norm `attn.kv_norm`, save_pretrained `attn.norm`.
        canonical = _KV_NORM.sub(r"\1.attn.norm.weight", canonical)
        canonical = _MTP_HEAD.sub(r"\1.hc_head.hc_\2", canonical)
        if canonical in out:
            raise CheckpointError(f"{where}: tensor {canonical!r} is in the checkpoint under two names")
        out[canonical] = value
    return out
