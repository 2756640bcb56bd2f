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

Its layer is a sliding-window layer with a learned-routing MoE: the released configs' `compress_ratios`
give the MTP layer 0 (no compression), and their hash-routed layers are the first few only (the MTP
layer's index, num_hidden_layers, is past them). The config read keeps no entry for it
(`config_released`), so a checkpoint whose MTP layer compresses would be read as a sliding one.

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
from mla_func.models.v4.params_load import V4Reader
from mla_func.parallel.config import Parallel
from mla_func.pytree import register_dataclass
from mla_func.state.layer_cache import CacheGroup
from mla_func.state.v4_cache import V4LayerCache

__all__ = ["V4_MTP", "V4MTPLayer", "V4MTPParams", "v4_mtp_tensor_shapes"]

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
    layer: V4LayerParams   # a sliding-window layer, its hc_head the MTP's own hyper head
    norm: torch.Tensor     # [D] the norm after that hyper head


@dataclass(frozen=True, slots=True)
class V4MTPLayer:
    """The layer kind of V4's MTP layer: the streams from embedding and hidden state, then a V4 layer
    that ends with its own hyper head (`base`)."""

    base: V4DecoderLayer = V4DecoderLayer(SLIDING, head=True)
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


MTP_LAYER = V4MTPLayer()


def v4_mtp_tensor_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """The first MTP layer's tensors, by name (`mtp.0.`, as `params.canonical_names` names them), with shapes."""
    d, n = config.hidden_size, v4_fields(config).hc_mult
    own = {"enorm.weight": (d,), "hnorm.weight": (d,), "norm.weight": (d,), "e_proj.weight": (d, d),
           "h_proj.weight": (d, d), "hc_head.hc_fn": (n, n * d), "hc_head.hc_base": (n,), "hc_head.hc_scale": (1,)}
    return {**{PREFIX + name: shape for name, shape in own.items()},
            **v4_layer_shapes(config, PREFIX, SLIDING, MLP_TYPE)}


def _no_optional_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    # DeepSeek-V4's MTP layer shares the model's embedding and head: its files hold no copies.
    return {}


def _load(config: ModelConfig, params: Params, fetch: TensorFetch, dtype: torch.dtype, device: torch.device | str,
          present: frozenset[str], parallel: Parallel | None) -> V4MTPParams:
    """The first MTP layer (`MTPFamily.load`); its layer rotates with the model's main RoPE tables. `fetch`
    reads a rank's shard under `parallel` (cut as the module docstring says); with expert parallelism the
    layer's MoE block holds the rank's own routed experts, as a decoder layer's does."""
    read = V4Reader(config, fetch, dtype, device)
    head = read.hyper_head(PREFIX + "hc_head.")
    rope = (params.rope_cos, params.rope_sin)
    if parallel is not None and parallel.expert_parallel and parallel.tensor_parallel > 1:
        held = expert_range(config, parallel.rank, parallel.tensor_parallel)
        layer = v4_expert_shard_layer(read.layer(PREFIX, SLIDING, MLP_TYPE, rope, routed=held, head=head), held)
    else:
        layer = read.layer(PREFIX, SLIDING, MLP_TYPE, rope, head=head)
    return V4MTPParams(enorm=read.get(PREFIX + "enorm.weight"), hnorm=read.get(PREFIX + "hnorm.weight"),
                       e_proj=read.weight(PREFIX + "e_proj.weight"), h_proj=read.weight(PREFIX + "h_proj.weight"),
                       layer=layer, norm=read.get(PREFIX + "norm.weight"))


def _drafter_params(model: Model) -> Params:
    """The drafter's params: the MTP layer, rotating with the model's RoPE tables as they are now (an engine
    may have extended them), its norm, and the model's embedding and head."""
    mtp: V4MTPParams = model.mtp
    base = model.params
    attn = dataclasses.replace(mtp.layer.attn, rope_cos=base.rope_cos, rope_sin=base.rope_sin)
    layer = dataclasses.replace(mtp, layer=dataclasses.replace(mtp.layer, attn=attn))
    return Params(embed=base.embed, layers=(layer,), norm=mtp.norm, lm_head=base.lm_head, rope_cos=base.rope_cos,
                  rope_sin=base.rope_sin, config=model.config, collectives=base.collectives)


def _layer_kind(config: ModelConfig) -> V4MTPLayer:
    return MTP_LAYER


def _prefix(config: ModelConfig) -> str:
    return PREFIX


def _hidden_size(config: ModelConfig) -> int:
    return v4_fields(config).hc_mult * config.hidden_size


V4_MTP = MTPFamily(layer_kind=_layer_kind, prefix=_prefix, tensor_shapes=v4_mtp_tensor_shapes,
                   optional_shapes=_no_optional_shapes, load=_load, drafter_params=_drafter_params,
                   hidden_size=_hidden_size)
