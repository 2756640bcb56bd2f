"""Multi-head Latent Attention of one layer: projections, cache write, and the two attention paths.

Prefill rows decompress the cached latents into per-head keys and values and
attend causally; decode rows absorb the key up-projection into the query and
attend over the latent cache directly, then apply the value up-projection.
Both compute the same function (tests check `absorbed == decompressed`).

A batch-invariant step (`mode.batch_invariant`) sends every row, prefill rows
included, through the absorbed path, each row a query of its own over its own
sequence's keys (`LayerContext.rows`, made once a step by the forward): the two
paths agree only to rounding, and a token must get the same bits whether a
prefill chunk or a decode step computes it, and wherever a chunk boundary falls.
"""

from __future__ import annotations

from typing import TypeVar

import torch

from mla_func.core.batch import Batch, BatchError
from mla_func.core.config import ModelConfig
from mla_func.core.mode import ForwardMode
from mla_func.core.rows import RowMetadata
from mla_func.kernels import Ops
from mla_func.kernels.latent_cache import LatentCache
from mla_func.models.mla.params import AttentionParams

# DeepSeek's q_a and kv_a norms are built with RMSNorm's default epsilon, not
# the config's rms_norm_eps.
LATENT_NORM_EPS = 1e-6


def project(p: AttentionParams, qkv_a: torch.Tensor, config: ModelConfig, ops: Ops) -> tuple[torch.Tensor, torch.Tensor]:
    """qkv_a [T, Q + C + R] -> (q [T, H, Dn + R], latent [T, C + R]: c_kv not yet normalised, k_pe not rotated).

    qkv_a is the one GEMM (`qkv_a_proj`) of the normalised input that makes the
    query's first projection (Q = q_lora_rank, or H * (Dn + R) without one) and the
    latent; a low-rank query then goes through its norm and q_b_proj. Both results
    are views of qkv_a. Columns past them (a V3.2 indexer's, see `AttentionParams`) are
    not read: dense attention runs on sparse models' weights too.

    H is the heads these params hold, read from their shape (`w_uk` [H, Dn, C]): a rank of a
    tensor-parallel model holds num_attention_heads / size of them (`mla_func.parallel`), while
    the config stays the checkpoint's, the same on every rank.
    """
    heads = p.w_uk.shape[0]
    heads_dim = heads * config.qk_head_dim
    q_width = config.q_lora_rank or heads_dim
    q, latent = qkv_a[:, :q_width], qkv_a[:, q_width:q_width + config.kv_cache_dim]
    if p.q_b_proj is not None:
        if p.q_a_norm is None:
            raise ValueError("project: a low-rank query (q_b_proj) needs its norm (q_a_norm)")
        q = ops.dense.linear(ops.dense.rms_norm(q, p.q_a_norm, LATENT_NORM_EPS), p.q_b_proj)[:, :heads_dim]
    return q.view(qkv_a.shape[0], heads, config.qk_head_dim), latent


def decode_attention(
    p: AttentionParams,
    q: torch.Tensor,
    kv_cache: LatentCache,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    config: ModelConfig,
    ops: Ops,
    q_len: int = 1,
) -> torch.Tensor:
    """Absorbed attention of `q_len` causal query tokens per sequence, through the value up-projection.

    q [B * q_len, H, C + R] absorbed query (q_nope @ W_UK, then the rotated q_pe), the rows
    of sequence b in position order; block_table [B, W], seq_lens [B] -> [B * q_len, H, Dv]
    """
    out, _ = ops.mla.mla_decode(
        q,
        kv_cache,
        block_table,
        seq_lens,
        softmax_scale=config.softmax_scale,
        kv_lora_rank=config.kv_lora_rank,
        w_uv=p.w_uv,
        q_len=q_len,
    )
    return out


_M = TypeVar("_M")


def _segment(meta: _M | None, name: str) -> _M:
    """A segment's metadata, which `check_batch` made present whenever the mode has that segment."""
    if meta is None:
        raise BatchError(f"{name} metadata: the mode has a {name} segment, the batch has no metadata for it")
    return meta


def mla_attention(
    p: AttentionParams,
    qkv_a: torch.Tensor,
    kv_cache: LatentCache,
    batch: Batch,
    mode: ForwardMode,
    config: ModelConfig,
    ops: Ops,
    cos: torch.Tensor,
    sin: torch.Tensor,
    *,
    inplace: bool,
    rows: RowMetadata | None = None,
) -> tuple[torch.Tensor, LatentCache]:
    """One layer's attention over all rows of a step.

    qkv_a [T, Q + C + R] the layer's first projection of its normalised input (see
    `project`; the forward makes it with the norm, `ops.dense.rms_norm_linear`);
    kv_cache [num_blocks, bs, C + R] (a tensor, or an `FP8LatentCache`: the ops take either)
    rows: the step's per-row view (`LayerContext.rows`: block_table [T, W], key_lens [T]), which a
          batch-invariant mode needs; other modes do not read it
    returns (output [T, D], the layer's cache with this step's latents written)
    """
    q, latent = project(p, qkv_a, config, ops)
    q_nope, q_pe = q.split([config.qk_nope_head_dim, config.qk_rope_head_dim], dim=-1)
    if mode.batch_invariant:
        if rows is None:
            raise ValueError("mla_attention: a batch-invariant mode needs the step's row metadata (rows=, "
                             "LayerContext.rows, which the forward builds when rows.rows_needed holds)")
        return _row_attention(p, q_nope, q_pe, latent, kv_cache, batch, rows, config, ops, cos, sin, inplace)
    split = mode.padded_prefill_tokens
    # The write comes first so that prefill reads its own keys from the cache like any context;
    # decode rows get their absorbed query from the same op.
    latent_args = (kv_cache, batch.slot_mapping, latent, p.kv_a_norm)
    rope_args = (batch.positions, cos, sin)
    has_decode = mode.padded_decode_seqs > 0
    if has_decode:
        kv_cache, q_pe, q_absorbed = ops.mla.write_latent_absorb(
            *latent_args, q_nope, q_pe, p.w_uk, *rope_args, absorb_from=split, eps=LATENT_NORM_EPS,
            interleaved=config.rope_interleave, inplace=inplace)
    else:
        kv_cache, q_pe = ops.mla.write_latent(*latent_args, q_pe, *rope_args, eps=LATENT_NORM_EPS,
                                              interleaved=config.rope_interleave, inplace=inplace)

    outputs = []
    if mode.padded_prefill_seqs > 0:
        meta = _segment(batch.prefill, "prefill")
        out, _ = ops.mla.prefill_attention(
            q_nope[:split],
            q_pe[:split],
            kv_cache,
            meta.block_table,
            meta.cu_seqlens_q,
            meta.seq_lens,
            batch.positions[:split],
            p.w_uk,
            p.w_uv,
            softmax_scale=config.softmax_scale,
        )
        outputs.append(out)
    if has_decode:
        dmeta = _segment(batch.decode, "decode")
        outputs.append(decode_attention(p, q_absorbed, kv_cache, dmeta.block_table, dmeta.seq_lens, config, ops,
                                        mode.decode_q_len))
    out = outputs[0] if len(outputs) == 1 else torch.cat(outputs, dim=0)
    return ops.dense.linear(out.flatten(1), p.o_proj), kv_cache


def _row_attention(p: AttentionParams, q_nope: torch.Tensor, q_pe: torch.Tensor, latent: torch.Tensor,
                   kv_cache: LatentCache, batch: Batch, rows: RowMetadata, config: ModelConfig, ops: Ops,
                   cos: torch.Tensor, sin: torch.Tensor, inplace: bool) -> tuple[torch.Tensor, LatentCache]:
    """Every row through the absorbed path as a query of its own: q_nope [T, H, Dn], q_pe [T, H, R],
    latent [T, C + R] -> (output [T, D], the cache with the step's latents written)."""
    kv_cache, _, q_absorbed = ops.mla.write_latent_absorb(
        kv_cache, batch.slot_mapping, latent, p.kv_a_norm, q_nope, q_pe, p.w_uk, batch.positions, cos, sin,
        absorb_from=0, eps=LATENT_NORM_EPS, interleaved=config.rope_interleave, inplace=inplace)
    out = decode_attention(p, q_absorbed, kv_cache, rows.block_table, rows.key_lens, config, ops)
    return ops.dense.linear(out.flatten(1), p.o_proj), kv_cache
