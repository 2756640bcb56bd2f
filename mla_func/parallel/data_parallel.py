"""Planning a step under data-parallel attention: every rank's plan known to every rank.

Each rank runs the step of its own requests over its own latent cache; the blocks the ranks
share (MLPs, experts) then take every rank's rows at once (`core.exchange`), which needs the same
number of rows from each: the most any rank's step has. Every rank is given the plans of all
(built identically everywhere, like the scheduler's decisions), so each computes that number
itself, and no rank waits on another to learn it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

from mla_func.core.batch import Batch
from mla_func.core.config import ModelConfig
from mla_func.core.mode import ForwardMode
from mla_func.core.plan import StepPlan
from mla_func.core.prepare import plan_step
from mla_func.kernels import default_backend
from mla_func.state.kv_cache import KVCacheState


def plan_rank_step(config: ModelConfig, state: KVCacheState, plans: Sequence[StepPlan], rank: int,
                   **options: Any) -> tuple[Batch, ForwardMode]:
    """Rank `rank`'s batch and mode of one data-parallel step.

    plans: every rank's plan of this step, in rank order (the same sequence on every rank); each
           needs at least one sequence (an idle rank is not supported yet).
    options: `plan_step`'s (backend, padding, graphs, ...), the same on every rank.
    The mode's `exchange_rows` is the most rows (padding included) of any rank's step.
    """
    if not 0 <= rank < len(plans):
        raise ValueError(f"plan_rank_step: rank {rank} of {len(plans)} plans")
    backend = options.pop("backend", None) or default_backend(state.device)
    decide = {name: options[name] for name in ("padding", "graphs", "graph_kinds", "batch_invariant")
              if name in options}
    rows = max(ForwardMode.decide(plan, cache_groups=state.groups, backend=backend, **decide).num_tokens
               for plan in plans)
    batch, mode = plan_step(config, state, plans[rank], backend=backend, **options)
    return batch, dataclasses.replace(mode, exchange_rows=rows)
