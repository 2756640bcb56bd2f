"""DeepSeek-V4's multi-token-prediction (MTP) layer, the drafter of speculative decoding.

DeepSeek-V4's MTP block (its inference code's `MTPBlock`), for the token t at position i and
the N = hc_mult streams h [N, D] the target model left at position i - 1 before its hyper head:

    e       = enorm(embed(t))                          # the model's embedding
    x[k]    = e_proj(e) + h_proj(hnorm(h[k]))           # each stream k: N streams [N, D]
    y       = V4Layer(x)                               # one full V4 layer over the drafter's own cache
    logits  = head(norm(hc_head(y)))                   # the MTP's own hyper head and norm, the model's head

so the drafter is the forward over params whose one layer is the MTP layer (`drafter_params`),
of kind `V4MTPLayer`: its `enter` makes the streams from the embedding and `Batch.hidden`, then
starts a V4 layer on them (`V4DecoderLayer.enter_streams`), and its body is that layer's with the
MTP's hyper head, whose `FinalResidual` hands on the streams y before it. The hidden state the
target's steps hand the drafter and the drafter's own are therefore streams flattened to
[T, N * D] (`ForwardOutput.hidden`, `Batch.hidden`): a further draft continues from y as the first
continues from h.

Checkpoints: DeepSeek's files name the layer `mtp.0.` (transformers' deepseek_v4 skips those
tensors), with `e_proj`, `h_proj` (FP8 linears in the released files), `enorm`, `hnorm`, `norm`,
`hc_head_fn` / `_base` / `_scale`, and a full layer's tensors (`attn.*`, `attn_norm`, `ffn_norm`,
`hc_attn_*`, `hc_ffn_*`, `ffn.gate.*`, `ffn.experts.*`, `ffn.shared_experts.*`), read under the
names `params.canonical_names` gives them (`mtp.0.attn.norm.weight`, `mtp.0.hc_head.hc_fn`), its
quantized weights as the decoder layers' (`quant_layout`).

Its layer is of the attention type its compress ratio says (`V4Config.mtp_compress_ratio`, read from the
released configs' `compress_ratios`, whose entry num_hidden_layers is the MTP layer's, as DeepSeek's
inference code builds its MTP block as the layer of that index; `config_released`): 0 (the released
configs', and the default where a config gives none) a sliding-window layer, the CSA rate (4 as
released) a CSA layer with its compressor and indexer, the HCA rate (128) an HCA layer. It is built,
loaded and run as a decoder layer of that type is (`V4DecoderLayer`): the same tensors, a compressed one
rotating with the compress rope, the same cache leaves in its own state, its entries in the cache group
of that type, which the target's state holds even where no decoder layer is of that type
(`layers.compressed_types`), so the target's tables address the drafter's cache. Its window and
compressor inputs are read back in cache group 0 as far as a decoder layer of its type reads
(`lookback`), which the target's layers must reach too (`init_drafter_state` refuses a state they do
not; with the released window of 128 tokens, every type's reach is within it). Its MoE routes by the
learned router: the released configs' hash-routed layers are the first few only (the MTP layer's index,
num_hidden_layers, is past them).

Across ranks its V4 layer is cut as a decoder layer is (`shard`: the family's split rule names tensors
by suffix, so `mtp.0.attn.wq_b.weight` is cut as `model.layers.0.attn.wq_b.weight`, FP8 and FP4 pairs
with their scales): query heads and output groups split, its MoE by columns or, expert-parallel, by
whole routed experts (`expert_shard`); its attention output and MoE block meet in the decoder layers'
all-reduces. `e_proj`, `h_proj`, the norms and the hyper head are whole on every rank. The two
projections are [D, D] maps of the residual streams, which every rank holds whole: a cut would need a
gather (rows) or an all-reduce (columns) of D values a stream per token, to save 2 D^2 values a rank
(34 M at D = 4096, a small part of the layer), and whole they give every rank the same bits, so
the layer's mHC weights and router agree across ranks without a collective, as the decoder layers' do.
The embedding and head are the model's, split by vocabulary rows as its own.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import torch

from mla_func.core.batch import BatchError
from mla_func.core.config import ModelConfig
from mla_func.core.family import MTPFamily
from mla_func.core.layers import FinalResidual, LayerContext
from mla_func.core.model import Model
from mla_func.core.params import Params, TensorFetch
from mla_func.kernels.quantized import Weight
from mla_func.models.expert_parallel import expert_range
from mla_func.models.v4.config import SLIDING, v4_fields
from mla_func.models.v4.expert_shard import v4_expert_shard_layer
from mla_func.models.v4.hyper_connections import HyperResidual
from mla_func.models.v4.layers import V4DecoderLayer, V4Entered
from mla_func.models.v4.params import V4LayerParams, v4_layer_shapes
from mla_func.models.v4.params_load import V4Reader, v4_rope_tables
from mla_func.parallel.config import Parallel
from mla_func.pytree import register_dataclass
from mla_func.state.layer_cache import CacheGroup
from mla_func.state.v4_cache import V4LayerCache

__all__ = ["V4_MTP", "V4MTPLayer", "V4MTPParams", "v4_mtp_layer", "v4_mtp_tensor_shapes"]

# The first MTP layer's checkpoint prefix (DeepSeek's, kept by `params.canonical_names`).
PREFIX = "mtp.0."
# Its MoE routes by the learned router: hash routing is for the first layers only.
MLP_TYPE = "moe"


@register_dataclass
@dataclass(frozen=True, slots=True)
class V4MTPParams:
    """One V4 MTP layer; the embedding and LM head are the model's (`drafter_params` takes them there)."""

    enorm: torch.Tensor    # [D]
    hnorm: torch.Tensor    # [D]
    e_proj: Weight         # [D, D] (a tensor or an FP8 pair)
    h_proj: Weight         # [D, D]
    layer: V4LayerParams   # a layer of the MTP's attention type, its hc_head the MTP's own hyper head
    norm: torch.Tensor     # [D] the norm after that hyper head


@dataclass(frozen=True, slots=True)
class V4MTPLayer:
    """The layer kind of V4's MTP layer: the streams from embedding and hidden state, then a V4 layer of
    the MTP layer's attention type that ends with its own hyper head (`base`, `v4_mtp_layer`)."""

    base: V4DecoderLayer
    name: str = "v4 mtp"

    def init_cache(self, config: ModelConfig, groups: tuple[CacheGroup, ...], *, dtype: torch.dtype,
                   device: torch.device | str) -> V4LayerCache:
        return self.base.init_cache(config, groups, dtype=dtype, device=device)

    def lookback(self, config: ModelConfig) -> int:
        return self.base.lookback(config)

    def enter(self, p: V4MTPParams, delta: torch.Tensor, residual: Any,
              ctx: LayerContext) -> tuple[V4Entered, torch.Tensor]:
        """delta [T, D] the rows' token embeddings, `batch.hidden` [T, N * D] the streams each row continues
        from -> what the V4 layer enters with for the streams [T, N, D]."""
        if residual is not None:
            raise ValueError("V4MTPLayer.enter: an MTP layer is the first layer of a drafter (residual must be None)")
        hidden = ctx.batch.hidden
        if hidden is None:
            raise BatchError("hidden: a drafter step needs the hidden state each row continues from (batch.hidden)")
        n, d = v4_fields(ctx.config).hc_mult, ctx.config.hidden_size
        if hidden.shape[1] != n * d:
            raise BatchError(f"hidden: a DeepSeek-V4 drafter reads the target's {n} streams of {d} (width {n * d}, "
                             f"hc_mult * hidden_size), got width {hidden.shape[1]}")
        eps, dense = ctx.config.rms_norm_eps, ctx.ops.dense
        e = dense.rms_norm_linear(delta, p.enorm, eps, p.e_proj)                                     # [T, D]
        h = dense.rms_norm_linear(hidden.to(delta.dtype).reshape(-1, d), p.hnorm, eps, p.h_proj)     # [T * N, D]
        streams = e.unsqueeze(1) + h.view(-1, n, d)                                                  # [T, N, D]
        return self.base.enter_streams(p.layer, streams, ctx)

    def body(self, p: V4MTPParams, entered: V4Entered, residual: torch.Tensor, cache: V4LayerCache,
             ctx: LayerContext) -> tuple[torch.Tensor, HyperResidual | FinalResidual, V4LayerCache]:
        """-> (the MTP's hyper head's output [T, D], FinalResidual(zeros, its streams [T, N * D]), cache)."""
        return self.base.body(p.layer, entered, residual, cache, ctx)


def v4_mtp_layer(config: ModelConfig) -> V4MTPLayer:
    """The kind of the first MTP layer of `config`: its V4 layer of type `V4Config.mtp_layer_type`."""
    return V4MTPLayer(V4DecoderLayer(v4_fields(config).mtp_layer_type, head=True))


def v4_mtp_tensor_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """The first MTP layer's tensors, by name (`mtp.0.`, as `params.canonical_names` names them), with shapes."""
    d, n = config.hidden_size, v4_fields(config).hc_mult
    own = {"enorm.weight": (d,), "hnorm.weight": (d,), "norm.weight": (d,), "e_proj.weight": (d, d),
           "h_proj.weight": (d, d), "hc_head.hc_fn": (n, n * d), "hc_head.hc_base": (n,), "hc_head.hc_scale": (1,)}
    return {**{PREFIX + name: shape for name, shape in own.items()},
            **v4_layer_shapes(config, PREFIX, v4_fields(config).mtp_layer_type, MLP_TYPE)}


def _no_optional_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    # DeepSeek-V4's MTP layer shares the model's embedding and head: its files hold no copies.
    return {}


def _rope(kind: str, params: Params, own: tuple[torch.Tensor, torch.Tensor] | None
          ) -> tuple[torch.Tensor, torch.Tensor]:
    """The (cos, sin) tables [P, R / 2] a layer of attention type `kind` rotates with, covering the positions
    `params`' tables cover now (an engine may have extended them): a sliding layer the model's main tables,
    a compressed one the compress rope's, as a compressed decoder layer holds them, else `own` (the MTP
    layer's, when as long), else built afresh."""
    if kind == SLIDING:
        return params.rope_cos, params.rope_sin
    positions = params.rope_cos.shape[0]
    for layer in params.layers:
        if layer.attn.compressor is not None:
            return layer.attn.rope_cos, layer.attn.rope_sin
    if own is not None and own[0].shape[0] == positions:
        return own
    return v4_rope_tables(params.config, params.rope_cos.device, positions)[1]


def _load(config: ModelConfig, params: Params, fetch: TensorFetch, dtype: torch.dtype, device: torch.device | str,
          present: frozenset[str], parallel: Parallel | None) -> V4MTPParams:
    """The first MTP layer (`MTPFamily.load`), of its attention type (`V4Config.mtp_layer_type`); its layer
    rotates with the model's RoPE tables of that type (`_rope`). `fetch` reads a rank's shard under
    `parallel` (cut as the module docstring says); with expert parallelism the layer's MoE block holds the
    rank's own routed experts, as a decoder layer's does."""
    read = V4Reader(config, fetch, dtype, device)
    head = read.hyper_head(PREFIX + "hc_head.")
    kind = v4_fields(config).mtp_layer_type
    rope = _rope(kind, params, None)
    if parallel is not None and parallel.expert_parallel and parallel.tensor_parallel > 1:
        held = expert_range(config, parallel.rank, parallel.tensor_parallel)
        layer = v4_expert_shard_layer(read.layer(PREFIX, kind, MLP_TYPE, rope, routed=held, head=head), held)
    else:
        layer = read.layer(PREFIX, kind, MLP_TYPE, rope, head=head)
    return V4MTPParams(enorm=read.get(PREFIX + "enorm.weight"), hnorm=read.get(PREFIX + "hnorm.weight"),
                       e_proj=read.weight(PREFIX + "e_proj.weight"), h_proj=read.weight(PREFIX + "h_proj.weight"),
                       layer=layer, norm=read.get(PREFIX + "norm.weight"))


def _drafter_params(model: Model) -> Params:
    """The drafter's params: the MTP layer, rotating with the model's RoPE tables of its type as they are now
    (an engine may have extended them, `_rope`), its norm, and the model's embedding and head."""
    mtp: V4MTPParams = model.mtp
    base = model.params
    own = (mtp.layer.attn.rope_cos, mtp.layer.attn.rope_sin)
    cos, sin = _rope(v4_fields(model.config).mtp_layer_type, base, own)
    attn = dataclasses.replace(mtp.layer.attn, rope_cos=cos, rope_sin=sin)
    layer = dataclasses.replace(mtp, layer=dataclasses.replace(mtp.layer, attn=attn))
    return Params(embed=base.embed, layers=(layer,), norm=mtp.norm, lm_head=base.lm_head, rope_cos=base.rope_cos,
                  rope_sin=base.rope_sin, config=model.config, collectives=base.collectives)


def _prefix(config: ModelConfig) -> str:
    return PREFIX


def _hidden_size(config: ModelConfig) -> int:
    return v4_fields(config).hc_mult * config.hidden_size


V4_MTP = MTPFamily(layer_kind=v4_mtp_layer, prefix=_prefix, tensor_shapes=v4_mtp_tensor_shapes,
                   optional_shapes=_no_optional_shapes, load=_load, drafter_params=_drafter_params,
                   hidden_size=_hidden_size)
