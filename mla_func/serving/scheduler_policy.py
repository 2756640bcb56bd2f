"""The step-building half of the scheduler: which rows a step gets, and preemption.

`Scheduler` (scheduler.py) owns the queues and the requests' lifecycle; this mixin
holds the policy its `schedule` applies (see the policy in scheduler.py's
docstring), over the same queues and the `GroupedAllocator` of every cache group.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field

from mla_func.core.plan import SeqPlan, StepPlan
from mla_func.serving.scheduler_types import FinishReason, Request, ScheduledStep, SchedulerConfig
from mla_func.state.block_allocator import BlockHash
from mla_func.state.cache_groups import GroupedAllocator, Tables


@dataclass(eq=False, slots=True)
class SeqState:
    """A request's mutable progress, owned by the scheduler."""

    request: Request
    arrival: int
    max_len: int  # prompt + max_tokens, cut to max_model_len: prompt + generated never exceeds this
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
    decode_q_len: int = 1  # tokens each decode row feeds: 1, or 1 + drafts to verify
    # The same requests as `preempted`, for the O(1) membership test of the scheduling loops.
    gone: set[int] = field(default_factory=set)

    def num_tokens(self) -> int:
        return sum(n for _, n in self.prefill) + len(self.decode) * self.decode_q_len



class StepPolicy:
    """Decodes first, then prefill chunks in arrival order, preempting the youngest (see scheduler.py)."""

    config: SchedulerConfig
    blocks: GroupedAllocator
    _running: list[SeqState]
    _waiting: list[SeqState]
    _next_index: int
    _pending: ScheduledStep | None
    _pending_seqs: list[SeqState]

    def _schedule_decodes(self, b: StepBuild) -> None:
        # Whether a request decodes does not change inside this loop (a preempted one is in `b.gone`), so
        # one pass picks them; the loop below runs once per decoding request every step, so it stays lean.
        decoding = [s for s in self._running if s.is_decoding and id(s) not in b.gone]
        k = self.config.speculative_tokens
        if k and decoding:
            # One query length for the step (a static shape): k drafts, fewer when a sequence
            # has fewer tokens left to generate, so no row writes past its request's length.
            b.decode_q_len = 1 + min(k, *(s.max_len - len(s.token_ids) - 1 for s in decoding))
        q, blocks, gone = b.decode_q_len, self.blocks, b.gone
        for seq in decoding:
            if id(seq) in gone:
                continue  # preempted earlier in this loop
            need = blocks.blocks_needed(seq.tables, seq.num_computed + q)
            if any(need):
                if not self._make_room(seq, need, b):
                    # Nobody younger is left to preempt; give the blocks back to older requests.
                    self._preempt(seq, b)
                    continue
                blocks.allocate(seq.tables, need)
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

    def _emit(self, b: StepBuild) -> ScheduledStep:
        prefill = []
        for seq, n in b.prefill:
            start = seq.num_computed
            end = start + n
            table, others = self._tables(seq, end)
            prefill.append(
                SeqPlan(
                    token_ids=tuple(seq.token_ids[start:end]),
                    start_pos=start,
                    block_table=table,
                    num_logits=1 if end == len(seq.token_ids) else 0,
                    group_block_tables=others,
                )
            )
        q = b.decode_q_len
        groups = self.config.cache_groups
        # A verify row's draft slots hold the last token until the engine writes the drafts in.
        if len(groups) == 1:
            # One cache group (V2/V3): the row's table is group 0's, cut in place; this loop runs once per
            # decoding request every step.
            bs = groups[0].block_size
            decode = [SeqPlan((seq.token_ids[-1],) * q, seq.num_computed,
                              tuple(seq.tables[0][: -(-(seq.num_computed + q) // bs)]), q)
                      for seq in b.decode]
        else:
            decode = []
            for seq in b.decode:
                table, others = self._tables(seq, seq.num_computed + q)
                decode.append(SeqPlan((seq.token_ids[-1],) * q, seq.num_computed, table, q, others))
        rows = [s for s, _ in b.prefill] + b.decode
        step = ScheduledStep(
            plan=StepPlan(prefill=tuple(prefill), decode=tuple(decode), decode_q_len=q if decode else 1),
            request_ids=tuple(s.request.request_id for s in rows),
            preempted=tuple(s.request.request_id for s in b.preempted),
            index=self._next_index,
        )
        self._next_index += 1
        self._pending = step
        self._pending_seqs = rows
        return step

    @staticmethod
    def _kept(seq: SeqState, new: tuple[int, ...]) -> tuple[tuple[int, ...], FinishReason | None]:
        """The prefix of `new` the request keeps, and why it finishes after them (None: it goes on)."""
        # How many more tokens it may take: max_len is the prompt plus max_tokens, cut to the length limit.
        room, stop_token_ids = seq.max_len - len(seq.token_ids), seq.request.stop_token_ids
        for j, tok in enumerate(new):
            if tok in stop_token_ids:
                return new[: j + 1], FinishReason.STOP
            if j + 1 >= room:
                return new[: j + 1], FinishReason.LENGTH
        return new, None

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
