"""The engine's limits: the `EngineConfig` and the checks and defaults of its arguments.

`EngineConfig` is the one carrier of the engine's limits: the scheduler's config and every
step the engine runs (the target's and the drafter's) are built from it by its methods, so
no limit is handed on twice by hand.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import torch

from mla_func.core.cache_budget import most_blocks_within
from mla_func.core.model import Model
from mla_func.core.step import Step, StepFn, make_step
from mla_func.models.mtp.layer import drafter_bytes_per_block
from mla_func.serving.scheduler_types import SchedulerConfig, check_token_budget
from mla_func.state.layer_cache import CacheGroup


@dataclass(frozen=True, slots=True)
class EngineConfig:
    """The engine's limits; every field has a documented default (see `Engine`).

    block_size and num_blocks are what `init_state` is given, with max_num_seqs and
    max_num_batched_tokens: num_blocks blocks of block_size tokens is the state's capacity in
    tokens, and each cache group gets its own block count from it (`core.layers.cache_groups`;
    for a model of one group, exactly num_blocks). The scheduler then reads the state's own
    groups (`scheduler_config`).
    Raises ValueError if max_num_batched_tokens cannot fit a decode row of every sequence
    (`check_token_budget`, the scheduler's rule, checked here before a state is allocated).
    """

    block_size: int
    num_blocks: int
    max_num_seqs: int
    max_num_batched_tokens: int
    long_prefill_token_threshold: int | None
    enable_mixed: bool
    enable_prefix_caching: bool
    max_model_len: int
    backend: str
    graphs: bool
    graph_kinds: tuple[str, ...]
    batch_invariant: bool
    speculative_tokens: int = 0
    kv_cache_dtype: str = "auto"
    w8a8: bool = False

    def __post_init__(self) -> None:
        check_token_budget(self.max_num_seqs, self.max_num_batched_tokens, self.speculative_tokens)

    def scheduler_config(self, cache_groups: tuple[CacheGroup, ...], *,
                         carry_periods: tuple[int, ...] = ()) -> SchedulerConfig:
        """The scheduler's config: these limits over `cache_groups`, the state's own (`KVCacheState.groups`,
        group 0 of blocks of block_size tokens, at most num_blocks of them: fewer where it has a lookback),
        so state and scheduler read one geometry. Raises ValueError if group 0 is not this config's (a
        state made for another engine)."""
        first = cache_groups[0] if cache_groups else None
        if first is None or first.block_size != self.block_size or not (
                first.num_blocks == self.num_blocks or (first.lookback is not None and first.num_blocks < self.num_blocks)):
            raise ValueError(f"EngineConfig.scheduler_config: cache group 0 must have num_blocks={self.num_blocks} "
                             f"(or fewer, with a lookback) and block_size={self.block_size}, as a state made from "
                             f"this config has; got {first}")
        return SchedulerConfig(
            max_num_seqs=self.max_num_seqs, max_num_batched_tokens=self.max_num_batched_tokens,
            max_model_len=self.max_model_len, cache_groups=cache_groups,
            long_prefill_token_threshold=self.long_prefill_token_threshold, enable_mixed=self.enable_mixed,
            enable_prefix_caching=self.enable_prefix_caching, carry_periods=carry_periods,
            speculative_tokens=self.speculative_tokens)

    def build_step(self, model: Model, *, fn: StepFn | None = None, params: Any = None) -> Step:
        """`make_step(model, fn=fn, params=params)` with these limits: backend, graphs and the kinds that
        use them, padding ladders for max_num_seqs, max_num_batched_tokens and max_model_len, block_size
        (checked at every call), batch invariance and w8a8 products."""
        return make_step(model, fn=fn, params=params, backend=self.backend, graphs=self.graphs,
                         graph_kinds=self.graph_kinds, max_num_seqs=self.max_num_seqs,
                         max_num_batched_tokens=self.max_num_batched_tokens, max_model_len=self.max_model_len,
                         block_size=self.block_size, batch_invariant=self.batch_invariant, w8a8=self.w8a8)


def check_limit(name: str, value: object, low: int | None, high: int | None = None, what: str = "",
                 why: str = "", *, or_none: bool = False) -> None:
    """ValueError naming the Engine argument unless `value` is an int in [low, high] (low None: any int),
    or None when `or_none`. A bool is refused: True would pass as 1."""
    if or_none and value is None:
        return
    if (not isinstance(value, int) or isinstance(value, bool) or (low is not None and value < low)
            or (high is not None and value > high)):
        bound = "" if low is None else f" >= {low}" if high is None else f" in [{low}, {high}] ({what})"
        none = " or None" if or_none else ""
        raise ValueError(f"Engine: {name} must be an int{bound}{none}{f', as {why}' if why else ''}, got {value!r}")


def check_flag(name: str, value: object) -> None:
    """ValueError naming the Engine argument unless `value` is a bool: a string such as "no" or "false"
    is truthy, and 0 or 1 may be a misplaced count, so only True and False are taken."""
    if not isinstance(value, bool):
        raise ValueError(f"Engine: {name} must be a bool, got {value!r}")


def default_num_blocks(model: Model, block_size: int, max_num_seqs: int, max_model_len: int, *,
                       speculative: bool = False, kv_cache_dtype: str = "auto",
                       max_num_batched_tokens: int | None = None) -> int:
    """num_blocks for the cache (its capacity, in blocks of block_size tokens): what max_num_seqs
    full-length sequences need, within a share of free memory.

    The state it is for (`init_state` with these arguments, `kv_cache_dtype` included) sizes each cache
    group on its own (`core.layers.cache_groups`; a group 0 with a lookback only for max_num_seqs
    sequences and a step of max_num_batched_tokens tokens, when given), and with `speculative` the
    drafter's cache follows group 0: the most blocks whose state fits the budget are taken
    (`cache_budget.most_blocks_within`).
    """
    drafter = drafter_bytes_per_block(model, block_size) if speculative else 0
    wanted = 1 + max_num_seqs * -(-max_model_len // block_size)
    if model.device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(model.device)
        # Leave room for activations, graph pools and the sampler's [N, V] buffers.
        budget = int(free * 0.85) - (2 << 30)
    else:
        budget = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // 8
    # The two limits go together (`cache_groups`): without a step's size, group 0 keeps its capacity.
    seqs = None if max_num_batched_tokens is None else max_num_seqs
    return most_blocks_within(model.config, dtype=model.dtype, block_size=block_size, budget_bytes=max(0, budget),
                              most=max(2, wanted), group0_extra_bytes=drafter, kv_cache_dtype=kv_cache_dtype,
                              max_num_seqs=seqs, max_num_batched_tokens=max_num_batched_tokens)
