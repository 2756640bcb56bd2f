"""One step's latents into the cache in one launch: norm of c_kv, rotation of k_pe and q_pe, the write.

At decode batch sizes the unfused sequence (RMSNorm, rotary embedding, a
concatenation, the cache write) is four launches of a microsecond or two of
work each; here one program per token does all of it, with the same rounding
as those ops (statistics and rotation in float32, each result rounded once).
`write_latent_absorb` adds the absorbed decode query (`absorb_query`) to the
same launch: its programs after the per-token ones multiply q_nope by W_UK (a
16-bit weight, or an FP8 pair whose tiles are dequantized as they are loaded,
`fp8_heads.head_tile`), and the per-token programs write the rotated q_pe of
decode rows into its tail.
An FP8 latent cache (`latent_cache.FP8LatentCache`) takes the normalised c_kv
quantized in the same program (`latent_parts.store_latent_values`), as
`reference.cache.write_kv` does, bit for bit.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from ..checks import check_dtype, check_same_device, check_shape
from ..latent_cache import LatentCache, cloned
from ..quantized import BlockFP8Weight
from ._common import check_float, dot_precision, next_pow2, pdl
from .absorb import ABSORB_BLOCK_C, absorb_block_b, absorb_tile
from .fp8_heads import check_head_weight, head_tiles
from .latent_parts import LatentParts, latent_parts, quant_group, store_latent_values
from .rope import rope_angles, rotate_heads


@triton.jit
def _latent_row(
    t, v_ptr, sc_ptr, r_ptr, slot_ptr, latent_ptr, norm_ptr, q_ptr, q_out_ptr, cos, sin, first, second,
    num_heads, block_size, eps,
    s_vn, s_vb, s_vd, s_scn, s_scb, s_scd, s_rn, s_rb, s_rd,
    s_slot, s_lt, s_ld, s_w, s_qt, s_qh, s_qd, s_qot, s_qoh,
    KV_LORA_RANK: tl.constexpr, HALF: tl.constexpr, ROUND_TO_WEIGHT: tl.constexpr,
    BLOCK_C: tl.constexpr, BLOCK_H: tl.constexpr, QUANT_GROUP: tl.constexpr, FP8: tl.constexpr,
):
    """Token t: rotate its q_pe into q_out, and write its normalised c_kv and rotated k_pe to its slot."""
    # The queries' rope part: every token, padded ones included (their output is never read).
    rotate_heads(q_ptr + t * s_qt, q_out_ptr + t * s_qot, num_heads, s_qh, s_qd, s_qoh, cos, sin, first, second,
                 HALF, BLOCK_H)

    slot = tl.load(slot_ptr + t * s_slot).to(tl.int64)
    if slot >= 0:
        row = latent_ptr + t * s_lt
        cols = tl.arange(0, BLOCK_C)
        cmask = cols < KV_LORA_RANK
        c = tl.load(row + cols * s_ld, mask=cmask, other=0.0)
        cf = c.to(tl.float32)
        inv_rms = 1.0 / tl.sqrt(tl.sum(cf * cf, axis=0) / KV_LORA_RANK + eps)
        normed = (cf * inv_rms).to(c.dtype).to(tl.float32)
        w = tl.load(norm_ptr + cols * s_w, mask=cmask, other=0.0).to(tl.float32)
        normed = w * normed
        if ROUND_TO_WEIGHT:
            # RMSNorm's result has the weight's dtype when it is also the input's;
            # for mixed dtypes it is float32, kept as is. The cache then takes its own.
            normed = normed.to(norm_ptr.dtype.element_ty)
        page = slot // block_size
        offset = slot % block_size
        store_latent_values(v_ptr + page * s_vn + offset * s_vb, sc_ptr + page * s_scn + offset * s_scb,
                            normed.to(tl.float32), s_vd, s_scd, KV_LORA_RANK, BLOCK_C, QUANT_GROUP, FP8)
        i = tl.arange(0, HALF)
        k_row = row + KV_LORA_RANK * s_ld
        k1 = tl.load(k_row + first * s_ld).to(tl.float32)
        k2 = tl.load(k_row + second * s_ld).to(tl.float32)
        k_ty = latent_ptr.dtype.element_ty
        k_dst = r_ptr + page * s_rn + offset * s_rb
        rope_ty = r_ptr.dtype.element_ty
        tl.store(k_dst + i * s_rd, (k1 * cos - k2 * sin).to(k_ty).to(rope_ty))
        tl.store(k_dst + (HALF + i) * s_rd, (k2 * cos + k1 * sin).to(k_ty).to(rope_ty))


@triton.jit
def _latent_token(
    t, v_ptr, sc_ptr, r_ptr, slot_ptr, latent_ptr, norm_ptr, q_ptr, q_out_ptr, pos_ptr, cos_ptr, sin_ptr,
    num_heads, block_size, eps,
    s_vn, s_vb, s_vd, s_scn, s_scb, s_scd, s_rn, s_rb, s_rd,
    s_slot, s_lt, s_ld, s_w, s_qt, s_qh, s_qd, s_qot, s_qoh, s_pos, s_ct, s_st,
    KV_LORA_RANK: tl.constexpr, HALF: tl.constexpr, INTERLEAVED: tl.constexpr, ROUND_TO_WEIGHT: tl.constexpr,
    BLOCK_C: tl.constexpr, BLOCK_H: tl.constexpr, QUANT_GROUP: tl.constexpr, FP8: tl.constexpr, GDC: tl.constexpr,
):
    """The per-token program of both latent kernels: wait for the previous kernel, look up
    token t's rope angles, do `_latent_row`; returns the angles (cos, sin, first, second)."""
    if GDC:
        gdc_wait()
        gdc_launch_dependents()
    pos = tl.load(pos_ptr + t * s_pos).to(tl.int64)
    cos, sin, first, second = rope_angles(cos_ptr, sin_ptr, pos, s_ct, s_st, HALF, INTERLEAVED)
    _latent_row(t, v_ptr, sc_ptr, r_ptr, slot_ptr, latent_ptr, norm_ptr, q_ptr, q_out_ptr, cos, sin, first, second,
                num_heads, block_size, eps,
                s_vn, s_vb, s_vd, s_scn, s_scb, s_scd, s_rn, s_rb, s_rd,
                s_slot, s_lt, s_ld, s_w, s_qt, s_qh, s_qd, s_qot, s_qoh,
                KV_LORA_RANK, HALF, ROUND_TO_WEIGHT, BLOCK_C, BLOCK_H, QUANT_GROUP, FP8)
    return cos, sin, first, second


@triton.jit
def _write_latent_kernel(
    v_ptr, sc_ptr, r_ptr, slot_ptr, latent_ptr, norm_ptr, q_ptr, q_out_ptr, pos_ptr, cos_ptr, sin_ptr,
    num_heads, block_size, eps,
    s_vn, s_vb, s_vd, s_scn, s_scb, s_scd, s_rn, s_rb, s_rd,
    s_slot, s_lt, s_ld, s_w, s_qt, s_qh, s_qd, s_qot, s_qoh, s_pos, s_ct, s_st,
    KV_LORA_RANK: tl.constexpr, HALF: tl.constexpr, INTERLEAVED: tl.constexpr, ROUND_TO_WEIGHT: tl.constexpr,
    BLOCK_C: tl.constexpr, BLOCK_H: tl.constexpr, QUANT_GROUP: tl.constexpr, FP8: tl.constexpr, GDC: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    _latent_token(t, v_ptr, sc_ptr, r_ptr, slot_ptr, latent_ptr, norm_ptr, q_ptr, q_out_ptr, pos_ptr, cos_ptr,
                  sin_ptr, num_heads, block_size, eps,
                  s_vn, s_vb, s_vd, s_scn, s_scb, s_scd, s_rn, s_rb, s_rd,
                  s_slot, s_lt, s_ld, s_w, s_qt, s_qh, s_qd, s_qot, s_qoh, s_pos, s_ct, s_st,
                  KV_LORA_RANK, HALF, INTERLEAVED, ROUND_TO_WEIGHT, BLOCK_C, BLOCK_H, QUANT_GROUP, FP8, GDC)


# Token counts follow the step: plain arguments, not one compile per count.
@triton.jit(do_not_specialize=["num_tokens", "absorb_from", "num_seqs"])
def _write_latent_absorb_kernel(
    v_ptr, sc_ptr, r_ptr, slot_ptr, latent_ptr, norm_ptr, q_ptr, q_out_ptr, pos_ptr, cos_ptr, sin_ptr,
    qn_ptr, wuk_ptr, wuks_ptr, qa_ptr,
    num_tokens, absorb_from, num_seqs, num_heads, num_col_blocks, block_size, eps,
    s_vn, s_vb, s_vd, s_scn, s_scb, s_scd, s_rn, s_rb, s_rd,
    s_slot, s_lt, s_ld, s_w, s_qt, s_qh, s_qd, s_qot, s_qoh, s_pos, s_ct, s_st,
    s_nt, s_nh, s_nd, s_wh, s_wd, s_wc, s_sh, s_sd, s_sc, s_at, s_ah, s_ad,
    KV_LORA_RANK: tl.constexpr, HALF: tl.constexpr, INTERLEAVED: tl.constexpr, ROUND_TO_WEIGHT: tl.constexpr,
    BLOCK_C: tl.constexpr, BLOCK_H: tl.constexpr, QUANT_GROUP: tl.constexpr, FP8: tl.constexpr,
    NOPE_DIM: tl.constexpr, BLOCK_B: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_AC: tl.constexpr,
    DOT_PRECISION: tl.constexpr, GDC: tl.constexpr,
    W_FP8: tl.constexpr, SCALE_D: tl.constexpr, SCALE_C: tl.constexpr,
    ONE_D_BLOCK: tl.constexpr, ONE_C_BLOCK: tl.constexpr,
):
    pid = tl.program_id(0)
    if pid < num_tokens:
        t = pid.to(tl.int64)
        cos, sin, first, second = _latent_token(
            t, v_ptr, sc_ptr, r_ptr, slot_ptr, latent_ptr, norm_ptr, q_ptr, q_out_ptr, pos_ptr, cos_ptr, sin_ptr,
            num_heads, block_size, eps,
            s_vn, s_vb, s_vd, s_scn, s_scb, s_scd, s_rn, s_rb, s_rd,
            s_slot, s_lt, s_ld, s_w, s_qt, s_qh, s_qd, s_qot, s_qoh, s_pos, s_ct, s_st,
            KV_LORA_RANK, HALF, INTERLEAVED, ROUND_TO_WEIGHT, BLOCK_C, BLOCK_H, QUANT_GROUP, FP8, GDC)
        if t >= absorb_from:
            # A decode row: its rotated q_pe is also the absorbed query's tail.
            rotate_heads(q_ptr + t * s_qt, qa_ptr + (t - absorb_from) * s_at + KV_LORA_RANK * s_ad, num_heads,
                         s_qh, s_qd, s_ah, cos, sin, first, second, HALF, BLOCK_H)
    else:
        tile = pid - num_tokens
        head = tile % num_heads
        col_block = (tile // num_heads) % num_col_blocks
        seq_block = tile // (num_heads * num_col_blocks)
        absorb_tile(head, col_block, seq_block, qn_ptr + absorb_from.to(tl.int64) * s_nt, qn_ptr, wuk_ptr, wuks_ptr,
                    qa_ptr, num_seqs, s_nt, s_nh, s_nd, 0, 0, 0, s_wh, s_wd, s_wc, s_sh, s_sd, s_sc, s_at, s_ah, s_ad,
                    NOPE_DIM, KV_LORA_RANK, 2 * HALF, BLOCK_B, BLOCK_D, BLOCK_AC, 16, DOT_PRECISION, GDC, False,
                    W_FP8, SCALE_D, SCALE_C, ONE_D_BLOCK, ONE_C_BLOCK)


def _check_latent_args(kv_cache: LatentCache, slot_mapping: torch.Tensor, latent: torch.Tensor,
                       kv_a_norm: torch.Tensor, q_pe: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor,
                       sin: torch.Tensor) -> LatentParts:
    """Raise ValueError unless the arguments fit the contract; the cache's leaves as the kernels take them."""
    num_tokens, _, rope_dim = q_pe.shape
    kv_lora_rank = kv_a_norm.shape[0]
    half = rope_dim // 2
    check_shape("kv_cache", kv_cache, (None, None, kv_lora_rank + rope_dim))
    check_shape("slot_mapping", slot_mapping, (num_tokens,))
    check_shape("latent", latent, (num_tokens, kv_lora_rank + rope_dim))
    check_shape("positions", positions, (num_tokens,))
    check_shape("cos", cos, (None, half))
    check_shape("sin", sin, tuple(cos.shape))
    if rope_dim % 2 or half & (half - 1):
        raise ValueError(f"q_pe: expected a rope dim of twice a power of two, got {rope_dim}")
    parts = latent_parts(kv_cache, kv_lora_rank)
    for name, tensor in (("kv_cache", parts.rope), ("latent", latent), ("kv_a_norm", kv_a_norm), ("q_pe", q_pe)):
        check_float(name, tensor)
    check_dtype("slot_mapping", slot_mapping, (torch.int32, torch.int64))
    check_same_device(kv_cache=parts.rope, slot_mapping=slot_mapping, latent=latent, kv_a_norm=kv_a_norm,
                      q_pe=q_pe, positions=positions, cos=cos, sin=sin)
    return parts


def _latent_constants(parts: LatentParts, kv_lora_rank: int) -> dict[str, int | bool]:
    """The latent tile's constexprs: its width, the quantization group in it, whether it is FP8."""
    block_c = next_pow2(kv_lora_rank)
    return dict(BLOCK_C=block_c, QUANT_GROUP=quant_group(block_c), FP8=parts.fp8)


def write_latent(
    kv_cache: LatentCache,
    slot_mapping: torch.Tensor,
    latent: torch.Tensor,
    kv_a_norm: torch.Tensor,
    q_pe: torch.Tensor,
    positions: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    *,
    eps: float,
    interleaved: bool,
    inplace: bool = True,
) -> tuple[LatentCache, torch.Tensor]:
    """Contract of `reference.latent.write_latent`, in one launch.

    kv_cache [num_blocks, bs, C + R] or an `FP8LatentCache`; slot_mapping [T] int32 / int64 (-1: padding,
    which writes nothing); latent [T, C + R], kv_a_norm [C], q_pe [T, H, R] (any
    strides); positions [T]; cos, sin [max_positions, R / 2], R / 2 a power of two.
    returns (kv_cache, a new contiguous rotated q_pe [T, H, R]); `inplace=False`
    clones the cache first.
    """
    num_tokens, num_heads, rope_dim = q_pe.shape
    kv_lora_rank = kv_a_norm.shape[0]
    half = rope_dim // 2
    _check_latent_args(kv_cache, slot_mapping, latent, kv_a_norm, q_pe, positions, cos, sin)
    if not inplace:
        kv_cache = cloned(kv_cache)
    parts = latent_parts(kv_cache, kv_lora_rank)
    q_out = torch.empty(q_pe.shape, dtype=q_pe.dtype, device=q_pe.device)
    if num_tokens:
        use_pdl = pdl(q_pe.device)
        _write_latent_kernel[(num_tokens,)](
            *parts.pointers(), slot_mapping, latent, kv_a_norm, q_pe, q_out, positions, cos, sin,
            num_heads, kv_cache.shape[1], float(eps), *parts.strides(),
            slot_mapping.stride(0), *latent.stride(), kv_a_norm.stride(0),
            *q_pe.stride(), q_out.stride(0), q_out.stride(1), positions.stride(0), cos.stride(0), sin.stride(0),
            KV_LORA_RANK=kv_lora_rank, HALF=half, INTERLEAVED=interleaved,
            ROUND_TO_WEIGHT=kv_a_norm.dtype == latent.dtype,
            BLOCK_H=next_pow2(num_heads), GDC=use_pdl, **_latent_constants(parts, kv_lora_rank),
            num_warps=4, launch_pdl=use_pdl,
        )
    return kv_cache, q_out


def write_latent_absorb(
    kv_cache: LatentCache,
    slot_mapping: torch.Tensor,
    latent: torch.Tensor,
    kv_a_norm: torch.Tensor,
    q_nope: torch.Tensor,
    q_pe: torch.Tensor,
    w_uk: torch.Tensor | BlockFP8Weight,
    positions: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    *,
    eps: float,
    interleaved: bool,
    absorb_from: int,
    inplace: bool = True,
) -> tuple[LatentCache, torch.Tensor, torch.Tensor]:
    """Contract of `reference.latent.write_latent_absorb`, in one launch.

    As `write_latent`, plus q_nope [T, H, Dn] and w_uk [H, Dn, C] (any strides) in q's dtype, or a stacked
    FP8 pair (values [H, Dn, C] float8_e4m3fn, scale_inv [H, ceil(Dn / bn), ceil(C / bk)] float32), each tile
    dequantized and rounded to q's dtype as the reference's dequantized weight is (`fp8_heads.head_tile`):
    returns (kv_cache, rotated q_pe [T, H, R], absorbed q [T - absorb_from, H, C + R]).
    """
    num_tokens, num_heads, rope_dim = q_pe.shape
    nope_dim = q_nope.shape[2]
    kv_lora_rank = kv_a_norm.shape[0]
    check_shape("q_nope", q_nope, (num_tokens, num_heads, None))
    check_dtype("q_nope", q_nope, (q_pe.dtype,))
    check_same_device(q_pe=q_pe, q_nope=q_nope)
    check_head_weight("w_uk", w_uk, q_pe, (num_heads, nope_dim, kv_lora_rank))
    if not 0 <= absorb_from <= num_tokens:
        raise ValueError(f"absorb_from: expected in [0, {num_tokens}], got {absorb_from}")
    _check_latent_args(kv_cache, slot_mapping, latent, kv_a_norm, q_pe, positions, cos, sin)
    if not inplace:
        kv_cache = cloned(kv_cache)
    parts = latent_parts(kv_cache, kv_lora_rank)
    device = q_pe.device
    q_out = torch.empty(q_pe.shape, dtype=q_pe.dtype, device=device)
    num_seqs = num_tokens - absorb_from
    q_absorbed = torch.empty((num_seqs, num_heads, kv_lora_rank + rope_dim), dtype=q_pe.dtype, device=device)
    if num_tokens == 0:
        return kv_cache, q_out, q_absorbed
    block_b = absorb_block_b(num_seqs)
    block_d = max(16, next_pow2(nope_dim))
    w = head_tiles(w_uk)
    num_col_blocks = triton.cdiv(kv_lora_rank, ABSORB_BLOCK_C)
    absorb_programs = num_heads * num_col_blocks * triton.cdiv(num_seqs, block_b)
    use_pdl = pdl(device)
    _write_latent_absorb_kernel[(num_tokens + absorb_programs,)](
        *parts.pointers(), slot_mapping, latent, kv_a_norm, q_pe, q_out, positions, cos, sin,
        q_nope, w.values, w.scales, q_absorbed,
        num_tokens, absorb_from, num_seqs, num_heads, num_col_blocks, kv_cache.shape[1], float(eps),
        *parts.strides(), slot_mapping.stride(0), *latent.stride(), kv_a_norm.stride(0),
        *q_pe.stride(), q_out.stride(0), q_out.stride(1), positions.stride(0), cos.stride(0), sin.stride(0),
        *q_nope.stride(), *w.values.stride(), *w.scales.stride(), *q_absorbed.stride(),
        KV_LORA_RANK=kv_lora_rank, HALF=rope_dim // 2, INTERLEAVED=interleaved,
        ROUND_TO_WEIGHT=kv_a_norm.dtype == latent.dtype, BLOCK_H=next_pow2(num_heads),
        **_latent_constants(parts, kv_lora_rank), NOPE_DIM=nope_dim, BLOCK_B=block_b, BLOCK_D=block_d,
        BLOCK_AC=ABSORB_BLOCK_C, DOT_PRECISION=dot_precision(q_pe.dtype), GDC=use_pdl,
        **w.constants(block_d, ABSORB_BLOCK_C), num_warps=4, launch_pdl=use_pdl,
    )
    return kv_cache, q_out, q_absorbed
