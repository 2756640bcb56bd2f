"""DeepSeek-V4's layer kinds: sliding-window, CSA and HCA attention layers, with hyper-connections.

A V4 layer's residual is N = hc_mult streams [T, N, D] (see `hyper_connections`).
`enter` is where the previous layer's output meets them: the previous layer hands
its MoE output as delta and, as residual, the streams with the write-back weights
still to apply (`HyperResidual`); one op writes it back and runs the attention's
mHC site on the new streams (the first layer starts from N copies of the
embedding and runs the site alone). `body` runs the attention, writes its output
back fused with the MoE block's site, runs the MoE block and hands on its output
and its pending write-back.

The last layer applies its write-back, collapses the streams with the model's
hyper head (its params hold it) and hands the forward that one hidden state as
delta with a zero residual, so the forward's final add-and-norm is the model's
final norm; the residual is a `FinalResidual` that also carries the streams before
the collapse, flattened [T, N * D]: the hidden state the MTP drafter continues from
(`models.v4.mtp`), whose own layer starts from streams (`enter_streams`).

Each kind's cache (`state.v4_cache.V4LayerCache`) holds the leaves that kind
needs; the compressed kinds' entries live in their own cache group
(`v4_cache_groups`): group 1.. in the order CSA, HCA, for the kinds the model has (its MTP
layer's kind included, which may be one no decoder layer has).
Group 0 is read only near a sequence's end; each kind's `lookback` says how far.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from mla_func.core.config import ModelConfig
from mla_func.core.layers import FinalResidual, LayerContext
from mla_func.models.v4.attention import v4_attention
from mla_func.models.v4.config import CSA, HCA, SLIDING, V4Config, v4_fields
from mla_func.models.v4.expert_shard import v4_feed_forward
from mla_func.models.v4.hyper_connections import HyperResidual
from mla_func.models.v4.params import HyperConnectionParams, V4LayerParams
from mla_func.state.layer_cache import CacheGroup
from mla_func.state.v4_cache import V4LayerCache, compressed_group, zeroed_v4_cache


def compressed_types(v: V4Config) -> tuple[str, ...]:
    """The compressed layer types the model has, its MTP layer's included (`V4Config.attention_types`: the
    drafter's cache is addressed by the target's tables, so the target's state has its group), in
    cache-group order (group 1, 2, ...)."""
    return tuple(t for t in (CSA, HCA) if t in v.attention_types)


def v4_cache_groups(v: V4Config, tokens: CacheGroup) -> tuple[CacheGroup, ...]:
    """Cache groups 1..: one per compressed layer type the model has, beside the token group."""
    return tuple(compressed_group(tokens, v.rate(t)) for t in compressed_types(v))


@dataclass(frozen=True, slots=True)
class V4Entered:
    """What a V4 layer's body reads: the attention's input and the mHC write-back weights."""

    x: torch.Tensor     # [T, D] the collapsed streams, normalised by attn_norm
    post: torch.Tensor  # [T, N] float32
    comb: torch.Tensor  # [T, N, N] float32



@dataclass(frozen=True, slots=True)
class V4DecoderLayer:
    """One V4 layer: `attention` is a V4 layer type, `head` marks the last layer; `kv_cache_dtype` the
    form of the cache it makes ("auto", or "fp8": `state.v4_cache`), which its body reads either way."""

    attention: str
    head: bool = False
    kv_cache_dtype: str = "auto"

    @property
    def name(self) -> str:
        return f"v4 {self.attention}"

    def init_cache(self, config: ModelConfig, groups: tuple[CacheGroup, ...], *, dtype: torch.dtype,
                   device: torch.device | str) -> V4LayerCache:
        v = v4_fields(config)
        if self.attention == SLIDING:
            return zeroed_v4_cache(groups, head_dim=v.head_dim, entry_group=0, compressor_width=0, index_dim=0,
                                   rope_dim=config.qk_rope_head_dim, dtype=dtype, device=device,
                                   kv_cache_dtype=self.kv_cache_dtype)
        entry_group = 1 + compressed_types(v).index(self.attention)
        expected = compressed_group(groups[0], v.rate(self.attention))
        # Each group has its own block count (group 0's may be bounded): the shape of an entry is what must agree.
        shape = (expected.block_size, expected.tokens_per_entry)
        if len(groups) <= entry_group or (groups[entry_group].block_size, groups[entry_group].tokens_per_entry) != shape:
            raise ValueError(f"{self.attention} layers keep their entries in cache group {entry_group} of blocks of "
                             f"{shape[0]} entries of {shape[1]} tokens; the state's groups are {groups} (make the "
                             "state with init_state(model, ...))")
        overlap = self.attention == CSA
        return zeroed_v4_cache(groups, head_dim=v.head_dim, entry_group=entry_group,
                               compressor_width=(2 if overlap else 1) * v.head_dim,
                               index_dim=v.index_head_dim if overlap else 0, rope_dim=config.qk_rope_head_dim,
                               dtype=dtype, device=device, kv_cache_dtype=self.kv_cache_dtype)

    def lookback(self, config: ModelConfig) -> int:
        """Tokens before a sequence's next position n that a later step of this layer reads from group 0.

        A row at p >= n reads the window keys of [p - sliding_window + 1, p], so sliding_window - 1
        before n. A row completing entry w (p = (w + 1) * rate - 1) pools the compressor inputs of its
        block [w * rate, p], and with CSA's overlap (c = 2; its indexer's compressor too) those of the
        block before: [(w - c + 1) * rate, p]. The lowest of these over p >= n is
        n - n % rate - (c - 1) * rate >= n - (c * rate - 1), equal when n % rate = rate - 1. Rows that
        complete no entry read inside the same range (`compress_entries`).
        """
        v = v4_fields(config)
        window = v.sliding_window - 1
        if self.attention == SLIDING:
            return window
        overlap = 2 if self.attention == CSA else 1
        return max(window, overlap * v.rate(self.attention) - 1)

    def _site(self, p: HyperConnectionParams, norm: torch.Tensor, streams: torch.Tensor, ctx: LayerContext
              ) -> V4Entered:
        v = v4_fields(ctx.config)
        x, post, comb = ctx.ops.v4.hc_site(streams, p.fn, p.base, p.scale, norm, iters=v.hc_sinkhorn_iters,
                                           hc_eps=v.hc_eps, norm_eps=ctx.config.rms_norm_eps)
        return V4Entered(x, post, comb)

    def _write_back_site(self, written: V4Entered | HyperResidual, out: torch.Tensor, streams: torch.Tensor,
                         p: HyperConnectionParams, norm: torch.Tensor, ctx: LayerContext
                         ) -> tuple[V4Entered, torch.Tensor]:
        """out [T, D] written back into streams [T, N, D] by `written`'s weights, then the site `p`, `norm`
        -> (the site's output, the new streams)."""
        v = v4_fields(ctx.config)
        new, x, post, comb = ctx.ops.v4.hc_write_back_site(
            written.post, written.comb, out, streams, p.fn, p.base, p.scale, norm, iters=v.hc_sinkhorn_iters,
            hc_eps=v.hc_eps, norm_eps=ctx.config.rms_norm_eps)
        return V4Entered(x, post, comb), new

    def enter(self, p: V4LayerParams, delta: torch.Tensor, residual: HyperResidual | None,
              ctx: LayerContext) -> tuple[V4Entered, torch.Tensor]:
        """delta: the embedding [T, D] (first layer, residual None) or the last layer's MoE output [T, D],
        which `residual` writes back -> (entered, streams [T, N, D])."""
        if residual is None:
            streams = delta.unsqueeze(1).expand(-1, v4_fields(ctx.config).hc_mult, -1).contiguous()
            return self.enter_streams(p, streams, ctx)
        return self._write_back_site(residual, delta, residual.streams, p.attn_hc, p.attn_norm, ctx)

    def enter_streams(self, p: V4LayerParams, streams: torch.Tensor, ctx: LayerContext
                      ) -> tuple[V4Entered, torch.Tensor]:
        """The start of a first layer whose streams [T, N, D] are given (not N copies of one embedding)
        -> (entered, streams)."""
        return self._site(p.attn_hc, p.attn_norm, streams, ctx), streams

    def body(self, p: V4LayerParams, entered: V4Entered, residual: torch.Tensor, cache: V4LayerCache,
             ctx: LayerContext) -> tuple[torch.Tensor, HyperResidual | FinalResidual, V4LayerCache]:
        """residual: the streams [T, N, D] -> (the MoE output [T, D], its pending write-back, cache); the last
        layer: (the hyper head's output [T, D], FinalResidual(zeros [T, D], the streams [T, N * D]), cache)."""
        out, cache = v4_attention(p.attn, entered.x, cache, ctx.batch, ctx.mode, self.attention, ctx.config, ctx.ops,
                                  inplace=ctx.inplace, rows=ctx.rows)
        ffn, streams = self._write_back_site(entered, out, residual, p.ffn_hc, p.ffn_norm, ctx)
        # A sharded layer's MoE shares meet across ranks inside (identities with one process).
        y = v4_feed_forward(p.mlp, ffn.x, ctx)
        if not self.head:
            return y, HyperResidual(streams, ffn.post, ffn.comb), cache
        if p.hc_head is None:
            raise ValueError("the last V4 layer's params must hold the hyper head (hc_head)")
        v = v4_fields(ctx.config)
        streams = ctx.ops.v4.hc_write_back(ffn.post, ffn.comb, y, streams)
        head = p.hc_head
        final = ctx.ops.v4.hc_head(streams, head.fn, head.base, head.scale, hc_eps=v.hc_eps,
                                   norm_eps=ctx.config.rms_norm_eps)
        return final, FinalResidual(torch.zeros_like(final), streams.flatten(1)), cache


def v4_layer_kinds(config: ModelConfig) -> tuple[V4DecoderLayer, ...]:
    """The kind of each layer of a V4 model, by its layer type."""
    types = v4_fields(config).layer_types
    return tuple(V4DecoderLayer(t, head=i == len(types) - 1) for i, t in enumerate(types))


def v4_fp8_cache_layer_kinds(config: ModelConfig) -> tuple[V4DecoderLayer, ...]:
    """The same layers over FP8 caches (`init_state(kv_cache_dtype="fp8")`, `state.v4_cache`)."""
    return tuple(dataclasses.replace(k, kv_cache_dtype="fp8") for k in v4_layer_kinds(config))


__all__ = ["V4DecoderLayer", "V4Entered", "compressed_types", "v4_cache_groups", "v4_fp8_cache_layer_kinds",
           "v4_layer_kinds"]
