"""Speculative decoding with the model's MTP layer: draft, verify, accept, catch up, one scheduled step at a time.

One iteration, for the step the scheduler planned (decode rows of `decode_q_len` = 1 + k'
tokens, k' <= k drafts):

1. draft (`SpeculativeDecoder.draft`): each decode sequence's first draft (and the
   drafter's hidden state after it) came from the previous iteration's catch-up; drafts
   2..k' are drafter decode steps at positions c .. c + k' - 2, each fed the previous
   draft and hidden state on the device. One host sync brings the chain's drafts back
   (none for k' = 1). Returns the `Verify`: the drafts and the target step's plan;
2. verify: the engine runs that plan on its own state, one target step, the decode rows
   fed [last token, drafts] (a decode segment of k' + 1 causal query tokens a sequence,
   through the absorbed decode kernel), the prefill chunks with logits and hidden states
   for every row (the drafter needs them);
3. accept (`SpeculativeDecoder.accept`, steps 3 to 5): every verify row's token is drawn
   with the request's key and the drafts are accepted as `acceptance` says, on the device;
4. catch up: one drafter step over the same rows as the target's, each row fed the
   token after it (a prompt token, the token just drawn, or a verify row's token) and
   the target's hidden state of that row, which writes the drafter's cache where the
   target's is valid and draws the next first drafts from the rows that will continue.
   Rows after a rejected draft write dead entries that later steps overwrite;
5. one host sync brings the tokens, the accepted counts and the next first drafts back,
   and only then are the next first drafts and the counts recorded.

Faults: the decoder never holds the target's state (the engine runs step 2 and keeps the
state that step returns), and it keeps the drafter's new state as each drafter step
returns, so an error or an interrupt anywhere in an iteration leaves both states live.
Until step 5 ends, an iteration changes no draft and no count (it only drops those of
the requests the scheduler preempted for it), so after a fault `drafts` still matches
the scheduler, which was not updated either; the engine then aborts the call's requests
and `forget`s their drafts, so a later call finds none. The cache entries a failed
iteration wrote lie at or past each sequence's computed length, dead as a rejected
draft's are, in blocks the prefix cache registers only once an iteration has ended.

Draft, verify and catch-up steps are ordinary steps of `make_step` (memoized and
graph-captured by their modes; the query length is part of the static key). The two
host syncs (`to_host`) sit between steps: after the draft chain and after the catch-up.

Under data-parallel attention (`draft` given a `RanksStep`) every rank runs an iteration of
its own rows, and the drafter's steps exchange rows at the MoE as the target's do, so every
rank runs the same drafter steps in the same order: as many chain steps as the longest chain
of any rank (`chain_plans`; a rank whose chain is shorter, or that has no row, runs idle ones
beside the others'), then one catch-up. Every rank plans every rank's steps from what all of
them hold alike (every rank's scheduled plan and every request's record), so none asks another
how many to run; drafts, accepted counts and the stats stay with the rank that owns the rows.
"""

from __future__ import annotations

from collections.abc import Hashable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

import torch

from mla_func.core.batch import Batch
from mla_func.core.mode import ForwardMode
from mla_func.core.plan import SeqPlan, StepPlan
from mla_func.core.step import Step, StepOutput
from mla_func.kernels import Ops
from mla_func.parallel.data_parallel import prepare_rank_step, rank_graph_modes
from mla_func.serving.acceptance import accepted_lengths
from mla_func.serving.draws import DrawRows, draw_tokens
from mla_func.serving.rank_scheduler import RanksStep
from mla_func.serving.requests import LiveRequest
from mla_func.serving.scheduler import ScheduledStep
from mla_func.state.kv_cache import KVCacheState

__all__ = ["CatchUp", "Draft", "SpeculativeDecoder", "SpeculativeStats", "Verify", "catch_up", "chain_plans",
           "to_host", "verify_plan"]

Live = Mapping[Hashable, LiveRequest]   # request id -> the engine's record of that request
Sampled = list[int | tuple[int, ...] | None]


@dataclass(frozen=True, slots=True)
class Draft:
    """A sequence's first draft for its verify row at `position` (its start_pos)."""

    position: int
    token: int
    hidden: torch.Tensor   # [H] the drafter's hidden state after the draft (`drafter_hidden_size`)


@dataclass(slots=True)
class SpeculativeStats:
    """Counts over verify rows: drafts proposed and drafts accepted."""

    drafted: int = 0
    accepted: int = 0

    @property
    def acceptance_rate(self) -> float:
        return self.accepted / self.drafted if self.drafted else float("nan")


@dataclass(frozen=True, slots=True)
class Verify:
    """An iteration's drafts and the target step that verifies them (`SpeculativeDecoder.draft`).

    plan: the scheduled plan with each decode row fed [last token, its drafts], and logits (and
          hidden states) for every prefill row, which the drafter's catch-up reads (`verify_plan`).
    ranks: under data-parallel attention, the step of every rank that `scheduled` is this rank's part of
           (`scheduled` empty when the rank is idle); None on one process.
    """

    scheduled: ScheduledStep
    drafts: tuple[tuple[int, ...], ...]   # per decode row, decode_q_len - 1 drafts
    plan: StepPlan
    ranks: RanksStep | None = None

    @property
    def every_rank(self) -> tuple[StepPlan, ...] | None:
        """Under data-parallel attention every rank's plan of the verify step, in rank order (this rank's
        `plan`; another's with its scheduled draft slots, of the same sizes: only its own rank reads their
        tokens); None on one process."""
        if self.ranks is None:
            return None
        own = self.ranks.rank
        return tuple(self.plan if r == own else verify_plan(p) for r, p in enumerate(self.ranks.plans))


def verify_plan(plan: StepPlan, drafts: Sequence[tuple[int, ...]] | None = None) -> StepPlan:
    """The target step that verifies the scheduled `plan`: logits (and hidden states) for every prefill row,
    which the drafter's catch-up reads, and each decode row fed [last token, its drafts] (drafts: per decode
    row, decode_q_len - 1 tokens; None keeps the scheduled rows' draft slots, which hold the last token)."""
    decode = plan.decode if drafts is None else tuple(
        replace(s, token_ids=s.token_ids[:1] + d) for s, d in zip(plan.decode, drafts))
    return StepPlan(prefill=tuple(replace(s, num_logits=s.num_tokens) for s in plan.prefill), decode=decode,
                    decode_q_len=plan.decode_q_len)


def chain_plans(plan: StepPlan) -> tuple[StepPlan, ...]:
    """The drafter's draft-chain steps of the scheduled `plan`: decode_q_len - 2 steps (none below 3), step
    i - 2 one row a decode sequence at position c + i - 2, fed draft i - 1 (its token ids here are
    placeholders: the chain feeds the drafts on the device) for the token at c + i."""
    return tuple(StepPlan(decode=tuple(SeqPlan((0,), s.start_pos + i - 2, s.block_table, 1, s.group_block_tables)
                                       for s in plan.decode))
                 for i in range(2, plan.decode_q_len))


@dataclass(frozen=True, slots=True)
class CatchUp:
    """The drafter's catch-up step over a target step's rows (`catch_up`).

    plan: the prefill chunks shifted by one token (each row fed the token after it) and the verify
          rows, q each, all giving logits where a next draft may be drawn.
    rows: the logits rows the next first drafts are drawn from, prefill rows' first.
    fed_drawn: the prefill rows (of the batch) fed the token drawn this iteration.
    continuing: for each drawn row, (request id, the position of its next verify row, or for verify
          row b (-1, b): the position follows from the drafts it accepts).
    prefill_tokens: the prefill rows' tokens, before the decode rows.
    prefill_logits: the prefill rows that give logits, the first of `rows`.
    """

    plan: StepPlan
    rows: DrawRows
    fed_drawn: tuple[int, ...]
    continuing: tuple[tuple[Hashable, int, int], ...]
    prefill_tokens: int
    prefill_logits: int


def catch_up(plan: StepPlan, ids: Sequence[Hashable], live: Live) -> CatchUp:
    """The catch-up step over the rows of the scheduled `plan` (request ids `ids`, row by row), from the
    records in `live` as they stand before the iteration's tokens are added (alike on every rank)."""
    q = plan.decode_q_len
    prefill, fed_drawn, continuing = [], [], []
    rows = DrawRows()
    offset, num_logits = 0, 0
    for s, rid in zip(plan.prefill, ids):
        entry = live[rid]
        full = list(entry.request.prompt_token_ids) + entry.output_token_ids
        end = s.seq_len
        nxt = full[end] if end < len(full) else 0
        if end >= len(full):
            fed_drawn.append(offset + s.num_tokens - 1)     # fed the token drawn just now
        logits = 1 if end >= len(full) - 1 else 0
        prefill.append(SeqPlan(s.token_ids[1:] + (nxt,), s.start_pos, s.block_table, logits, s.group_block_tables))
        if logits:
            rows.add(num_logits, entry, [], end + 1)
            continuing.append((rid, end, -1))
            num_logits += 1
        offset += s.num_tokens
    decode = tuple(SeqPlan((0,) * q, s.start_pos, s.block_table, q, s.group_block_tables) for s in plan.decode)
    for b, (s, rid) in enumerate(zip(plan.decode, ids[len(plan.prefill):])):
        entry = live[rid]
        for j in range(q):
            rows.add(num_logits + b * q + j, entry, [], s.start_pos + j + 2)
        continuing.append((rid, -1, b))
    return CatchUp(StepPlan(prefill=tuple(prefill), decode=decode, decode_q_len=q), rows, tuple(fed_drawn),
                   tuple(continuing), offset, num_logits)


def _own_step(step: ScheduledStep | RanksStep) -> ScheduledStep:
    """The scheduled step of this process's rows: `step` itself, or this rank's of every rank's (an empty one
    when the rank is idle)."""
    if isinstance(step, ScheduledStep):
        return step
    return step.own or ScheduledStep(StepPlan(), (), index=step.index)


def to_host(values: torch.Tensor) -> list[Any]:
    """Bring device values to the host: the iteration's host syncs, both of them through here."""
    return values.tolist()


class SpeculativeDecoder:
    """The drafter's step and state beside the engine's target step.

    An iteration is `draft`, then the engine's own step of `Verify.plan` on the target's
    state (which this class never holds), then `accept`.
    """

    def __init__(self, drafter: Step, drafter_state: KVCacheState, ops: Ops, *, hidden_size: int):
        self.drafter = drafter
        self.ops = ops  # the engine's op table, whose sampling op draws every token here
        self.state = drafter_state
        self.hidden_size = hidden_size  # H of the hidden states its steps read (`drafter_hidden_size`)
        self.drafts: dict[Hashable, Draft] = {}
        self.stats = SpeculativeStats()

    def warmup(self, max_q_len: int, hidden_size: int, *, progress: bool, data_parallel: bool = False) -> int:
        """Capture the drafter's decode graphs for every step length 1..max_q_len (its draft steps
        have one row a sequence, its catch-up steps one per verified row); returns how many. Under
        data-parallel attention every rank calls it and captures the keys its steps agree on
        (`parallel.data_parallel.rank_graph_modes`), in the same order."""
        before = len(self.drafter.captured_keys)
        modes = [m for q in range(1, max_q_len + 1) for m in self.drafter.decode_graph_modes(self.state, decode_q_len=q)]
        if data_parallel:
            modes = list(rank_graph_modes(modes))
        self.drafter.warmup(self.state, modes, progress=progress, hidden_size=hidden_size)
        return len(self.drafter.captured_keys) - before

    def forget(self, *request_ids: Hashable) -> None:
        """Drop requests' pending drafts (they finished or were preempted; a recompute drafts anew)."""
        for request_id in request_ids:
            self.drafts.pop(request_id, None)

    def draft(self, scheduled: ScheduledStep | RanksStep, live: Live) -> Verify:
        """Step 1: the drafts of `scheduled`'s decode rows, and the plan of the target step that verifies them.
        `live` holds a record of every request `scheduled` has a row of.

        Under data-parallel attention `scheduled` is every rank's step (`RanksStep`): this rank drafts for
        its own rows (none when idle) in the drafter steps every rank runs (module docstring), and the
        verify step is every rank's (`Verify.every_rank`)."""
        ranks = scheduled if isinstance(scheduled, RanksStep) else None
        own = _own_step(scheduled)
        plan, ids = own.plan, own.request_ids
        self.forget(*own.preempted)  # before the catch-up, which drafts anew for one re-admitted at once
        drafts = self._draft(plan, ids[len(plan.prefill):], live, ranks)
        return Verify(own, tuple(drafts), verify_plan(plan, drafts), ranks)

    def accept(self, verify: Verify, target: StepOutput, live: Live) -> Sampled:
        """Steps 3 to 5, after the target's step of `verify.plan` gave `target`: per row of the scheduled
        step, its tokens (an int for a prefill row that completes its prompt, a tuple for a decode row,
        None otherwise). Records the next first drafts and the counts only once everything else has run.
        Under data-parallel attention (`verify.ranks`) the rows are this rank's own (none when idle: it then
        runs its part of the catch-up only), and so are the counts."""
        plan, ids, drafts = verify.scheduled.plan, verify.scheduled.request_ids, verify.drafts
        num_prefill, q = len(plan.prefill), plan.decode_q_len
        decode_ids = ids[num_prefill:]
        logits, hidden = target.output.logits, target.output.hidden      # [N, V], [N, H]: every real row

        rows, done, offset = DrawRows(), [], 0
        for i, s in enumerate(plan.prefill):
            offset += s.num_tokens
            if s.num_logits:  # the chunk completes its prompt
                done.append(i)
                entry = live[ids[i]]
                rows.add(offset - 1, entry, entry.output_token_ids, s.seq_len)
        for b, (s, rid) in enumerate(zip(plan.decode, decode_ids)):
            entry = live[rid]
            for j in range(q):
                rows.add(offset + b * q + j, entry, entry.output_token_ids + list(drafts[b][:j]), s.start_pos + j + 1)
        tokens = draw_tokens(logits, rows, penalties=True, ops=self.ops)           # [len(done) + B * q]
        verify_tokens = tokens[len(done):].view(len(decode_ids), q)
        drafted = torch.tensor(drafts, dtype=torch.int64, device=tokens.device).view(len(decode_ids), q - 1)
        accepted = accepted_lengths(verify_tokens, drafted)
        first, next_hidden, continuing = self._catch_up(plan, ids, live, tokens, hidden, accepted, verify.ranks)

        host = to_host(torch.cat([tokens, accepted, first]))  # the iteration's one sync after its steps
        n_tokens, n_acc = len(rows.index), len(decode_ids)
        sampled: Sampled = [None] * len(ids)
        for k, i in enumerate(done):
            sampled[i] = host[k]
        counts = host[n_tokens:n_tokens + n_acc]
        for b, a in enumerate(counts):
            sampled[num_prefill + b] = tuple(host[len(done) + b * q: len(done) + b * q + a + 1])
        next_drafts = {}
        for k, (rid, position, b) in enumerate(continuing):
            if b >= 0:  # a verify row continues after the tokens it keeps
                position = plan.decode[b].start_pos + counts[b] + 1
            next_drafts[rid] = Draft(position, host[n_tokens + n_acc + k], next_hidden[k])
        # The iteration's only changes to the decoder, after the last thing that can fail.
        self.drafts.update(next_drafts)
        self.stats.drafted += (q - 1) * n_acc
        self.stats.accepted += sum(counts)
        return sampled

    def _drafter_step(self, batch: Batch, mode: ForwardMode) -> StepOutput:
        """Run the drafter on its state. The step donates `self.state`; its new state is kept here as
        the step returns, so whatever raises afterwards leaves the decoder a live state."""
        self.state, out = self.drafter(self.state, batch, mode)
        return out

    def _prepare(self, plan: StepPlan, ranks: RanksStep | None,
                 every_rank: Sequence[StepPlan]) -> tuple[Batch, ForwardMode]:
        """The drafter's batch and mode of `plan`: on one process (ranks None) its own; under data-parallel
        attention this rank's part of the drafter step whose plans of every rank are `every_rank`."""
        if ranks is None:
            return self.drafter.prepare(self.state, plan)
        return prepare_rank_step(self.drafter, self.state, every_rank, ranks.rank)

    def _idle_step(self, ranks: RanksStep, every_rank: Sequence[StepPlan]) -> None:
        """A drafter step with no row of this rank's, beside the other ranks' steps `every_rank` (this rank's
        plan empty there): its padding rows, fed zero hidden states, enter every exchange as theirs do."""
        batch, mode = self._prepare(StepPlan(), ranks, every_rank)
        zeros = torch.zeros((mode.num_tokens, self.hidden_size), dtype=self.state.dtype, device=self.state.device)
        self._drafter_step(replace(batch, hidden=zeros), mode)

    def _first_draft(self, row: SeqPlan, request_id: Hashable) -> Draft:
        """The first draft of a verify row, which the previous iteration's catch-up drew for its position."""
        draft = self.drafts.get(request_id)
        if draft is None or draft.position != row.start_pos:
            raise RuntimeError(f"speculative decoding: request {request_id!r} has no first draft for position "
                               f"{row.start_pos} (got {None if draft is None else draft.position})")
        return draft

    def _draft(self, plan: StepPlan, decode_ids: Sequence[Hashable], live: Live,
               ranks: RanksStep | None) -> list[tuple[int, ...]]:
        """The drafts of each decode row (decode_q_len - 1 of them). Under data-parallel attention (`ranks`)
        every rank runs as many chain steps as the longest chain of any rank, idle past its own."""
        firsts = [self._first_draft(s, rid) for s, rid in zip(plan.decode, decode_ids)] if plan.decode_q_len > 1 else []
        own = chain_plans(plan)
        # Every rank's chain, padded with idle steps to the longest: the same count on every rank.
        chains = [own] if ranks is None else [chain_plans(p) for p in ranks.plans]
        steps = max(len(chain) for chain in chains)
        chains = [chain + (StepPlan(),) * (steps - len(chain)) for chain in chains]
        chain: list[torch.Tensor] = []
        if own:
            device = self.state.device
            token = torch.tensor([d.token for d in firsts], dtype=torch.int64, device=device)   # [B]
            hidden = torch.stack([d.hidden for d in firsts])                                  # [B, H]
        for k in range(steps):
            every_rank = [c[k] for c in chains]
            if ranks is not None and k >= len(own):  # (one process runs its own chain only)
                self._idle_step(ranks, every_rank)
                continue
            i = k + 2  # draft i: the row at c + i - 2 fed draft i - 1, for the token at c + i
            batch, mode = self._prepare(own[k], ranks, every_rank)
            n, pad = len(firsts), mode.num_tokens - len(firsts)
            batch = replace(batch, input_ids=torch.cat([token, batch.input_ids[n:]]),
                            hidden=torch.cat([hidden, hidden.new_zeros(pad, hidden.shape[1])]))
            out = self._drafter_step(batch, mode)
            rows = DrawRows()
            for b, (s, rid) in enumerate(zip(plan.decode, decode_ids)):
                rows.add(b, live[rid], [], s.start_pos + i)
            token, hidden = draw_tokens(out.output.logits, rows, penalties=False, ops=self.ops), out.output.hidden
            chain.append(token)
        if not chain:  # q <= 2: the first drafts, or none
            return [(d.token,) for d in firsts] if firsts else [()] * len(decode_ids)
        later = to_host(torch.stack(chain, dim=1))  # the draft chain's one host sync
        return [(d.token, *rest) for d, rest in zip(firsts, later)]

    def _catch_up(self, plan: StepPlan, ids: Sequence[Hashable], live: Live, tokens: torch.Tensor, hidden: torch.Tensor,
                  accepted: torch.Tensor, ranks: RanksStep | None
                  ) -> tuple[torch.Tensor, torch.Tensor, tuple[tuple[Hashable, int, int], ...]]:
        """The drafter over the target step's rows (`catch_up`; under data-parallel attention beside every
        rank's, an idle rank's without rows); returns the next first drafts [M], their hidden states [M, H]
        and `CatchUp.continuing`."""
        q = plan.decode_q_len
        own = catch_up(plan, ids, live)
        every_rank = () if ranks is None else tuple(
            own.plan if r == ranks.rank else StepPlan() if s is None else catch_up(s.plan, s.request_ids, live).plan
            for r, s in enumerate(ranks.steps))
        batch, mode = self._prepare(own.plan, ranks, every_rank)
        device = tokens.device
        offset, num_logits, n_decode = own.prefill_tokens, own.prefill_logits, len(plan.decode) * q
        split = mode.padded_prefill_tokens
        patch_rows = [*own.fed_drawn, *range(split, split + n_decode)]
        real = torch.cat([torch.arange(offset, device=device), torch.arange(split, split + n_decode, device=device)])
        # The rows fed a token drawn this iteration, in the order `tokens` holds them.
        ids_t = batch.input_ids.index_copy(0, torch.tensor(patch_rows, dtype=torch.int64, device=device), tokens)
        fed = hidden.new_zeros(mode.num_tokens, self.hidden_size).index_copy(0, real, hidden)
        out = self._drafter_step(replace(batch, input_ids=ids_t, hidden=fed), mode)
        drafts = draw_tokens(out.output.logits, own.rows, penalties=False, ops=self.ops)
        pick = torch.cat([torch.arange(num_logits, device=device),
                          num_logits + torch.arange(len(plan.decode), device=device) * q + accepted])
        return drafts.index_select(0, pick), out.output.hidden.index_select(0, pick), own.continuing
