"""Host-side scheduler: which sequences run in each step, and which cache blocks they use.

Plain data in and out. The engine drives it in a loop:

    scheduler.add(Request(...))                  # any time
    while (step := scheduler.schedule()) is not None:
        sampled = run_model_and_sample(step.plan)  # one entry per row, None where num_logits == 0
        finished = scheduler.update(step, sampled)

Exactly one step is outstanding at a time: `schedule` refuses to run again until
`update` has been called with the step it returned, or `cancel` if the step
could not run (its work is then scheduled again). A step whose requests have
all been finished with `finish` may still be passed to `update` (which then
changes nothing), or left: the next `schedule` drops it.

Policy (one step):

1. Decodes first. Every running request in the decode phase gets one token, in
   arrival order. A request is in the decode phase when everything but its last
   token is in the cache (including a prompt whose only missing token is its
   last one after chunking or a prefix-cache hit).
2. Prefill chunks fill the remaining token budget: first running requests whose
   prompt is partly computed, then waiting requests in arrival order (new ones,
   and preempted ones that recompute prompt + generated tokens). Each chunk is
   at most `long_prefill_token_threshold` tokens. Admission is strictly in
   arrival order: if the head of the queue does not fit, nobody overtakes it.
3. With `enable_mixed=False` a step holds only decodes or only prefills; the
   kinds alternate when both have work, so neither starves.

Priority is arrival order. When a running request needs a KV block and none is
free, the most recently arrived running request younger than it is preempted
(its blocks freed, its generated tokens kept, put back in the waiting queue
ahead of every request that arrived after it); a decode with nobody younger to
preempt is preempted itself, a prefill chunk is shrunk to what fits. So the
oldest request always makes progress and every request finishes.

Guarantees (tested): at most `max_num_seqs` rows and `max_num_batched_tokens`
tokens per step; with `enable_mixed`, every request in the decode phase at the
start of a step gets a decode row in that step unless it is preempted in that
step; without it, no such request waits two steps in a row.

A request finishes inside `update` when it samples one of its `stop_token_ids`
(reason STOP), when it has `max_tokens` generated tokens, or when prompt +
generated reaches `max_model_len` (reason LENGTH); `finish` aborts it.
"""

from __future__ import annotations

import bisect
import enum
from collections import Counter
from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field
from typing import Any

from mla_func.plan import SeqPlan, StepPlan
from mla_func.state.block_allocator import BlockAllocator, BlockHash


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
    """

    max_num_seqs: int
    max_num_batched_tokens: int
    block_size: int
    num_blocks: int
    max_model_len: int
    long_prefill_token_threshold: int | None = None
    enable_mixed: bool = True
    enable_prefix_caching: bool = True

    def __post_init__(self):
        for name in ("max_num_seqs", "max_num_batched_tokens", "block_size", "max_model_len"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.num_blocks < 2:
            raise ValueError(f"num_blocks must be >= 2 (block 0 is the scratch block), got {self.num_blocks}")
        if self.max_num_batched_tokens < self.max_num_seqs:
            raise ValueError(
                f"max_num_batched_tokens ({self.max_num_batched_tokens}) must be >= max_num_seqs "
                f"({self.max_num_seqs}), or running decodes could use the whole budget"
            )
        if self.long_prefill_token_threshold is not None and self.long_prefill_token_threshold < 0:
            raise ValueError(
                f"long_prefill_token_threshold must be >= 0 or None, got {self.long_prefill_token_threshold}"
            )

    @property
    def max_prefill_chunk(self) -> int:
        return self.long_prefill_token_threshold or self.max_num_batched_tokens


@dataclass(frozen=True, slots=True)
class Request:
    """One generation request. `sampling_params` is carried for the caller, never read.

    stop_token_ids: sampling one of these finishes the request (the caller adds
    the tokenizer's eos here unless it is to be ignored); the stop token is kept
    in the output.
    """

    request_id: Hashable
    prompt_token_ids: tuple[int, ...]
    max_tokens: int
    stop_token_ids: tuple[int, ...] = ()
    sampling_params: Any = None

    def __post_init__(self):
        if len(self.prompt_token_ids) == 0:
            raise ValueError(f"request {self.request_id!r}: prompt_token_ids is empty")
        bad = [t for t in self.prompt_token_ids if not isinstance(t, int) or t < 0]
        if bad:
            raise ValueError(f"request {self.request_id!r}: prompt_token_ids must be ints >= 0, got {bad[:5]}")
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


@dataclass(eq=False, slots=True)
class _Seq:
    """A request's mutable progress, owned by the scheduler."""

    request: Request
    arrival: int
    max_len: int  # prompt + generated never exceeds this
    token_ids: list[int]  # prompt + generated
    num_computed: int = 0  # tokens whose KV is in the cache (a prefix of token_ids)
    block_table: list[int] = field(default_factory=list)
    block_hashes: list[BlockHash] = field(default_factory=list)  # of the registered full blocks
    num_preemptions: int = 0

    @property
    def num_generated(self) -> int:
        return len(self.token_ids) - len(self.request.prompt_token_ids)

    @property
    def is_decoding(self) -> bool:
        return self.num_computed > 0 and len(self.token_ids) - self.num_computed == 1


@dataclass(slots=True)
class _StepBuild:
    """The rows chosen so far in one call of `schedule`."""

    prefill: list[tuple[_Seq, int]] = field(default_factory=list)
    decode: list[_Seq] = field(default_factory=list)
    preempted: list[_Seq] = field(default_factory=list)
    # The same requests as `preempted`, for the O(1) membership test of the scheduling loops.
    gone: set[int] = field(default_factory=set)

    def num_tokens(self) -> int:
        return sum(n for _, n in self.prefill) + len(self.decode)


class Scheduler:
    """Waiting and running queues over one `BlockAllocator`, which it owns."""

    def __init__(self, config: SchedulerConfig):
        self.config = config
        self.allocator = BlockAllocator(
            config.num_blocks, config.block_size, enable_prefix_caching=config.enable_prefix_caching
        )
        self._seqs: dict[Hashable, _Seq] = {}
        self._waiting: list[_Seq] = []  # sorted by arrival, holds no blocks
        self._running: list[_Seq] = []  # sorted by arrival, holds blocks
        self._next_arrival = 0
        self._pending: ScheduledStep | None = None
        self._pending_seqs: list[_Seq] = []  # per row of the pending step
        self._next_index = 0
        self._last_kind = "decode"  # so an unmixed scheduler starts with a prefill step

    # ---- requests in and out -------------------------------------------------

    def add(self, request: Request) -> None:
        """Queue a request. Raises ValueError if its id is in use or it could never fit the cache."""
        cfg = self.config
        rid = request.request_id
        if rid in self._seqs:
            raise ValueError(f"request {rid!r} is already queued or running")
        num_prompt = len(request.prompt_token_ids)
        if num_prompt >= cfg.max_model_len:
            raise ValueError(
                f"request {rid!r}: prompt of {num_prompt} tokens leaves no room to generate within "
                f"max_model_len={cfg.max_model_len}"
            )
        max_len = min(num_prompt + request.max_tokens, cfg.max_model_len)
        # The last sampled token is never fed back, so the cache holds at most max_len - 1 tokens.
        blocks = -(-(max_len - 1) // cfg.block_size)
        if blocks > self.allocator.num_usable_blocks:
            raise ValueError(
                f"request {rid!r}: needs up to {blocks} KV blocks ({max_len - 1} tokens) but the cache has "
                f"only {self.allocator.num_usable_blocks} usable blocks of {cfg.block_size} tokens"
            )
        seq = _Seq(request, self._next_arrival, max_len, list(request.prompt_token_ids))
        self._next_arrival += 1
        self._seqs[rid] = seq
        self._waiting.append(seq)

    def finish(self, request_id: Hashable, reason: FinishReason = FinishReason.ABORT) -> FinishedRequest:
        """Finish a queued or running request now and free its blocks.

        If the outstanding step has a row for it, `update` ignores that row.
        """
        seq = self._seqs.get(request_id)
        if seq is None:
            raise KeyError(f"request {request_id!r} is not queued or running")
        return self._finish(seq, FinishReason(reason))

    def has_unfinished(self) -> bool:
        return bool(self._seqs)

    @property
    def num_waiting(self) -> int:
        return len(self._waiting)

    @property
    def num_running(self) -> int:
        return len(self._running)

    # ---- one step ------------------------------------------------------------

    def schedule(self) -> ScheduledStep | None:
        """Choose the next step's rows, allocating blocks (and preempting) as needed.

        Returns None when no request is queued or running.
        """
        if self._pending is not None and any(self._is_live(s) for s in self._pending_seqs):
            raise RuntimeError(f"step {self._pending.index} has not been passed to update() or cancel() yet")
        self._pending = None
        if not self._seqs:
            return None
        b = _StepBuild()
        if self.config.enable_mixed:
            self._schedule_decodes(b)
            self._schedule_prefills(b)
        else:
            kinds = ("prefill", "decode") if self._last_kind == "decode" else ("decode", "prefill")
            for kind in kinds:
                (self._schedule_prefills if kind == "prefill" else self._schedule_decodes)(b)
                if b.prefill or b.decode:
                    self._last_kind = kind
                    break
        if not (b.prefill or b.decode):
            raise RuntimeError(
                f"no step could be formed for {len(self._seqs)} unfinished requests (a scheduler bug)"
            )
        return self._emit(b)

    def _emit(self, b: _StepBuild) -> ScheduledStep:
        bs = self.config.block_size
        prefill = []
        for seq, n in b.prefill:
            start = seq.num_computed
            end = start + n
            prefill.append(
                SeqPlan(
                    token_ids=tuple(seq.token_ids[start:end]),
                    start_pos=start,
                    block_table=tuple(seq.block_table[: -(-end // bs)]),
                    num_logits=1 if end == len(seq.token_ids) else 0,
                )
            )
        decode = [
            SeqPlan(
                token_ids=(seq.token_ids[-1],),
                start_pos=seq.num_computed,
                block_table=tuple(seq.block_table[: -(-len(seq.token_ids) // bs)]),
                num_logits=1,
            )
            for seq in b.decode
        ]
        rows = [s for s, _ in b.prefill] + b.decode
        step = ScheduledStep(
            plan=StepPlan(prefill=tuple(prefill), decode=tuple(decode)),
            request_ids=tuple(s.request.request_id for s in rows),
            preempted=tuple(s.request.request_id for s in b.preempted),
            index=self._next_index,
        )
        self._next_index += 1
        self._pending = step
        self._pending_seqs = rows
        return step

    def cancel(self, step: ScheduledStep) -> None:
        """Forget the outstanding `step`, which did not run: give back the blocks it added.

        Its requests keep what was cached before it and are scheduled again;
        requests it preempted stay preempted.
        """
        self._check_outstanding(step)
        self._pending = None
        for seq in self._pending_seqs:
            if self._is_live(seq):
                keep = -(-seq.num_computed // self.config.block_size)
                self.allocator.free(seq.block_table[keep:])
                del seq.block_table[keep:]

    def _is_live(self, seq: _Seq) -> bool:
        return self._seqs.get(seq.request.request_id) is seq

    def _check_outstanding(self, step: ScheduledStep) -> None:
        if self._pending is None or step is not self._pending:
            raise ValueError(
                f"got step {step.index}, but the outstanding step is "
                f"{None if self._pending is None else self._pending.index}"
            )

    def _schedule_decodes(self, b: _StepBuild) -> None:
        bs = self.config.block_size
        for seq in list(self._running):
            if id(seq) in b.gone or not seq.is_decoding:
                continue  # preempted earlier in this loop, or still prefilling
            need = -(-(seq.num_computed + 1) // bs) - len(seq.block_table)  # `_blocks_needed(seq, 1)`, inlined
            if need > 0 and not self._make_room(seq, need, b):
                # Nobody younger is left to preempt; give the blocks back to older requests.
                self._preempt(seq, b)
                continue
            if need > 0:
                seq.block_table += self.allocator.allocate(need)
            b.decode.append(seq)

    def _schedule_prefills(self, b: _StepBuild) -> None:
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
            seq.block_table += self.allocator.allocate(self._blocks_needed(seq, n))
            b.prefill.append((seq, n))

        while self._waiting and len(self._running) < cfg.max_num_seqs:
            budget = cfg.max_num_batched_tokens - b.num_tokens()
            if budget == 0:
                return
            seq = self._waiting[0]
            if cfg.enable_prefix_caching:
                # Leave the last token uncached so this chunk has a token that makes logits.
                hit = self.allocator.match_prefix(seq.token_ids[:-1])
                seq.block_table = list(hit.blocks)
                seq.block_hashes = list(hit.hashes)
                seq.num_computed = len(hit.blocks) * cfg.block_size
            n = min(
                len(seq.token_ids) - seq.num_computed, budget, cfg.max_prefill_chunk, self._tokens_that_fit(seq)
            )
            if n == 0:
                # Admission never preempts; and later arrivals must not overtake the head.
                self._release(seq)
                return
            seq.block_table += self.allocator.allocate(self._blocks_needed(seq, n))
            self._waiting.pop(0)
            bisect.insort(self._running, seq, key=lambda s: s.arrival)
            b.prefill.append((seq, n))

    def _blocks_needed(self, seq: _Seq, n: int) -> int:
        return max(0, -(-(seq.num_computed + n) // self.config.block_size) - len(seq.block_table))

    def _tokens_that_fit(self, seq: _Seq) -> int:
        slack = len(seq.block_table) * self.config.block_size - seq.num_computed
        return slack + self.allocator.num_free_blocks * self.config.block_size

    def _make_room(self, seq: _Seq, need: int, b: _StepBuild) -> bool:
        """Preempt running requests younger than `seq`, youngest first, until `need` blocks are free."""
        while self.allocator.num_free_blocks < need:
            victim = self._running[-1]
            if victim.arrival <= seq.arrival:
                return False
            self._preempt(victim, b)
        return True

    def _preempt(self, seq: _Seq, b: _StepBuild) -> None:
        b.decode = [s for s in b.decode if s is not seq]
        b.prefill = [(s, n) for s, n in b.prefill if s is not seq]
        b.preempted.append(seq)
        b.gone.add(id(seq))
        self._running.remove(seq)
        self._release(seq)
        seq.num_preemptions += 1
        bisect.insort(self._waiting, seq, key=lambda s: s.arrival)

    def _release(self, seq: _Seq) -> None:
        self.allocator.free(seq.block_table)
        seq.block_table = []
        seq.block_hashes = []
        seq.num_computed = 0

    # ---- results -------------------------------------------------------------

    def update(self, step: ScheduledStep, sampled_token_ids: Sequence[int | None]) -> list[FinishedRequest]:
        """Record that `step` ran: its tokens are now cached, and append the sampled tokens.

        sampled_token_ids: one entry per row of `step` (prefill rows then decode
        rows): the sampled token for a row with num_logits > 0, None otherwise.
        Returns the requests that finished.
        """
        self._check_outstanding(step)
        rows = step.rows
        if len(sampled_token_ids) != len(rows):
            raise ValueError(f"step {step.index} has {len(rows)} rows, got {len(sampled_token_ids)} sampled tokens")
        tokens: list[int | None] = []
        for i, (row, tok) in enumerate(zip(rows, sampled_token_ids)):
            if (tok is None) != (row.num_logits == 0) or not (tok is None or isinstance(tok, int)):
                raise ValueError(
                    f"row {i} ({step.request_ids[i]!r}) has num_logits={row.num_logits} but got sampled token {tok!r}"
                )
            tokens.append(tok)
        self._pending = None
        finished = []
        for seq, row, tok in zip(self._pending_seqs, rows, tokens):
            if not self._is_live(seq):
                continue  # finished from outside after it was scheduled
            assert seq.num_computed == row.start_pos, (seq.request.request_id, seq.num_computed, row.start_pos)
            seq.num_computed += row.num_tokens
            self._register_full_blocks(seq)
            if tok is None:
                continue
            seq.token_ids.append(tok)
            if tok in seq.request.stop_token_ids:
                finished.append(self._finish(seq, FinishReason.STOP))
            elif seq.num_generated >= seq.request.max_tokens or len(seq.token_ids) >= seq.max_len:
                finished.append(self._finish(seq, FinishReason.LENGTH))
        return finished

    def _register_full_blocks(self, seq: _Seq) -> None:
        if not self.config.enable_prefix_caching:
            return
        bs = self.config.block_size
        for i in range(len(seq.block_hashes), seq.num_computed // bs):
            parent = seq.block_hashes[-1] if seq.block_hashes else None
            block_tokens = seq.token_ids[i * bs : (i + 1) * bs]
            seq.block_hashes.append(self.allocator.register(seq.block_table[i], parent, block_tokens))

    def _finish(self, seq: _Seq, reason: FinishReason) -> FinishedRequest:
        if seq in self._running:
            self._running.remove(seq)
            self._release(seq)
        else:
            self._waiting.remove(seq)
        del self._seqs[seq.request.request_id]
        req = seq.request
        return FinishedRequest(
            req.request_id,
            req.prompt_token_ids,
            tuple(seq.token_ids[len(req.prompt_token_ids) :]),
            reason,
            seq.num_preemptions,
        )

    # ---- checks --------------------------------------------------------------

    def check_invariants(self) -> None:
        """Raise AssertionError if queues, block tables and the allocator disagree."""
        bs = self.config.block_size
        assert len(self._running) <= self.config.max_num_seqs
        assert [s.arrival for s in self._running] == sorted(s.arrival for s in self._running)
        assert [s.arrival for s in self._waiting] == sorted(s.arrival for s in self._waiting)
        assert {id(s) for s in self._running} | {id(s) for s in self._waiting} == {id(s) for s in self._seqs.values()}
        assert not ({id(s) for s in self._running} & {id(s) for s in self._waiting})
        owners: Counter[int] = Counter()
        for seq in self._running:
            assert len(set(seq.block_table)) == len(seq.block_table), f"{seq.request.request_id!r} repeats a block"
            if self._pending is None:
                assert len(seq.block_table) == -(-seq.num_computed // bs), seq.request.request_id
            owners.update(seq.block_table)
        for seq in self._waiting:
            assert not seq.block_table and seq.num_computed == 0, seq.request.request_id
        self.allocator.check_invariants(owners)
