"""DeepSeek-V4's FP4 experts' widened tiles on Hopper's warpgroup MMA, each weight word loaded where the MMA reads it.

The `tl.dot` twin (`triton.fp4_widened`, the path the interpreter checks) widens a weight tile [64 rows, 128 of K]
to fp16 and hands it to `tl.dot` as the left operand; Triton then moves the widened values between threads into
the MMA's register layout, and the low and high nibbles take two products (even and odd K). Here the packed
words are loaded straight into that layout, so the widening is the only work between the load and the MMA:

* a K step of a weight row is 64 bytes, sixteen 32-bit words, four words (16 bytes) to one of four lanes; a
  thread holds rows r and r + 8 of its warp's 16 and loads each row's four words as one 16-byte vector. Each
  word's four bytes widen to eight fp16 values (`e2m1_widen.e2m1x4_to_f16_scaled_asm`: the low nibbles, then
  the high ones), each times its group's scale, in one block of PTX (the four words of a thread are one
  32-value group: one scale a thread, row and step);
* the widened values [64, 4 lanes, 4 words, 8] are relabelled as the A operand [64, 128] (a reshape and a
  permutation that `convert_layout` checks moves no data), which fixes the order in which the step's 128
  values of K meet the activations (`K_ORDER_BITS`); the activation rows are lifted to fp16 in that order by
  `fp16_lift.lift_rows(x, K_ORDER_BITS)`, so one product takes both nibbles.

The products are those of the twin: the weight values times 2^(e - top) exactly in fp16 (a row's scales in a
step relative to the largest, exact within 2^23 of it), 2^top on the step's float32 product, the rows' lifts
undone on the output. One program: 64 weight rows (the MMA's M) against 16 sorted rows of one expert (its N),
one warpgroup, the next step's words and scales loaded into registers before this step's product; the step's
activations go through shared memory. (Issuing a step's product before widening the next, with two activation
buffers, ran 1.09-1.25x slower on an H200: the loop-carried operands cost more registers and moves than the
overlap saved.)

V4-Flash's experts (256 of D 4096, I 2048) on an H200, each kernel against its twin: gate/up 0.70-0.76x the
time, down 0.68-0.71x, at 32-256 tokens (bench/notes/fp8.md).
"""

from __future__ import annotations

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, warpgroup_mma, warpgroup_mma_wait

from ..fp4_weight import BlockFP4Weight
from ..triton.e2m1_widen import e2m1x4_to_f16_scaled_asm
from .support import available

# Weight rows a program (the MMA's M), sorted rows a program (its N; the rows `moe_align` sorts in runs of), and
# values of K a step (64 packed bytes a row).
BLOCK_N = 64
BLOCK_M = 16
K_STEP = 128
NUM_WARPS = 4

_BLOCK_N = gl.constexpr(BLOCK_N)
_BLOCK_M = gl.constexpr(BLOCK_M)
_ACC = gl.constexpr(gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BLOCK_M, 16]))
_A_OPERAND = gl.constexpr(gl.DotOperandLayout(operand_index=0, parent=_ACC, k_width=2))
# A step's words widened [64 rows, 4 (q: the lane within a quad), 4 (w: the word), 8 (v: the word's four low
# nibbles, then its four high ones)]: a thread holds rows r and r + 8 of its warp's 16 and the four words of q.
_VALUES = gl.constexpr(gl.DistributedLinearLayout(
    reg_bases=[[0, 0, 0, 1], [0, 0, 0, 2], [0, 0, 0, 4], [0, 0, 1, 0], [0, 0, 2, 0], [8, 0, 0, 0]],
    lane_bases=[[0, 1, 0, 0], [0, 2, 0, 0], [1, 0, 0, 0], [2, 0, 0, 0], [4, 0, 0, 0]],
    warp_bases=[[16, 0, 0, 0], [32, 0, 0, 0]], block_bases=[], shape=[BLOCK_N, 4, 4, 8]))
_WORDS = gl.constexpr(gl.SliceLayout(3, _VALUES))                    # [64, 4, 4] int32
_SCALES = gl.constexpr(gl.SliceLayout(2, _WORDS))                    # [64, 4]: a group of 32 values each
# A step's activations [16 rows, 128] (lifted in K_ORDER_BITS' order) as 16-byte vectors, into the 128-byte
# swizzle.
_X_LOAD = gl.constexpr(gl.BlockedLayout([1, 8], [2, 16], [4, 1], [1, 0]))
_X_SMEM = gl.constexpr(gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2))

# Eight operands of the word ($8-$15, the same word), eight of its scale as an f16x2 pair ($16-$23, the same).
_WIDEN_WORD = gl.constexpr(e2m1x4_to_f16_scaled_asm("$8", "$16", "$16"))
_WIDEN_CONSTRAINTS = gl.constexpr("=r,=r,=r,=r," + ",".join(["r"] * 16))


# The K order of a step's A operand (`_as_operand`): position j = v0 + 2 q + 8 v1 + 16 v2 + 32 w0 + 64 w1 is
# value v = b + 4 h (byte b of the word; h 0 for its low nibble, 1 for its high one) of word w of lane q, which
# holds K k = 2 (16 q + 4 w + b) + h. So bit i of k is bit K_ORDER_BITS[i] of j: h = v2, b = (v0, v1), w, q.
# The activations are lifted in that order (`fp16_lift.lift_rows(x, K_ORDER_BITS)`).
K_ORDER_BITS = (4, 0, 3, 5, 6, 1, 2)


def applies(x: torch.Tensor, w13: BlockFP4Weight, w2: BlockFP4Weight) -> bool:
    """Whether the kernels take these experts: bf16 activations where the Gluon kernels run
    (`support.available`); a scale a row and 32 values (block (1, 32)); D and I multiples of K_STEP; packed
    rows of unit stride, every row 16-byte aligned (the words load as 16-byte vectors)."""
    hidden, inter = x.shape[1], w2.shape[2]
    packed = (w13.packed, w2.packed)
    return (x.dtype == torch.bfloat16 and w13.block == (1, 32) and w2.block == (1, 32)
            and hidden % K_STEP == 0 and inter % K_STEP == 0
            and all(p.stride(-1) == 1 and p.data_ptr() % 16 == 0 and all(s % 16 == 0 for s in p.stride()[:-1])
                    for p in packed)
            and available(x.device))


@gluon.jit
def _as_operand(v):
    # [64, 4 (q), 4 (w), 8 (v)] -> [64, 128], position j = v0 + 2 q + 8 v1 + 16 v2 + 32 w0 + 64 w1: the A
    # layout's order (its lanes hold j's bits 1-2, its registers the rest). A relabelling: no data moves.
    v = v.reshape([_BLOCK_N, 4, 2, 2, 2, 2, 2]).permute([0, 2, 3, 4, 5, 1, 6]).reshape([_BLOCK_N, 128])
    return gl.convert_layout(v, _A_OPERAND, assert_trivial=True)


@gluon.jit
def _load_step(w_rows, s_rows, k_step, q_idx, w_idx, s_sk):
    # A step's words [64, 4, 4] int32 and scale bytes [64, 4] (as int32).
    w = gl.load(w_rows + (k_step * 16 + q_idx * 4 + w_idx))
    g = k_step * 4 + gl.arange(0, 4, layout=gl.SliceLayout(0, _SCALES))
    e = gl.load(s_rows + (g * s_sk)[None, :]).to(gl.int32)
    return w, e


@gluon.jit
def _widen(w, e):
    # Words [64, 4, 4] and scale bytes [64, 4] -> (the A operand [64, 128] fp16: the values times 2^(e - top),
    # 2^(top - 127) [64] in the accumulator's row layout). The widening leaves each value times 2^-6, which
    # the relative scale's + 6 undoes; a group more than 2^23 below its row's largest rounds (as the twin).
    top = gl.max(e, axis=1)
    rel = gl.maximum(e - top[:, None] + 6, -126)
    s16 = ((rel + 127) << 23).to(gl.float32, bitcast=True).to(gl.float16)
    bits = s16.to(gl.int16, bitcast=True).to(gl.int32) & 0xFFFF
    pair = gl.expand_dims(gl.expand_dims(bits | (bits << 16), 2), 3).broadcast_to([_BLOCK_N, 4, 4, 8])
    words = gl.expand_dims(w, 3).broadcast_to([_BLOCK_N, 4, 4, 8])
    v = gl.inline_asm_elementwise(_WIDEN_WORD, _WIDEN_CONSTRAINTS, [words, pair], dtype=gl.float16, is_pure=True,
                                  pack=8)
    row_scale = gl.convert_layout((top << 23).to(gl.float32, bitcast=True), gl.SliceLayout(1, _ACC))
    return _as_operand(v), row_scale


@gluon.jit
def _weight_rows(w_ptr, s_ptr, expert, rows_from, num_rows, s_we, s_wn, s_se, s_sn):
    # 64 weight rows from rows_from (inside num_rows, as it is a multiple of 64): their packed words [64, 1, 1]
    # (int32 pointers) and scale rows [64, 1], in the words' and the scales' layouts.
    r3 = rows_from + gl.arange(0, _BLOCK_N, layout=gl.SliceLayout(1, gl.SliceLayout(2, _WORDS)))
    w_rows = (w_ptr + expert.to(gl.int64) * s_we + (r3.to(gl.int64) * s_wn)[:, None, None]).to(gl.pointer_type(gl.int32))
    rs = rows_from + gl.arange(0, _BLOCK_N, layout=gl.SliceLayout(1, _SCALES))
    s_rows = (s_ptr + expert.to(gl.int64) * s_se + rs.to(gl.int64) * s_sn)[:, None]
    return w_rows, s_rows


@gluon.jit
def _program(block_expert_ptr):
    # This program's block of sorted rows, its first weight row and the block's expert (-1: an unused block).
    block = gl.program_id(0)
    return block, gl.program_id(1) * _BLOCK_N, gl.load(block_expert_ptr + block)


@gluon.jit
def _stage_activations(x_smem, x_rows, k_step, mask_b):
    # Step k_step's activation rows [16, 128] (rows outside mask_b: zeros) into the buffer, once every thread's
    # last product (waited) is done with it, and visible to the MMA before any thread issues the next.
    x = gl.load(x_rows + k_step * 128, mask=mask_b[:, None], other=0.0)
    gl.thread_barrier()
    x_smem.store(x)
    fence_async_shared()
    gl.thread_barrier()


@gluon.jit
def _word_indices():
    q_idx = gl.arange(0, 4, layout=gl.SliceLayout(0, gl.SliceLayout(2, _WORDS)))[None, :, None]
    w_idx = gl.arange(0, 4, layout=gl.SliceLayout(0, gl.SliceLayout(1, _WORDS)))[None, None, :]
    return q_idx, w_idx


@gluon.jit
def _gate_up_kernel(x_ptr, unlift_ptr, w13_ptr, ws_ptr, sorted_ptr, block_expert_ptr, act_ptr,
                    num_pairs, hidden, inter, limit, s_xt, s_we, s_wn, s_se, s_sn, s_sk, s_ar,
                    TOP_K: gl.constexpr):
    # act[r, n0 : n0 + 64] (bf16) = the clamped SwiGLU of sorted row r's gate and up products with its block's
    # expert's w13 rows n0.. and inter + n0.. (x: the tokens' rows lifted in K_ORDER_BITS' order, unlift [T]).
    block, n0, expert = _program(block_expert_ptr)
    if expert >= 0:
        g_rows, g_scales = _weight_rows(w13_ptr, ws_ptr, expert, n0, inter, s_we, s_wn, s_se, s_sn)
        u_rows, u_scales = _weight_rows(w13_ptr, ws_ptr, expert, inter + n0, 2 * inter, s_we, s_wn, s_se, s_sn)
        q_idx, w_idx = _word_indices()
        mb = gl.arange(0, _BLOCK_M, layout=gl.SliceLayout(1, _X_LOAD))
        cb = gl.arange(0, 128, layout=gl.SliceLayout(0, _X_LOAD))
        pairs_b = gl.load(sorted_ptr + block * _BLOCK_M + mb)
        mask_b = pairs_b < num_pairs
        tokens_b = gl.where(mask_b, pairs_b // TOP_K, 0)
        x_rows = x_ptr + (tokens_b.to(gl.int64) * s_xt)[:, None] + cb[None, :]
        x_smem = gl.allocate_shared_memory(gl.float16, [_BLOCK_M, 128], _X_SMEM)
        acc_g = gl.zeros([_BLOCK_N, _BLOCK_M], gl.float32, _ACC)
        acc_u = gl.zeros([_BLOCK_N, _BLOCK_M], gl.float32, _ACC)
        num_steps = hidden // 128
        wg, eg = _load_step(g_rows, g_scales, 0, q_idx, w_idx, s_sk)
        wu, eu = _load_step(u_rows, u_scales, 0, q_idx, w_idx, s_sk)
        for k_step in range(num_steps):
            # The next step's words before this step's products (the last step reloads itself: in bounds).
            k_next = gl.minimum(k_step + 1, num_steps - 1)
            wg_next, eg_next = _load_step(g_rows, g_scales, k_next, q_idx, w_idx, s_sk)
            wu_next, eu_next = _load_step(u_rows, u_scales, k_next, q_idx, w_idx, s_sk)
            _stage_activations(x_smem, x_rows, k_step, mask_b)
            a_g, scale_g = _widen(wg, eg)
            step_g = warpgroup_mma(a_g, x_smem.permute((1, 0)), acc_g, use_acc=False, is_async=True)
            a_u, scale_u = _widen(wu, eu)
            step_u = warpgroup_mma(a_u, x_smem.permute((1, 0)), acc_u, use_acc=False, is_async=True)
            step_g, step_u = warpgroup_mma_wait(0, deps=[step_g, step_u])
            acc_g = acc_g + step_g * scale_g[:, None]
            acc_u = acc_u + step_u * scale_u[:, None]
            wg, eg, wu, eu = wg_next, eg_next, wu_next, eu_next
        mo = gl.arange(0, _BLOCK_M, layout=gl.SliceLayout(0, _ACC))
        no = gl.arange(0, _BLOCK_N, layout=gl.SliceLayout(1, _ACC))
        pairs = gl.load(sorted_ptr + block * _BLOCK_M + mo)
        ok = pairs < num_pairs
        unlift = gl.load(unlift_ptr + gl.where(ok, pairs // TOP_K, 0), mask=ok, other=1.0)
        # `swiglu.swiglu_activation`'s clamp and roundings: pre-activations to bf16, the gate clamped from
        # above, up both ways, silu(gate) * up to bf16.
        gate = gl.minimum((acc_g * unlift[None, :]).to(gl.bfloat16).to(gl.float32), limit)
        up = gl.minimum(gl.maximum((acc_u * unlift[None, :]).to(gl.bfloat16).to(gl.float32), -limit), limit)
        act = (gate / (1.0 + gl.exp(-gate)) * up).to(gl.bfloat16)
        rows = block * _BLOCK_M + mo
        gl.store(act_ptr + rows[None, :].to(gl.int64) * s_ar + (n0 + no)[:, None], act, mask=ok[None, :])


@gluon.jit
def _down_kernel(act_ptr, unlift_ptr, w2_ptr, ws_ptr, sorted_ptr, block_expert_ptr, weights_ptr, pair_out_ptr,
                 num_pairs, hidden, inter, s_ar, s_we, s_wn, s_se, s_sn, s_sk, s_tw_t, s_tw_k, s_pr,
                 TOP_K: gl.constexpr):
    # pair_out[pair, n0 : n0 + 64] (float32) = sorted row r's down product with its block's expert's w2 rows
    # n0.., times the pair's router weight (act: the sorted rows lifted in K_ORDER_BITS' order, unlift [rows]).
    block, n0, expert = _program(block_expert_ptr)
    if expert >= 0:
        w_rows, s_rows = _weight_rows(w2_ptr, ws_ptr, expert, n0, hidden, s_we, s_wn, s_se, s_sn)
        q_idx, w_idx = _word_indices()
        mb = gl.arange(0, _BLOCK_M, layout=gl.SliceLayout(1, _X_LOAD))
        cb = gl.arange(0, 128, layout=gl.SliceLayout(0, _X_LOAD))
        rows_b = block * _BLOCK_M + mb
        mask_b = gl.load(sorted_ptr + rows_b) < num_pairs
        x_rows = act_ptr + (rows_b.to(gl.int64) * s_ar)[:, None] + cb[None, :]
        x_smem = gl.allocate_shared_memory(gl.float16, [_BLOCK_M, 128], _X_SMEM)
        acc = gl.zeros([_BLOCK_N, _BLOCK_M], gl.float32, _ACC)
        num_steps = inter // 128
        w, e = _load_step(w_rows, s_rows, 0, q_idx, w_idx, s_sk)
        for k_step in range(num_steps):
            k_next = gl.minimum(k_step + 1, num_steps - 1)
            w_next, e_next = _load_step(w_rows, s_rows, k_next, q_idx, w_idx, s_sk)
            _stage_activations(x_smem, x_rows, k_step, mask_b)
            a_op, row_scale = _widen(w, e)
            step = warpgroup_mma(a_op, x_smem.permute((1, 0)), acc, use_acc=False, is_async=True)
            step = warpgroup_mma_wait(0, deps=[step])
            acc = acc + step * row_scale[:, None]
            w, e = w_next, e_next
        mo = gl.arange(0, _BLOCK_M, layout=gl.SliceLayout(0, _ACC))
        no = gl.arange(0, _BLOCK_N, layout=gl.SliceLayout(1, _ACC))
        pairs = gl.load(sorted_ptr + block * _BLOCK_M + mo)
        ok = pairs < num_pairs
        unlift = gl.load(unlift_ptr + block * _BLOCK_M + mo, mask=ok, other=1.0)
        router = gl.load(weights_ptr + (pairs // TOP_K) * s_tw_t + (pairs % TOP_K) * s_tw_k, mask=ok, other=0.0)
        out = acc * (unlift * router)[None, :]
        gl.store(pair_out_ptr + pairs[None, :].to(gl.int64) * s_pr + (n0 + no)[:, None], out, mask=ok[None, :])


def wgmma_fp4_gate_up(x16: torch.Tensor, unlift: torch.Tensor, w13: BlockFP4Weight, sorted_pairs: torch.Tensor,
                      block_expert: torch.Tensor, top_k: int, limit: float, act: torch.Tensor) -> None:
    """act[r] = clamped SwiGLU(gate, up) of sorted row r's token with its block's expert, in bf16.

    x16:          [T, D] fp16, the tokens' rows lifted in K_ORDER_BITS' order (`fp16_lift.lift_rows`), unit stride
    unlift:       [T] float32, their lifts' undoing
    w13:          [E, 2I, D] (`applies`); sorted_pairs [R] int32 and block_expert [R / BLOCK_M] int32 from
                  `moe_align` with block_m = BLOCK_M (pairs >= T * top_k: padding; expert -1: an unused block)
    act:          [R, I] bf16, unit stride: written at the rows of valid pairs
    """
    num_tokens, hidden = x16.shape
    inter = w13.shape[1] // 2
    s13 = w13.scale.view(torch.uint8)
    _gate_up_kernel[(block_expert.numel(), triton.cdiv(inter, BLOCK_N))](
        x16, unlift, w13.packed, s13, sorted_pairs, block_expert, act, num_tokens * top_k, hidden, inter, float(limit),
        x16.stride(0), w13.packed.stride(0), w13.packed.stride(1), *s13.stride(), act.stride(0),
        TOP_K=top_k, num_warps=NUM_WARPS)


def wgmma_fp4_down(act16: torch.Tensor, unlift: torch.Tensor, w2: BlockFP4Weight, sorted_pairs: torch.Tensor,
                   block_expert: torch.Tensor, weights: torch.Tensor, pair_out: torch.Tensor) -> None:
    """pair_out[p] = the down product of pair p's sorted row with its expert, times its router weight.

    act16:        [R, I] fp16, the sorted rows lifted in K_ORDER_BITS' order, unit stride; unlift [R] float32
    w2:           [E, D, I] (`applies`); sorted_pairs, block_expert as `wgmma_fp4_gate_up`'s
    weights:      [T, k] float32 router weights
    pair_out:     [T * k, D] float32, unit stride: written at the rows of pairs with an expert
    """
    hidden, inter = w2.shape[1], w2.shape[2]
    s2 = w2.scale.view(torch.uint8)
    _down_kernel[(block_expert.numel(), triton.cdiv(hidden, BLOCK_N))](
        act16, unlift, w2.packed, s2, sorted_pairs, block_expert, weights, pair_out, weights.numel(), hidden, inter,
        act16.stride(0), w2.packed.stride(0), w2.packed.stride(1), *s2.stride(), *weights.stride(), pair_out.stride(0),
        TOP_K=weights.shape[1], num_warps=NUM_WARPS)
