"""Scheduling every rank's requests on every rank: the engine under data-parallel attention.

With data-parallel attention (`Parallel(data_parallel_attention=True)`) each rank runs the steps of
its own requests over a cache of its own, and the ranks meet in every layer's shared blocks, which
need every rank's plan of the step (`parallel.data_parallel.plan_rank_step`). So every rank runs the
same schedulers, one a rank, each over that rank's cache blocks, and makes the same calls on them in
the same order (requests added and aborted, and every row's tokens): then every rank knows every
rank's plan of a step without asking. The one exchange a step adds is the tokens each rank drew for
its own rows (`RanksStep.every_token`, a gather of at most one token a row; with their logprobs when a
request of the step asks for them, `RanksStep.every_logits_row`; with speculative decoding, a verify
row's tokens, `RanksStep.every_verify_token`): every rank updates every rank's scheduler with the same
tokens, and so every rank returns every completion.

A request goes to the rank with the fewest unfinished requests when it is added, the lowest rank
on a tie: a rule of what every rank has seen alike, so every rank assigns it to the same rank
(requests added together go round robin).
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass
from typing import Protocol, TypeVar

import torch

from mla_func.core.plan import SeqPlan, StepPlan
from mla_func.kernels import CollectiveOps
from mla_func.serving.scheduler import FinishedRequest, FinishReason, Request, ScheduledStep, Scheduler
from mla_func.serving.scheduler_types import SchedulerConfig
from mla_func.state.block_allocator import BlockAllocator
from mla_func.state.cache_groups import GroupedAllocator

_NO_TOKEN = -1  # a padding entry of the token gather (token ids are never negative)
StepT = TypeVar("StepT")


class StepScheduler(Protocol[StepT]):
    """What the engine's loop asks of a scheduler: `Scheduler` (of `ScheduledStep`s) or `RankSchedulers`
    (of `RanksStep`s)."""

    def schedule(self) -> StepT | None: ...

    def cancel(self, step: StepT) -> None: ...

    def update(self, step: StepT,
               sampled_token_ids: Sequence[int | tuple[int, ...] | None]) -> list[FinishedRequest]: ...


@dataclass(frozen=True, slots=True)
class RanksStep:
    """One step of every rank: each rank's `ScheduledStep` (None for a rank with no request in it).

    rows and request_ids are every rank's, rank by rank, as `RankSchedulers.update` takes their tokens.
    """

    steps: tuple[ScheduledStep | None, ...]
    rank: int   # this process's
    index: int = 0

    @property
    def own(self) -> ScheduledStep | None:
        """This rank's step (None: idle this step)."""
        return self.steps[self.rank]

    @property
    def plans(self) -> tuple[StepPlan, ...]:
        """Every rank's plan, an idle rank's empty (`plan_rank_step`'s `plans`)."""
        return tuple(StepPlan() if s is None else s.plan for s in self.steps)

    @property
    def rows(self) -> tuple[SeqPlan, ...]:
        return tuple(row for s in self.steps if s is not None for row in s.rows)

    @property
    def request_ids(self) -> tuple[Hashable, ...]:
        return tuple(rid for s in self.steps if s is not None for rid in s.request_ids)

    def every_token(self, drawn: Sequence[int | tuple[int, ...] | None], collectives: CollectiveOps,
                    device: torch.device) -> list[int | None]:
        """Every rank's token of each of its rows (None where a row gives no logits), rank by rank, from
        `drawn`, this rank's tokens of its own rows: one all-gather of [most logits rows of any rank]
        int64 a rank (none when no row of any rank gives logits). Every rank enters it alike."""
        counts = self._logits_counts()
        own = [t for t in drawn if isinstance(t, int)]
        if len(own) != counts[self.rank] or any(isinstance(t, tuple) for t in drawn):
            raise ValueError(f"RanksStep.every_token: rank {self.rank} drew {drawn} for {counts[self.rank]} logits "
                             "rows (one token a row: a verify row's tokens go through every_verify_token)")
        # Padded on the host, so the step's one transfer to the device is the gather's input.
        mine = torch.full((max(counts), 1), _NO_TOKEN, dtype=torch.int64)
        mine[:len(own), 0] = torch.tensor(own, dtype=torch.int64)
        tokens = iter(self._gather(mine.to(device), counts, collectives)[:, 0].tolist())
        return [next(tokens) if row.num_logits else None for row in self.rows]

    def every_verify_token(self, drawn: Sequence[int | tuple[int, ...] | None], collectives: CollectiveOps,
                           device: torch.device) -> list[int | tuple[int, ...] | None]:
        """`every_token` of a speculative step: every rank's tokens of each of its rows, rank by rank, from
        `drawn`, this rank's (`SpeculativeDecoder.accept`'s: an int for a prefill row that completes its
        prompt, a tuple of 1 to decode_q_len tokens for a verify row, None for a row without logits). One
        all-gather of [most logits rows of any rank, W] int64 a rank, W the longest decode_q_len of any
        rank's plan (known alike on every rank), each row's tokens padded; every rank enters it alike."""
        counts = self._logits_counts()
        own = [t for t in drawn if t is not None]
        width = max(s.plan.decode_q_len for s in self.steps if s is not None)
        if len(own) != counts[self.rank] or any(not isinstance(t, int) and len(t) > width for t in own):
            raise ValueError(f"RanksStep.every_verify_token: rank {self.rank} drew {drawn} for {counts[self.rank]} "
                             f"logits rows (at most {width} tokens a row)")
        mine = torch.full((max(counts), width), _NO_TOKEN, dtype=torch.int64)
        for i, tokens in enumerate(own):
            kept = (tokens,) if isinstance(tokens, int) else tokens
            mine[i, :len(kept)] = torch.tensor(kept, dtype=torch.int64)
        gathered = iter(self._gather(mine.to(device), counts, collectives).tolist())
        every: list[int | tuple[int, ...] | None] = []
        for s in self.steps:
            if s is None:
                continue
            num_prefill = len(s.plan.prefill)
            for i, row in enumerate(s.rows):
                if not row.num_logits:
                    every.append(None)
                    continue
                values = next(gathered)
                # A prefill row gives its one token; a verify row the tokens it keeps, before the padding.
                every.append(values[0] if i < num_prefill else tuple(t for t in values if t != _NO_TOKEN))
        return every

    def every_logits_row(self, own: torch.Tensor, collectives: CollectiveOps) -> torch.Tensor:
        """[logits rows of every rank, W] int64 on the host, rank by rank, from `own` ([this rank's logits
        rows, W] int64, on the model's device): one all-gather of [most logits rows of any rank, W] a rank,
        padded (none when no row of any rank gives logits). Every rank enters it alike, with the same W."""
        counts = self._logits_counts()
        if own.dim() != 2 or own.shape[0] != counts[self.rank] or own.dtype != torch.int64:
            raise ValueError(f"RanksStep.every_logits_row: rank {self.rank} has {counts[self.rank]} logits rows, "
                             f"got {own.dtype} {tuple(own.shape)} (expected int64 [{counts[self.rank]}, W])")
        mine = own.new_full((max(counts), own.shape[1]), _NO_TOKEN)
        mine[:len(own)] = own
        return self._gather(mine, counts, collectives)

    def _gather(self, mine: torch.Tensor, counts: list[int], collectives: CollectiveOps) -> torch.Tensor:
        """[sum(counts), W] on the host: each rank's first counts[r] rows of its `mine` ([max(counts), W])."""
        most = mine.shape[0]
        if not most:
            return torch.zeros((0, mine.shape[1]), dtype=mine.dtype)
        gathered = collectives.all_gather(mine, dim=0).cpu()  # [ranks * most, W]
        return torch.cat([gathered[r * most:r * most + n] for r, n in enumerate(counts)])

    def _logits_counts(self) -> list[int]:
        """Each rank's rows that give logits (0 for an idle rank)."""
        return [0 if s is None else sum(1 for row in s.rows if row.num_logits) for s in self.steps]


class RankSchedulers:
    """One `Scheduler` a rank of a data-parallel group, each over that rank's blocks, driven alike on every
    rank (module docstring). It answers the engine as one scheduler does: `schedule` gives a `RanksStep`,
    `update` takes every rank's tokens; `allocator` and `blocks` are this rank's."""

    def __init__(self, config: SchedulerConfig, ranks: int, rank: int):
        if not 0 <= rank < ranks:
            raise ValueError(f"RankSchedulers: rank {rank} of {ranks}")
        self.config = config
        self.rank = rank
        self.schedulers = tuple(Scheduler(config) for _ in range(ranks))
        self._owner: dict[Hashable, int] = {}   # request id -> the rank that runs it
        self._next_index = 0

    @property
    def allocator(self) -> BlockAllocator:
        """The allocator of this rank's cache group 0."""
        return self.schedulers[self.rank].allocator

    @property
    def blocks(self) -> GroupedAllocator:
        """This rank's blocks of every cache group."""
        return self.schedulers[self.rank].blocks

    def owner(self, request_id: Hashable) -> int:
        """The rank that runs a queued or running request."""
        return self._owner[request_id]

    def add(self, request: Request) -> None:
        """Queue a request on the rank with the fewest unfinished requests (the lowest rank on a tie)."""
        loads = [s.num_waiting + s.num_running for s in self.schedulers]
        rank = loads.index(min(loads))
        self.schedulers[rank].add(request)
        self._owner[request.request_id] = rank

    def finish(self, request_id: Hashable, reason: FinishReason = FinishReason.ABORT) -> FinishedRequest:
        """`Scheduler.finish` on the rank that runs it."""
        rank = self._owner.get(request_id)
        if rank is None:
            raise KeyError(f"request {request_id!r} is not queued or running")
        finished = self.schedulers[rank].finish(request_id, reason)
        del self._owner[request_id]
        return finished

    def has_unfinished(self) -> bool:
        return bool(self._owner)

    @property
    def num_waiting(self) -> int:
        """Requests queued on every rank."""
        return sum(s.num_waiting for s in self.schedulers)

    @property
    def num_running(self) -> int:
        """Requests running on every rank."""
        return sum(s.num_running for s in self.schedulers)

    def schedule(self) -> RanksStep | None:
        """Every rank's next step (`Scheduler.schedule`); None when no rank has a request."""
        steps: list[ScheduledStep | None] = []
        try:
            for scheduler in self.schedulers:
                steps.append(scheduler.schedule())
        except BaseException:
            self._cancel(steps)
            raise
        if all(s is None for s in steps):
            return None
        index, self._next_index = self._next_index, self._next_index + 1
        return RanksStep(tuple(steps), self.rank, index)

    def cancel(self, step: RanksStep) -> None:
        """`Scheduler.cancel` of every rank's step."""
        self._cancel(list(step.steps))

    def _cancel(self, steps: list[ScheduledStep | None]) -> None:
        for scheduler, step in zip(self.schedulers, steps):
            if step is not None:
                scheduler.cancel(step)

    def update(self, step: RanksStep,
               sampled_token_ids: Sequence[int | tuple[int, ...] | None]) -> list[FinishedRequest]:
        """`Scheduler.update` of every rank's step with its rows' tokens (`step.rows`' order); the requests
        of every rank that finished."""
        if len(sampled_token_ids) != len(step.rows):
            raise ValueError(f"step {step.index} has {len(step.rows)} rows, got {len(sampled_token_ids)} tokens")
        finished: list[FinishedRequest] = []
        start = 0
        for scheduler, own in zip(self.schedulers, step.steps):
            if own is None:
                continue
            stop = start + len(own.rows)
            finished += scheduler.update(own, sampled_token_ids[start:stop])
            start = stop
        for done in finished:
            del self._owner[done.request_id]
        return finished
