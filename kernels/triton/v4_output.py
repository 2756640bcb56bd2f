"""DeepSeek-V4's grouped output projection of a decode step in one launch, the inverse rope folded in.

V4's attention output leaves each head's rope tail rotated; the layer rotates it back
(`rope_tail(..., inverse=True)`, a pass over the whole [T, H, D] output) and then
multiplies each group of H / G heads by its own [Og, H * D / G] block of o_a
(a batched GEMM, cuBLAS). At decode sizes the product streams o_a's 67 MB a layer
(v4-mini) and cuBLAS's batched tiles reach about two thirds of the copy rate.

Here the product runs on `linear_rows`' tiles: a program owns BLOCK_N rows of one
group's block and streams them through `tl.dot` against all the tokens at once,
the weight as the product's wide side. The tokens' channels are loaded with each K
step, and those in a head's tail are rotated back there, each with its pair partner
and its token's angles, rounded to the output's dtype as `rope_tail` rounds them
and only then multiplied: the bits of the two-op path, in one launch and with no
rotated copy of the output written and read again.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from ..checks import check_same_device, check_shape
from ._common import check_float, next_pow2, pdl
from .linear_rows import WIDE_ROWS_MAX_ROWS
from .linear_widened import sum_splits
from .v4_rope import rope_tail

_DTYPES = (torch.bfloat16, torch.float16)
# Programs below which K is split as well (each split sums its share into a float32 slice).
_SPLIT_BELOW_PROGRAMS = 64
_SPLIT_K = 4


@dataclass(frozen=True, slots=True)
class GroupedOutputConfig:
    block_n: int
    block_k: int
    split_k: int
    num_stages: int


def grouped_output_config(groups: int, group_out: int, group_in: int, on_gpu: bool) -> GroupedOutputConfig:
    """Tiles for G groups of [Og, I] weights: `linear_rows`' wide-row tiles (64 weight rows, K steps of 128
    three deep), K split four ways where the groups' tiles would leave most multiprocessors idle."""
    block_n, block_k, stages = (64, 128, 3) if on_gpu else (16, 32, 1)
    programs = groups * triton.cdiv(group_out, block_n)
    split_k = _SPLIT_K if programs < _SPLIT_BELOW_PROGRAMS and group_in >= _SPLIT_K * block_k else 1
    return GroupedOutputConfig(block_n, block_k, split_k, stages)


@triton.jit(do_not_specialize=["num_rows"])
def _grouped_rows_kernel(
    x_ptr, w_ptr, y_ptr,
    num_rows, group_out, group_in, k_per_split, tiles_per_group,
    s_xt, s_xg, s_xk, s_wn, s_wk, s_ys, s_yt, s_yg, s_yn,
    BLOCK_T: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GDC: tl.constexpr,
):
    group = tl.program_id(0) // tiles_per_group
    outs = (tl.program_id(0) % tiles_per_group) * BLOCK_N + tl.arange(0, BLOCK_N)
    rows = tl.arange(0, BLOCK_T)
    out_mask = outs < group_out
    row_mask = rows < num_rows
    # Split s sums K in [s * k_per_split, (s + 1) * k_per_split) into its own float32 slice of y.
    k_lo = tl.program_id(1) * k_per_split
    k_hi = tl.minimum(k_lo + k_per_split, group_in)
    w_rows = w_ptr + (group * group_out + outs)[:, None].to(tl.int64) * s_wn
    x_rows = x_ptr + rows[:, None].to(tl.int64) * s_xt + group * s_xg
    if GDC:
        gdc_wait()
        gdc_launch_dependents()
    # The weight as the product's rows: [BLOCK_N, BLOCK_K] x [BLOCK_K, BLOCK_T], as in `linear_rows`.
    acc = tl.zeros([BLOCK_N, BLOCK_T], dtype=tl.float32)
    for k0 in range(k_lo, k_hi, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_mask = ks < k_hi
        w = tl.load(w_rows + ks[None, :] * s_wk, mask=out_mask[:, None] & k_mask[None, :], other=0.0)
        x = tl.load(x_rows + ks[None, :] * s_xk, mask=row_mask[:, None] & k_mask[None, :], other=0.0)
        acc = tl.dot(w, tl.trans(x), acc)
    y_ptr += tl.program_id(1).to(tl.int64) * s_ys + group * s_yg
    tl.store(y_ptr + rows[None, :] * s_yt + outs[:, None] * s_yn, acc.to(y_ptr.dtype.element_ty),
             mask=row_mask[None, :] & out_mask[:, None])


def grouped_output(out: torch.Tensor, o_a: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                   positions: torch.Tensor, *, groups: int, config: GroupedOutputConfig | None = None
                   ) -> torch.Tensor:
    """Contract of `reference.v4_attention.grouped_output`: out [T, H, D]; o_a [G * Og, H * D / G];
    cos, sin [P, R / 2] at positions [T] -> [T, G, Og] in out's dtype.

    Up to `linear_rows.WIDE_ROWS_MAX_ROWS` tokens of bf16 / fp16 take one launch (two with a
    K split); longer inputs (prefill) and float32 take `rope_tail` and cuBLAS's batched product,
    whose tiles then fill the GPU. `config` overrides `grouped_output_config` (sweeps).
    """
    check_float("out", out)
    check_same_device(out=out, o_a=o_a, cos=cos, sin=sin, positions=positions)
    if out.dim() != 3:
        raise ValueError(f"out: expected [T, H, D], got shape {tuple(out.shape)}")
    num_rows, heads, head_dim = out.shape
    if groups < 1 or heads % groups:
        raise ValueError(f"groups: expected a divisor of the {heads} heads, got {groups}")
    group_in = heads // groups * head_dim
    if o_a.dim() != 2 or o_a.shape[0] % groups or o_a.shape[1] != group_in:
        raise ValueError(f"o_a: expected [G * Og, {group_in}] for G = {groups}, got {tuple(o_a.shape)}")
    if o_a.dtype != out.dtype:
        raise ValueError(f"o_a: expected out's dtype {out.dtype}, got {o_a.dtype}")
    group_out = o_a.shape[0] // groups
    half = cos.shape[-1]
    if cos.dim() != 2 or tuple(sin.shape) != tuple(cos.shape) or 2 * half > head_dim:
        raise ValueError(f"cos, sin: expected tables [P, R / 2] with R <= {head_dim}, got {tuple(cos.shape)} and "
                         f"{tuple(sin.shape)}")
    check_shape("positions", positions, (num_rows,))
    if positions.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"positions: expected int32 or int64, got {positions.dtype}")
    unrotated = rope_tail(out, cos, sin, positions=positions, inverse=True).reshape(num_rows, groups, group_in)
    if out.dtype not in _DTYPES or num_rows > WIDE_ROWS_MAX_ROWS:
        return torch.einsum("tgi,goi->tgo", unrotated, o_a.view(groups, group_out, group_in))
    y = torch.empty((num_rows, groups, group_out), dtype=out.dtype, device=out.device)
    if num_rows == 0:
        return y
    c = config or grouped_output_config(groups, group_out, group_in, out.device.type == "cuda")
    k_per_split = triton.cdiv(triton.cdiv(group_in, c.split_k), c.block_k) * c.block_k
    split_k = triton.cdiv(group_in, k_per_split)
    partial = y if split_k == 1 else torch.empty((split_k, *y.shape), dtype=torch.float32, device=y.device)
    tiles = triton.cdiv(group_out, c.block_n)
    use_pdl = pdl(out.device)
    _grouped_rows_kernel[(groups * tiles, split_k)](
        unrotated, o_a, partial,
        num_rows, group_out, group_in, k_per_split, tiles,
        *unrotated.stride(), *o_a.stride(), y.numel(), *y.stride(),
        BLOCK_T=max(16, next_pow2(num_rows)), BLOCK_N=c.block_n, BLOCK_K=c.block_k, GDC=use_pdl,
        num_warps=4, num_stages=c.num_stages, launch_pdl=use_pdl,
    )
    if split_k > 1:
        sum_splits(partial, y, use_pdl)
    return y
