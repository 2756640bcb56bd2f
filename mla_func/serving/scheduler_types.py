"""The scheduler's plain data: its limits, requests in, steps and finished requests out."""

from __future__ import annotations

import enum
from collections.abc import Hashable
from dataclasses import dataclass
from typing import Any

from mla_func.core.plan import SeqPlan, StepPlan
from mla_func.state.layer_cache import CacheGroup


class FinishReason(str, enum.Enum):
    STOP = "stop"  # sampled one of the request's stop token ids
    LENGTH = "length"  # max_tokens generated, or max_model_len reached
    ABORT = "abort"  # finished from outside with `Scheduler.finish`


def check_token_budget(max_num_seqs: int, max_num_batched_tokens: int, speculative_tokens: int) -> None:
    """ValueError unless a step's token budget fits a decode row (1 + speculative_tokens tokens) of
    every running request: the scheduler's rule, which `EngineConfig` checks too, so that an engine
    refuses its limits before its state is allocated."""
    per_decode = speculative_tokens + 1
    if max_num_batched_tokens < max_num_seqs * per_decode:
        raise ValueError(
            f"max_num_batched_tokens ({max_num_batched_tokens}) must be >= max_num_seqs "
            f"({max_num_seqs}) * {per_decode} tokens a decode row, or running decodes could use the whole "
            "budget"
        )


@dataclass(frozen=True, slots=True)
class SchedulerConfig:
    """Static limits of the scheduler, and the geometry of the cache it allocates.

    long_prefill_token_threshold: most tokens in one prefill chunk; 0 or None
    means a chunk is limited only by the step's token budget.
    max_num_batched_tokens must be >= max_num_seqs, so that after every running
    request's decode token there is budget left for a prefill chunk.
    cache_groups: the cache's groups, as the state that the steps run on has them
    (`KVCacheState.groups`): group 0 holds one entry per token (its block_size and
    num_blocks are this config's), groups 1.. (none for an MLA model) each have their
    own blocks, block tables and accounting (see `state.cache_groups`); a group with a
    lookback holds only each sequence's blocks a later step can read.
    carry_periods: periods of the layer kinds' state kept outside full blocks; prefix
    hits are cut to multiples of them (see `state.cache_groups`).
    speculative_tokens: drafts verified per decode row (0: plain decoding); a decode row
    then feeds its last token and up to k drafts, and must fit the token budget, so
    max_num_batched_tokens must be >= max_num_seqs * (k + 1).
    """

    max_num_seqs: int
    max_num_batched_tokens: int
    max_model_len: int
    cache_groups: tuple[CacheGroup, ...]
    long_prefill_token_threshold: int | None = None
    enable_mixed: bool = True
    enable_prefix_caching: bool = True
    carry_periods: tuple[int, ...] = ()
    speculative_tokens: int = 0

    def __post_init__(self) -> None:
        for name in ("max_num_seqs", "max_num_batched_tokens", "max_model_len"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        # `CacheGroup` checks each group's own sizes (block 0 is scratch, so num_blocks >= 2).
        if not self.cache_groups:
            raise ValueError("cache_groups: expected at least one cache group (group 0, one entry per token), got none")
        if self.cache_groups[0].tokens_per_entry != 1:
            raise ValueError(f"cache_groups[0].tokens_per_entry: group 0 holds one entry per token, got "
                             f"{self.cache_groups[0].tokens_per_entry}")
        if self.speculative_tokens < 0:
            raise ValueError(f"speculative_tokens must be >= 0, got {self.speculative_tokens}")
        check_token_budget(self.max_num_seqs, self.max_num_batched_tokens, self.speculative_tokens)
        if self.long_prefill_token_threshold is not None and self.long_prefill_token_threshold < 0:
            raise ValueError(
                f"long_prefill_token_threshold must be >= 0 or None, got {self.long_prefill_token_threshold}"
            )

    @property
    def max_prefill_chunk(self) -> int:
        return self.long_prefill_token_threshold or self.max_num_batched_tokens

    @property
    def block_size(self) -> int:
        """Tokens a block of cache group 0 holds."""
        return self.cache_groups[0].block_size

    @property
    def num_blocks(self) -> int:
        """Blocks of cache group 0, block 0 (scratch) included."""
        return self.cache_groups[0].num_blocks


@dataclass(frozen=True, slots=True)
class Request:
    """One generation request. `sampling_params` is carried for the caller, never read.

    Token values are not the scheduler's concern: the engine validates requests, and
    every step's token ids are checked where its batch is built (`plan_checks`).

    stop_token_ids: sampling one of these finishes the request (the caller adds
    the tokenizer's eos here unless it is to be ignored); the stop token is kept
    in the output.
    """

    request_id: Hashable
    prompt_token_ids: tuple[int, ...]
    max_tokens: int
    stop_token_ids: tuple[int, ...] = ()
    sampling_params: Any = None

    def __post_init__(self) -> None:
        if len(self.prompt_token_ids) == 0:
            raise ValueError(f"request {self.request_id!r}: prompt_token_ids is empty")
        if self.max_tokens < 1:
            raise ValueError(f"request {self.request_id!r}: max_tokens must be >= 1, got {self.max_tokens}")


@dataclass(frozen=True, slots=True)
class ScheduledStep:
    """One step: its plan, and for each row (prefill rows then decode rows) the request id."""

    plan: StepPlan
    request_ids: tuple[Hashable, ...]
    preempted: tuple[Hashable, ...] = ()  # requests sent back to waiting while building this step
    index: int = 0  # counts steps from 0, for messages

    @property
    def rows(self) -> tuple[SeqPlan, ...]:
        return self.plan.prefill + self.plan.decode


@dataclass(frozen=True, slots=True)
class FinishedRequest:
    request_id: Hashable
    prompt_token_ids: tuple[int, ...]
    output_token_ids: tuple[int, ...]
    finish_reason: FinishReason
    num_preemptions: int = 0
