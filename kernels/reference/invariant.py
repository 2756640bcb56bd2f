"""Batch-invariant reference ops: each row's bits depend on that row's inputs only.

A BLAS picks its code path by the problem's shape (a GEMV for one row, other
blockings for more), so `F.linear(x)[t]` may change in the last bits with the
number of rows of x. Here every product runs on tiles of exactly `ROW_TILE` rows
(`row_tiles`; the last one zero-padded): each BLAS call has one shape, so a row reduces the
same way in a batch of 1 or of 1000 (checked by tests/core/test_batch_invariance.py).

Attention (`mla_decode`) takes one query a row, cut into chunks of
`SPLIT_KEYS` keys at absolute positions and merged one chunk after the other,
so a row's result depends on its own keys only, not on the longest row of the
batch; the batch-invariant forward sends prefill rows through it as well.

DeepSeek-V4's ops (the `v4` group and the indexer's scores) are `v4_invariant`'s.
"""

from __future__ import annotations

import dataclasses
from typing import overload

import torch

from ..checks import as_dtype, check_shape
from ..dequantizing import (DequantizingAbsorbQuery, DequantizingFusedMoe, DequantizingLinear, DequantizingMlaDecode,
                            DequantizingRmsNormLinear, DequantizingSparseMlaDecode, DequantizingWriteLatentAbsorb)
from ..held_experts import HeldExperts
from ..latent_cache import LatentCache, latent_rows
from ..ops import Ops
from . import attention as ref_attention
from . import dsa as ref_dsa
from . import latent as ref_latent
from . import linear as ref_linear
from . import moe as ref_moe
from . import routing as ref_routing
from . import v4_invariant
from .norm import rms_norm
# ROW_TILE and linear are this table's too (the tests read them here).
from .row_tiles import ROW_TILE, by_row_tiles, linear

SPLIT_KEYS = 64


@overload
def rms_norm_linear(x: torch.Tensor, norm_weight: torch.Tensor, eps: float, weight: torch.Tensor, residual: None = None
                    ) -> torch.Tensor: ...
@overload
def rms_norm_linear(x: torch.Tensor, norm_weight: torch.Tensor, eps: float, weight: torch.Tensor, residual: torch.Tensor
                    ) -> tuple[torch.Tensor, torch.Tensor]: ...


def rms_norm_linear(x: torch.Tensor, norm_weight: torch.Tensor, eps: float, weight: torch.Tensor,
                    residual: torch.Tensor | None = None) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """`reference.linear.rms_norm_linear` with the batch-invariant `linear` (the norm is row-wise)."""
    if residual is None:
        return linear(rms_norm(x, norm_weight, eps), weight)
    normed, residual_out = rms_norm(x, norm_weight, eps, residual)
    return linear(normed, weight), residual_out


def absorb_query(q_nope: torch.Tensor, q_pe: torch.Tensor, w_uk: torch.Tensor) -> torch.Tensor:
    """`reference.attention.absorb_query` on ROW_TILE-row tiles: [B, H, Dn], [B, H, R] -> [B, H, C + R]."""
    return by_row_tiles(lambda qn, qp: ref_attention.absorb_query(qn, qp, w_uk), q_nope, q_pe)[0]


def write_latent_absorb(kv_cache: LatentCache, slot_mapping: torch.Tensor, latent: torch.Tensor,
                        kv_a_norm: torch.Tensor, q_nope: torch.Tensor, q_pe: torch.Tensor, w_uk: torch.Tensor,
                        positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, *, eps: float,
                        interleaved: bool, absorb_from: int,
                        inplace: bool = True) -> tuple[LatentCache, torch.Tensor, torch.Tensor]:
    """`reference.latent.write_latent_absorb` with the batch-invariant `absorb_query`."""
    if not 0 <= absorb_from <= q_pe.shape[0]:
        raise ValueError(f"absorb_from: expected in [0, {q_pe.shape[0]}], got {absorb_from}")
    kv_cache, q_pe = ref_latent.write_latent(kv_cache, slot_mapping, latent, kv_a_norm, q_pe, positions, cos, sin,
                                             eps=eps, interleaved=interleaved, inplace=inplace)
    return kv_cache, q_pe, absorb_query(q_nope[absorb_from:], q_pe[absorb_from:], w_uk)


def fused_moe(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
              topk_ids: torch.Tensor, *, out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """`reference.moe.fused_moe` on ROW_TILE-row tiles (padding rows take no expert): [T, D] -> [T, D]."""
    return by_row_tiles(lambda xt, wt, it: ref_moe.fused_moe(xt, w13, w2, wt, it, out_dtype=out_dtype),
                         x, topk_weights, topk_ids)[0]


def route(x: torch.Tensor, gate: torch.Tensor, e_score_correction_bias: torch.Tensor | None, valid: torch.Tensor, *,
          top_k: int, scoring_func: str, topk_method: str, n_group: int | None, topk_group: int | None,
          norm_topk_prob: bool, routed_scaling_factor: float, num_shared: int = 0,
          fixed_ids: torch.Tensor | None = None, held: HeldExperts | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """`reference.routing.route` on ROW_TILE-row tiles (the router logits are a product)."""
    # A tile's rows are numbered from 0: each tile gives every row the shared experts, and the rows
    # of other ranks lose them below, counted on the whole batch.
    tile_held = held if held is None else dataclasses.replace(held, rank=0, ranks=1)

    def tile(xt: torch.Tensor, vt: torch.Tensor, *fixed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return ref_routing.route(xt, gate, e_score_correction_bias, vt, top_k=top_k, scoring_func=scoring_func,
                                 topk_method=topk_method, n_group=n_group, topk_group=topk_group,
                                 norm_topk_prob=norm_topk_prob, routed_scaling_factor=routed_scaling_factor,
                                 num_shared=num_shared, fixed_ids=fixed[0] if fixed else None, held=tile_held)

    rows = (x, valid) if fixed_ids is None else (x, valid, fixed_ids)
    weights, ids = by_row_tiles(tile, *rows)
    if held is not None and held.ranks > 1 and num_shared:
        others = (torch.arange(x.shape[0], device=x.device) % held.ranks != held.rank).unsqueeze(-1)
        weights[:, top_k:].masked_fill_(others, 0.0)
        ids[:, top_k:].masked_fill_(others, -1)
    return weights, ids


def mla_decode(q: torch.Tensor, kv_cache: LatentCache, block_table: torch.Tensor, seq_lens: torch.Tensor, *,
               softmax_scale: float, kv_lora_rank: int, w_uv: torch.Tensor | None = None,
               q_len: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """`reference.attention.mla_decode` for one query a row, in SPLIT_KEYS-key chunks merged in order.

    q [B, H, C + R]; kv_cache [num_blocks, bs, C + R] (or an `FP8LatentCache`, read dequantized);
    block_table [B, W] int32; seq_lens [B] int32 (0: padded row); w_uv [H, Dv, C] or None
    returns out [B, H, C] (with w_uv [B, H, Dv]) in q's dtype, lse [B, H] float32.
    """
    if q_len != 1:
        raise ValueError(f"q_len: the batch-invariant decode takes one query a row (give each query its own row "
                         f"with its own seq_len), got q_len={q_len}")
    num_rows, num_heads, dim = q.shape
    check_shape("kv_cache", kv_cache, (None, None, dim))
    check_shape("block_table", block_table, (num_rows, None))
    check_shape("seq_lens", seq_lens, (num_rows,))
    block_size = kv_cache.shape[1]
    width = block_table.shape[1]
    acc = torch.float64 if q.dtype == torch.float64 else torch.float32
    qa = as_dtype(q, acc)                                                   # [B, H, C+R]
    m_run = torch.full((num_rows, num_heads), float("-inf"), dtype=acc, device=q.device)
    total = torch.zeros((num_rows, num_heads), dtype=acc, device=q.device)
    out = torch.zeros((num_rows, num_heads, kv_lora_rank), dtype=acc, device=q.device)
    offsets = torch.arange(SPLIT_KEYS, device=q.device)
    for start in range(0, width * block_size, SPLIT_KEYS):
        pos = start + offsets                                               # [S]
        pages = block_table.long()[:, (pos // block_size).clamp(max=width - 1)]   # [B, S]
        keys = as_dtype(latent_rows(kv_cache, pages, pos % block_size), acc)   # [B, S, C+R]
        scores = torch.bmm(qa, keys.transpose(1, 2)) * softmax_scale        # bhd,bsd->bhs
        visible = pos[None, :] < seq_lens[:, None]                          # [B, S]
        scores = scores.masked_fill(~visible[:, None, :], float("-inf"))
        chunk_max = scores.amax(dim=-1)
        shift = torch.where(torch.isinf(chunk_max), torch.zeros_like(chunk_max), chunk_max)
        probs = torch.exp(scores - shift[..., None])
        chunk_total = probs.sum(dim=-1)
        chunk_out = torch.bmm(probs, keys[..., :kv_lora_rank])               # bhs,bsc->bhc
        # In position order: chunks past a row's length add exact zeros.
        m_new = torch.maximum(m_run, chunk_max)
        m_shift = torch.where(torch.isinf(m_new), torch.zeros_like(m_new), m_new)
        rescale = torch.exp(m_run - m_shift)
        weight = torch.exp(shift - m_shift)
        total = total * rescale + chunk_total * weight
        out = out * rescale[..., None] + chunk_out * weight[..., None]
        m_run = m_new
    has_keys = total > 0
    out = as_dtype(out / torch.where(has_keys, total, torch.ones_like(total))[..., None], q.dtype)
    lse = torch.where(has_keys, m_run + torch.log(torch.where(has_keys, total, torch.ones_like(total))),
                      torch.full_like(total, float("-inf")))
    if w_uv is not None:
        check_shape("w_uv", w_uv, (num_heads, None, kv_lora_rank))
        out = by_row_tiles(lambda o: torch.bmm(o.transpose(0, 1), w_uv.transpose(1, 2)).transpose(0, 1), out)[0]
    return out, lse.float()


def sparse_mla_decode(q: torch.Tensor, kv_cache: LatentCache, block_table: torch.Tensor, indices: torch.Tensor, *,
                      softmax_scale: float, kv_lora_rank: int,
                      w_uv: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """`reference.dsa.sparse_mla_decode` (a fixed k keys a row) with W_UV on ROW_TILE-row tiles:
    q [T, H, C + R], indices [T, k] -> out [T, H, C] (with w_uv [T, H, Dv]), lse [T, H]."""
    out, lse = ref_dsa.sparse_mla_decode(q, kv_cache, block_table, indices, softmax_scale=softmax_scale,
                                         kv_lora_rank=kv_lora_rank)
    if w_uv is not None:
        check_shape("w_uv", w_uv, (q.shape[1], None, kv_lora_rank))
        out = by_row_tiles(lambda o: torch.bmm(o.transpose(0, 1), w_uv.transpose(1, 2)).transpose(0, 1), out)[0]
    return out, lse


def invariant_ops(base: Ops) -> Ops:
    """`base` (the reference table) with every op whose rows could depend on their batch-mates replaced."""
    return dataclasses.replace(
        base,
        batch_invariant=True,
        dense=dataclasses.replace(base.dense, linear=DequantizingLinear(linear), logits=ref_linear.logits_of(linear),
                                  rms_norm_linear=DequantizingRmsNormLinear(rms_norm_linear)),
        mla=dataclasses.replace(base.mla, write_latent_absorb=DequantizingWriteLatentAbsorb(write_latent_absorb),
                                absorb_query=DequantizingAbsorbQuery(absorb_query),
                                mla_decode=DequantizingMlaDecode(mla_decode)),
        moe=dataclasses.replace(base.moe, route=route, fused_moe=DequantizingFusedMoe(fused_moe)),
        dsa=dataclasses.replace(base.dsa, index_scores=v4_invariant.index_scores,
                                sparse_mla_decode=DequantizingSparseMlaDecode(sparse_mla_decode)),
        v4=dataclasses.replace(base.v4, window_entry_attention=v4_invariant.window_entry_attention,
                               compress_entries=v4_invariant.compress_entries, hc_site=v4_invariant.hc_site,
                               hc_write_back=v4_invariant.hc_write_back,
                               hc_write_back_site=v4_invariant.hc_write_back_site, hc_head=v4_invariant.hc_head,
                               clamped_experts=v4_invariant.clamped_experts),
    )
