"""The per-pair path of fused MoE: one launch for steps of few (token, slot) pairs (decode).

`_pair_kernel` programs each take one pair and a slice of its expert's
intermediate columns, and add their slice's share of the down projection into
the token's float32 output row (atomics into a zeroed row).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from ._common import dot_precision, next_pow2, pdl
from .fill import zeros


@dataclass(frozen=True, slots=True)
class PairConfig:
    """The per-pair path: one program per (token, slot) pair and BLOCK_I intermediate columns."""

    block_i: int   # intermediate columns per program
    block_k: int   # gate/up reduction step over the hidden dimension
    block_d: int   # down-projection output step over the hidden dimension
    num_warps: int
    num_stages: int


# Chosen on an H100 from 66 settings, V2-Lite shapes with its two shared experts
# (8 pairs a token), timed as graph replays over 8 routings: 53.2 us at one token
# against 55.7 us for the tiled path (gate/up, down, combine) in the same run;
# CUDA-core dot products without `tl.dot` (no pipelined loads) took 59-102 us.
_GPU_PAIRS = PairConfig(block_i=64, block_k=128, block_d=128, num_warps=4, num_stages=3)
# Under the interpreter: 32 columns a program still leave the tests' I = 48 two programs, the last
# partial, and 32-wide K steps two over their D = 64.
_INTERPRETER_PAIRS = PairConfig(block_i=32, block_k=32, block_d=32, num_warps=4, num_stages=1)

# Up to this many (token, slot) pairs the per-pair path runs: one launch instead
# of three, and no 16-row tiles of which one row is live. It reads an expert's
# weights once per pair, so once tokens share experts the tiled path reads less:
# in the sweep above 2 tokens took 92.7 us against 96.2 (tiled), 4 tokens 168
# against 168.
PAIR_MAX_PAIRS = 32


def pair_config(device: torch.device) -> PairConfig:
    """The per-pair path's launch configuration on `device`."""
    return _GPU_PAIRS if device.type == "cuda" else _INTERPRETER_PAIRS


@triton.jit
def _pair_kernel(
    x_ptr, w13_ptr, w2_ptr, ids_ptr, weights_ptr, out_ptr,
    hidden, inter,
    s_xt, s_xd, s_ge, s_gn, s_gd, s_de, s_dd, s_di, s_ids_t, s_ids_k, s_tw_t, s_tw_k, s_ot,
    TOP_K: tl.constexpr, BLOCK_I: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_D: tl.constexpr,
    DOT_PRECISION: tl.constexpr, GDC: tl.constexpr,
):
    """One (token, slot) pair, BLOCK_I of its expert's intermediate columns, gate/up and down.

    The down projection of a column slice is a partial sum over the intermediate
    dimension, so each program adds weight * w2[:, slice] @ act[slice] into the
    token's float32 output row with atomics. The pair's row sits in row 0 of
    16-row tiles (rows 1-15 are zero) so that the weight loads feed `tl.dot`,
    whose loads Triton pipelines; the weights, not the multiplies, bound it.
    """
    pair = tl.program_id(0)
    token = (pair // TOP_K).to(tl.int64)
    slot = pair % TOP_K
    if GDC:
        gdc_wait()
        gdc_launch_dependents()
    expert = tl.load(ids_ptr + token * s_ids_t + slot * s_ids_k)
    if expert >= 0:
        router = tl.load(weights_ptr + token * s_tw_t + slot * s_tw_k)
        first = tl.arange(0, 16) == 0
        offs_i = tl.program_id(1) * BLOCK_I + tl.arange(0, BLOCK_I)
        i_mask = offs_i < inter
        w_gate = w13_ptr + expert.to(tl.int64) * s_ge + offs_i[None, :] * s_gn
        w_up = w_gate + inter * s_gn
        x_row = x_ptr + token * s_xt
        offs_k = tl.arange(0, BLOCK_K)
        acc_gate = tl.zeros([16, BLOCK_I], dtype=tl.float32)
        acc_up = tl.zeros([16, BLOCK_I], dtype=tl.float32)
        for k0 in range(0, hidden, BLOCK_K):
            ks = k0 + offs_k
            k_mask = ks < hidden
            xa = tl.load(x_row + ks[None, :] * s_xd + tl.zeros([16, 1], dtype=tl.int64),
                         mask=first[:, None] & k_mask[None, :], other=0.0)
            w_mask = k_mask[:, None] & i_mask[None, :]
            gate = tl.load(w_gate + ks[:, None] * s_gd, mask=w_mask, other=0.0)
            up = tl.load(w_up + ks[:, None] * s_gd, mask=w_mask, other=0.0)
            acc_gate = tl.dot(xa, gate, acc_gate, input_precision=DOT_PRECISION)
            acc_up = tl.dot(xa, up, acc_up, input_precision=DOT_PRECISION)
        # act is rounded to x's dtype, as the tiled path stores it.
        act = (acc_gate / (1.0 + tl.exp(-acc_gate)) * acc_up).to(x_ptr.dtype.element_ty)
        w_down = w2_ptr + expert.to(tl.int64) * s_de + offs_i[:, None] * s_di
        offs_d = tl.arange(0, BLOCK_D)
        out_row = out_ptr + token * s_ot + tl.zeros([16, 1], dtype=tl.int64)
        for d0 in range(0, hidden, BLOCK_D):
            ds = d0 + offs_d
            d_mask = ds < hidden
            w = tl.load(w_down + ds[None, :] * s_dd, mask=i_mask[:, None] & d_mask[None, :], other=0.0)
            part = tl.dot(act, w, input_precision=DOT_PRECISION) * router
            tl.atomic_add(out_row + ds[None, :], part, mask=first[:, None] & d_mask[None, :], sem="relaxed")


def pair_moe(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
             config: PairConfig) -> torch.Tensor:
    """The per-pair path: one launch into a zeroed float32 [T, D]."""
    num_tokens, hidden = x.shape
    num_pairs = topk_ids.numel()
    inter = w13.shape[1] // 2
    out = zeros((num_tokens, hidden), torch.float32, x.device)
    use_pdl = pdl(x.device)
    _pair_kernel[(num_pairs, triton.cdiv(inter, config.block_i))](
        x, w13, w2, topk_ids, topk_weights, out,
        hidden, inter,
        *x.stride(), *w13.stride(), *w2.stride(), *topk_ids.stride(), *topk_weights.stride(), out.stride(0),
        TOP_K=topk_ids.shape[1], BLOCK_I=config.block_i,
        BLOCK_K=min(config.block_k, next_pow2(hidden)), BLOCK_D=min(config.block_d, next_pow2(hidden)),
        DOT_PRECISION=dot_precision(x.dtype), GDC=use_pdl,
        num_warps=config.num_warps, num_stages=config.num_stages, launch_pdl=use_pdl,
    )
    return out
