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


@dataclass(frozen=True, slots=True)
class SchedulerConfig:
    """Static limits of the scheduler.

    long_prefill_token_threshold: most tokens in one prefill chunk; 0 or None
    means a chunk is limited only by the step's token budget.
    max_num_batched_tokens must be >= max_num_seqs, so that after every running
    request's decode token there is budget left for a prefill chunk.
    block_size, num_blocks: cache group 0 (one entry per token).
    extra_cache_groups: cache groups 1.. (none for an MLA model); each has its own
    blocks, block tables and accounting (see `state.cache_groups`).
    carry_periods: periods of the layer kinds' state kept outside full blocks; prefix
    hits are cut to multiples of them (see `state.cache_groups`).
    speculative_tokens: drafts verified per decode row (0: plain decoding); a decode row
    then feeds its last token and up to k drafts, and must fit the token budget, so
    max_num_batched_tokens must be >= max_num_seqs * (k + 1).
    """

    max_num_seqs: int
    max_num_batched_tokens: int
    block_size: int
    num_blocks: int
    max_model_len: int
    long_prefill_token_threshold: int | None = None
    enable_mixed: bool = True
    enable_prefix_caching: bool = True
    extra_cache_groups: tuple[CacheGroup, ...] = ()
    carry_periods: tuple[int, ...] = ()
    speculative_tokens: int = 0

    def __post_init__(self) -> None:
        for name in ("max_num_seqs", "max_num_batched_tokens", "block_size", "max_model_len"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.num_blocks < 2:
            raise ValueError(f"num_blocks must be >= 2 (block 0 is the scratch block), got {self.num_blocks}")
        if self.speculative_tokens < 0:
            raise ValueError(f"speculative_tokens must be >= 0, got {self.speculative_tokens}")
        per_decode = self.speculative_tokens + 1
        if self.max_num_batched_tokens < self.max_num_seqs * per_decode:
            raise ValueError(
                f"max_num_batched_tokens ({self.max_num_batched_tokens}) must be >= max_num_seqs "
                f"({self.max_num_seqs}) * {per_decode} tokens a decode row, or running decodes could use the whole "
                "budget"
            )
        if self.long_prefill_token_threshold is not None and self.long_prefill_token_threshold < 0:
            raise ValueError(
                f"long_prefill_token_threshold must be >= 0 or None, got {self.long_prefill_token_threshold}"
            )

    @property
    def max_prefill_chunk(self) -> int:
        return self.long_prefill_token_threshold or self.max_num_batched_tokens

    @property
    def cache_groups(self) -> tuple[CacheGroup, ...]:
        return (CacheGroup(self.num_blocks, self.block_size), *self.extra_cache_groups)


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
