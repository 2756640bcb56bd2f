"""Batch-invariant absorbed MLA decode: splits of a length set by the row alone, merged in order.

`decode.mla_decode` divides each sequence among a split count chosen from the
batch size (to fill the GPU), so a row's partial sums, and its bits, follow its
batch-mates. Here a row of length L is cut at multiples of
keys_per_split(L) = max(MIN_SPLIT_KEYS, the next power of two of L / LENGTH_SPLITS)
absolute positions, each split reduces its keys in tiles of the same width, and
the splits merge one after the other in position order. Every number a row
produces is then a function of its own query, its own keys and L: the same in a
batch of 1 or 256, in a graph or eagerly, and for a prompt token computed in a
prefill step (the batch-invariant forward sends prefill rows here too) or a
decode step. The value up-projection is the batch-invariant `bmm`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from ..latent_cache import LatentCache
from ._common import LOG2E, dot_precision, next_pow2, pdl
from .decode import _split_kernel, check_latent_attention_args, decode_config
from .invariant_matmul import bmm

# At most this many splits a row (fewer for short rows), each of at least
# MIN_SPLIT_KEYS keys: 1K keys make 8 splits, 32K keys 16 splits of 2K.
LENGTH_SPLITS = 16
MIN_SPLIT_KEYS = 128
# The interpreter (CPU tests) runs small lengths: smaller splits still give several.
_INTERPRETER_LENGTH_SPLITS = 4
_INTERPRETER_MIN_SPLIT_KEYS = 16


def split_policy(device: torch.device) -> tuple[int, int]:
    """(LENGTH_SPLITS, MIN_SPLIT_KEYS) on `device`."""
    if device.type != "cuda":
        return _INTERPRETER_LENGTH_SPLITS, _INTERPRETER_MIN_SPLIT_KEYS
    return LENGTH_SPLITS, MIN_SPLIT_KEYS


def max_splits(max_keys: int, device: torch.device) -> int:
    """The most splits any row of at most `max_keys` keys takes (the grid's split axis)."""
    length_splits, min_keys = split_policy(device)
    return max(1, min(length_splits, triton.cdiv(max_keys, min_keys)))


@triton.jit(do_not_specialize=["num_heads"])
def _merge_in_order_kernel(
    po_ptr, pl_ptr, seq_lens_ptr, out_ptr, lse_ptr,
    num_heads, s_sl,
    s_pob, s_poh, s_pos, s_pod,
    s_plb, s_plh, s_pls,
    s_ob, s_oh, s_lb, s_lh,
    KV_LORA_RANK: tl.constexpr, BLOCK_C: tl.constexpr,
    LENGTH_SPLITS: tl.constexpr, MIN_SPLIT_KEYS: tl.constexpr, GDC: tl.constexpr,
):
    pid = tl.program_id(0)
    if GDC:
        gdc_wait()
        gdc_launch_dependents()
    b = (pid // num_heads).to(tl.int64)
    h = pid % num_heads
    seq_len = tl.load(seq_lens_ptr + b * s_sl)
    keys_per_split = tl.full([], MIN_SPLIT_KEYS, tl.int32)
    while keys_per_split * LENGTH_SPLITS < seq_len:
        keys_per_split *= 2
    num_splits = tl.cdiv(seq_len, keys_per_split)
    offs_c = tl.arange(0, BLOCK_C)
    c_mask = offs_c < KV_LORA_RANK
    pl_row = pl_ptr + b * s_plb + h * s_plh
    po_row = po_ptr + b * s_pob + h * s_poh
    # Each split holds at least one key, so its LSE is finite: the running maximum
    # is finite from the first split on and no -inf - -inf arises.
    m_run = tl.full([], float("-inf"), tl.float32)
    total = tl.full([], 0.0, tl.float32)
    acc = tl.zeros([BLOCK_C], dtype=tl.float32)
    for s in range(0, num_splits):
        lse_s = tl.load(pl_row + s * s_pls)
        part = tl.load(po_row + s * s_pos + offs_c * s_pod, mask=c_mask, other=0.0)
        m_new = tl.maximum(m_run, lse_s)
        rescale = tl.exp(m_run - m_new)
        weight = tl.exp(lse_s - m_new)
        total = total * rescale + weight
        acc = acc * rescale + part * weight
        m_run = m_new
    has_keys = total > 0.0
    out = acc / tl.where(has_keys, total, 1.0)
    tl.store(out_ptr + b * s_ob + h * s_oh + offs_c, out.to(out_ptr.dtype.element_ty), mask=c_mask)
    lse = tl.where(has_keys, m_run + tl.log(tl.where(has_keys, total, 1.0)), float("-inf"))
    tl.store(lse_ptr + b * s_lb + h * s_lh, lse)


def mla_decode(
    q: torch.Tensor,
    kv_cache: LatentCache,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    *,
    softmax_scale: float,
    kv_lora_rank: int,
    w_uv: torch.Tensor | None = None,
    q_len: int = 1,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Contract of `reference.attention.mla_decode` for one query a row, batch-invariant.

    q [B, H, C + R] absorbed query; kv_cache [num_blocks, bs, C + R] (or an `FP8LatentCache`,
    read dequantized as `decode.mla_decode` reads it); block_table [B, W]
    int32; seq_lens [B] int32 (0: padded row); w_uv [H, Dv, C] or None
    returns out [B, H, C] (with w_uv [B, H, Dv]) in q's dtype, lse [B, H] float32.
    Several causal queries a sequence (q_len > 1) are given as one row each
    (`mla_func.core.rows.row_metadata`), which is what makes them equal to decode rows.
    """
    if q_len != 1:
        raise ValueError(f"q_len: the batch-invariant decode takes one query a row (give each query its own row "
                         f"with its own seq_len), got q_len={q_len}")
    num_rows, num_heads, dim = q.shape
    _, block_size, _ = kv_cache.shape
    parts = check_latent_attention_args(q, kv_cache, block_table, kv_lora_rank, w_uv, num_seqs=num_rows,
                                        seq_lens=seq_lens)
    device = q.device
    out = torch.empty((num_rows, num_heads, kv_lora_rank), dtype=q.dtype, device=device)
    lse = torch.empty((num_rows, num_heads), dtype=torch.float32, device=device)
    if num_rows:
        length_splits, min_keys = split_policy(device)
        splits = max_splits(block_table.shape[1] * block_size, device)
        partial_out = torch.empty((num_rows, num_heads, splits, kv_lora_rank), dtype=torch.float32, device=device)
        partial_lse = torch.empty((num_rows, num_heads, splits), dtype=torch.float32, device=device)
        config = decode_config(num_heads, device, parts.fp8)
        use_pdl = pdl(device)
        _split_kernel[(num_rows, triton.cdiv(num_heads, config.block_h), splits)](
            q, *parts.pointers(), block_table, seq_lens, partial_out, partial_lse,
            num_heads, splits, softmax_scale * LOG2E, seq_lens.stride(0),
            *q.stride(), *parts.strides(), *block_table.stride(),
            *partial_out.stride(), *partial_lse.stride(),
            KV_LORA_RANK=kv_lora_rank, ROPE_DIM=dim - kv_lora_rank, FP8=parts.fp8,
            BLOCK_C=next_pow2(kv_lora_rank), BLOCK_R=max(16, next_pow2(dim - kv_lora_rank)),
            BLOCK_H=config.block_h, BLOCK_N=config.block_n, PAGE_SIZE=block_size,
            DOT_PRECISION=dot_precision(q.dtype), GDC=use_pdl, Q_LEN=1, HEADS_PER_PROGRAM=config.block_h,
            LENGTH_SPLITS=length_splits, MIN_SPLIT_KEYS=min_keys,
            num_warps=config.num_warps, num_stages=config.num_stages, launch_pdl=use_pdl,
        )
        _merge_in_order_kernel[(num_rows * num_heads,)](
            partial_out, partial_lse, seq_lens, out, lse,
            num_heads, seq_lens.stride(0),
            *partial_out.stride(), *partial_lse.stride(), out.stride(0), out.stride(1), *lse.stride(),
            KV_LORA_RANK=kv_lora_rank, BLOCK_C=next_pow2(kv_lora_rank),
            LENGTH_SPLITS=length_splits, MIN_SPLIT_KEYS=min_keys, GDC=use_pdl,
            num_warps=4, launch_pdl=use_pdl,
        )
    if w_uv is None:
        return out, lse
    # [H, B, C] @ [H, C, Dv] -> [B, H, Dv], as views: out[b, h] @ w_uv[h]^T.
    value = torch.empty((num_rows, num_heads, w_uv.shape[1]), dtype=q.dtype, device=device)
    bmm(out.transpose(0, 1), w_uv.transpose(1, 2), out=value.transpose(0, 1))
    return value, lse
