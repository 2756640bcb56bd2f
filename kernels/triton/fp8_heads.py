"""MLA's per-head up-projections read from FP8: one head's weight tile dequantized in a kernel, and the
products that take it.

A model loaded from an FP8 checkpoint holds kv_b_proj as two stacked `BlockFP8Weight`s, W_UK
[H, Dn, C] and W_UV [H, Dv, C] (`quantized.split_heads`), one byte a value. A kernel reads one head's
[D, C] tile of either through `head_tile`: the FP8 values times their blocks' scales in float32,
rounded to the activations' dtype (the reference's dequantized weight exactly), then fed to the same
products as a 16-bit weight's tile; a `W_FP8` constexpr keeps the 16-bit path as it was. Where the
tile lies in one scale block along a side (DeepSeek's 128 x 128 blocks, Dn = Dv = 128, tiles whose
width divides 128), that side takes one scale instead of a gathered one per element.

The fused decode kernels take a pair that way: the latent write's absorbed query
(`latent.write_latent_absorb`) and the split merge's value projection (`decode_merge.merge_splits_value`,
small batches of `decode.mla_decode` and `dsa_decode.sparse_mla_decode`). The rest goes through
`_head_product_kernel`: per head h, y[t, h] = x[t, h] @ B_h, with B_h = W_UK[h] (the absorbed query of
`absorb.absorb_query`, q_nope @ W_UK: the reduction runs over the weight's rows) or W_UV[h]^T (the
value projection of large batches' attended latent: over its columns), each program one head, a
tile of output columns and a tile of rows. Prefill's keys and values are decompressed by `fp8_linear`
over the heads' rows (`head_rows`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from ..checks import check_dtype, check_same_device, check_shape
from ..latent_cache import LatentCache
from ..quantized import BlockFP8Weight, Weight, dequantized
from ._common import check_float, dot_precision, next_pow2, pdl
from .fp8_ops import fp8_pair
from .fp8_linear import fp8_linear

Tensor = torch.Tensor

# Output columns and reduction steps a program takes.
_BLOCK_N = 64
_BLOCK_K = 64


@triton.jit
def head_tile(
    w_ptr, s_ptr, rows, cols, row0, col0, row_mask, col_mask, s_wd, s_wc, s_sd, s_sc,
    DTYPE: tl.constexpr, W_FP8: tl.constexpr, SCALE_D: tl.constexpr, SCALE_C: tl.constexpr,
    ONE_D_BLOCK: tl.constexpr, ONE_C_BLOCK: tl.constexpr,
):
    """One head's weight tile w[rows, cols] ([len(rows), len(cols)], 0 outside the masks), w_ptr and s_ptr at
    the head; row0, col0 the tile's first row and column. A 16-bit weight's tile as stored; an FP8 pair's
    values times scale[d // SCALE_D, c // SCALE_C] in float32, rounded to DTYPE. ONE_D_BLOCK / ONE_C_BLOCK:
    every row / column of the tile lies in the block of row0 / col0, so that side loads one scale."""
    w = tl.load(w_ptr + rows[:, None] * s_wd + cols[None, :] * s_wc,
                mask=row_mask[:, None] & col_mask[None, :], other=0.0)
    if W_FP8:
        if ONE_D_BLOCK and ONE_C_BLOCK:
            scales = tl.load(s_ptr + (row0 // SCALE_D) * s_sd + (col0 // SCALE_C) * s_sc)
        elif ONE_D_BLOCK:
            scales = tl.load(s_ptr + (row0 // SCALE_D) * s_sd + (cols // SCALE_C)[None, :] * s_sc,
                             mask=col_mask[None, :], other=0.0)
        elif ONE_C_BLOCK:
            scales = tl.load(s_ptr + (rows // SCALE_D)[:, None] * s_sd + (col0 // SCALE_C) * s_sc,
                             mask=row_mask[:, None], other=0.0)
        else:
            scales = tl.load(s_ptr + (rows // SCALE_D)[:, None] * s_sd + (cols // SCALE_C)[None, :] * s_sc,
                             mask=row_mask[:, None] & col_mask[None, :], other=0.0)
        w = (w.to(tl.float32) * scales).to(DTYPE)
    return w


def within_block(length: int, tile: int, block: int) -> bool:
    """Whether every tile of `tile` along a side of `length`, the tiles starting at multiples of `tile`,
    lies in one block of `block` along it."""
    return length <= block or block % tile == 0


@dataclass(frozen=True, slots=True)
class HeadTiles:
    """A stacked up-projection as `head_tile` reads it: values [H, D, C] (the weight itself, or a pair's FP8
    values), scales [H, ceil(D / bn), ceil(C / bk)] float32 (a tensor's: its values, never read), block
    (bn, bk) ((1, 1) for a tensor)."""

    values: Tensor
    scales: Tensor
    block: tuple[int, int]
    fp8: bool

    def constants(self, tile_d: int, tile_c: int) -> dict[str, bool | int]:
        """`head_tile`'s constexprs for tiles of tile_d x tile_c that start at multiples of their sides."""
        bn, bk = self.block
        _, dim, kv_lora_rank = self.values.shape
        return dict(W_FP8=self.fp8, SCALE_D=bn, SCALE_C=bk,
                    ONE_D_BLOCK=not self.fp8 or within_block(dim, tile_d, bn),
                    ONE_C_BLOCK=not self.fp8 or within_block(kv_lora_rank, tile_c, bk))


def head_tiles(w: Tensor | BlockFP8Weight) -> HeadTiles:
    """w [H, D, C] (a tensor or a stacked FP8 pair, checked by the caller) as `head_tile` reads it."""
    if isinstance(w, BlockFP8Weight):
        return HeadTiles(w.values, w.scale_inv, w.block, True)
    return HeadTiles(w, w, (1, 1), False)


def check_head_weight(name: str, w: Weight, x: Tensor, shape: tuple[int | None, ...]) -> None:
    """ValueError naming `name` unless w is a tensor of `shape` in x's dtype or a stacked FP8 pair of `shape`,
    on x's device."""
    if isinstance(w, BlockFP8Weight):
        _check_pair(name, w, x, shape)
        return
    if not isinstance(w, torch.Tensor):
        raise ValueError(f"{name}: expected a tensor or a block-scaled FP8 pair, got {type(w).__name__}")
    check_shape(name, w, shape)
    check_dtype(name, w, (x.dtype,))
    check_same_device(x=x, **{name: w})


@triton.jit(do_not_specialize=["num_rows"])
def _head_product_kernel(
    x_ptr, w_ptr, ws_ptr, pe_ptr, out_ptr,
    num_rows, k_dim, n_dim,
    s_xt, s_xh, s_xk, s_wh, s_wk, s_wn, s_sh, s_sk, s_sn, s_pt, s_ph, s_pr, s_ot, s_oh, s_on,
    SCALE_K: tl.constexpr, SCALE_N: tl.constexpr, ONE_K_BLOCK: tl.constexpr, ONE_N_BLOCK: tl.constexpr,
    ROPE_DIM: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_B: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr, DOT_PRECISION: tl.constexpr, GDC: tl.constexpr, COPY_PE: tl.constexpr,
):
    head = tl.program_id(0)
    col_block = tl.program_id(1)
    rows = tl.program_id(2) * BLOCK_B + tl.arange(0, BLOCK_B)
    row_mask = rows < num_rows
    rows64 = rows.to(tl.int64)
    cols = col_block * BLOCK_N + tl.arange(0, BLOCK_N)
    col_mask = cols < n_dim
    if GDC:
        gdc_wait()
    w_head = w_ptr + head.to(tl.int64) * s_wh
    s_head = ws_ptr + head.to(tl.int64) * s_sh
    x_rows = x_ptr + rows64[:, None] * s_xt + head * s_xh
    acc = tl.zeros([BLOCK_B, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, k_dim, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_mask = ks < k_dim
        w = head_tile(w_head, s_head, ks, cols, k0, col_block * BLOCK_N, k_mask, col_mask, s_wk, s_wn, s_sk, s_sn,
                      x_ptr.dtype.element_ty, True, SCALE_K, SCALE_N, ONE_K_BLOCK, ONE_N_BLOCK)
        x = tl.load(x_rows + ks[None, :] * s_xk, mask=row_mask[:, None] & k_mask[None, :], other=0.0)
        acc = tl.dot(x, w, acc, input_precision=DOT_PRECISION)
    if GDC:
        gdc_launch_dependents()
    out_rows = out_ptr + rows64[:, None] * s_ot + head * s_oh
    tl.store(out_rows + cols[None, :] * s_on, acc.to(out_ptr.dtype.element_ty),
             mask=row_mask[:, None] & col_mask[None, :])
    if COPY_PE and col_block == 0:
        r = tl.arange(0, BLOCK_R)
        r_mask = row_mask[:, None] & (r < ROPE_DIM)[None, :]
        pe = tl.load(pe_ptr + rows64[:, None] * s_pt + head * s_ph + r[None, :] * s_pr, mask=r_mask)
        tl.store(out_rows + (n_dim + r[None, :]) * s_on, pe.to(out_ptr.dtype.element_ty), mask=r_mask)


def _launch(x: Tensor, w: BlockFP8Weight, out: Tensor, *, transpose: bool, pe: Tensor | None) -> None:
    """out[t, h, :N] = x[t, h] @ B_h, B_h = w[h] ([K, N]) or, with `transpose`, w[h]^T; with pe [T, H, R]
    also out[t, h, N:] = pe[t, h]. Shapes and dtypes checked by the callers."""
    num_rows, num_heads, k_dim = x.shape
    values, scales = w.values, w.scale_inv
    bn, bk = w.block
    strides: tuple[int, ...]
    if transpose:                      # B_h[k, n] = w[h, n, k]
        n_dim = values.shape[1]
        strides = (values.stride(0), values.stride(2), values.stride(1),
                   scales.stride(0), scales.stride(2), scales.stride(1))
        scale_k, scale_n = bk, bn
    else:                              # B_h[k, n] = w[h, k, n]
        n_dim = values.shape[2]
        strides = (*values.stride(), *scales.stride())
        scale_k, scale_n = bn, bk
    if num_rows == 0:
        return
    rope = pe if pe is not None else out
    rope_dim = pe.shape[2] if pe is not None else 1
    block_b = min(64, max(16, next_pow2(num_rows)))
    block_k = min(_BLOCK_K, max(16, next_pow2(k_dim)))
    use_pdl = pdl(x.device)
    _head_product_kernel[(num_heads, triton.cdiv(n_dim, _BLOCK_N), triton.cdiv(num_rows, block_b))](
        x, values, scales, rope, out,
        num_rows, k_dim, n_dim,
        *x.stride(), *strides, *rope.stride(), *out.stride(),
        SCALE_K=scale_k, SCALE_N=scale_n, ONE_K_BLOCK=within_block(k_dim, block_k, scale_k),
        ONE_N_BLOCK=within_block(n_dim, _BLOCK_N, scale_n), ROPE_DIM=rope_dim, BLOCK_R=max(16, next_pow2(rope_dim)),
        BLOCK_B=block_b, BLOCK_N=_BLOCK_N, BLOCK_K=block_k, DOT_PRECISION=dot_precision(x.dtype), GDC=use_pdl,
        COPY_PE=pe is not None, num_warps=4, launch_pdl=use_pdl,
    )


def _check_pair(name: str, w: BlockFP8Weight, x: Tensor, shape: tuple[int | None, ...]) -> None:
    if w.values.ndim != 3:
        raise ValueError(f"{name}: expected a stacked pair [H, D, C], got shape {list(w.shape)}")
    check_shape(name, w.values, shape)
    check_same_device(x=x, **{name: w.values, f"{name} scale_inv": w.scale_inv})


def fp8_absorb_query(q_nope: Tensor, q_pe: Tensor, w_uk: BlockFP8Weight) -> Tensor:
    """Contract of `reference.attention.absorb_query` with W_UK a stacked FP8 pair, in one launch.

    q_nope [B, H, Dn], q_pe [B, H, R] (any strides, one float dtype); w_uk values [H, Dn, C]
    float8_e4m3fn, scale_inv [H, ceil(Dn / bn), ceil(C / bk)] -> a new contiguous q [B, H, C + R]:
    each head's q_nope times its dequantized W_UK (rounded to q's dtype), products in float32."""
    num_heads, nope_dim, kv_lora_rank = w_uk.shape
    num_seqs = q_nope.shape[0]
    check_float("q_nope", q_nope)
    check_shape("q_nope", q_nope, (num_seqs, num_heads, nope_dim))
    check_shape("q_pe", q_pe, (num_seqs, num_heads, None))
    check_dtype("q_pe", q_pe, (q_nope.dtype,))
    _check_pair("w_uk", w_uk, q_nope, (num_heads, nope_dim, kv_lora_rank))
    out = torch.empty((num_seqs, num_heads, kv_lora_rank + q_pe.shape[2]), dtype=q_nope.dtype, device=q_nope.device)
    _launch(q_nope, w_uk, out, transpose=False, pe=q_pe)
    return out


def fp8_value_projection(latent: Tensor, w_uv: BlockFP8Weight) -> Tensor:
    """The attended latent through each head's value up-projection: latent [T, H, C] (any strides) ->
    [T, H, Dv] = latent[:, h] @ dequantized(w_uv[h])^T in latent's dtype; w_uv values [H, Dv, C],
    scale_inv [H, ceil(Dv / bn), ceil(C / bk)]. Products in float32, rounded once."""
    num_rows, num_heads, kv_lora_rank = latent.shape
    check_float("latent", latent)
    _check_pair("w_uv", w_uv, latent, (num_heads, None, kv_lora_rank))
    out = torch.empty((num_rows, num_heads, w_uv.shape[1]), dtype=latent.dtype, device=latent.device)
    _launch(latent, w_uv, out, transpose=True, pe=None)
    return out


def head_rows(latent: Tensor, w: Weight) -> Tensor:
    """latent [..., C] (any strides) -> [..., H * D]: every head's rows of w [H, D, C] applied to every latent,
    heads one after another (prefill's decompressed keys or values, bsc,(hd)c->bs(hd)). A tensor is one
    matmul; a pair's values are read as one [H * D, C] FP8 matrix by `fp8_linear` (each head's blocks are
    whole, `quantized.split_heads`), or dequantized where that kernel cannot step its K block."""
    heads, dim, kv_lora_rank = w.shape
    if isinstance(w, BlockFP8Weight):
        flat = BlockFP8Weight(w.values.reshape(heads * dim, kv_lora_rank),
                              w.scale_inv.reshape(heads * w.scale_inv.shape[1], -1), w.block, w.activation_scale_fmt)
        if (pair := fp8_pair(flat)) is not None:
            rows = fp8_linear(latent.reshape(-1, kv_lora_rank), pair.values, pair.scale_inv, block=pair.block)
            return rows.view(*latent.shape[:-1], heads * dim)
    return torch.matmul(latent, dequantized(w, latent.dtype).reshape(heads * dim, kv_lora_rank).t())


def check_up_projections(dtype: torch.dtype, device: torch.device, **weights: Weight) -> None:
    """ValueError naming the weight unless each is a tensor of `dtype` or an FP8 pair, all on `device`."""
    for name, w in weights.items():
        if isinstance(w, torch.Tensor):
            check_dtype(name, w, (dtype,))
        elif not isinstance(w, BlockFP8Weight):
            raise ValueError(f"{name}: expected a tensor or a block-scaled FP8 pair, got {type(w).__name__}")
        if w.device != device:
            raise ValueError(f"{name}: on {w.device}, expected {device}")


def _kernel_weight(w: Weight, dtype: torch.dtype) -> Tensor | BlockFP8Weight:
    """What the fused kernels take: a tensor or an FP8 pair as it is, any other weight (FP4) dequantized."""
    return w if isinstance(w, BlockFP8Weight) else dequantized(w, dtype)


@dataclass(frozen=True, slots=True)
class Fp8HeadsWriteLatentAbsorb:
    """`contracts.WriteLatentAbsorb`: `fused` (the one-launch kernel), which reads W_UK as a tensor or an FP8
    pair; other weights dequantized first."""

    fused: Callable[..., Any]

    def __call__(self, kv_cache: LatentCache, slot_mapping: Tensor, latent: Tensor, kv_a_norm: Tensor,
                 q_nope: Tensor, q_pe: Tensor, w_uk: Weight, positions: Tensor, cos: Tensor, sin: Tensor, /, *,
                 eps: float, interleaved: bool, absorb_from: int,
                 inplace: bool = True) -> tuple[LatentCache, Tensor, Tensor]:
        """See `contracts.WriteLatentAbsorb`: -> (kv_cache, rotated q_pe [T, H, R], q [T - absorb_from, H, C + R])."""
        out: tuple[LatentCache, Tensor, Tensor] = self.fused(
            kv_cache, slot_mapping, latent, kv_a_norm, q_nope, q_pe, _kernel_weight(w_uk, q_nope.dtype), positions,
            cos, sin, eps=eps, interleaved=interleaved, absorb_from=absorb_from, inplace=inplace)
        return out


@dataclass(frozen=True, slots=True)
class Fp8HeadsMlaDecode:
    """`contracts.MlaDecode`: `dense` (the decode kernel), which reads W_UV as a tensor or an FP8 pair (in its
    split merge, or by `fp8_value_projection` for large batches); other weights dequantized first."""

    dense: Callable[..., tuple[Tensor, Tensor]]

    def __call__(self, q: Tensor, kv_cache: LatentCache, block_table: Tensor, seq_lens: Tensor, /, *,
                 softmax_scale: float, kv_lora_rank: int, w_uv: Weight | None = None,
                 q_len: int = 1) -> tuple[Tensor, Tensor]:
        """See `contracts.MlaDecode`: -> out [B * q_len, H, C] (with w_uv [B * q_len, H, Dv]), lse [B * q_len, H]."""
        return self.dense(q, kv_cache, block_table, seq_lens, softmax_scale=softmax_scale, kv_lora_rank=kv_lora_rank,
                          w_uv=None if w_uv is None else _kernel_weight(w_uv, q.dtype), q_len=q_len)


@dataclass(frozen=True, slots=True)
class Fp8HeadsSparseMlaDecode:
    """`contracts.SparseMlaDecode`: `dense` (the sparse decode kernel), which reads W_UV as a tensor or an FP8
    pair; other weights dequantized first."""

    dense: Callable[..., tuple[Tensor, Tensor]]

    def __call__(self, q: Tensor, kv_cache: LatentCache, block_table: Tensor, indices: Tensor, /, *,
                 softmax_scale: float, kv_lora_rank: int, w_uv: Weight | None = None) -> tuple[Tensor, Tensor]:
        """See `contracts.SparseMlaDecode`: -> out [T, H, C] (with w_uv [T, H, Dv]), lse [T, H]."""
        return self.dense(q, kv_cache, block_table, indices, softmax_scale=softmax_scale, kv_lora_rank=kv_lora_rank,
                          w_uv=None if w_uv is None else _kernel_weight(w_uv, q.dtype))
