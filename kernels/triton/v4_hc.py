"""DeepSeek-V4's hyper-connection weights: gates and the Sinkhorn projection of each token, in registers.

`hc_gates` keeps each token's N x N mixing matrix in registers (N = hc_mult, padded
to a power of two with inert zeros) through the row softmax and every Sinkhorn
iteration, where the reference spends a launch per elementwise step and four per
iteration. The fused site kernels (`v4_hc_site`) call it on logits they computed;
`hc_mix_weights` runs it alone on given logits (one program per BLOCK_T tokens),
which tests hold against the float64 reference.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..checks import check_dtype, check_same_device, check_shape
from ._common import next_pow2

_BLOCK_T = 16


@triton.jit
def hc_gates(pre, post, comb, base_ptr, scale_ptr, iters, eps, N: tl.constexpr, NP: tl.constexpr):
    """An mHC site's weights from its logits, in registers: pre, post [BT, NP] and comb [BT, NP, NP]
    (lanes past N any finite value) -> pre, post [BT, NP], comb [BT, NP, NP] (padding rows and
    columns of comb exactly 0; pre's and post's padding lanes are not meaningful)."""
    offs = tl.arange(0, NP)
    n_mask = offs < N
    s_pre = tl.load(scale_ptr).to(tl.float32)
    s_post = tl.load(scale_ptr + 1).to(tl.float32)
    s_comb = tl.load(scale_ptr + 2).to(tl.float32)
    pre = tl.sigmoid(pre * s_pre + tl.load(base_ptr + offs, mask=n_mask, other=0.0)[None, :]) + eps
    post = 2.0 * tl.sigmoid(post * s_post + tl.load(base_ptr + N + offs, mask=n_mask, other=0.0)[None, :])

    r = offs[None, :, None]
    c = offs[None, None, :]
    inside = (r < N) & (c < N)                                                     # [1, NP, NP]
    logits = comb * s_comb + tl.load(base_ptr + 2 * N + r * N + c, mask=inside, other=0.0)
    logits = tl.where(inside, logits, float("-inf"))
    row_max = tl.max(logits, axis=2, keep_dims=True)
    row_max = tl.where(row_max == float("-inf"), 0.0, row_max)
    p = tl.exp(logits - row_max)
    comb = p / tl.where(inside, tl.sum(p, axis=2, keep_dims=True), 1.0)
    # Padding rows and columns stay exactly 0 through every normalisation.
    comb = tl.where(inside, comb + eps, 0.0)
    comb = comb / (tl.sum(comb, axis=1, keep_dims=True) + eps)
    for _ in range(iters - 1):
        comb = comb / (tl.sum(comb, axis=2, keep_dims=True) + eps)
        comb = comb / (tl.sum(comb, axis=1, keep_dims=True) + eps)
    return pre, post, comb


@triton.jit(do_not_specialize=["num_tokens", "iters"])
def _hc_kernel(
    mix_ptr, base_ptr, scale_ptr, pre_ptr, post_ptr, comb_ptr,
    num_tokens, iters, eps,
    s_mt, s_md, s_pt, s_pn, s_qt, s_qn, s_ct, s_cr, s_cc,
    N: tl.constexpr, NP: tl.constexpr, BLOCK_T: tl.constexpr,
):
    tokens = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    t_mask = tokens < num_tokens
    t64 = tokens.to(tl.int64)
    offs = tl.arange(0, NP)
    n_mask = offs < N
    mask2 = t_mask[:, None] & n_mask[None, :]
    row = mix_ptr + t64[:, None] * s_mt
    pre = tl.load(row + offs[None, :] * s_md, mask=mask2, other=0.0)
    post = tl.load(row + (N + offs[None, :]) * s_md, mask=mask2, other=0.0)
    r = offs[None, :, None]
    c = offs[None, None, :]
    mask3 = t_mask[:, None, None] & (r < N) & (c < N)
    comb = tl.load(mix_ptr + t64[:, None, None] * s_mt + (2 * N + r * N + c) * s_md, mask=mask3, other=0.0)
    pre, post, comb = hc_gates(pre, post, comb, base_ptr, scale_ptr, iters, eps, N, NP)
    tl.store(pre_ptr + t64[:, None] * s_pt + offs[None, :] * s_pn, pre, mask=mask2)
    tl.store(post_ptr + t64[:, None] * s_qt + offs[None, :] * s_qn, post, mask=mask2)
    tl.store(comb_ptr + t64[:, None, None] * s_ct + r * s_cr + c * s_cc, comb, mask=mask3)


def hc_mix_weights(mixes: torch.Tensor, base: torch.Tensor, scale: torch.Tensor, *, hc_mult: int, iters: int,
                   hc_eps: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """An mHC site's weights (see `reference.v4_hc.hc_mix_weights`): mixes [T, (2 + N) * N] float32,
    base [(2 + N) * N], scale [3] -> pre [T, N], post [T, N], comb [T, N, N], float32."""
    n = hc_mult
    num_tokens = mixes.shape[0]
    width = (2 + n) * n
    check_shape("mixes", mixes, (num_tokens, width))
    check_dtype("mixes", mixes, (torch.float32,))
    check_shape("base", base, (width,))
    check_dtype("base", base, (torch.float32,))
    check_shape("scale", scale, (3,))
    check_dtype("scale", scale, (torch.float32,))
    check_same_device(mixes=mixes, base=base, scale=scale)
    if iters < 1:
        raise ValueError(f"iters: expected >= 1, got {iters}")
    if not base.is_contiguous():
        base = base.contiguous()
    pre = torch.empty((num_tokens, n), dtype=torch.float32, device=mixes.device)
    post = torch.empty((num_tokens, n), dtype=torch.float32, device=mixes.device)
    comb = torch.empty((num_tokens, n, n), dtype=torch.float32, device=mixes.device)
    if num_tokens == 0:
        return pre, post, comb
    _hc_kernel[(triton.cdiv(num_tokens, _BLOCK_T),)](
        mixes, base, scale, pre, post, comb,
        num_tokens, iters, hc_eps,
        *mixes.stride(), *pre.stride(), *post.stride(), *comb.stride(),
        N=n, NP=max(2, next_pow2(n)), BLOCK_T=_BLOCK_T,
        num_warps=4,
    )
    return pre, post, comb
