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

from mla_func.core.cache_budget import cache_budget
from mla_func.core.model import Model
from mla_func.core.step import Step, StepFn, make_step
from mla_func.models.mtp.layer import drafter_bytes_per_block
from mla_func.serving.scheduler_types import SchedulerConfig, check_token_budget
from mla_func.state.layer_cache import CacheGroup


@dataclass(frozen=True, slots=True)
class EngineConfig:
    """The engine's limits; every field has a documented default (see `Engine`).

    block_size and num_blocks are those of the state's cache group 0, which `init_state` is
    given; the scheduler then reads the state's own groups (`scheduler_config`).
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

    def __post_init__(self) -> None:
        check_token_budget(self.max_num_seqs, self.max_num_batched_tokens, self.speculative_tokens)

    def scheduler_config(self, cache_groups: tuple[CacheGroup, ...], *,
                         carry_periods: tuple[int, ...] = ()) -> SchedulerConfig:
        """The scheduler's config: these limits over `cache_groups`, the state's own (`KVCacheState.groups`,
        group 0 of num_blocks blocks of block_size tokens), so state and scheduler read one geometry.
        Raises ValueError if group 0 is not this config's (a state made for another engine)."""
        first = cache_groups[0] if cache_groups else None
        if first is None or (first.num_blocks, first.block_size) != (self.num_blocks, self.block_size):
            raise ValueError(f"EngineConfig.scheduler_config: cache group 0 must have num_blocks={self.num_blocks} "
                             f"and block_size={self.block_size}, as a state made from this config has; got {first}")
        return SchedulerConfig(
            max_num_seqs=self.max_num_seqs, max_num_batched_tokens=self.max_num_batched_tokens,
            max_model_len=self.max_model_len, cache_groups=cache_groups,
            long_prefill_token_threshold=self.long_prefill_token_threshold, enable_mixed=self.enable_mixed,
            enable_prefix_caching=self.enable_prefix_caching, carry_periods=carry_periods,
            speculative_tokens=self.speculative_tokens)

    def build_step(self, model: Model, *, fn: StepFn | None = None, params: Any = None) -> Step:
        """`make_step(model, fn=fn, params=params)` with these limits: backend, graphs and the kinds that
        use them, padding ladders for max_num_seqs, max_num_batched_tokens and max_model_len, block_size
        (checked at every call) and batch invariance."""
        return make_step(model, fn=fn, params=params, backend=self.backend, graphs=self.graphs,
                         graph_kinds=self.graph_kinds, max_num_seqs=self.max_num_seqs,
                         max_num_batched_tokens=self.max_num_batched_tokens, max_model_len=self.max_model_len,
                         block_size=self.block_size, batch_invariant=self.batch_invariant)


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
                       speculative: bool = False) -> int:
    """Blocks for the cache: what max_num_seqs full-length sequences need, within a share of free memory
    (a block of every cache group, and with `speculative` the drafter's cache, in every block)."""
    # Every cache group gets num_blocks blocks (init_state), so a block of the budget costs one of each.
    bytes_per_block = sum(cache_budget(model.config, dtype=model.dtype, block_size=block_size).bytes_per_block)
    if speculative:
        bytes_per_block += drafter_bytes_per_block(model, block_size)
    wanted = 1 + max_num_seqs * -(-max_model_len // block_size)
    if model.device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(model.device)
        # Leave room for activations, graph pools and the sampler's [N, V] buffers.
        budget = int(free * 0.85) - (2 << 30)
    else:
        budget = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // 8
    return max(2, min(wanted, budget // bytes_per_block))
