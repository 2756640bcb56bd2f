"""How the Triton kernels address the latent cache, in either format: three leaves, and tiles of them.

Every kernel that reads or writes the MLA latent cache takes it as `LatentParts`: base pointers and
strides of its latent values [nb, bs, C], their scales [nb, bs, ceil(C / 128)] and its RoPE values
[nb, bs, R], with FP8 (a constexpr) saying whether the values are float8_e4m3fn with scales. A plain
cache [nb, bs, C + R] is the same thing seen as two column views of one tensor, so each kernel has
one body for both formats, and the FP8 branches compile away for a plain cache.

Reads dequantize in the tile (`latent_values`): FP8 values times their group's scale in float32,
rounded to the RoPE values' dtype (the activations'), which the products then take as they take a
16-bit cache's tile: `FP8LatentCache.rows` exactly. Writes quantize a token's latent values by
group (`store_latent_values`) with the activation quantizer's arithmetic (`fp8_quant.quantize_tile`),
which matches `reference.cache.quantize_latent` bit for bit.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import triton
import triton.language as tl

from ..latent_cache import FP8_GROUP, LatentCache
from .fp8_quant import quantize_tile

# Kernels read module globals only as constexprs.
_GROUP = tl.constexpr(FP8_GROUP)


@dataclass(frozen=True, slots=True)
class LatentParts:
    """A latent cache's leaves as kernel arguments.

    values: [nb, bs, C]: a plain cache's first C columns (a view), or an FP8 cache's values
    scales: [nb, bs, ceil(C / 128)] float32 of an FP8 cache; a plain cache passes its values again,
            which no kernel reads (FP8 is then False)
    rope:   [nb, bs, R] in the activations' dtype (a plain cache's last R columns)
    fp8:    the values are FP8 and the scales are read
    """

    values: torch.Tensor
    scales: torch.Tensor
    rope: torch.Tensor
    fp8: bool

    def pointers(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(values, scales, rope): the kernels' three base pointers."""
        return self.values, self.scales, self.rope

    def strides(self) -> tuple[Any, ...]:
        """The strides of values, scales and rope, three each (block, offset, column)."""
        return (*self.values.stride(), *self.scales.stride(), *self.rope.stride())


def latent_parts(cache: LatentCache, kv_lora_rank: int) -> LatentParts:
    """The leaves of `cache` (a tensor [nb, bs, C + R] or an `FP8LatentCache`) as the kernels take them."""
    if isinstance(cache, torch.Tensor):
        values = cache[..., :kv_lora_rank]
        return LatentParts(values=values, scales=values, rope=cache[..., kv_lora_rank:], fp8=False)
    if cache.kv_lora_rank != kv_lora_rank:
        raise ValueError(f"kv_lora_rank: the FP8 cache holds {cache.kv_lora_rank} latent values a token, "
                         f"got {kv_lora_rank}")
    return LatentParts(values=cache.values, scales=cache.scales, rope=cache.rope, fp8=True)


def quant_group(block_c: int) -> int:
    """Columns of one quantization group in a write's tile of block_c (a power of two) latent columns:
    FP8_GROUP, or the whole tile when it is narrower (a latent of fewer than 128 values is one group)."""
    return min(FP8_GROUP, block_c)


@triton.jit
def latent_values(row, sc_row, key_mask, s_d, s_scd, C0: tl.constexpr, WIDTH: tl.constexpr, LIMIT: tl.constexpr,
                  OUT_TY: tl.constexpr, FP8: tl.constexpr):
    """Columns [C0, C0 + WIDTH) of the cache rows at pointers `row` [N], zeros where not key_mask [N] or at a
    column >= LIMIT -> [N, WIDTH]: as stored, or for FP8 values times their group's scale (at rows `sc_row`)
    in float32, rounded to OUT_TY."""
    cols = C0 + tl.arange(0, WIDTH)
    if C0 + WIDTH <= LIMIT:
        mask = key_mask[:, None]                    # on keys alone: the loads stay vectorised
    else:
        mask = key_mask[:, None] & (cols[None, :] < LIMIT)
    if FP8 and (C0 // _GROUP) * _GROUP == C0 and (WIDTH // _GROUP) * _GROUP == WIDTH and C0 + WIDTH <= LIMIT:
        # Whole groups (DeepSeek's 512 latent values): the tile as [N, groups, 128], each group times its
        # row's scale by a broadcast, then seen as [N, WIDTH]. On an H100 (decode, B64 x 32K, 128 heads, the
        # tiles of `decode._GPU_FP8_CONFIGS`) this ran 2.40 ms where spreading the scales over the columns by
        # selects (below) ran 2.74.
        groups = C0 // _GROUP + tl.arange(0, WIDTH // _GROUP)
        cols3 = groups[:, None] * _GROUP + tl.arange(0, _GROUP)[None, :]
        x3 = tl.load(row[:, None, None] + cols3[None, :, :] * s_d, mask=key_mask[:, None, None], other=0.0)
        s2 = tl.load(sc_row[:, None] + groups[None, :] * s_scd, mask=key_mask[:, None], other=0.0)
        return tl.reshape((x3.to(tl.float32) * s2[:, :, None]).to(OUT_TY), [x3.shape[0], WIDTH])
    x = tl.load(row[:, None] + cols[None, :] * s_d, mask=mask, other=0.0)
    if FP8:
        # A row's scales are loaded one group at a time, a value a row, and spread over their columns by
        # selects: a scale gathered for every value would be a load a value (and a tile as large as the
        # values' in shared memory once the loop is pipelined).
        group = cols // _GROUP
        scale = tl.zeros([x.shape[0], WIDTH], dtype=tl.float32)
        for g in tl.static_range(C0 // _GROUP, (C0 + WIDTH - 1) // _GROUP + 1):
            if g * _GROUP < LIMIT:
                s = tl.load(sc_row + g * s_scd, mask=key_mask, other=0.0)
                scale = tl.where((group == g)[None, :], s[:, None], scale)
        x = (x.to(tl.float32) * scale).to(OUT_TY)
    return x


@triton.jit
def latent_tile(v_ptr, sc_ptr, r_ptr, page, offset, key_mask,
                s_vn, s_vb, s_vd, s_scn, s_scb, s_scd, s_rn, s_rb, s_rd,
                KV_LORA_RANK: tl.constexpr, ROPE_DIM: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_R: tl.constexpr,
                FP8: tl.constexpr):
    """The cache rows at (page, offset) [N] int64 (zeros where not key_mask) -> (k_latent [N, BLOCK_C],
    k_pe [N, BLOCK_R]) in the RoPE values' dtype, the latent values dequantized (`latent_values`)."""
    out_ty = r_ptr.dtype.element_ty
    if FP8:
        r_row = r_ptr + page * s_rn + offset * s_rb
        k_latent = latent_values(v_ptr + page * s_vn + offset * s_vb, sc_ptr + page * s_scn + offset * s_scb,
                                 key_mask, s_vd, s_scd, 0, BLOCK_C, KV_LORA_RANK, out_ty, FP8)
        k_pe = latent_values(r_row, r_row, key_mask, s_rd, s_rd, 0, BLOCK_R, ROPE_DIM, out_ty, False)
    else:
        # A plain cache's RoPE values follow its latent values in the same row (`latent_parts` views one
        # tensor), so one row address serves both: a second per-key address cost 2-3% at 128 heads on an H100.
        row = v_ptr + page * s_vn + offset * s_vb
        k_latent = latent_values(row, row, key_mask, s_vd, s_vd, 0, BLOCK_C, KV_LORA_RANK, out_ty, False)
        k_pe = latent_values(row, row, key_mask, s_vd, s_vd, KV_LORA_RANK, BLOCK_R, KV_LORA_RANK + ROPE_DIM,
                             out_ty, False)
    return k_latent, k_pe


@triton.jit
def store_latent_values(v_dst, sc_dst, x, s_vd, s_scd, KV_LORA_RANK: tl.constexpr, BLOCK_C: tl.constexpr,
                        QUANT_GROUP: tl.constexpr, FP8: tl.constexpr):
    """One token's latent values x [BLOCK_C] float32 (zeros past KV_LORA_RANK) into the cache at
    v_dst: cast to the values' dtype, or for FP8 quantized by groups of QUANT_GROUP columns
    (`quant_group`) with each group's scale stored at sc_dst."""
    if FP8:
        groups = tl.arange(0, BLOCK_C // QUANT_GROUP)
        cols = groups[:, None] * QUANT_GROUP + tl.arange(0, QUANT_GROUP)[None, :]
        values, scales = quantize_tile(tl.reshape(x, [BLOCK_C // QUANT_GROUP, QUANT_GROUP]), False)
        tl.store(v_dst + cols * s_vd, values, mask=cols < KV_LORA_RANK)
        tl.store(sc_dst + groups * s_scd, scales, mask=groups * QUANT_GROUP < KV_LORA_RANK)
    else:
        cols = tl.arange(0, BLOCK_C)
        tl.store(v_dst + cols * s_vd, x.to(v_dst.dtype.element_ty), mask=cols < KV_LORA_RANK)


def check_latent_cache(parts: LatentParts, activations: torch.dtype) -> None:
    """ValueError unless the cache's reads come in the `activations` dtype (its RoPE values')."""
    if parts.rope.dtype != activations:
        raise ValueError(f"kv_cache: expected the activations' dtype {activations} (an FP8 cache's RoPE "
                         f"values too), got {parts.rope.dtype}")

