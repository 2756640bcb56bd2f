"""FP4 weight tiles widened to fp16 in registers, as the left side of a tensor-core product.

`tl.dot_scaled` on Hopper (which has no FP4 tensor cores) widens the packed e2m1 tile to bf16 and
multiplies it by its scales one value at a time. Here a K step of W's rows [BLOCK_N, BLOCK_K] is read as
its packed bytes and widened through e4m3 (`e2m1_widen`: a few word-wide bit operations and one
conversion for two values), each value times its group's scale in the same instructions (one fp16
product for two values), and the tile is the product's left operand: its rows are the MMA's M side
and the few activation rows a decode step gives an expert are its N side. The warpgroup MMA then reads
the widened tile from registers; the activations go through shared memory, and there are few of them.
The low nibbles (even K) and the high ones (odd K) are two tiles, against the even and the odd columns
of the activations.

Every operand is exact in fp16, so the products are those of the dequantized weights, and the sums
differ from the reference's only in their order:

* a row's scales in a step are taken relative to the largest of them, 2^(e - top), and 2^top is applied
  to the step's float32 product: exact while every group's scale is within 2^23 of its row's largest in
  the step (fp16's subnormals reach 0.5 x 2^-23); a group further below is rounded on fp16's subnormal
  grid (and, past 2^-30, reads zero);
* the activation rows come lifted into fp16 by a power of two a row (`fp16_lift.lift_rows`, a pass
  before each product), undone on the float32 product: exact for every value above 2^-31 times its
  row's largest. (Lifted a K step at a time inside the loop instead, the products ran 1.4x slower.)

The scale byte 0 (2^-127) reads as zero on the product, as the tiled path's scales-on-products do.
"""

from __future__ import annotations

import triton
import triton.language as tl

from .e2m1_widen import e2m1_to_fp16_scaled

# Values one e8m0 scale covers along K.
_GROUP = tl.constexpr(32)


@triton.jit
def _widened_product(acc, w_rows, s_rows, kh, kh_mask, k0, k_dim, s_sk, x_even, x_odd, unlift,
                     BLOCK_K: tl.constexpr, ASM: tl.constexpr):
    """acc [BLOCK_N, M] + (W's step [BLOCK_N, BLOCK_K] @ the step's activations [BLOCK_K, M]) as float32:
    x_even / x_odd [BLOCK_K / 2, M] fp16 (lifted rows), unlift [M] undoing their lift."""
    kb = k0 // _GROUP + tl.arange(0, BLOCK_K // _GROUP)
    exps = tl.load(s_rows[:, None] + (kb * s_sk)[None, :], mask=(kb < k_dim // _GROUP)[None, :], other=0)
    exps = exps.to(tl.int32)                                            # e8m0 bytes [BLOCK_N, BLOCK_K / 32]
    top = tl.max(exps, axis=1)
    # 2^(e - top + 6): the group's scale relative to the row's largest, times the 2^6 the widening takes off.
    rel = tl.maximum(exps - top[:, None] + 6, -126)
    s16 = ((rel + 127) << 23).to(tl.float32, bitcast=True).to(tl.float16)
    s_full = tl.reshape(tl.broadcast_to(s16[:, :, None], [s16.shape[0], BLOCK_K // _GROUP, _GROUP // 2]),
                        [s16.shape[0], BLOCK_K // 2])
    w = tl.load(w_rows[:, None] + kh[None, :], mask=kh_mask[None, :], other=0)
    low, high = e2m1_to_fp16_scaled(w, s_full, ASM)
    step = tl.dot(low, x_even)
    step = tl.dot(high, x_odd, step)
    row_scale = (top << 23).to(tl.float32, bitcast=True)               # 2^(top - 127)
    return acc + step * row_scale[:, None] * unlift[None, :]


@triton.jit
def widened_fp4_step(acc, acc2, x_rows, row_mask, s_xk, unlift, w_rows, s_rows, w2_rows, s2_rows, k0, k_dim, s_sk,
                     BLOCK_K: tl.constexpr, TWO: tl.constexpr, ASM: tl.constexpr):
    """One K step of one or (TWO) two FP4 products that share their activations, transposed:
    acc [BLOCK_N, BLOCK_M] + W[:, k0 : k0 + BLOCK_K] @ x[:, k0 : k0 + BLOCK_K]^T, and acc2 likewise with W2.

    x_rows [BLOCK_M]: the lifted activation rows (fp16, K strides s_xk; `fp16_lift.lift_rows`) of row_mask
    [BLOCK_M], unlift [BLOCK_M] their lifts' undoing; w_rows [BLOCK_N]: the packed rows of W (K / 2 bytes,
    unit stride); s_rows [BLOCK_N]: their e8m0 scale rows (strides s_sk). BLOCK_K a multiple of 32; past
    K the bytes read as zeros. ASM: `hardware.e4m3_pairs_to_fp16`.
    """
    kh = k0 // 2 + tl.arange(0, BLOCK_K // 2)
    kh_mask = kh < k_dim // 2
    x_mask = row_mask[None, :] & kh_mask[:, None]
    x_even = tl.load(x_rows[None, :] + (2 * kh)[:, None] * s_xk, mask=x_mask, other=0.0)
    x_odd = tl.load(x_rows[None, :] + (2 * kh + 1)[:, None] * s_xk, mask=x_mask, other=0.0)
    acc = _widened_product(acc, w_rows, s_rows, kh, kh_mask, k0, k_dim, s_sk, x_even, x_odd, unlift, BLOCK_K, ASM)
    if TWO:
        acc2 = _widened_product(acc2, w2_rows, s2_rows, kh, kh_mask, k0, k_dim, s_sk, x_even, x_odd, unlift,
                                BLOCK_K, ASM)
    return acc, acc2
