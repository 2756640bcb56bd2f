"""Merging two partial attention results over disjoint key sets by their LSE."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..checks import check_dtype, check_same_device, check_shape
from ._common import check_float, next_pow2


@triton.jit
def _merge_kernel(
    out_a_ptr, lse_a_ptr, out_b_ptr, lse_b_ptr, out_ptr, lse_ptr,
    num_heads, dim,
    s_oa_t, s_oa_h, s_oa_d, s_la_t, s_la_h,
    s_ob_t, s_ob_h, s_ob_d, s_lb_t, s_lb_h,
    s_o_t, s_o_h,
    BLOCK_D: tl.constexpr,
):
    pid = tl.program_id(0)
    t = (pid // num_heads).to(tl.int64)
    h = pid % num_heads
    lse_a = tl.load(lse_a_ptr + t * s_la_t + h * s_la_h).to(tl.float32)
    lse_b = tl.load(lse_b_ptr + t * s_lb_t + h * s_lb_h).to(tl.float32)
    m = tl.maximum(lse_a, lse_b)
    # Both sides empty: m = -inf; shifting by 0 instead keeps exp(-inf - 0) = 0
    # and the sum 0, so the output is 0 and lse -inf rather than NaN.
    m = tl.where(m == float("-inf"), 0.0, m)
    w_a = tl.exp(lse_a - m)
    w_b = tl.exp(lse_b - m)
    total = w_a + w_b
    lse = tl.where(total > 0, m + tl.log(tl.where(total > 0, total, 1.0)), float("-inf"))
    inv = tl.where(total > 0, 1.0 / tl.where(total > 0, total, 1.0), 0.0)
    w_a = w_a * inv
    w_b = w_b * inv
    cols = tl.arange(0, BLOCK_D)
    for d0 in range(0, dim, BLOCK_D):
        d = d0 + cols
        mask = d < dim
        a = tl.load(out_a_ptr + t * s_oa_t + h * s_oa_h + d * s_oa_d, mask=mask, other=0.0).to(tl.float32)
        b = tl.load(out_b_ptr + t * s_ob_t + h * s_ob_h + d * s_ob_d, mask=mask, other=0.0).to(tl.float32)
        tl.store(out_ptr + t * s_o_t + h * s_o_h + d, (w_a * a + w_b * b).to(out_ptr.dtype.element_ty), mask=mask)
    tl.store(lse_ptr + t * num_heads + h, lse)


def merge_attn_states(
    out_a: torch.Tensor,
    lse_a: torch.Tensor,
    out_b: torch.Tensor,
    lse_b: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Combine two partial attention results over disjoint key sets.

    out_a, out_b: [T, H, D] (any strides); lse_a, lse_b: [T, H] float32 natural-log
                  sums, -inf = empty side (any strides)
    returns       out [T, H, D] contiguous in out_a's dtype, lse [T, H] float32.
    Both sides empty gives out 0 and lse -inf, never NaN.
    """
    num_tokens, num_heads, dim = out_a.shape
    check_shape("out_b", out_b, (num_tokens, num_heads, dim))
    check_shape("lse_a", lse_a, (num_tokens, num_heads))
    check_shape("lse_b", lse_b, (num_tokens, num_heads))
    check_float("out_a", out_a)
    check_float("out_b", out_b)
    check_dtype("lse_a", lse_a, (torch.float32,))
    check_dtype("lse_b", lse_b, (torch.float32,))
    check_same_device(out_a=out_a, lse_a=lse_a, out_b=out_b, lse_b=lse_b)
    out = torch.empty((num_tokens, num_heads, dim), dtype=out_a.dtype, device=out_a.device)
    lse = torch.empty((num_tokens, num_heads), dtype=torch.float32, device=out_a.device)
    if num_tokens * num_heads == 0:
        return out, lse
    _merge_kernel[(num_tokens * num_heads,)](
        out_a, lse_a, out_b, lse_b, out, lse,
        num_heads, dim,
        *out_a.stride(), *lse_a.stride(),
        *out_b.stride(), *lse_b.stride(),
        out.stride(0), out.stride(1),
        BLOCK_D=min(1024, next_pow2(dim)),
        num_warps=4,
    )
    return out, lse
