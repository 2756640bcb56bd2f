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

Cache groups: a request holds one block table per cache group of the model
(`SchedulerConfig.cache_groups`; one for an MLA model), and every block
operation covers all groups at once through a `GroupedAllocator`. In a group
with a lookback (`CacheGroup.lookback`: only a sequence's last tokens are read
there), `update` frees a sequence's blocks that lie wholly before
num_computed - lookback once the step's results are in, and its table keeps the
scratch block in their place (`GroupedAllocator.free_behind`), so such a group
holds a bounded number of blocks per sequence however long it grows.

A request finishes inside `update` when it samples one of its `stop_token_ids`
(reason STOP), when it has `max_tokens` generated tokens, or when prompt +
generated reaches `max_model_len` (reason LENGTH); `finish` aborts it.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Hashable, Sequence

from mla_func.serving.scheduler_policy import SeqState, StepBuild, StepPolicy
from mla_func.serving.scheduler_types import FinishedRequest, FinishReason, Request, ScheduledStep, SchedulerConfig
from mla_func.state.block_allocator import SCRATCH_BLOCK, BlockAllocator
from mla_func.state.cache_groups import GroupedAllocator

__all__ = ["FinishReason", "FinishedRequest", "Request", "ScheduledStep", "Scheduler", "SchedulerConfig"]


class Scheduler(StepPolicy):
    """Waiting and running queues over a `GroupedAllocator` (one `BlockAllocator` per cache group), which it owns."""

    def __init__(self, config: SchedulerConfig):
        self.config = config
        self.blocks = GroupedAllocator(config.cache_groups, enable_prefix_caching=config.enable_prefix_caching,
                                       carry_periods=config.carry_periods)
        self._seqs: dict[Hashable, SeqState] = {}
        self._waiting: list[SeqState] = []  # sorted by arrival, holds no blocks
        self._running: list[SeqState] = []  # sorted by arrival, holds blocks
        self._next_arrival = 0
        self._pending: ScheduledStep | None = None
        self._pending_seqs: list[SeqState] = []  # per row of the pending step
        self._next_index = 0
        self._last_kind = "decode"  # so an unmixed scheduler starts with a prefill step

    @property
    def allocator(self) -> BlockAllocator:
        """The allocator of cache group 0."""
        return self.blocks.allocators[0]

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
        # A group with a lookback holds only a sequence's last tokens, so the scarcest group decides.
        blocks = -(-(max_len - 1) // cfg.block_size)
        if max_len - 1 > (longest := self.blocks.num_usable_tokens()):
            raise ValueError(
                f"request {rid!r}: needs up to {blocks} KV blocks ({max_len - 1} tokens) but the cache has "
                f"only {self.allocator.num_usable_blocks} usable blocks of {cfg.block_size} tokens"
                + ("" if len(cfg.cache_groups) == 1 else
                   f" (one sequence can hold at most {longest} tokens: the scarcest cache group decides)")
            )
        seq = SeqState(request, self._next_arrival, max_len, list(request.prompt_token_ids), self.blocks.empty_tables(),
                   tuple([] for _ in cfg.cache_groups))
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
        b = StepBuild()
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

    def cancel(self, step: ScheduledStep) -> None:
        """Forget the outstanding `step`, which did not run: give back the blocks it added.

        Its requests keep what was cached before it and are scheduled again;
        requests it preempted stay preempted.
        """
        self._check_outstanding(step)
        self._pending = None
        for seq in self._pending_seqs:
            if self._is_live(seq):
                self.blocks.truncate(seq.tables, seq.num_computed)

    def _is_live(self, seq: SeqState) -> bool:
        return self._seqs.get(seq.request.request_id) is seq

    def _check_outstanding(self, step: ScheduledStep) -> None:
        if self._pending is None or step is not self._pending:
            raise ValueError(
                f"got step {step.index}, but the outstanding step is "
                f"{None if self._pending is None else self._pending.index}"
            )

    # ---- results -------------------------------------------------------------

    def update(self, step: ScheduledStep,
               sampled_token_ids: Sequence[int | tuple[int, ...] | None]) -> list[FinishedRequest]:
        """Record that `step` ran: its tokens are now cached, and append the sampled tokens.

        sampled_token_ids: one entry per row of `step` (prefill rows then decode
        rows): the sampled token for a row with num_logits > 0, None otherwise. A verify
        row (speculative decoding) gives a tuple: the drafts it accepted, then the token
        sampled after them (1 to decode_q_len tokens); tokens past a stop token or the
        length limit are dropped. Returns the requests that finished.
        """
        self._check_outstanding(step)
        rows = step.rows
        if len(sampled_token_ids) != len(rows):
            raise ValueError(f"step {step.index} has {len(rows)} rows, got {len(sampled_token_ids)} sampled tokens")
        tokens: list[tuple[int, ...]] = []
        for i, (row, tok) in enumerate(zip(rows, sampled_token_ids)):
            if type(tok) is int and row.num_logits:  # the common case, checked without the general test below
                tokens.append((tok,))
                continue
            new = (tok,) if isinstance(tok, int) else tok if isinstance(tok, tuple) else ()
            if ((tok is None) != (row.num_logits == 0) or len(new) > row.num_logits
                    or (tok is not None and (not new or not all(isinstance(t, int) for t in new)))):
                raise ValueError(
                    f"row {i} ({step.request_ids[i]!r}) has num_logits={row.num_logits} but got sampled token {tok!r}"
                )
            tokens.append(new)
        self._pending = None
        finished = []
        num_prefill = len(step.plan.prefill)
        seqs, prefix_caching = self._seqs, self.config.enable_prefix_caching
        # Only a cache group with a lookback frees blocks as sequences grow (none for V2/V3: no call per row).
        free_behind = self.blocks.free_behind if self.blocks.has_lookback else None
        for i, (seq, row, new) in enumerate(zip(self._pending_seqs, rows, tokens)):
            if seqs.get(seq.request.request_id) is not seq:
                continue  # finished from outside after it was scheduled
            assert seq.num_computed == row.start_pos, (seq.request.request_id, seq.num_computed, row.start_pos)
            kept: tuple[int, ...]  # one token in the common case below, several from a verify row
            if len(new) == 1 and new[0] not in seq.request.stop_token_ids and len(seq.token_ids) + 1 < seq.max_len:
                # The common case, once a row every step: one token, and the request goes on.
                kept, reason = new, None
                seq.token_ids.append(new[0])
            else:
                kept, reason = self._kept(seq, new)
                seq.token_ids.extend(kept)
            if i < num_prefill:
                seq.num_computed += row.num_tokens
            else:
                # A verify row fed the last token and its drafts: the last token and the drafts
                # before the first rejected one are cached; the rest of its KV is dead.
                seq.num_computed += len(kept)
                if row.num_tokens > 1:
                    self.blocks.truncate(seq.tables, seq.num_computed)
            if prefix_caching:
                self.blocks.register_full_blocks(seq.tables, seq.hashes, seq.token_ids, seq.num_computed)
            if reason is not None:
                finished.append(self._finish(seq, reason))
            elif free_behind is not None:
                # After a verify row's truncation and after registering, so that rejected drafts never
                # make it free too much and freed full blocks stay in the prefix cache (evictable).
                free_behind(seq.tables, seq.num_computed)
        return finished

    def _finish(self, seq: SeqState, reason: FinishReason) -> FinishedRequest:
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
        """Raise AssertionError if queues, block tables and the allocators disagree."""
        groups = self.config.cache_groups
        assert len(self._running) <= self.config.max_num_seqs
        assert [s.arrival for s in self._running] == sorted(s.arrival for s in self._running)
        assert [s.arrival for s in self._waiting] == sorted(s.arrival for s in self._waiting)
        assert {id(s) for s in self._running} | {id(s) for s in self._waiting} == {id(s) for s in self._seqs.values()}
        assert not ({id(s) for s in self._running} & {id(s) for s in self._waiting})
        owners: list[Counter[int]] = [Counter() for _ in groups]
        for seq in self._running:
            for g, table, count in zip(groups, seq.tables, owners):
                # Exactly the blocks behind a group's lookback are placeholders: none a later step reads is freed.
                first = g.first_live_block(seq.num_computed)
                held = table[first:]
                assert all(b == SCRATCH_BLOCK for b in table[:first]), (seq.request.request_id, table)
                assert SCRATCH_BLOCK not in held, (seq.request.request_id, table)
                assert len(set(held)) == len(held), f"{seq.request.request_id!r} repeats a block"
                if self._pending is None:
                    assert len(table) == g.blocks_for(seq.num_computed), seq.request.request_id
                count.update(held)
        for seq in self._waiting:
            assert not any(seq.tables) and seq.num_computed == 0, seq.request.request_id
        self.blocks.check_invariants(owners)
