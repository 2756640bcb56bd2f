"""Planning a step under data-parallel attention: every rank's plan known to every rank.

Each rank runs the step of its own requests over its own latent cache; the blocks the ranks
share (MLPs, experts) then take every rank's rows at once (`core.exchange`), which needs the same
number of rows from each: the most any rank's step has. Every rank is given the plans of all
(built identically everywhere, like the scheduler's decisions), so each decides every rank's mode
itself (`rank_modes`, the same tuple on every rank), and no rank waits on another to learn it.

A rank with no request this step still enters every layer's exchange, or the others would wait on
it: it runs an idle step of padding rows that write only the scratch block, give no logits and
bring the exchange rows of padding that a router sends nowhere.

CUDA graphs need one more agreement. A rank that captures a graph runs its step's collectives
twice (the capture's warm-up runs the step once eagerly), a rank that replays one runs them once,
and ranks whose graphs exchange other row counts mismatch: any of these hangs the group. So a step
replays (or captures) a graph only when every rank can: every busy rank's own mode may use one and
is a decode step of one query length. Then every rank, an idle one too, runs a mode padded to the
largest sizes any of them needs, exchanging that mode's rows: one static key on every rank, which
each finds memoized, or captures, at the same step. A step any rank cannot graph runs eagerly on
all, and so does every prefill and mixed step: their logits rows follow each rank's own prompts
(so their keys seldom agree), and an idle rank beside them would need an all-padding prefill graph.
A verify step of speculative decoding is a decode step like any other here (its query length is in
the key), and so are the drafter's chain and catch-up steps around it: every rank runs the same
drafter steps (an idle rank's all padding), decided by the same rule.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Collection, Sequence

from mla_func.core.batch import Batch
from mla_func.core.batch_build import build_batch
from mla_func.core.config import ModelConfig
from mla_func.core.mode import SEGMENT_KINDS, ForwardMode, PaddingPolicy, SegmentKind
from mla_func.core.plan import StepPlan
from mla_func.core.step import Step
from mla_func.kernels import default_backend
from mla_func.state.kv_cache import KVCacheState
from mla_func.state.layer_cache import CacheGroup


def _idle_mode(groups: tuple[CacheGroup, ...], busy: ForwardMode, *, decode_seqs: int = 1,
               block_table_width: int = 1, decode_q_len: int = 1, use_graph: bool = False) -> ForwardMode:
    """The mode of a rank with no sequence this step: decode rows of padding only (slot -1, the scratch
    block's table, no logits); by default one row, run eagerly. Its op table (backend, batch invariance,
    w8a8) is a busy rank's mode's, as the blocks the ranks share need."""
    return ForwardMode.padded_only(SegmentKind.DECODE, backend=busy.backend, cache_groups=groups,
                                   decode_seqs=decode_seqs, block_table_width=block_table_width,
                                   decode_q_len=decode_q_len, use_graph=use_graph,
                                   batch_invariant=busy.batch_invariant, w8a8=busy.w8a8)


def _exchanging(modes: Sequence[ForwardMode]) -> tuple[ForwardMode, ...]:
    """`modes` each exchanging the most rows any of them has."""
    rows = max(mode.num_tokens for mode in modes)
    return tuple(dataclasses.replace(mode, exchange_rows=rows) for mode in modes)


def _agreed_graph_modes(own: Sequence[ForwardMode | None],
                        groups: tuple[CacheGroup, ...]) -> tuple[ForwardMode, ...] | None:
    """Every rank's mode of a graph step, each padded to the largest sizes any rank's needs (an idle rank's,
    None in `own`, all padding), or None when not every rank can replay one graph of one static key."""
    busy = [mode for mode in own if mode is not None]
    if not all(mode.use_graph and mode.kind is SegmentKind.DECODE for mode in busy):
        return None
    q_len = busy[0].decode_q_len
    if any(mode.decode_q_len != q_len for mode in busy):
        return None
    seqs = max(mode.padded_decode_seqs for mode in busy)
    width = max(mode.block_table_width for mode in busy)
    idle = _idle_mode(groups, busy[0], decode_seqs=seqs, block_table_width=width, decode_q_len=q_len, use_graph=True)
    modes = _exchanging([idle if mode is None else mode.padded_to(decode_seqs=seqs, block_table_width=width)
                         for mode in own])
    # The logits sizes follow each rank's own rows (a rank whose decode rows do not all give logits gathers
    # them, the others do not): one key on every rank, or no graph on any.
    return modes if len({mode.static_key for mode in modes}) == 1 else None


def rank_modes(plans: Sequence[StepPlan], *, cache_groups: Sequence[CacheGroup], backend: str,
               padding: PaddingPolicy | None = None, graphs: bool = False,
               graph_kinds: Collection[str] = SEGMENT_KINDS, batch_invariant: bool = False,
               w8a8: bool = False) -> tuple[ForwardMode, ...]:
    """Every rank's mode of one data-parallel step, in rank order: the same tuple on every rank.

    plans: every rank's plan of this step, in rank order (an empty plan is an idle rank's); at least
           one rank has a sequence.
    The other arguments are `ForwardMode.decide`'s, the same on every rank. Each busy rank's own mode
    is `decide`'s of its plan. When every rank can replay a graph (each busy rank's mode uses one and is
    a decode step of one query length, and all padded alike have one key) every mode is padded to the
    largest sizes any rank's needs, uses a graph and has one static key, `exchange_rows` its row count
    (an idle rank's all padding); otherwise every mode runs eagerly (`graph_fallback` stays each rank's
    own: only a rank whose step did not fit the ladders warns), an idle rank's at one row, and
    `exchange_rows` is the most rows of any rank's step.
    """
    if not any(plan.num_seqs for plan in plans):
        raise ValueError(f"rank_modes: all {len(plans)} ranks' plans are empty: there is no step to run")
    groups = tuple(cache_groups)
    own = [ForwardMode.decide(plan, cache_groups=groups, backend=backend, padding=padding, graphs=graphs,
                              graph_kinds=graph_kinds, batch_invariant=batch_invariant, w8a8=w8a8)
           if plan.num_seqs else None for plan in plans]
    agreed = _agreed_graph_modes(own, groups)
    if agreed is not None:
        return agreed
    busy = next(mode for mode in own if mode is not None)
    return _exchanging([_idle_mode(groups, busy) if mode is None
                        else dataclasses.replace(mode, use_graph=False) for mode in own])


def rank_graph_modes(modes: Sequence[ForwardMode]) -> tuple[ForwardMode, ...]:
    """Graph modes (`Step.decode_graph_modes`) as a data-parallel step of their padded sizes runs them on
    every rank (`rank_modes`): each exchanging its own row count. Every rank builds the same from the
    same ladders, so a warm-up of these (`Step.warmup`) captures the keys real steps get, on every rank
    in the same order."""
    return tuple(dataclasses.replace(mode, exchange_rows=mode.num_tokens) for mode in modes)


def plan_rank_step(config: ModelConfig, state: KVCacheState, plans: Sequence[StepPlan], rank: int, *,
                   backend: str | None = None, padding: PaddingPolicy | None = None, graphs: bool = False,
                   graph_kinds: Collection[str] = SEGMENT_KINDS, max_position: int | None = None,
                   batch_invariant: bool = False, w8a8: bool = False) -> tuple[Batch, ForwardMode]:
    """Rank `rank`'s batch and mode of one data-parallel step: its mode of `rank_modes`, and the batch
    of its plan (an idle rank's: padding only) built for it, checked as `core.prepare.plan_step` checks.

    plans: every rank's plan of this step, in rank order (the same sequence on every rank); an empty
           plan (no sequence) is an idle rank's. At least one rank has a sequence.
    The other arguments are `plan_step`'s, the same on every rank.
    """
    if not 0 <= rank < len(plans):
        raise ValueError(f"plan_rank_step: rank {rank} of {len(plans)} plans")
    mode = rank_modes(plans, cache_groups=state.groups, backend=backend or default_backend(state.device),
                      padding=padding, graphs=graphs, graph_kinds=graph_kinds, batch_invariant=batch_invariant,
                      w8a8=w8a8)[rank]
    plan = plans[rank] if plans[rank].num_seqs else StepPlan(decode_q_len=mode.decode_q_len)
    batch = build_batch(plan, mode, block_size=state.block_size, device=state.device, num_blocks=state.num_blocks,
                        vocab_size=config.vocab_size,
                        max_position=config.max_position_embeddings if max_position is None else max_position)
    return batch, mode


def prepare_rank_step(step: Step, state: KVCacheState, plans: Sequence[StepPlan],
                      rank: int) -> tuple[Batch, ForwardMode]:
    """`step.prepare` of a data-parallel step: rank `rank`'s batch and mode of every rank's `plans`
    (`plan_rank_step`), decided with the step's padding, graph settings, batch invariance and w8a8."""
    state.check_live("step.prepare")
    return plan_rank_step(step.config, state, plans, rank, backend=step.backend, padding=step.padding,
                          graphs=step.graphs, graph_kinds=step.graph_kinds, max_position=step.max_position,
                          batch_invariant=step.batch_invariant, w8a8=step.w8a8)
