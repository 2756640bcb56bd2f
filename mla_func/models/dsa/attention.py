"""DeepSeek Sparse Attention (V3.2): MLA restricted to the keys the lightning indexer picks, as a layer kind.

Each row (a query token, in the prefill or the decode segment alike) gets its
indexer scores over every key its sequence has up to its own position, keeps the
`index_topk` best, and attends in latent space (absorbed) to those latent rows only.

Prefill rows take the absorbed path too, through the same op as decode rows. The
decompressed path pays off when many queries share one key set (one GEMM of
decompressed keys per sequence); here every row has its own key set, so
decompressing would expand up to k latents per row through W_UK and W_UV (H * (Dn
+ Dv) values each) where the absorbed path reads k latents of C + R values per
row once for all heads. One op for both segments also makes a token's result the
same whichever segment it is computed in, and mixed steps need nothing more.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from mla_func.core.config import ModelConfig
from mla_func.core.exchange import attention_output, shared_block
from mla_func.core.layers import LayerContext
from mla_func.kernels.index_cache import IndexCache
from mla_func.kernels.latent_cache import LatentCache
from mla_func.models.dsa.indexer import index_query_key, index_weight_scale
from mla_func.models.mla.attention import LATENT_NORM_EPS
from mla_func.models.mla.moe import feed_forward
from mla_func.models.mla.params import LayerParams
from mla_func.state.kv_cache import zeroed_dsa_cache
from mla_func.state.layer_cache import CacheGroup, DSALayerCache

__all__ = ["DSA_DECODER", "DSA_DECODER_FP8", "DSADecoderLayer", "sparse_mla_attention"]


def sparse_mla_attention(
    p: LayerParams,
    x: torch.Tensor,
    kv_cache: LatentCache,
    index_cache: IndexCache,
    ctx: LayerContext,
) -> tuple[torch.Tensor, LatentCache, IndexCache]:
    """One layer's sparse attention over all rows of a step.

    x [T, D] the layer's normalised input; kv_cache [num_blocks, bs, C + R] (a tensor or an
    `FP8LatentCache`);
    index_cache [num_blocks, bs, Di] (a tensor or an `FP8IndexCache`)
    ctx.rows: the step's per-row view (block_table [T, W], key_lens [T]), which the forward makes
    returns (output [T, D], the latent cache and the indexer-key cache with this step's rows written)
    """
    a, config, ops, batch = p.attn, ctx.config, ctx.ops, ctx.batch
    if (p.indexer is None or a.q_a_norm is None or a.q_b_proj is None or config.index_topk is None
            or config.q_lora_rank is None or config.index_head_dim is None):
        raise ValueError("sparse_mla_attention: a DeepSeek-V3.2 layer needs its indexer and a low-rank query "
                         f"(indexer: {p.indexer is not None}, q_b_proj: {a.q_b_proj is not None})")
    num_rows, index_dim = x.shape[0], config.index_head_dim
    # One GEMM for each input: the indexer's key and query rows follow the attention's (AttentionParams).
    qkv_a = ops.dense.linear(x, a.qkv_a_proj)
    q_a, latent, index_k = qkv_a.split([config.q_lora_rank, config.kv_cache_dim, index_dim], dim=-1)
    q_resid = ops.dense.rms_norm(q_a, a.q_a_norm, LATENT_NORM_EPS)                     # [T, Q]
    q_all = ops.dense.linear(q_resid, a.q_b_proj)
    # The heads these params hold (a tensor-parallel rank's share, see `mla.attention.project`); the
    # indexer's rows, whole on every rank, follow them, so every rank picks the same keys.
    heads = a.w_uk.shape[0]
    heads_dim = heads * config.qk_head_dim
    q = q_all[:, :heads_dim].view(num_rows, heads, config.qk_head_dim)
    q_nope, q_pe = q.split([config.qk_nope_head_dim, config.qk_rope_head_dim], dim=-1)
    # The writes come first, so that every row reads its own key from the caches like any other.
    kv_cache, _, q_absorbed = ops.mla.write_latent_absorb(
        kv_cache, batch.slot_mapping, latent, a.kv_a_norm, q_nope, q_pe, a.w_uk, batch.positions, ctx.rope_cos,
        ctx.rope_sin, eps=LATENT_NORM_EPS, interleaved=config.rope_interleave, absorb_from=0, inplace=ctx.inplace)
    index_q, index_key, head_weights = index_query_key(p.indexer, x, q_all[:, heads_dim:], index_k, batch.positions,
                                                       ctx.rope_cos, ctx.rope_sin, config, ops)
    index_cache = ops.dsa.write_index_key(index_cache, batch.slot_mapping, index_key, inplace=ctx.inplace)
    # Every row's own keys, made once a step by the forward (`rows.rows_needed`: this family attends by row).
    rows = ctx.rows
    if rows is None:
        raise ValueError("sparse_mla_attention: the step's row metadata (LayerContext.rows) is missing: the forward "
                         "builds it when rows.rows_needed holds (the family attends by row)")
    scores = ops.dsa.index_scores(index_q, head_weights, index_cache, rows.block_table, rows.key_lens,
                                  weight_scale=index_weight_scale(p.indexer))
    indices = ops.dsa.top_k_indices(scores, rows.key_lens, k=config.index_topk)       # [T, k]
    out, _ = ops.dsa.sparse_mla_decode(q_absorbed, kv_cache, rows.block_table, indices,
                                       softmax_scale=config.softmax_scale, kv_lora_rank=config.kv_lora_rank,
                                       w_uv=a.w_uv)                                    # [T, H, Dv]
    return ops.dense.linear(out.flatten(1), a.o_proj), kv_cache, index_cache


@dataclass(frozen=True, slots=True)
class DSADecoderLayer:
    """DeepSeek-V3.2's layer: sparse MLA over the latent cache picked by the indexer, then MLP or MoE.

    `enter` keeps the normalised input itself (not only its first projection, as the MLA
    layer does): the indexer's key and head weights are projections of it too.

    kv_cache_dtype: the format of the caches `init_cache` makes: the latents as `MLADecoderLayer`'s, and
                    the indexer's keys ("fp8": an `FP8IndexCache`, one byte a value and a scale a key).
    """

    name: str = "dsa"
    kv_cache_dtype: str = "auto"

    def init_cache(self, config: ModelConfig, groups: tuple[CacheGroup, ...], *, dtype: torch.dtype,
                   device: torch.device | str) -> DSALayerCache:
        if config.index_head_dim is None:
            raise ValueError(f"DSADecoderLayer: config of model_type {config.model_type!r} has no index_head_dim")
        return zeroed_dsa_cache(config.kv_lora_rank, config.qk_rope_head_dim, config.index_head_dim, groups[0],
                                dtype=dtype, device=device, kv_cache_dtype=self.kv_cache_dtype)

    def lookback(self, config: ModelConfig) -> int | None:
        """None: the indexer scores every earlier token, and any may be selected."""
        return None

    def enter(self, p: LayerParams, delta: torch.Tensor, residual: torch.Tensor | None,
              ctx: LayerContext) -> tuple[torch.Tensor, torch.Tensor]:
        """delta [T, D] -> (norm(residual + delta) [T, D], residual + delta)."""
        eps = ctx.config.rms_norm_eps
        if residual is None:
            return ctx.ops.dense.rms_norm(delta, p.input_norm, eps), delta
        return ctx.ops.dense.rms_norm(delta, p.input_norm, eps, residual=residual)

    def body(self, p: LayerParams, entered: torch.Tensor, residual: torch.Tensor, cache: DSALayerCache,
             ctx: LayerContext) -> tuple[torch.Tensor, torch.Tensor, DSALayerCache]:
        attn_out, kv, index_k = sparse_mla_attention(p, entered, cache.kv, cache.index_k, ctx)
        # Where a sharded layer's blocks meet, as in `MLADecoderLayer.body` (identities with one process).
        attn_out = attention_output(attn_out, ctx.ops.collectives)
        x, residual = ctx.ops.dense.rms_norm(attn_out, p.post_attention_norm, ctx.config.rms_norm_eps,
                                             residual=residual)
        # In place, the cache value is unchanged: keep it rather than build one per layer per step.
        same = kv is cache.kv and index_k is cache.index_k
        new_cache = cache if same else DSALayerCache(kv=kv, index_k=index_k, group=cache.group)
        out = shared_block(lambda rows, valid: feed_forward(p.mlp, rows, valid, ctx.config, ctx.ops), x, ctx.valid,
                           ctx.exchange, ctx.ops.collectives)
        return out, residual, new_cache


DSA_DECODER = DSADecoderLayer()
# The same layer over FP8 latent and indexer-key caches (`init_state(kv_cache_dtype="fp8")`).
DSA_DECODER_FP8 = DSADecoderLayer(kv_cache_dtype="fp8")
