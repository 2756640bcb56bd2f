"""Mixture-of-experts routing in one kernel: router logits, scores, group limiting, top-k.

Each program routes BLOCK_T tokens over all E experts, one row of the tile per
token, so a token's whole choice happens in registers:

1. logits = x @ gate^T in float32 (where they come from: below);
2. the choice from the logits (`routing_select`): scores, group limiting,
   top-k, weights, shared experts.

Logits. For decode-sized batches (up to `_KERNEL_LOGITS_MAX_TOKENS` tokens) the
kernel computes them itself, loading x in its own dtype and widening it to
float32. One program per token tile would stream the whole router weight
through one multiprocessor, so the weight is cut into split_d slices of D times
E / BLOCK_C slices of columns, one program each: each writes its partial logits
to a workspace and bumps the tile's arrival counter (zeroed by `fill.zeros`, the
one other launch); the last to arrive sums the partials in split order (so the
result does not depend on the order of arrival) and routes. Larger batches take
their logits from one float32 product beforehand (`linear` with a float32 output:
the widened kernel of `linear_widened` up to a few hundred tokens, cuBLAS above):
computing them in the kernel would re-read the router weight once per token tile,
where a GEMM reads it once. Nothing is read back to the host, so the op can be
captured in a graph.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from ..checks import check_dtype, check_route_args, check_same_device, check_shape
from ..held_experts import HeldExperts
from ._common import check_float, next_pow2, pdl
from .fill import zeros
from .linear import linear
from .routing_select import expert_of, route_tile


@dataclass(frozen=True, slots=True)
class RouteConfig:
    block_t: int          # tokens per program
    kernel_logits: bool   # the kernel computes x @ gate^T (else one matmul before it)
    block_d: int = 32     # reduction step over D (kernel logits only)
    split_d: int = 1      # programs sharing one tile's D axis (kernel logits only)
    block_c: int = 0      # tile columns per program (kernel logits only; 0: all)
    num_warps: int = 4


# Up to this many tokens the kernel computes the logits itself (decode): the
# broadcast product it uses does not pad the tile to the 16 rows tl.dot needs.
_KERNEL_LOGITS_MAX_TOKENS = 4
# The [BLOCK_T, BLOCK_K, BLOCK_E] tile that gathers the picked experts' raw scores.
_GATHER_TILE = 8192
# Kernel logits: tile columns (experts) per program. Splitting E as well as D
# spreads the router weight over many programs while keeping the partial sums
# that the last program reads (split_d * T * E values) few.
_BLOCK_C = 16
# Kernel logits: at most this many partial sums for the last program to read,
# and at least this long a share of D per split.
_MAX_PARTIALS = 8192
_MIN_SPLIT_D = 64
# Kernel logits: the broadcast product's [BLOCK_T, BLOCK_C, BLOCK_D] float32 tile.
_PRODUCT_TILE = 16384


def route_config(num_tokens: int, num_experts: int, n_group: int, top_k: int, hidden: int) -> RouteConfig:
    """The tile sizes and D split for routing num_tokens tokens to top_k of num_experts experts in n_group groups."""
    block_e = _block_e(num_experts, n_group)
    if num_tokens > _KERNEL_LOGITS_MAX_TOKENS:
        block_t = max(1, min(16, _GATHER_TILE // (block_e * next_pow2(top_k))))
        return RouteConfig(block_t=block_t, kernel_logits=False)
    # Chosen on an H100 with V2-Lite (D 2048, 64 experts) and V3 (D 7168, 256
    # experts) shapes for T <= 4, timed as CUDA graph replays that read the
    # router weight from memory: 5.8-8.5 us (V2-Lite) and 11-22 us (V3) a call,
    # zeroing the counters included, against 28-34 and 67-84 us for the reference.
    block_t = next_pow2(num_tokens)
    block_c = min(block_e, _BLOCK_C)
    split_d = max(1, min(triton.cdiv(hidden, _MIN_SPLIT_D), _MAX_PARTIALS // (block_t * block_e)))
    # Most splits are one BLOCK_D step long: a loop over D waits on memory once per step.
    block_d = max(16, min(256, next_pow2(triton.cdiv(hidden, split_d)), _PRODUCT_TILE // (block_t * block_c)))
    return RouteConfig(block_t=block_t, kernel_logits=True, block_d=block_d, split_d=split_d, block_c=block_c)


def _group_block(num_experts: int, n_group: int) -> int:
    return next_pow2(num_experts // n_group)


def _block_e(num_experts: int, n_group: int) -> int:
    """Columns of the tile: n_group (rounded up to a power of two) groups of GROUP_BLOCK columns."""
    return next_pow2(n_group) * _group_block(num_experts, n_group)


@triton.jit
def _gate_tile(gate_ptr, experts, col_mask, d0, d_hi, s_ge, s_gd, BLOCK_D: tl.constexpr):
    """[BLOCK_C, BLOCK_D] slice gate[experts, d0:d0 + BLOCK_D] (zero past d_hi)."""
    ds = d0 + tl.arange(0, BLOCK_D)
    return tl.load(gate_ptr + experts[:, None].to(tl.int64) * s_ge + ds[None, :] * s_gd,
                   mask=col_mask[:, None] & (ds < d_hi)[None, :], other=0.0)


@triton.jit
def _partial_logits(x_ptr, gate_ptr, first_gate, rows, row_mask, experts, col_mask, d_lo, d_hi,
                    s_xt, s_xd, s_ge, s_gd,
                    BLOCK_T: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_D: tl.constexpr):
    """[BLOCK_T, BLOCK_C] float32 sums of x[t, d] * gate[experts[c], d] over d in [d_lo, d_hi).

    first_gate is the gate's first slice, `_gate_tile(..., d_lo, ...)`, loaded by the caller.
    """
    offs_d = tl.arange(0, BLOCK_D)
    x_rows = x_ptr + rows[:, None].to(tl.int64) * s_xt
    ds = d_lo + offs_d
    xt = tl.load(x_rows + ds[None, :] * s_xd, mask=row_mask[:, None] & (ds < d_hi)[None, :], other=0.0)
    acc = tl.sum(xt.to(tl.float32)[:, None, :] * first_gate.to(tl.float32)[None, :, :], axis=2)
    for d0 in range(d_lo + BLOCK_D, d_hi, BLOCK_D):
        ds = d0 + offs_d
        xt = tl.load(x_rows + ds[None, :] * s_xd, mask=row_mask[:, None] & (ds < d_hi)[None, :], other=0.0)
        g = _gate_tile(gate_ptr, experts, col_mask, d0, d_hi, s_ge, s_gd, BLOCK_D)
        acc += tl.sum(xt.to(tl.float32)[:, None, :] * g.to(tl.float32)[None, :, :], axis=2)
    return acc


@triton.jit
def _sum_partials(partial_ptr, tile_offs, tile_mask, split_d, stride_s,
                  BLOCK_T: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_S: tl.constexpr):
    """Sum over splits of the [split_d, T, BLOCK_E] workspace, for one tile, in split order."""
    # BLOCK_S splits per step: one round trip to L2 for BLOCK_S splits.
    splits = tl.arange(0, BLOCK_S)
    logits = tl.zeros([BLOCK_T, BLOCK_E], dtype=tl.float32)
    for s0 in range(0, split_d, BLOCK_S):
        ss = s0 + splits
        # .cg reads from L2, past any stale copy in this multiprocessor's L1.
        part = tl.load(partial_ptr + ss[:, None, None].to(tl.int64) * stride_s + tile_offs[None, :, :],
                       mask=(ss < split_d)[:, None, None] & tile_mask[None, :, :], other=0.0,
                       cache_modifier=".cg")
        logits += tl.sum(part, axis=0)
    return logits


# The token count and the split follow the step's size: plain (unspecialised)
# arguments, or every new token count of an eager step would compile again.
@triton.jit(do_not_specialize=["num_tokens", "split_d", "d_per_split"])
def _route_kernel(
    x_ptr, gate_ptr, logits_ptr, bias_ptr, valid_ptr, w_ptr, ids_ptr, fixed_ptr, partial_ptr, arrived_ptr,
    num_tokens, hidden, split_d, d_per_split, scaling, held_first, held_count, held_rank, held_ranks,
    s_xt, s_xd, s_ge, s_gd, s_lt, s_le, s_b, s_v, s_wt, s_wk, s_it, s_ik, s_ft, s_fk,
    KERNEL_LOGITS: tl.constexpr, SPLIT: tl.constexpr, BLOCK_C: tl.constexpr,
    TOP_K: tl.constexpr, SCORING: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_FIXED: tl.constexpr,
    GROUPED: tl.constexpr, TOP2: tl.constexpr, GROUP_SIZE: tl.constexpr, GROUP_BLOCK: tl.constexpr,
    N_GROUP: tl.constexpr, TOPK_GROUP: tl.constexpr, NORM: tl.constexpr, NUM_SHARED: tl.constexpr,
    HELD: tl.constexpr,
    BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_G: tl.constexpr,
    BLOCK_S: tl.constexpr, GDC: tl.constexpr,
):
    BLOCK_E: tl.constexpr = BLOCK_G * GROUP_BLOCK
    tile = tl.program_id(0)
    if KERNEL_LOGITS:
        # Program (tile, s, c) sums D slice s for tile columns [c * BLOCK_C, (c + 1) * BLOCK_C).
        d_lo = tl.program_id(1) * d_per_split
        d_hi = tl.minimum(d_lo + d_per_split, hidden)
        my_cols = tl.program_id(2) * BLOCK_C + tl.arange(0, BLOCK_C)
        my_experts, my_mask = expert_of(my_cols, GROUP_SIZE, GROUP_BLOCK, N_GROUP)
        # The router weight depends on no earlier kernel: its first slice (at decode
        # sizes the whole split) is in flight before the wait.
        first_gate = _gate_tile(gate_ptr, my_experts, my_mask, d_lo, d_hi, s_ge, s_gd, BLOCK_D)
    if GDC:
        gdc_wait()
        gdc_launch_dependents()
    rows = tile * BLOCK_T + tl.arange(0, BLOCK_T)
    row_mask = rows < num_tokens
    cols = tl.arange(0, BLOCK_E)
    experts, col_mask = expert_of(cols, GROUP_SIZE, GROUP_BLOCK, N_GROUP)
    last = True
    if KERNEL_LOGITS:
        part = _partial_logits(x_ptr, gate_ptr, first_gate, rows, row_mask, my_experts, my_mask, d_lo, d_hi,
                               s_xt, s_xd, s_ge, s_gd, BLOCK_T, BLOCK_C, BLOCK_D)
        if SPLIT:
            # partial[s, t, c]: split s's sums for token t and tile column c.
            stride_s = num_tokens.to(tl.int64) * BLOCK_E
            rows_offs = rows[:, None].to(tl.int64) * BLOCK_E
            tl.store(partial_ptr + tl.program_id(1) * stride_s + rows_offs + my_cols[None, :], part,
                     mask=row_mask[:, None])
            # Every thread's partial stores precede the release of the arrival count.
            tl.debug_barrier()
            arrived = tl.atomic_add(arrived_ptr + tile, 1, sem="acq_rel", scope="gpu")
            last = arrived == split_d * tl.num_programs(2) - 1
            logits = tl.zeros([BLOCK_T, BLOCK_E], dtype=tl.float32)
            if last:
                logits = _sum_partials(partial_ptr, rows_offs + cols[None, :],
                                       row_mask[:, None] & col_mask[None, :], split_d, stride_s,
                                       BLOCK_T, BLOCK_E, BLOCK_S)
        else:
            logits = part  # one program holds the whole tile: BLOCK_C == BLOCK_E
    else:
        logits = tl.load(logits_ptr + rows[:, None].to(tl.int64) * s_lt + experts[None, :] * s_le,
                         mask=row_mask[:, None] & col_mask[None, :], other=0.0)
    if last:
        route_tile(logits, rows, row_mask, cols, col_mask, bias_ptr, valid_ptr, w_ptr, ids_ptr, fixed_ptr,
                    s_b, s_v, s_wt, s_wk, s_it, s_ik, s_ft, s_fk, scaling, held_first, held_count, held_rank,
                    held_ranks, TOP_K, SCORING, HAS_BIAS, HAS_FIXED, GROUPED, TOP2, GROUP_SIZE, GROUP_BLOCK, N_GROUP,
                    TOPK_GROUP, NORM, NUM_SHARED, HELD, BLOCK_T, BLOCK_K, BLOCK_G)


def route(
    x: torch.Tensor,
    gate: torch.Tensor,
    e_score_correction_bias: torch.Tensor | None,
    valid: torch.Tensor,
    *,
    top_k: int,
    scoring_func: str,
    topk_method: str,
    n_group: int | None,
    topk_group: int | None,
    norm_topk_prob: bool,
    routed_scaling_factor: float,
    num_shared: int = 0,
    fixed_ids: torch.Tensor | None = None,
    held: HeldExperts | None = None,
    config: RouteConfig | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Contract of `reference.routing.route`, in the routing kernel (see the module docstring).

    x:                       [T, D] bf16 / fp16 / fp32 (any strides); float64 is refused
    gate:                    [E, D] bf16 / fp16 / fp32, read as float32
    e_score_correction_bias: [E] bf16 / fp16 / fp32, or None
    valid:                   [T] bool
    num_shared:              S shared experts appended to every row (ids E .., weight 1)
    fixed_ids:               [T, k] int32 / int64 experts chosen beforehand, or None
    held:                    an expert-parallel rank's experts (`HeldExperts`), or None for all
    returns                  topk_weights [T, k + S] float32, topk_ids [T, k + S] int64 (-1
                             and weight 0 in rows where valid is False)
    Logits, scores and weights are float32 throughout.
    """
    num_tokens, hidden = x.shape
    num_experts = gate.shape[0]
    check_float("x", x)
    check_float("gate", gate)
    check_shape("gate", gate, (num_experts, hidden))
    check_shape("valid", valid, (num_tokens,))
    check_dtype("valid", valid, (torch.bool,))
    bias = e_score_correction_bias
    if bias is not None:
        check_float("e_score_correction_bias", bias)
        check_shape("e_score_correction_bias", bias, (num_experts,))
        check_same_device(x=x, gate=gate, valid=valid, e_score_correction_bias=bias)
    else:
        check_same_device(x=x, gate=gate, valid=valid)
    check_route_args(num_experts, top_k=top_k, scoring_func=scoring_func, topk_method=topk_method,
                     n_group=n_group, topk_group=topk_group, num_shared=num_shared)
    if fixed_ids is not None:
        check_shape("fixed_ids", fixed_ids, (num_tokens, top_k))
        check_dtype("fixed_ids", fixed_ids, (torch.int32, torch.int64))
        check_same_device(x=x, fixed_ids=fixed_ids)
    if held is not None:
        held.check(num_experts)
    device = x.device
    topk_weights = torch.empty((num_tokens, top_k + num_shared), dtype=torch.float32, device=device)
    topk_ids = torch.empty((num_tokens, top_k + num_shared), dtype=torch.int64, device=device)
    if num_tokens == 0:
        return topk_weights, topk_ids
    # check_route_args made sure the group-limited methods have n_group >= 1.
    groups = n_group if topk_method != "greedy" and n_group else 1
    config = config or route_config(num_tokens, num_experts, groups, top_k, hidden)
    _launch(x, gate, bias, valid, fixed_ids, topk_weights, topk_ids, config, groups=groups, top_k=top_k,
            num_shared=num_shared, scoring_func=scoring_func, topk_method=topk_method, topk_group=topk_group,
            norm_topk_prob=norm_topk_prob, routed_scaling_factor=routed_scaling_factor, held=held)
    return topk_weights, topk_ids


def _launch(x: torch.Tensor, gate: torch.Tensor, bias: torch.Tensor | None, valid: torch.Tensor,
            fixed_ids: torch.Tensor | None, topk_weights: torch.Tensor, topk_ids: torch.Tensor, config: RouteConfig, *, groups: int, top_k: int,
            num_shared: int, scoring_func: str, topk_method: str, topk_group: int | None, norm_topk_prob: bool,
            routed_scaling_factor: float, held: HeldExperts | None) -> None:
    num_tokens, hidden = x.shape
    num_experts = gate.shape[0]
    device = x.device
    block_e = _block_e(num_experts, groups)
    num_tiles = triton.cdiv(num_tokens, config.block_t)
    split_d, d_per_split, block_c = 1, hidden, block_e
    logits = partial = arrived = topk_weights  # stand-ins for buffers the chosen path never touches
    if config.kernel_logits:
        # Each split's share of D is a whole number of BLOCK_D steps.
        d_per_split = triton.cdiv(triton.cdiv(hidden, config.split_d), config.block_d) * config.block_d
        split_d = triton.cdiv(hidden, d_per_split)
        block_c = min(block_e, config.block_c or block_e)
        if block_c != next_pow2(block_c):
            raise ValueError(f"config.block_c: expected 0 or a power of two, got {config.block_c}")
        if split_d > 1 or block_c < block_e:
            partial = torch.empty((split_d, num_tokens, block_e), dtype=torch.float32, device=device)
            arrived = zeros((num_tiles,), torch.int32, device)
    else:
        # Float32 products of the inputs as they are, as the reference's float32 matmul computes.
        logits = linear(x, gate, out_dtype=torch.float32)
    grouped = topk_method != "greedy"
    use_pdl = pdl(device)
    _route_kernel[(num_tiles, split_d, block_e // block_c)](
        x, gate, logits, bias if bias is not None else gate, valid, topk_weights, topk_ids,
        fixed_ids if fixed_ids is not None else topk_ids, partial, arrived,
        num_tokens, hidden, split_d, d_per_split, float(routed_scaling_factor),
        *((held.first, held.count, held.rank, held.ranks) if held is not None else (0, num_experts, 0, 1)),
        *x.stride(), *gate.stride(), *logits.stride(), bias.stride(0) if bias is not None else 0, valid.stride(0),
        *topk_weights.stride(), *topk_ids.stride(), *(fixed_ids.stride() if fixed_ids is not None else (0, 0)),
        KERNEL_LOGITS=config.kernel_logits, SPLIT=split_d > 1 or block_c < block_e, BLOCK_C=block_c,
        TOP_K=top_k, SCORING=scoring_func, HAS_BIAS=bias is not None, HAS_FIXED=fixed_ids is not None,
        GROUPED=grouped, TOP2=topk_method == "noaux_tc", GROUP_SIZE=num_experts // groups,
        GROUP_BLOCK=_group_block(num_experts, groups), N_GROUP=groups, TOPK_GROUP=topk_group if grouped else 1,
        NORM=bool(norm_topk_prob), NUM_SHARED=num_shared, HELD=held is not None,
        BLOCK_T=config.block_t, BLOCK_D=config.block_d, BLOCK_K=max(2, next_pow2(top_k)),
        BLOCK_G=next_pow2(groups),
        # The last program sums a [BLOCK_S, BLOCK_T, BLOCK_E] tile of at most 8K partials per step.
        BLOCK_S=max(2, min(64, 8192 // (config.block_t * block_e))), GDC=use_pdl,
        num_warps=config.num_warps, launch_pdl=use_pdl,
    )
