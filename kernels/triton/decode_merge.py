"""Stage 2 of split-KV MLA decode: merging each row's split partials by LSE, optionally through W_UV.

Every split program of stage 1 (`decode`) wrote a normalised partial output and
its LSE, empty splits out 0 and lse -inf. A row's splits merge into out and lse;
with the value up-projection W_UV the merged latent goes through it in the same
kernel (small batches, where that is the cheapest read of W_UV), W_UV a 16-bit
weight or an FP8 pair dequantized as its tile is loaded (`fp8_heads.head_tile`).
Larger batches merge, then project (`project_values`).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from ..checks import check_dtype, check_same_device, check_shape
from ..quantized import BlockFP8Weight
from ._common import next_pow2
from .fp8_heads import fp8_value_projection, head_tile, head_tiles

# W_UV's output columns per program, and warps: a (row, head) of 128 value columns in one
# program reads its split partials once, where 32-column programs read them four times;
# few (row, head) pairs take narrow programs so that enough run. H200, 8 rows x 16 heads x
# 32 splits (sparse decode of 2048 keys, both stages): 21.8 us with [128, 8 warps], 26.2
# with [32, 4 warps] (bench/results/dsa-kernels/h200/logs-archive/moe-topk-sweep-h200-2026-11-24.log).
_VALUE_WIDE = (128, 8)
_VALUE_NARROW = (32, 4)
_VALUE_WIDE_MIN_PROGRAMS = 128
# Splits merged per step of stage 2's loop: a [_MERGE_SPLITS, C] float32 tile
# (16 covers batch 1 up to 2K keys of table in one step).
_MERGE_SPLITS = 16


# The split count follows the batch size, and eager (mixed) steps meet every batch
# size: as a constexpr or a specialised int it would compile a kernel per count mid-run.
@triton.jit(do_not_specialize=["num_splits", "s_plh"])
def _reduce_kernel(
    po_ptr, pl_ptr, out_ptr, lse_ptr,
    num_heads, num_splits,
    s_pob, s_poh, s_pos, s_pod,
    s_plb, s_plh, s_pls,
    s_ob, s_oh, s_lb, s_lh,
    KV_LORA_RANK: tl.constexpr, BLOCK_C: tl.constexpr,
    BLOCK_S: tl.constexpr, GDC: tl.constexpr,
):
    pid = tl.program_id(0)
    if GDC:
        gdc_wait()
        gdc_launch_dependents()
    b = (pid // num_heads).to(tl.int64)
    h = pid % num_heads
    offs_s = tl.arange(0, BLOCK_S)
    split_mask = offs_s < num_splits
    lse_s = tl.load(pl_ptr + b * s_plb + h * s_plh + offs_s * s_pls, mask=split_mask, other=float("-inf"))
    m = tl.max(lse_s, axis=0)
    # Empty splits carry lse -inf; an all-empty row shifts by 0 so weights are 0, not NaN.
    m = tl.where(m == float("-inf"), 0.0, m)
    w = tl.exp(lse_s - m)
    total = tl.sum(w, axis=0)
    w = w * tl.where(total > 0.0, 1.0 / tl.where(total > 0.0, total, 1.0), 0.0)
    offs_c = tl.arange(0, BLOCK_C)
    for c0 in range(0, KV_LORA_RANK, BLOCK_C):
        c = c0 + offs_c
        c_mask = c < KV_LORA_RANK
        parts = tl.load(po_ptr + b * s_pob + h * s_poh + offs_s[:, None] * s_pos + c[None, :] * s_pod,
                        mask=split_mask[:, None] & c_mask[None, :], other=0.0)
        out = tl.sum(parts * w[:, None], axis=0)
        tl.store(out_ptr + b * s_ob + h * s_oh + c, out.to(out_ptr.dtype.element_ty), mask=c_mask)
    lse = tl.where(total > 0.0, m + tl.log(tl.where(total > 0.0, total, 1.0)), float("-inf"))
    tl.store(lse_ptr + b * s_lb + h * s_lh, lse)


# The split count follows the batch size (see _reduce_kernel).
@triton.jit(do_not_specialize=["num_splits", "s_plh"])
def _reduce_value_kernel(
    po_ptr, pl_ptr, w_ptr, ws_ptr, out_ptr, lse_ptr,
    num_heads, num_splits, value_dim,
    s_pob, s_poh, s_pos, s_pod,
    s_plb, s_plh, s_pls,
    s_wh, s_wv, s_wc, s_sh, s_sv, s_sc,
    s_ob, s_oh, s_ov, s_lb, s_lh,
    KV_LORA_RANK: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_V: tl.constexpr,
    GDC: tl.constexpr, W_FP8: tl.constexpr, SCALE_D: tl.constexpr, SCALE_C: tl.constexpr,
    ONE_D_BLOCK: tl.constexpr, ONE_C_BLOCK: tl.constexpr,
):
    pid = tl.program_id(0)
    b = (pid // num_heads).to(tl.int64)
    h = pid % num_heads
    offs_c = tl.arange(0, BLOCK_C)
    c_mask = offs_c < KV_LORA_RANK
    v0 = tl.program_id(1) * BLOCK_V
    vs = v0 + tl.arange(0, BLOCK_V)
    v_mask = vs < value_dim
    # W_UV (and a pair's scales) depend on no earlier kernel: its slice is in flight before the wait. A pair's
    # tile comes dequantized and rounded to the output dtype, as the reference's dequantized W_UV.
    w = head_tile(w_ptr + h * s_wh, ws_ptr + h * s_sh, vs, offs_c, v0, 0, v_mask, c_mask, s_wv, s_wc, s_sv, s_sc,
                  out_ptr.dtype.element_ty, W_FP8, SCALE_D, SCALE_C, ONE_D_BLOCK, ONE_C_BLOCK)
    if GDC:
        gdc_wait()
        gdc_launch_dependents()
    pl_row = pl_ptr + b * s_plb + h * s_plh
    po_row = po_ptr + b * s_pob + h * s_poh
    # One pass over the splits, BLOCK_S at a time, rescaling the running sums to
    # the largest LSE so far: a chunk's LSEs and partial outputs load together
    # (every split wrote both, empty ones out 0 and lse -inf), so at batch 1,
    # where one chunk holds every split, stage 2 waits on memory once.
    m_run = tl.full([], float("-inf"), tl.float32)
    total = tl.full([], 0.0, tl.float32)
    latent = tl.zeros([BLOCK_C], dtype=tl.float32)
    for s0 in range(0, num_splits, BLOCK_S):
        ss = s0 + tl.arange(0, BLOCK_S)
        s_mask = ss < num_splits
        lse_s = tl.load(pl_row + ss * s_pls, mask=s_mask, other=float("-inf"))
        parts = tl.load(po_row + ss[:, None] * s_pos + offs_c[None, :] * s_pod,
                        mask=s_mask[:, None] & c_mask[None, :], other=0.0)
        m_new = tl.maximum(m_run, tl.max(lse_s, axis=0))
        # While every split so far is empty, shift by 0 so weights are 0, not NaN.
        shift = tl.where(m_new == float("-inf"), 0.0, m_new)
        rescale = tl.exp(m_run - shift)
        wt = tl.exp(lse_s - shift)
        total = total * rescale + tl.sum(wt, axis=0)
        latent = latent * rescale + tl.sum(parts * wt[:, None], axis=0)
        m_run = m_new
    m_all = tl.where(m_run == float("-inf"), 0.0, m_run)
    total_all = total
    latent = latent * tl.where(total_all > 0.0, 1.0 / tl.where(total_all > 0.0, total_all, 1.0), 0.0)
    # Rounded to the output dtype first, as the merged latent is before an unfused projection.
    latent = latent.to(out_ptr.dtype.element_ty).to(tl.float32)
    out = tl.sum(w.to(tl.float32) * latent[None, :], axis=1)
    tl.store(out_ptr + b * s_ob + h * s_oh + vs * s_ov, out.to(out_ptr.dtype.element_ty), mask=v_mask)
    if tl.program_id(1) == 0:
        lse = tl.where(total_all > 0.0, m_all + tl.log(tl.where(total_all > 0.0, total_all, 1.0)), float("-inf"))
        tl.store(lse_ptr + b * s_lb + h * s_lh, lse)


def split_partials(out: torch.Tensor, lse: torch.Tensor, splits: int, *, direct: bool,
                   workspace: tuple[torch.Tensor, torch.Tensor] | None) -> tuple[torch.Tensor, torch.Tensor]:
    """Where stage 1 of a split decode writes each split's partial output and LSE.

    out [R, H, C], lse [R, H]: the decode's results. With `direct` (one split and no merge pass
    through W_UV), stage 1 writes them itself: `out` and `lse` viewed as one split (split stride 0),
    and stage 2 is skipped. Otherwise float32 partials (partial_out [R, H, splits, C], partial_lse
    [R, H, splits]): the caller's `workspace` (checked; a graph's buffers), or fresh ones.
    """
    if direct:
        return out.unsqueeze(2), lse.unsqueeze(2)
    num_rows, num_heads, dim = out.shape
    if workspace is None:
        return (torch.empty((num_rows, num_heads, splits, dim), dtype=torch.float32, device=out.device),
                torch.empty((num_rows, num_heads, splits), dtype=torch.float32, device=out.device))
    partial_out, partial_lse = workspace
    check_shape("workspace[0]", partial_out, (num_rows, num_heads, splits, dim))
    check_shape("workspace[1]", partial_lse, (num_rows, num_heads, splits))
    check_dtype("workspace[0]", partial_out, (torch.float32,))
    check_dtype("workspace[1]", partial_lse, (torch.float32,))
    check_same_device(q=out, workspace_out=partial_out, workspace_lse=partial_lse)
    return partial_out, partial_lse


def merge_splits(partial_out: torch.Tensor, partial_lse: torch.Tensor, out: torch.Tensor, lse: torch.Tensor,
                 use_pdl: bool) -> None:
    """partial_out [N, H, S, C], partial_lse [N, H, S] float32 -> out [N, H, C], lse [N, H] (written)."""
    num_rows, num_heads, splits, kv_lora_rank = partial_out.shape
    _reduce_kernel[(num_rows * num_heads,)](
        partial_out, partial_lse, out, lse,
        num_heads, splits,
        *partial_out.stride(), *partial_lse.stride(),
        *out.stride()[:2], *lse.stride(),
        KV_LORA_RANK=kv_lora_rank, BLOCK_C=min(512, next_pow2(kv_lora_rank)),
        BLOCK_S=next_pow2(splits), GDC=use_pdl,
        num_warps=4, launch_pdl=use_pdl,
    )


def merge_splits_value(partial_out: torch.Tensor, partial_lse: torch.Tensor, w_uv: torch.Tensor | BlockFP8Weight,
                       out: torch.Tensor, lse: torch.Tensor, use_pdl: bool) -> None:
    """partial_out [N, H, S, C], partial_lse [N, H, S], w_uv [H, Dv, C] -> out [N, H, Dv], lse [N, H] (written).

    out = (the merged latent rounded to out's dtype) @ w_uv[h]^T, products in float32; w_uv a tensor in
    out's dtype or a stacked FP8 pair, dequantized and rounded to out's dtype (checked by the caller).
    """
    num_rows, num_heads, splits, kv_lora_rank = partial_out.shape
    w = head_tiles(w_uv)
    value_dim = w.values.shape[1]
    wide = num_rows * num_heads >= _VALUE_WIDE_MIN_PROGRAMS
    block_v, num_warps = _VALUE_WIDE if wide else _VALUE_NARROW
    block_v = min(block_v, max(16, next_pow2(value_dim)))
    block_c = next_pow2(kv_lora_rank)
    _reduce_value_kernel[(num_rows * num_heads, triton.cdiv(value_dim, block_v))](
        partial_out, partial_lse, w.values, w.scales, out, lse,
        num_heads, splits, value_dim,
        *partial_out.stride(), *partial_lse.stride(), *w.values.stride(), *w.scales.stride(),
        *out.stride(), *lse.stride(),
        KV_LORA_RANK=kv_lora_rank, BLOCK_C=block_c,
        BLOCK_S=min(_MERGE_SPLITS, next_pow2(splits)), BLOCK_V=block_v, GDC=use_pdl,
        **w.constants(block_v, block_c), num_warps=num_warps, launch_pdl=use_pdl,
    )


def project_values(latent: torch.Tensor, w_uv: torch.Tensor | BlockFP8Weight) -> torch.Tensor:
    """latent [T, H, C] -> [T, H, Dv] = latent[:, h] @ w_uv[h]^T in latent's dtype: the unfused value
    projection of a merged latent. A tensor w_uv [H, Dv, C] takes one batched GEMM over the heads, which
    writes its [H, T, Dv] product straight into a [T, H, Dv] tensor (a row stride of H * Dv), so the output
    projection flattens it without the copy an einsum's head-major result would need; a stacked FP8 pair
    takes `fp8_heads.fp8_value_projection`."""
    if isinstance(w_uv, BlockFP8Weight):
        return fp8_value_projection(latent, w_uv)
    out = torch.empty((latent.shape[0], latent.shape[1], w_uv.shape[1]), dtype=latent.dtype, device=latent.device)
    torch.bmm(latent.transpose(0, 1), w_uv.transpose(1, 2), out=out.transpose(0, 1))
    return out
