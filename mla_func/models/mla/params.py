"""The params pytree of a DeepSeek-V2/V3 model and its construction from Hugging Face tensors.

Weights keep the Hugging Face [out, in] layout. Two things are reshaped once at
load time: `kv_b_proj` is split per head into `w_uk` [H, Dn, C] and `w_uv`
[H, Dv, C], which both the decompressed (prefill) and the absorbed (decode)
attention use; and the experts are stacked into `w13` [E + S, 2I, D] (gate rows
then up rows) and `w2` [E + S, D, I]: the E routed experts, then the shared MLP
(intermediate size S * I) cut into S experts of I columns each, which sum to it.

A block-scaled FP8 checkpoint keeps its projections as (values, scales) pairs (`BlockFP8Weight`):
joined and cut by `cat_rows`, `slice_block`, `stack_experts` and `split_heads`, which keep every value
and regroup the scales where a piece's boundary falls inside a block. `kv_b_proj` becomes the stacked
pairs `w_uk` [H, Dn, C] and `w_uv` [H, Dv, C] (`split_heads`: DeepSeek-V2/V3's heads of 128 + 128 rows
fill their 128-row blocks, so each head keeps its own scales as stored), which the attention ops take
as they take a tensor (the absorbed query, the value projection, prefill's decompressed keys and values).
"""


from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from tqdm.auto import tqdm

from mla_func.core.config import ModelConfig
from mla_func.core.params import Params, TensorFetch, TensorGet, checked_fetch
from mla_func.core.rope_tables import rope_positions, rope_tables
from mla_func.kernels.held_experts import HeldExperts
from mla_func.kernels.quantized import (BlockFP8Weight, Weight, cat_rows, dequantized, slice_block, split_heads,
                                        stack_experts)
from mla_func.models.mla.indexer_params import IndexerParams, indexer_params, indexer_projections
from mla_func.pytree import register_dataclass, static_field


@register_dataclass
@dataclass(frozen=True, slots=True)
class AttentionParams:
    """MLA projections of one layer (D hidden, H heads, C kv_lora_rank, R rope dim).

    Both projections of the hidden state, the query's first one and the latent's
    (`kv_a_proj_with_mqa`), are one matrix: one GEMM reads both. In a layer with an
    indexer (DeepSeek-V3.2) its key projection `wk` [Di, D] follows them in that matrix,
    and its query projection `wq_b` [Hi * Di, q_lora_rank] follows the query's in `q_b_proj`.
    """

    qkv_a_proj: Weight                    # [Q + C + R (+ Di), D]: query rows (Q = H * (Dn + R), or
                                          # q_lora_rank with a low-rank query), latent rows, indexer key rows
    kv_a_norm: torch.Tensor               # [C]
    w_uk: Weight                          # [H, Dn, C] key up-projection (a tensor or a stacked FP8 pair)
    w_uv: Weight                          # [H, Dv, C] value up-projection (likewise)
    o_proj: Weight                        # [D, H * Dv]
    q_a_norm: torch.Tensor | None = None  # [q_lora_rank], low-rank query only
    q_b_proj: Weight | None = None        # [H * (Dn + R) (+ Hi * Di), q_lora_rank], low-rank query only


@register_dataclass
@dataclass(frozen=True, slots=True)
class MLPParams:
    """A SiLU-gated MLP: down(silu(gate(x)) * up(x))."""

    gate_up: Weight                       # [2I, D], gate rows then up rows
    down: Weight                          # [D, I]


@register_dataclass
@dataclass(frozen=True, slots=True)
class MoEParams:
    """Routed experts, their router, and the shared experts.

    Experts [0, E) are routed; [E, E + S) are the shared experts, slices of I
    columns of the checkpoint's shared MLP, which every token takes with weight 1.
    Stacked with the routed ones, a decode step runs them in the same fused call.
    An expert-parallel rank (`held`, `expert_shard`) holds R = held.count of the routed
    experts whole, from the router's held.first, then every shared expert whole, which it
    runs for its share of the rows (`kernels.held_experts`).
    """

    gate: torch.Tensor                    # [E, D] router weight, float32 (or float64 in a float64 model)
    w13: Weight                           # [R + S, 2I, D] (R = E with one rank)
    w2: Weight                            # [R + S, D, I]
    e_score_correction_bias: torch.Tensor | None = None  # [E] float32, noaux_tc only
    held: HeldExperts | None = static_field(default=None)  # an expert-parallel rank's experts; None: all

    @property
    def num_routed(self) -> int:
        """R: the routed experts w13 holds (all the router's E, or an expert-parallel rank's)."""
        return self.gate.shape[0] if self.held is None else self.held.count

    @property
    def num_shared(self) -> int:
        return self.w13.shape[0] - self.num_routed


@register_dataclass
@dataclass(frozen=True, slots=True)
class LayerParams:
    input_norm: torch.Tensor              # [D]
    attn: AttentionParams
    post_attention_norm: torch.Tensor     # [D]
    mlp: MLPParams | MoEParams
    indexer: IndexerParams | None = None  # DeepSeek-V3.2's sparse-attention indexer


def mla_with_max_positions(params: Params, num_positions: int) -> Params:
    """`params` with the one pair of RoPE tables a DeepSeek-V2/V3/V3.2 model has, of `num_positions` positions."""
    cos, sin = rope_tables(params.config, params.rope_cos.device, num_positions)
    return dataclasses.replace(params, rope_cos=cos, rope_sin=sin)


def split_shared(shared: MLPParams, num_shared: int) -> list[MLPParams]:
    """The shared MLP (gate_up [2 * S * I, D], down [D, S * I]) as S experts of I columns.

    Each output column of gate and up and each input column of down belongs to one
    slice, so the slices' outputs sum to the whole MLP's.
    """
    inter = shared.down.shape[1] // num_shared
    rows = shared.gate_up.shape[0] // 2
    return [
        MLPParams(
            gate_up=cat_rows([slice_block(shared.gate_up, -2, s * inter, (s + 1) * inter),
                              slice_block(shared.gate_up, -2, rows + s * inter, rows + (s + 1) * inter)]),
            down=slice_block(shared.down, -1, s * inter, (s + 1) * inter),
        )
        for s in range(num_shared)
    ]


def join_shared(experts: list[MLPParams]) -> MLPParams:
    """The inverse of `split_shared`: S experts of I columns as one MLP of S * I (plain tensors)."""
    gates, ups = zip(*(dequantized(e.gate_up, torch.float32).chunk(2, dim=0) for e in experts))
    return MLPParams(gate_up=torch.cat([*gates, *ups]),
                     down=torch.cat([dequantized(e.down, torch.float32) for e in experts], dim=1))


def mla_params_from_hf(
    config: ModelConfig,
    fetch: TensorFetch,
    *,
    dtype: torch.dtype,
    device: torch.device | str,
    progress: bool = False,
    max_model_len: int | None = None,
    layer: Callable[[ModelConfig, int, TensorGet, torch.dtype], Any] | None = None,
) -> Params:
    """`params_from_hf` for DeepSeek-V2/V3/V3.2 (the MLA and DSA families' `Family.params_from_hf`).

    layer: builds each decoder layer's params (default `layer_params`; an expert-parallel rank's
           keeps its own experts, `models.mla.expert_shard`).
    """
    get = checked_fetch(fetch, dtype=dtype, device=device)
    c = config
    layer = layer or layer_params
    layers = [layer(c, i, get, dtype)
              for i in tqdm(range(c.num_hidden_layers), desc="loading layers", unit="layer", disable=not progress)]
    embed = get("model.embed_tokens.weight")
    cos, sin = rope_tables(c, device, rope_positions(c, max_model_len))
    return Params(embed=embed, layers=tuple(layers), norm=get("model.norm.weight"),
                  lm_head=embed if c.tie_word_embeddings else get("lm_head.weight"), rope_cos=cos, rope_sin=sin,
                  config=c)


def held_dtype(name: str, dtype: torch.dtype) -> torch.dtype:
    """The dtype the params of a `dtype` model hold checkpoint tensor `name` in (DeepSeek-V2/V3/V3.2).

    Routing and the indexer's head weights run in at least float32, so their weights are held
    there (a router as `layer_params` makes it, an indexer's as `indexer_params` does); noaux_tc's
    correction bias is float32 in every model dtype. Everything else is `dtype`.
    """
    if name.endswith("mlp.gate.e_score_correction_bias"):
        return torch.float32
    if name.endswith(("mlp.gate.weight", "indexer.weights_proj.weight")):
        return torch.promote_types(dtype, torch.float32)
    return dtype


def key_value_up(kv_b: Weight, config: ModelConfig, dtype: torch.dtype) -> tuple[Weight, Weight]:
    """kv_b_proj [H * (Dn + Dv), C] (its heads' rows one head after another) -> (w_uk [H, Dn, C],
    w_uv [H, Dv, C]): an FP8 pair's per-head pairs (`split_heads`), else the rows of the tensor (another
    pair dequantized into `dtype`), contiguous. H is read from the rows given (a tensor-parallel rank's)."""
    nope, value = config.qk_nope_head_dim, config.v_head_dim
    heads = kv_b.shape[0] // (nope + value)
    if isinstance(kv_b, BlockFP8Weight):
        w_uk, w_uv = split_heads(kv_b, heads, (nope, value))
        return w_uk, w_uv
    rows = dequantized(kv_b, dtype).view(heads, nope + value, config.kv_lora_rank)
    return rows[:, :nope].contiguous(), rows[:, nope:].contiguous()


def layer_params(config: ModelConfig, i: int, get: TensorGet, dtype: torch.dtype,
                 routed: range | None = None) -> LayerParams:
    """Decoder layer `i` from the tensors named `model.layers.{i}.*` (`get` as `checked_fetch` makes it).

    routed: the routed experts to read (default all); with fewer, the MoE block's w13 and w2 hold
            those, then the shared experts, and its router still scores all (`models.mla.expert_shard`).
    """

    def mlp(prefix: str) -> MLPParams:
        gate_up = cat_rows([get.weight(prefix + "gate_proj.weight"), get.weight(prefix + "up_proj.weight")])
        return MLPParams(gate_up=gate_up, down=get.weight(prefix + "down_proj.weight"))

    c = config
    p = f"model.layers.{i}."
    a = p + "self_attn."
    # Heads by the rows fetched: a tensor-parallel rank's fetch gives its own heads' rows only
    # (`mla_func.parallel`).
    w_uk, w_uv = key_value_up(get.weight(a + "kv_b_proj.weight"), c, dtype)
    # An indexer's projections become the last rows of the attention's (see AttentionParams).
    index_proj = indexer_projections(c, a, get.weight)
    index_q_rows, index_k_rows = ([index_proj[0]], [index_proj[1]]) if index_proj is not None else ([], [])
    q_parts: dict[str, Weight] = {}
    if c.q_lora_rank is None:
        q_a = get.weight(a + "q_proj.weight")
    else:
        q_a = get.weight(a + "q_a_proj.weight")
        q_parts = dict(q_a_norm=get(a + "q_a_layernorm.weight"),
                       q_b_proj=cat_rows([get.weight(a + "q_b_proj.weight"), *index_q_rows]))
    attn = AttentionParams(
        qkv_a_proj=cat_rows([q_a, get.weight(a + "kv_a_proj_with_mqa.weight"), *index_k_rows]),
        kv_a_norm=get(a + "kv_a_layernorm.weight"),
        w_uk=w_uk,
        w_uv=w_uv,
        o_proj=get.weight(a + "o_proj.weight"),
        **q_parts,  # type: ignore[arg-type]
    )
    m = p + "mlp."
    if c.is_moe_layer(i):
        experts = [mlp(f"{m}experts.{j}.") for j in (range(c.n_routed_experts or 0) if routed is None else routed)]
        if c.n_shared_experts:
            experts += split_shared(mlp(m + "shared_experts."), c.n_shared_experts)
        block: MLPParams | MoEParams = MoEParams(
            # Routing runs in at least float32; holding the router there saves a cast per step.
            gate=get(m + "gate.weight").to(held_dtype(m + "gate.weight", dtype)),
            w13=stack_experts([e.gate_up for e in experts]),
            w2=stack_experts([e.down for e in experts]),
            e_score_correction_bias=(
                get(m + "gate.e_score_correction_bias", keep_float32=True) if c.topk_method == "noaux_tc" else None
            ),
        )
        del experts
    else:
        block = mlp(m)
    return LayerParams(
        input_norm=get(p + "input_layernorm.weight"),
        attn=attn,
        post_attention_norm=get(p + "post_attention_layernorm.weight"),
        mlp=block,
        indexer=indexer_params(c, a, get, torch.promote_types(dtype, torch.float32)),
    )
