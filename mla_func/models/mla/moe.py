"""The feed-forward blocks: dense SiLU MLP, and routed + shared experts."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from mla_func.core.config import ModelConfig
from mla_func.kernels import Ops
from mla_func.kernels.quantized import dequantized
from mla_func.models.mla.params import MLPParams, MoEParams


def mlp(p: MLPParams, x: torch.Tensor, ops: Ops) -> torch.Tensor:
    """x [T, D] -> down(silu(gate(x)) * up(x)) [T, D]."""
    gate, up = ops.dense.linear(x, p.gate_up).chunk(2, dim=-1)
    return ops.dense.linear(F.silu(gate) * up, p.down)


# Up to this many tokens a step runs its shared experts inside the fused MoE call,
# as experts every token takes with weight 1, instead of three GEMM launches and an
# add. Their tiles re-read the shared weights once per tile of rows, mostly from L2:
# one V2-Lite MoE layer on an H200 was faster fused at every count measured, 8 to 256
# tokens (64: 315 vs 335 us; 256: 367 vs 382 us). Prefill chunks above it take the GEMMs.
SHARED_IN_FUSED_MAX_TOKENS = 256

# From this many rows a sharded block's partial sum leaves the fused MoE in the model's dtype
# (`sum_dtype`): the ranks' all-reduce or reduce-scatter then moves half float32's bytes. On two
# H200s over v2-lite's 256 rows that took TP 2's decode step from 9.89 to 9.34 ms and
# DP attention's from 8.15 to 8.00. Fewer rows move too few bytes for it to pay, and at decode's
# one or two rows the per-pair kernel, which sums in float32, would spend a launch on the cast.
NARROW_SUMS_MIN_TOKENS = 16


def route(p: MoEParams, x: torch.Tensor, valid: torch.Tensor, config: ModelConfig, ops: Ops, *,
          num_shared: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Choose each token's experts, with the backend's `route` op.

    x [T, D]; valid [T] bool (False for padded rows)
    returns topk_weights [T, k + num_shared] (float32, or float64 for a float64 model) and topk_ids
    [T, k + num_shared] int64; padded rows get id -1 and weight 0, so they take no expert. The
    last num_shared columns are the shared experts (ids E.., weight 1). An expert-parallel
    rank's block (`p.held`) gets ids among the experts it holds, and the shared experts on its
    share of the rows (`kernels.held_experts`).

    Routing runs in at least float32 whatever the model dtype (bf16 scores would
    tie and flip experts); a float64 model routes in float64 (torch backend only).
    Scores are softmax or sigmoid; `group_limited_greedy` keeps the topk_group
    groups with the best single expert, `noaux_tc` those with the best sum of two
    bias-corrected scores; the bias only steers the choice, weights use raw scores.
    """
    c = config
    return ops.moe.route(
        x, p.gate, p.e_score_correction_bias, valid,
        top_k=c.num_experts_per_tok, scoring_func=c.scoring_func, topk_method=c.topk_method,
        n_group=c.n_group, topk_group=c.topk_group, norm_topk_prob=c.norm_topk_prob,
        routed_scaling_factor=c.routed_scaling_factor, num_shared=num_shared, held=p.held,
    )


def shared_experts(p: MoEParams, x: torch.Tensor) -> torch.Tensor:
    """The shared experts (experts E.. of p) as dense GEMMs: x [T, D] -> [T, D].

    FP8 experts are dequantized into x's dtype for these GEMMs (the reference's math for them);
    only prefill chunks above SHARED_IN_FUSED_MAX_TOKENS take this path.
    """
    w13 = dequantized(p.w13[p.num_routed:], x.dtype)                    # [S, 2I, D]
    w2 = dequantized(p.w2[p.num_routed:], x.dtype)                      # [S, D, I]
    num_shared, two_inter, _ = w13.shape
    gate, up = F.linear(x, w13.flatten(0, 1)).view(-1, num_shared, 2, two_inter // 2).unbind(2)
    act = F.silu(gate) * up                                             # [T, S, I]
    out = F.linear(act[:, 0], w2[0])
    for s in range(1, num_shared):
        out = torch.addmm(out, act[:, s], w2[s].t())
    return out


def sum_dtype(x: torch.Tensor, ops: Ops) -> torch.dtype:
    """The dtype of the MoE block's output for rows x [T, D].

    With one process, at least float32: the sum over experts stays there up to the residual add
    (`rms_norm` rounds once, to the residual's dtype), which spares the fused MoE a pass that
    would only round its float32 sums. When the output is a rank's partial sum that crosses the
    wire, x's dtype from `NARROW_SUMS_MIN_TOKENS` rows (half the bytes; each rank's share then
    rounds once before the ranks' sum). A batch-invariant table keeps float32 at every size: a
    row's bits may not depend on how many rows share its step.
    """
    wide = torch.promote_types(x.dtype, torch.float32)
    if ops.collectives.size == 1 or ops.batch_invariant or x.shape[0] < NARROW_SUMS_MIN_TOKENS:
        return wide
    return x.dtype


def moe(p: MoEParams, x: torch.Tensor, valid: torch.Tensor, config: ModelConfig, ops: Ops) -> torch.Tensor:
    """Routed experts plus shared experts: x [T, D] -> [T, D] in `sum_dtype` (an expert-parallel
    rank's partial sum: its experts, its rows' shared experts)."""
    out_dtype = sum_dtype(x, ops)
    # A batch-invariant table keeps the shared experts in the fused call at every size: the
    # dense GEMMs and the separate add would give a token other bits in a larger step. So does
    # an expert-parallel rank, which runs them for its share of the rows only.
    if p.num_shared and (ops.batch_invariant or p.held is not None or x.shape[0] <= SHARED_IN_FUSED_MAX_TOKENS):
        topk_weights, topk_ids = route(p, x, valid, config, ops, num_shared=p.num_shared)
        return ops.moe.fused_moe(x, p.w13, p.w2, topk_weights, topk_ids, out_dtype=out_dtype)
    topk_weights, topk_ids = route(p, x, valid, config, ops)
    out = ops.moe.fused_moe(x, p.w13[:p.num_routed], p.w2[:p.num_routed], topk_weights, topk_ids,
                        out_dtype=out_dtype)
    if p.num_shared:
        out = out + shared_experts(p, x)
    return out


def feed_forward(p: MLPParams | MoEParams, x: torch.Tensor, valid: torch.Tensor, config: ModelConfig, ops: Ops) -> torch.Tensor:
    """The layer's feed-forward block, dense or MoE, x [T, D] -> [T, D] (x's dtype for dense, see `moe`)."""
    if isinstance(p, MoEParams):
        return moe(p, x, valid, config, ops)
    return mlp(p, x, ops)
