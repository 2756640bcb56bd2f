"""MLA prefill: decompress the cached context, then varlen causal flash attention.

Algorithm (the "naive" form of MLA, as DeepSeek runs prefill): gather each
sequence's latent rows from the paged cache, expand them to per-head keys and
values with two matmuls (k_nope = c_kv @ W_UK^T, v = c_kv @ W_UV^T), and run a
flash-attention kernel whose scores are q_nope . k_nope + q_pe . k_pe, with k_pe
shared by all heads. Per query-key pair this costs 2 * (Dn + R + Dv) FLOPs a head,
against 2 * (2C + R) for attention in the latent space, so it is the cheaper form
whenever a step's query count is not far below its context length (a long
context with a few new tokens is decode's job).

The decompression covers all W * bs positions of each block table, so its cost
follows the padded width of the batch, not the real lengths. An FP8 latent cache
is dequantized as its rows are gathered (`latent_cache.latent_rows`), before the
two matmuls that read it: the only read of the cache here.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from ..checks import check_dtype, check_same_device, check_shape
from ..latent_cache import LatentCache, latent_rows
from ..quantized import Weight
from ._common import LN2, LOG2E, check_float, dot_precision, next_pow2
from .fp8_heads import check_up_projections, head_rows
from .latent_parts import check_latent_cache, latent_parts


@dataclass(frozen=True, slots=True)
class PrefillConfig:
    block_m: int
    block_n: int
    num_warps: int
    num_stages: int


# Chosen on an H100 by `bench/kernels.py --sweep` (bf16, Dn=128, R=64, Dv=128, 8K
# causal): 128 x 128 tiles over 8 warps ran 0.91 ms against 0.97-2.3 ms for the
# other candidates; three stages of 128-key tiles exceed shared memory.
_GPU_CONFIG = PrefillConfig(block_m=128, block_n=128, num_warps=8, num_stages=2)
# float32 tiles take twice the shared memory; correctness runs, not a fast path.
_GPU_FP32_CONFIG = PrefillConfig(block_m=64, block_n=32, num_warps=4, num_stages=2)
_INTERPRETER_CONFIG = PrefillConfig(block_m=16, block_n=16, num_warps=4, num_stages=1)


def prefill_config(device: torch.device, dtype: torch.dtype = torch.bfloat16) -> PrefillConfig:
    if device.type != "cuda":
        return _INTERPRETER_CONFIG
    return _GPU_FP32_CONFIG if dtype == torch.float32 else _GPU_CONFIG


@triton.jit
def _attend_tile(q_nope, q_pe, kn_ptrs, kr_ptrs, v_ptrs, key_mask, visible, acc, m_i, l_i, scale_log2,
                 DOT_PRECISION: tl.constexpr, MASKED: tl.constexpr):
    if MASKED:
        k_nope = tl.load(kn_ptrs, mask=key_mask[:, None], other=0.0)
        k_pe = tl.load(kr_ptrs, mask=key_mask[:, None], other=0.0)
        value = tl.load(v_ptrs, mask=key_mask[:, None], other=0.0)
    else:
        k_nope = tl.load(kn_ptrs)
        k_pe = tl.load(kr_ptrs)
        value = tl.load(v_ptrs)
    scores = tl.dot(q_nope, tl.trans(k_nope), input_precision=DOT_PRECISION)
    scores = tl.dot(q_pe, tl.trans(k_pe), scores, input_precision=DOT_PRECISION) * scale_log2
    if MASKED:
        scores = tl.where(visible, scores, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(scores, axis=1))
        # A row may see no key of this tile (or none yet): shift by 0 so that
        # exp2(-inf - -inf) never happens; its p and alpha stay 0 / 1 exactly.
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
    else:
        m_new = tl.maximum(m_i, tl.max(scores, axis=1))
        m_use = m_new
    alpha = tl.exp2(m_i - m_use)
    p = tl.exp2(scores - m_use[:, None])
    l_i = l_i * alpha + tl.sum(p, axis=1)
    acc = acc * alpha[:, None]
    acc = tl.dot(p.to(value.dtype), value, acc, input_precision=DOT_PRECISION)
    return acc, m_new, l_i


# The step's token and sequence counts stay unspecialised so that eager steps of
# new sizes reuse the compiled kernel.
@triton.jit(do_not_specialize=["num_tokens", "num_seqs"])
def _prefill_kernel(
    qn_ptr, qr_ptr, kn_ptr, kr_ptr, v_ptr,
    cu_q_ptr, seq_lens_ptr, pos_ptr, out_ptr, lse_ptr,
    num_tokens, num_seqs, scale_log2, s_cu, s_sl, s_pos,
    s_qn_t, s_qn_h, s_qn_d, s_qr_t, s_qr_h, s_qr_d,
    s_kn_b, s_kn_s, s_kn_h, s_kn_d,
    s_kr_b, s_kr_s, s_kr_d,
    s_v_b, s_v_s, s_v_h, s_v_d,
    s_o_t, s_o_h, s_o_d, s_l_t, s_l_h,
    NOPE_DIM: tl.constexpr, ROPE_DIM: tl.constexpr, V_DIM: tl.constexpr,
    BLOCK_B: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    # Largest tiles of a causal sequence come last in it; launching tiles in
    # reverse starts the long ones first and leaves short ones for the tail.
    tile = tl.num_programs(0) - 1 - tl.program_id(0)
    head = tl.program_id(1)
    offs_m = tl.arange(0, BLOCK_M)
    offs_dv = tl.arange(0, V_DIM)

    # Map the flat tile index to (sequence, tile within it) from cu_seqlens_q on
    # the device; every program redoes this O(B) scan instead of a separate launch.
    seq_ids = tl.arange(0, BLOCK_B)
    seq_mask = seq_ids < num_seqs
    q_lo = tl.load(cu_q_ptr + seq_ids * s_cu, mask=seq_mask, other=0)
    q_hi = tl.load(cu_q_ptr + (seq_ids + 1) * s_cu, mask=seq_mask, other=0)
    tiles = tl.where(seq_mask, tl.cdiv(q_hi - q_lo, BLOCK_M), 0)
    tiles_end = tl.cumsum(tiles, axis=0)
    total_tiles = tl.sum(tiles, axis=0)

    if tile < total_tiles:
        b = tl.sum((tiles_end <= tile).to(tl.int32), axis=0)
        this = seq_ids == b
        first_tile = tl.sum(tl.where(this, tiles_end - tiles, 0), axis=0)
        row_start = tl.sum(tl.where(this, q_lo, 0), axis=0)
        row_end = tl.sum(tl.where(this, q_hi, 0), axis=0)
        rows = (row_start + (tile - first_tile) * BLOCK_M + offs_m).to(tl.int64)
        row_mask = rows < row_end
        pos = tl.load(pos_ptr + rows * s_pos, mask=row_mask, other=0)
        seq_len = tl.load(seq_lens_ptr + b * s_sl).to(tl.int64)
        kv_end = tl.minimum(tl.max(tl.where(row_mask, pos, -1), axis=0) + 1, seq_len)
        # Keys below every row's position need no causal mask.
        min_pos = tl.min(tl.where(row_mask, pos, seq_len), axis=0)
        full_end = tl.maximum(tl.minimum(min_pos + 1, kv_end), 0) // BLOCK_N * BLOCK_N

        offs_dn = tl.arange(0, NOPE_DIM)
        offs_r = tl.arange(0, ROPE_DIM)
        q_nope = tl.load(qn_ptr + rows[:, None] * s_qn_t + head * s_qn_h + offs_dn[None, :] * s_qn_d,
                         mask=row_mask[:, None], other=0.0)
        q_pe = tl.load(qr_ptr + rows[:, None] * s_qr_t + head * s_qr_h + offs_r[None, :] * s_qr_d,
                       mask=row_mask[:, None], other=0.0)

        offs_n = tl.arange(0, BLOCK_N)
        kn_base = kn_ptr + b.to(tl.int64) * s_kn_b + head * s_kn_h + offs_dn[None, :] * s_kn_d
        kr_base = kr_ptr + b.to(tl.int64) * s_kr_b + offs_r[None, :] * s_kr_d
        v_base = v_ptr + b.to(tl.int64) * s_v_b + head * s_v_h + offs_dv[None, :] * s_v_d

        m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
        l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
        acc = tl.zeros([BLOCK_M, V_DIM], dtype=tl.float32)
        for n0 in range(0, full_end, BLOCK_N):
            keys = (n0 + offs_n).to(tl.int64)
            key_mask = keys < kv_end
            acc, m_i, l_i = _attend_tile(
                q_nope, q_pe,
                kn_base + keys[:, None] * s_kn_s, kr_base + keys[:, None] * s_kr_s, v_base + keys[:, None] * s_v_s,
                key_mask, key_mask[None, :], acc, m_i, l_i, scale_log2, DOT_PRECISION, False)
        for n0 in range(full_end, kv_end, BLOCK_N):
            keys = (n0 + offs_n).to(tl.int64)
            key_mask = keys < kv_end
            visible = (keys[None, :] <= pos[:, None]) & key_mask[None, :]
            acc, m_i, l_i = _attend_tile(
                q_nope, q_pe,
                kn_base + keys[:, None] * s_kn_s, kr_base + keys[:, None] * s_kr_s, v_base + keys[:, None] * s_v_s,
                key_mask, visible, acc, m_i, l_i, scale_log2, DOT_PRECISION, True)

        has_keys = l_i > 0.0
        l_safe = tl.where(has_keys, l_i, 1.0)
        out = acc / l_safe[:, None]
        lse = tl.where(has_keys, (m_i + tl.log2(l_safe)) * LN2, float("-inf"))
    else:
        # Programs past the real tiles cover the padded rows from cu_seqlens_q[B] on.
        pad_start = tl.load(cu_q_ptr + num_seqs * s_cu)
        rows = (pad_start + (tile - total_tiles) * BLOCK_M + offs_m).to(tl.int64)
        row_mask = rows < num_tokens
        out = tl.zeros([BLOCK_M, V_DIM], dtype=tl.float32)
        lse = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    tl.store(out_ptr + rows[:, None] * s_o_t + head * s_o_h + offs_dv[None, :] * s_o_d,
             out.to(out_ptr.dtype.element_ty), mask=row_mask[:, None])
    tl.store(lse_ptr + rows * s_l_t + head * s_l_h, lse, mask=row_mask)


def _check_head_dim(name: str, value: int) -> None:
    if value < 16 or value & (value - 1):
        raise ValueError(f"{name}: expected a power of two >= 16, got {value}")


def decompress_context(
    kv_cache: LatentCache,
    block_table: torch.Tensor,
    w_uk: Weight,
    w_uv: Weight,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-head keys and values of every block-table position.

    kv_cache [num_blocks, bs, C + R] (or an `FP8LatentCache`, dequantized), block_table [B, W],
    w_uk [H, Dn, C], w_uv [H, Dv, C] (tensors, or stacked FP8 pairs read by `fp8_heads.head_rows`)
    returns  k_nope [B, S, H, Dn], k_pe [B, S, R] (a view), value [B, S, H, Dv]; S = W * bs.
    """
    num_seqs, width = block_table.shape
    _, block_size, dim = kv_cache.shape
    num_heads, nope_dim, kv_lora_rank = w_uk.shape
    v_dim = w_uv.shape[1]
    context = width * block_size
    rows = latent_rows(kv_cache, block_table.long()).view(num_seqs, context, dim)              # [B, S, C+R]
    latent = rows[..., :kv_lora_rank]                                                           # [B, S, C]
    k_nope = head_rows(latent, w_uk)                                                            # bsc,(hd)c->bs(hd)
    value = head_rows(latent, w_uv)                                                             # bsc,(hv)c->bs(hv)
    return (
        k_nope.view(num_seqs, context, num_heads, nope_dim),
        rows[..., kv_lora_rank:],
        value.view(num_seqs, context, num_heads, v_dim),
    )


def flash_prefill(
    q_nope: torch.Tensor,
    q_pe: torch.Tensor,
    k_nope: torch.Tensor,
    k_pe: torch.Tensor,
    value: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    seq_lens: torch.Tensor,
    positions: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    *,
    softmax_scale: float,
    config: PrefillConfig | None = None,
) -> None:
    """The attention kernel alone, writing into `out` [T, H, Dv] and `lse` [T, H].

    Inputs as `prefill_attention` after `decompress_context`; shapes are checked there.
    """
    num_tokens, num_heads, nope_dim = q_nope.shape
    num_seqs = seq_lens.shape[0]
    config = config or prefill_config(q_nope.device, q_nope.dtype)
    # Each sequence has at most cdiv(len, BM) tiles, so cdiv(T, BM) + B programs
    # cover every real tile plus the padded rows after cu_seqlens_q[B].
    grid = (triton.cdiv(num_tokens, config.block_m) + num_seqs, num_heads)
    _prefill_kernel[grid](
        q_nope, q_pe, k_nope, k_pe, value,
        cu_seqlens_q, seq_lens, positions, out, lse,
        num_tokens, num_seqs, softmax_scale * LOG2E,
        cu_seqlens_q.stride(0), seq_lens.stride(0), positions.stride(0),
        *q_nope.stride(), *q_pe.stride(),
        *k_nope.stride(), *k_pe.stride(), *value.stride(),
        *out.stride(), *lse.stride(),
        NOPE_DIM=nope_dim, ROPE_DIM=q_pe.shape[-1], V_DIM=value.shape[-1],
        # At least 16: a step's prefill sequence count varies, and each new power of
        # two would compile another kernel in the middle of a run.
        BLOCK_B=max(16, next_pow2(num_seqs)), BLOCK_M=config.block_m, BLOCK_N=config.block_n,
        DOT_PRECISION=dot_precision(q_nope.dtype),
        num_warps=config.num_warps, num_stages=config.num_stages,
    )


def prefill_attention(
    q_nope: torch.Tensor,
    q_pe: torch.Tensor,
    kv_cache: LatentCache,
    block_table: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    seq_lens: torch.Tensor,
    positions: torch.Tensor,
    w_uk: Weight,
    w_uv: Weight,
    *,
    softmax_scale: float,
    config: PrefillConfig | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """MLA prefill: new tokens attend causally over their sequence's cache.

    The cache already holds this step's latent vectors.

    q_nope:       [T, H, Dn]      q_pe: [T, H, R] (rotated); any strides
    kv_cache:     [num_blocks, bs, C + R], same dtype as q, or an `FP8LatentCache` whose RoPE values
                  have q's dtype
    block_table:  [B, W] int32
    cu_seqlens_q: [B + 1] int32; rows from cu[B] on are padding
    seq_lens:     [B] int32 KV length of each sequence after this step
    positions:    [T] int64, token t sees key positions j <= positions[t], j < seq_lens[b]
    w_uk:         [H, Dn, C]      w_uv: [H, Dv, C], same dtype as q, or stacked FP8 pairs
    returns       out [T, H, Dv] in q's dtype, lse [T, H] float32; padded rows give 0 / -inf.
    Dn, R and Dv must be powers of two >= 16 (128, 64, 128 in DeepSeek V2/V3).
    """
    num_tokens, num_heads, nope_dim = q_nope.shape
    num_seqs, width = block_table.shape
    rope_dim = q_pe.shape[-1]
    kv_lora_rank = w_uk.shape[-1]
    v_dim = w_uv.shape[1]
    _, block_size, _ = kv_cache.shape
    check_shape("q_pe", q_pe, (num_tokens, num_heads, None))
    check_shape("kv_cache", kv_cache, (None, None, kv_lora_rank + rope_dim))
    check_shape("cu_seqlens_q", cu_seqlens_q, (num_seqs + 1,))
    check_shape("seq_lens", seq_lens, (num_seqs,))
    check_shape("positions", positions, (num_tokens,))
    check_shape("w_uk", w_uk, (num_heads, nope_dim, kv_lora_rank))
    check_shape("w_uv", w_uv, (num_heads, None, kv_lora_rank))
    check_float("q_nope", q_nope)
    parts = latent_parts(kv_cache, kv_lora_rank)
    check_latent_cache(parts, q_nope.dtype)
    check_dtype("q_pe", q_pe, (q_nope.dtype,))
    check_up_projections(q_nope.dtype, q_nope.device, w_uk=w_uk, w_uv=w_uv)
    check_dtype("block_table", block_table, (torch.int32,))
    check_dtype("cu_seqlens_q", cu_seqlens_q, (torch.int32,))
    check_dtype("seq_lens", seq_lens, (torch.int32,))
    check_dtype("positions", positions, (torch.int64,))
    check_same_device(q_nope=q_nope, q_pe=q_pe, kv_cache=parts.rope, block_table=block_table,
                      cu_seqlens_q=cu_seqlens_q, seq_lens=seq_lens, positions=positions)
    for name, size in (("Dn", nope_dim), ("R", rope_dim), ("Dv", v_dim)):
        _check_head_dim(name, size)
    device = q_nope.device
    config = config or prefill_config(device, q_nope.dtype)

    out = torch.empty((num_tokens, num_heads, v_dim), dtype=q_nope.dtype, device=device)
    lse = torch.empty((num_tokens, num_heads), dtype=torch.float32, device=device)
    if num_tokens == 0 or num_heads == 0:
        return out, lse

    k_nope, k_pe, value = decompress_context(kv_cache, block_table, w_uk, w_uv)
    flash_prefill(q_nope, q_pe, k_nope, k_pe, value, cu_seqlens_q, seq_lens, positions, out, lse,
                  softmax_scale=softmax_scale, config=config)
    return out, lse


def prefill_flops(visible_pairs: int, num_heads: int, nope_dim: int, rope_dim: int, v_dim: int,
                  context_rows: int, kv_lora_rank: int) -> dict[str, int]:
    """FLOPs of this algorithm: attention over visible (query, key) pairs, and decompression."""
    attention = 2 * visible_pairs * num_heads * (nope_dim + rope_dim + v_dim)
    decompress = 2 * context_rows * kv_lora_rank * num_heads * (nope_dim + v_dim)
    return {"attention": attention, "decompress": decompress, "total": attention + decompress}
