"""Planning a step under data-parallel attention: every rank's plan known to every rank.

Each rank runs the step of its own requests over its own latent cache; the blocks the ranks
share (MLPs, experts) then take every rank's rows at once (`core.exchange`), which needs the same
number of rows from each: the most any rank's step has. Every rank is given the plans of all
(built identically everywhere, like the scheduler's decisions), so each computes that number
itself, and no rank waits on another to learn it.

A rank with no request this step still enters every layer's exchange, or the others would wait on
it: it runs an idle step, one padding row that writes only the scratch block, gives no logits and
brings the exchange rows of padding that a router sends nowhere (`idle_step`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

from mla_func.core.batch import Batch
from mla_func.core.batch_build import build_batch
from mla_func.core.config import ModelConfig
from mla_func.core.mode import ForwardMode, SegmentKind
from mla_func.core.plan import StepPlan
from mla_func.core.prepare import plan_step
from mla_func.core.step import Step
from mla_func.kernels import default_backend
from mla_func.state.kv_cache import KVCacheState


def idle_step(state: KVCacheState, *, backend: str, batch_invariant: bool = False) -> tuple[Batch, ForwardMode]:
    """The batch and mode of a rank with no sequence this step: one decode row of padding (slot -1, the
    scratch block's table, no logits), run eagerly."""
    mode = ForwardMode.padded_only(SegmentKind.DECODE, backend=backend, cache_groups=state.groups, decode_seqs=1,
                                   block_table_width=1, use_graph=False, batch_invariant=batch_invariant)
    return build_batch(StepPlan(), mode, block_size=state.block_size, device=state.device), mode


def plan_rank_step(config: ModelConfig, state: KVCacheState, plans: Sequence[StepPlan], rank: int,
                   **options: Any) -> tuple[Batch, ForwardMode]:
    """Rank `rank`'s batch and mode of one data-parallel step.

    plans: every rank's plan of this step, in rank order (the same sequence on every rank); an empty
           plan (no sequence) is an idle rank's, which runs `idle_step`. At least one rank has a sequence.
    options: `plan_step`'s (backend, padding, graphs, ...), the same on every rank.
    The mode's `exchange_rows` is the most rows (padding included) of any rank's step.
    """
    if not 0 <= rank < len(plans):
        raise ValueError(f"plan_rank_step: rank {rank} of {len(plans)} plans")
    busy = [plan for plan in plans if plan.num_seqs]
    if not busy:
        raise ValueError(f"plan_rank_step: all {len(plans)} ranks' plans are empty: there is no step to run")
    backend = options.pop("backend", None) or default_backend(state.device)
    decide = {name: options[name] for name in ("padding", "graphs", "graph_kinds", "batch_invariant")
              if name in options}
    # An idle rank's one padding row never raises the most, which a busy rank's step sets.
    rows = max(ForwardMode.decide(plan, cache_groups=state.groups, backend=backend, **decide).num_tokens
               for plan in busy)
    if plans[rank].num_seqs:
        batch, mode = plan_step(config, state, plans[rank], backend=backend, **options)
    else:
        batch, mode = idle_step(state, backend=backend, batch_invariant=options.get("batch_invariant", False))
    return batch, dataclasses.replace(mode, exchange_rows=rows)


def prepare_rank_step(step: Step, state: KVCacheState, plans: Sequence[StepPlan],
                      rank: int) -> tuple[Batch, ForwardMode]:
    """`step.prepare` of a data-parallel step: rank `rank`'s batch and mode of every rank's `plans`
    (`plan_rank_step`), decided with the step's padding, graph settings and batch invariance."""
    state.check_live("step.prepare")
    return plan_rank_step(step.config, state, plans, rank, backend=step.backend, padding=step.padding,
                          graphs=step.graphs, graph_kinds=step.graph_kinds, max_position=step.max_position,
                          batch_invariant=step.batch_invariant)
