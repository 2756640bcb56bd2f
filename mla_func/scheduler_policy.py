"""The step-building half of the scheduler: which rows a step gets, and preemption.

`Scheduler` (scheduler.py) owns the queues and the requests' lifecycle; this mixin
holds the policy its `schedule` applies (see the policy in scheduler.py's
docstring), over the same queues and the `GroupedAllocator` of every cache group.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field

from mla_func.scheduler_types import Request, SchedulerConfig
from mla_func.state.block_allocator import BlockHash
from mla_func.state.cache_groups import GroupedAllocator, Tables


@dataclass(eq=False, slots=True)
class SeqState:
    """A request's mutable progress, owned by the scheduler."""

    request: Request
    arrival: int
    max_len: int  # prompt + generated never exceeds this
    token_ids: list[int]  # prompt + generated
    tables: Tables  # one block table per cache group
    hashes: tuple[list[BlockHash], ...]  # per group, of the registered full blocks
    num_computed: int = 0  # tokens whose KV is in the cache (a prefix of token_ids)
    num_preemptions: int = 0

    @property
    def block_table(self) -> list[int]:
        """The block table of cache group 0."""
        return self.tables[0]

    @property
    def num_generated(self) -> int:
        return len(self.token_ids) - len(self.request.prompt_token_ids)

    @property
    def is_decoding(self) -> bool:
        return self.num_computed > 0 and len(self.token_ids) - self.num_computed == 1


@dataclass(slots=True)
class StepBuild:
    """The rows chosen so far in one call of `schedule`."""

    prefill: list[tuple[SeqState, int]] = field(default_factory=list)
    decode: list[SeqState] = field(default_factory=list)
    preempted: list[SeqState] = field(default_factory=list)
    # The same requests as `preempted`, for the O(1) membership test of the scheduling loops.
    gone: set[int] = field(default_factory=set)

    def num_tokens(self) -> int:
        return sum(n for _, n in self.prefill) + len(self.decode)



class StepPolicy:
    """Decodes first, then prefill chunks in arrival order, preempting the youngest (see scheduler.py)."""

    config: SchedulerConfig
    blocks: GroupedAllocator
    _running: list[SeqState]
    _waiting: list[SeqState]

    def _schedule_decodes(self, b: StepBuild) -> None:
        for seq in list(self._running):
            if id(seq) in b.gone or not seq.is_decoding:
                continue  # preempted earlier in this loop, or still prefilling
            need = self.blocks.blocks_needed(seq.tables, seq.num_computed + 1)
            if any(need) and not self._make_room(seq, need, b):
                # Nobody younger is left to preempt; give the blocks back to older requests.
                self._preempt(seq, b)
                continue
            if any(need):
                self.blocks.allocate(seq.tables, need)
            b.decode.append(seq)

    def _schedule_prefills(self, b: StepBuild) -> None:
        cfg = self.config
        for seq in list(self._running):
            if id(seq) in b.gone or seq.is_decoding:
                continue
            budget = cfg.max_num_batched_tokens - b.num_tokens()
            if budget == 0:
                return
            n = min(len(seq.token_ids) - seq.num_computed, budget, cfg.max_prefill_chunk)
            self._make_room(seq, self._blocks_needed(seq, n), b)
            n = min(n, self._tokens_that_fit(seq))
            if n == 0:
                continue  # the youngest running request keeps its blocks and retries next step
            self.blocks.allocate(seq.tables, self._blocks_needed(seq, n))
            b.prefill.append((seq, n))

        while self._waiting and len(self._running) < cfg.max_num_seqs:
            budget = cfg.max_num_batched_tokens - b.num_tokens()
            if budget == 0:
                return
            seq = self._waiting[0]
            if cfg.enable_prefix_caching:
                # Leave the last token uncached so this chunk has a token that makes logits.
                seq.tables, seq.hashes, seq.num_computed = self.blocks.match_prefix(seq.token_ids[:-1])
            n = min(
                len(seq.token_ids) - seq.num_computed, budget, cfg.max_prefill_chunk, self._tokens_that_fit(seq)
            )
            if n == 0:
                # Admission never preempts; and later arrivals must not overtake the head.
                self._release(seq)
                return
            self.blocks.allocate(seq.tables, self._blocks_needed(seq, n))
            self._waiting.pop(0)
            bisect.insort(self._running, seq, key=lambda s: s.arrival)
            b.prefill.append((seq, n))

    def _blocks_needed(self, seq: SeqState, n: int) -> tuple[int, ...]:
        return self.blocks.blocks_needed(seq.tables, seq.num_computed + n)

    def _tokens_that_fit(self, seq: SeqState) -> int:
        return self.blocks.tokens_that_fit(seq.tables) - seq.num_computed

    def _make_room(self, seq: SeqState, need: tuple[int, ...], b: StepBuild) -> bool:
        """Preempt running requests younger than `seq`, youngest first, until `need` blocks (per group) are free."""
        while not self.blocks.can_allocate(need):
            victim = self._running[-1]
            if victim.arrival <= seq.arrival:
                return False
            self._preempt(victim, b)
        return True

    def _preempt(self, seq: SeqState, b: StepBuild) -> None:
        b.decode = [s for s in b.decode if s is not seq]
        b.prefill = [(s, n) for s, n in b.prefill if s is not seq]
        b.preempted.append(seq)
        b.gone.add(id(seq))
        self._running.remove(seq)
        self._release(seq)
        seq.num_preemptions += 1
        bisect.insort(self._waiting, seq, key=lambda s: s.arrival)

    def _release(self, seq: SeqState) -> None:
        self.blocks.free(seq.tables)
        seq.tables = self.blocks.empty_tables()
        seq.hashes = tuple([] for _ in seq.tables)
        seq.num_computed = 0

    def _tables(self, seq: SeqState, end: int) -> tuple[tuple[int, ...], tuple[tuple[int, ...], ...]]:
        """(group 0's table, the other groups' tables), each cut to the blocks covering `end` tokens."""
        groups = self.config.cache_groups
        first = tuple(seq.tables[0][: -(-end // groups[0].block_size)])
        if len(groups) == 1:
            return first, ()
        return first, tuple(tuple(t[: g.blocks_for(end)]) for g, t in zip(groups[1:], seq.tables[1:]))
