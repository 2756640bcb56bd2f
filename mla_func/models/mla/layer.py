"""The MLA decoder layer kind: MLA over the latent cache, then a dense MLP or MoE, pre-norm residual."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from mla_func.core.config import ModelConfig
from mla_func.core.exchange import attention_output, shared_block
from mla_func.core.layers import LayerContext
from mla_func.models.mla.attention import mla_attention
from mla_func.models.mla.moe import feed_forward
from mla_func.models.mla.params import LayerParams
from mla_func.state.kv_cache import zeroed_mla_caches
from mla_func.state.layer_cache import CacheGroup, MLALayerCache


@dataclass(frozen=True, slots=True)
class MLADecoderLayer:
    """The MLA decoder layer: MLA over the latent cache, then a dense MLP or MoE, pre-norm residual.

    kv_cache_dtype: the format of the latent cache `init_cache` makes ("auto": the activations' dtype;
                    "fp8": `kernels.latent_cache.FP8LatentCache`). The body runs either: the ops
                    take the cache by its type.
    """

    name: str = "mla"
    kv_cache_dtype: str = "auto"

    def init_cache(self, config: ModelConfig, groups: tuple[CacheGroup, ...], *, dtype: torch.dtype,
                   device: torch.device | str) -> MLALayerCache:
        return zeroed_mla_caches(1, config.kv_lora_rank, config.qk_rope_head_dim, groups[0], dtype=dtype,
                                 device=device, kv_cache_dtype=self.kv_cache_dtype)[0]

    def lookback(self, config: ModelConfig) -> int | None:
        """None: every query attends to every earlier token's latent."""
        return None

    def enter(self, p: LayerParams, delta: torch.Tensor, residual: torch.Tensor | None,
              ctx: LayerContext) -> tuple[torch.Tensor, torch.Tensor]:
        """delta [T, D] -> (qkv_a [T, Q + C + R] of norm(residual + delta), residual + delta)."""
        eps = ctx.config.rms_norm_eps
        if residual is None:
            return ctx.ops.dense.rms_norm_linear(delta, p.input_norm, eps, p.attn.qkv_a_proj), delta
        qkv_a, residual = ctx.ops.dense.rms_norm_linear(delta, p.input_norm, eps, p.attn.qkv_a_proj, residual=residual)
        return qkv_a, residual

    def body(self, p: LayerParams, entered: torch.Tensor, residual: torch.Tensor, cache: MLALayerCache,
             ctx: LayerContext) -> tuple[torch.Tensor, torch.Tensor, MLALayerCache]:
        attn_out, kv = mla_attention(
            p.attn, entered, cache.kv, ctx.batch, ctx.mode, ctx.config, ctx.ops, ctx.rope_cos, ctx.rope_sin,
            inplace=ctx.inplace, rows=ctx.rows,
        )
        # A sharded layer's blocks meet across ranks here (`core.exchange`; identities with one process).
        attn_out = attention_output(attn_out, ctx.ops.collectives)
        x, residual = ctx.ops.dense.rms_norm(attn_out, p.post_attention_norm, ctx.config.rms_norm_eps, residual=residual)
        # In place, the cache value is unchanged: keep it rather than build one per layer per step.
        new_cache = cache if kv is cache.kv else MLALayerCache(kv=kv, group=cache.group)
        out = shared_block(lambda rows, valid: feed_forward(p.mlp, rows, valid, ctx.config, ctx.ops), x, ctx.valid,
                           ctx.exchange, ctx.ops.collectives)
        return out, residual, new_cache


MLA_DECODER = MLADecoderLayer()
# The same layer over an FP8 latent cache (`init_state(kv_cache_dtype="fp8")`).
MLA_DECODER_FP8 = MLADecoderLayer(kv_cache_dtype="fp8")
