"""Choosing each token's experts from its router logits, inside the routing kernel.

One row of a [BLOCK_T, BLOCK_E] tile per token, so a token's whole choice
happens in registers: softmax, sigmoid or sqrt(softplus) scores (the correction
bias added for the choice only); group limiting, where a group scores its best
(group_limited_greedy) or best two (noaux_tc) choice values and all but the
topk_group best groups drop to -inf; top-k by k rounds of a max with its index
(ties go to the lowest expert id); the weights are the raw scores of the picked
experts, then normalised, scaled and masked by `valid`; shared experts, when
asked for, follow in slots k .. k + S - 1 with weight 1. Experts fixed beforehand
(hash routing) replace the choice: their scores are gathered the same way.

Columns of the tile are laid out by group: group g's experts sit at columns
[g * GROUP_BLOCK, g * GROUP_BLOCK + E / n_group), so the tile reshapes to
[BLOCK_T, groups, GROUP_BLOCK] and all groups are scored by one reduction.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def expert_of(cols, GROUP_SIZE: tl.constexpr, GROUP_BLOCK: tl.constexpr, N_GROUP: tl.constexpr):
    """Expert id of each tile column, and whether the column holds an expert at all."""
    group = cols // GROUP_BLOCK
    member = cols % GROUP_BLOCK
    return group * GROUP_SIZE + member, (member < GROUP_SIZE) & (group < N_GROUP)


@triton.jit
def _scores(logits, col_mask, SCORING: tl.constexpr):
    """Softmax, sigmoid or sqrt(softplus) of [BLOCK_T, BLOCK_E] logits; columns without an expert score 0."""
    if SCORING == "sigmoid":
        scores = 1.0 / (1.0 + tl.exp(-logits))
    elif SCORING == "sqrtsoftplus":
        # softplus(l) = max(l, 0) + log(1 + exp(-|l|)): no overflow for large logits.
        scores = tl.sqrt(tl.maximum(logits, 0.0) + tl.log(1.0 + tl.exp(-tl.abs(logits))))
    else:
        masked = tl.where(col_mask[None, :], logits, float("-inf"))
        e = tl.exp(masked - tl.max(masked, axis=1)[:, None])
        scores = e / tl.sum(e, axis=1)[:, None]
    return tl.where(col_mask[None, :], scores, 0.0)


@triton.jit
def _limit_groups(choice, TOPK_GROUP: tl.constexpr, TOP2: tl.constexpr,
                  BLOCK_T: tl.constexpr, BLOCK_G: tl.constexpr, GROUP_BLOCK: tl.constexpr):
    """choice [BLOCK_T, BLOCK_E] with every expert outside the TOPK_GROUP best groups at -inf.

    A group scores its best choice value, with TOP2 the sum of its best two.
    Columns without an expert are -inf already, so they never count.
    """
    grouped = tl.reshape(choice, [BLOCK_T, BLOCK_G, GROUP_BLOCK])
    if TOP2:
        best, first = tl.max(grouped, axis=2, return_indices=True, return_indices_tie_break_left=True)
        # Only the best one's column is dropped, so a tie for best counts twice.
        members = tl.arange(0, GROUP_BLOCK)
        second = tl.max(tl.where(members[None, None, :] == first[:, :, None], float("-inf"), grouped), axis=2)
        group_scores = best + second
    else:
        group_scores = tl.max(grouped, axis=2)                                      # [BLOCK_T, BLOCK_G]
    # A group's rank is the number of groups ahead of it (ties go to the lower
    # group): one reduction picks all TOPK_GROUP groups at once.
    groups = tl.arange(0, BLOCK_G)
    mine = group_scores[:, :, None]
    other = group_scores[:, None, :]
    ahead = (other > mine) | ((other == mine) & (groups[None, None, :] < groups[None, :, None]))
    keep = tl.sum(ahead.to(tl.int32), axis=2) < TOPK_GROUP
    grouped = tl.where(keep[:, :, None], grouped, float("-inf"))
    return tl.reshape(grouped, [BLOCK_T, BLOCK_G * GROUP_BLOCK])


@triton.jit
def _top_k(choice, scores, cols, TOP_K: tl.constexpr, HAS_BIAS: tl.constexpr,
           BLOCK_T: tl.constexpr, BLOCK_K: tl.constexpr):
    """The TOP_K best columns of each row of choice, and their raw scores: [BLOCK_T, BLOCK_K] each.

    Slots past TOP_K hold column -1 and weight 0.
    """
    slots = tl.arange(0, BLOCK_K)
    weights = tl.zeros([BLOCK_T, BLOCK_K], dtype=tl.float32)
    picked = tl.full([BLOCK_T, BLOCK_K], -1, dtype=tl.int32)
    for j in tl.static_range(TOP_K):
        best, col = tl.max(choice, axis=1, return_indices=True, return_indices_tie_break_left=True)
        weights = tl.where(slots[None, :] == j, best[:, None], weights)
        picked = tl.where(slots[None, :] == j, col[:, None], picked)
        choice = tl.where(cols[None, :] == col[:, None], float("-inf"), choice)
    if HAS_BIAS:
        # The best choices include the bias, which only steers: gather the raw
        # scores of all picked columns in one reduction.
        hit = cols[None, None, :] == picked[:, :, None]                             # [BLOCK_T, BLOCK_K, BLOCK_E]
        weights = tl.sum(tl.where(hit, scores[:, None, :], 0.0), axis=2)
    return weights, picked


@triton.jit
def _fixed(fixed_ptr, rows, row_mask, scores, cols, s_ft, s_fk,
           GROUP_SIZE: tl.constexpr, GROUP_BLOCK: tl.constexpr, TOP_K: tl.constexpr, BLOCK_K: tl.constexpr):
    """The experts fixed beforehand as tile columns [BLOCK_T, BLOCK_K] (-1 past TOP_K), and their scores."""
    slots = tl.arange(0, BLOCK_K)
    ids = tl.load(fixed_ptr + rows[:, None].to(tl.int64) * s_ft + slots[None, :] * s_fk,
                  mask=row_mask[:, None] & (slots < TOP_K)[None, :], other=-1).to(tl.int32)
    picked = tl.where(ids >= 0, (ids // GROUP_SIZE) * GROUP_BLOCK + ids % GROUP_SIZE, -1)
    hit = cols[None, None, :] == picked[:, :, None]                                 # [BLOCK_T, BLOCK_K, BLOCK_E]
    return tl.sum(tl.where(hit, scores[:, None, :], 0.0), axis=2), picked


@triton.jit
def route_tile(logits, rows, row_mask, cols, col_mask, bias_ptr, valid_ptr, w_ptr, ids_ptr, fixed_ptr,
                s_b, s_v, s_wt, s_wk, s_it, s_ik, s_ft, s_fk, scaling, held_first, held_count, held_rank, held_ranks,
                TOP_K: tl.constexpr, SCORING: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_FIXED: tl.constexpr,
                GROUPED: tl.constexpr, TOP2: tl.constexpr, GROUP_SIZE: tl.constexpr,
                GROUP_BLOCK: tl.constexpr, N_GROUP: tl.constexpr, TOPK_GROUP: tl.constexpr,
                NORM: tl.constexpr, NUM_SHARED: tl.constexpr, HELD: tl.constexpr,
                BLOCK_T: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_G: tl.constexpr):
    """Steps 2-4 of the module docstring for one tile of logits; writes the tile's weights and ids.

    Slots [TOP_K, TOP_K + NUM_SHARED) take the shared experts, ids E.., weight 1. With HELD (an
    expert-parallel rank's `HeldExperts`): a chosen expert in [held_first, held_first + held_count)
    gets id e - held_first, any other id -1 and weight 0; the shared experts' ids start at
    held_count and go to rows t with t % held_ranks == held_rank only.
    """
    experts, _ = expert_of(cols, GROUP_SIZE, GROUP_BLOCK, N_GROUP)
    scores = _scores(logits, col_mask, SCORING)
    if HAS_FIXED:
        weights, picked = _fixed(fixed_ptr, rows, row_mask, scores, cols, s_ft, s_fk,
                                 GROUP_SIZE, GROUP_BLOCK, TOP_K, BLOCK_K)
    else:
        choice = scores
        if HAS_BIAS:
            choice += tl.load(bias_ptr + experts * s_b, mask=col_mask, other=0.0).to(tl.float32)[None, :]
        choice = tl.where(col_mask[None, :], choice, float("-inf"))
        if GROUPED:
            choice = _limit_groups(choice, TOPK_GROUP, TOP2, BLOCK_T, BLOCK_G, GROUP_BLOCK)
        weights, picked = _top_k(choice, scores, cols, TOP_K, HAS_BIAS, BLOCK_T, BLOCK_K)
    if NORM:
        weights = weights / (tl.sum(weights, axis=1)[:, None] + 1e-20)
    weights = weights * scaling
    ids, _ = expert_of(picked, GROUP_SIZE, GROUP_BLOCK, N_GROUP)

    valid = tl.load(valid_ptr + rows * s_v, mask=row_mask, other=0) != 0
    kept = valid[:, None]
    shared_rows = valid
    first_shared = N_GROUP * GROUP_SIZE
    if HELD:
        ids = ids - held_first
        kept = kept & (ids >= 0) & (ids < held_count)
        shared_rows = shared_rows & (rows % held_ranks == held_rank)
        first_shared = held_count
    weights = tl.where(kept, weights, 0.0)
    ids = tl.where(kept, ids, -1)
    slots = tl.arange(0, BLOCK_K)
    out_mask = row_mask[:, None] & (slots < TOP_K)[None, :]
    rows64 = rows[:, None].to(tl.int64)
    tl.store(w_ptr + rows64 * s_wt + slots[None, :] * s_wk, weights, mask=out_mask)
    tl.store(ids_ptr + rows64 * s_it + slots[None, :] * s_ik, ids.to(tl.int64), mask=out_mask)
    for j in tl.static_range(NUM_SHARED):
        shared_id = tl.where(shared_rows, first_shared + j, -1).to(tl.int64)
        tl.store(w_ptr + rows.to(tl.int64) * s_wt + (TOP_K + j) * s_wk, tl.where(shared_rows, 1.0, 0.0),
                 mask=row_mask)
        tl.store(ids_ptr + rows.to(tl.int64) * s_it + (TOP_K + j) * s_ik, shared_id, mask=row_mask)
