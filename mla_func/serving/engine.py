"""Engine: continuous batching of generation requests over the memoized step.

Offline, `generate` / `generate_stream` run one call's requests to their end. Online (a server),
`add_request` and `abort` change the requests between iterations and `iterate` runs one: schedule,
step, sample, update, returning the events of the tokens it sampled; `generate_stream` is exactly
those, for one call at a time. The engine is not thread-safe: one thread drives it
(`mla_func.server.engine_loop`).

The engine owns the KV state, the scheduler and the step. Each iteration asks the scheduler
for a plan, runs it through `make_step`, samples the rows that produce logits on the device
with each request's own key (seed, position), and feeds the tokens back. A request with bad
input fails alone: its completion carries the error, and every other request of the batch
runs to its end. Every request is checked (`mla_func.serving.requests`) before any is queued; each
row's penalties and min_tokens (`mla_func.serving.penalties`) are applied to its logits on the
device before sampling.

An error or an interrupt inside an iteration (a step, drawing, the drafter, a host sync)
reaches the caller, aborts that call's requests and frees their blocks, and leaves the
engine usable: every step of its state goes through `Engine._target_step`, which keeps the
state the step returns before anything else runs (the drafter's state is kept the same way
in `mla_func.serving.speculative`).

Under data-parallel attention (a model loaded with `Parallel(data_parallel_attention=True)`) every
rank runs this engine with the same calls: it schedules every rank's requests alike
(`mla_func.serving.rank_scheduler`), runs its own rank's step (an idle one when it has no request in
it; a CUDA graph only where every rank's step replays one of the same key), draws its own rows' tokens
(with their logprobs when a request of the step asks for them; with speculative decoding, drafts and
verifies its own rows in drafter steps every rank runs alike), and gathers every rank's, so every rank
returns every completion.
"""

from __future__ import annotations

import gc
import random
from collections.abc import Callable, Hashable, Iterator, Sequence
from typing import TypeVar

import torch

from mla_func.core.cache_budget import CacheBudget, CacheReport, cache_budget
from mla_func.core.model import Model
from mla_func.core.plan import SeqPlan, StepPlan
from mla_func.core.prepare import init_state
from mla_func.core.step import StepOutput, check_w8a8
from mla_func.kernels import CollectiveOps, default_backend, ops_for
from mla_func.kernels.latent_cache import check_kv_cache_dtype
from mla_func.models.mtp.layer import (DrafterFn, drafter_hidden_size, drafter_params, init_drafter_state, mtp_layer,
                                       target_step_fn)
from mla_func.parallel.data_parallel import prepare_rank_step, rank_graph_modes
from mla_func.serving.draws import DrawRows, draw_tokens, draw_tokens_with_logprobs
from mla_func.serving.engine_config import EngineConfig, check_flag, check_limit, default_num_blocks
from mla_func.serving.rank_scheduler import RankSchedulers, RanksStep, StepScheduler
from mla_func.serving.requests import (CheckedRequest, Completion, Limits, LiveRequest, ParamsLike, Prompt,
                                       RequestError, StopText, StreamEvent, TokenLogprob, check_request,
                                       check_score_ids, choice_seed, split_call)
from mla_func.serving.scheduler import FinishedRequest, FinishReason, Request, ScheduledStep, Scheduler
from mla_func.serving.speculative import SpeculativeDecoder, SpeculativeStats
from mla_func.state.block_allocator import OutOfBlocks

__all__ = ["Completion", "Engine", "EngineConfig", "RequestError", "StreamEvent"]

# What a step gives each of its rows: a token, a verify row's tokens, or None (a row without logits).
Drawn = int | tuple[int, ...] | None
_Step = TypeVar("_Step", ScheduledStep, RanksStep)  # a step of one scheduler, or of every rank's


def _fewest(count: int, ranks: CollectiveOps, device: torch.device) -> int:
    """The least of every rank's `count` (one all-gather): a number every rank's schedulers agree on."""
    return int(ranks.all_gather(torch.tensor([count], dtype=torch.int64, device=device), dim=0).min())


def _most_logprobs(entries: list[LiveRequest]) -> int | None:
    """The most `SamplingParams.logprobs` any of the records asks for; None when none asks."""
    return max((n for e in entries if (n := e.request.params.logprobs) is not None), default=None)


def _record_logprobs(packed: torch.Tensor, entries: list[LiveRequest], top: int) -> list[int]:
    """The tokens of `packed` ([M, 1 + top + 1 + top] int64 on the host, `Engine._packed_draw`'s, a row
    of each record of `entries`), appending each logprobs request's `TokenLogprob` to its record."""
    ids = packed[:, : top + 1].tolist()
    values = packed[:, top + 1 :].to(torch.int32).view(torch.float32).tolist()
    for entry, row_ids, row_values in zip(entries, ids, values):
        if entry.logprobs is not None and (n := entry.request.params.logprobs) is not None:
            alternatives = dict(zip(row_ids[1 : n + 1], row_values[1 : n + 1]))
            entry.logprobs.append(TokenLogprob(row_values[0], alternatives))
    return [row[0] for row in ids]


def _spread(drawn: Sequence[int], rows: Sequence[SeqPlan]) -> list[Drawn]:
    """A token of `drawn` for each row that gives logits, in order, None for the others."""
    if len(drawn) == len(rows):
        return list(drawn)
    tokens = iter(drawn)
    return [next(tokens) if row.num_logits else None for row in rows]


class Engine:
    """Scheduler + sampler + state around one model.

    Defaults: block_size 16; num_blocks from free memory (85% of free GPU memory less 2 GiB
    on CUDA, an eighth of RAM on CPU), at most what max_num_seqs full-length sequences need;
    max_num_seqs 64; max_num_batched_tokens 2048; long_prefill_token_threshold 512; mixed
    batches and prefix caching on; max_model_len the model's maximum; backend "triton" on
    CUDA, "torch" elsewhere; CUDA graphs on where CUDA is, for decode steps only
    (`graph_kinds`): decode steps are launch-bound and few shapes recur, while prefill and
    mixed steps are compute-bound and would each need a graph for every combination of
    padded sizes they meet. `batch_invariant=True` makes a request's logits, and so its
    tokens, independent of what else is running, at a cost in speed (off by default; see
    README "Batch invariance"). `speculative_tokens=k` (1 to 8; 0, the default, is off)
    drafts k tokens a decode step with the model's MTP layer (`load_model(..., mtp=True)`)
    and verifies them in one step (`mla_func.serving.speculative`); with `batch_invariant=True` the
    tokens are exactly those of decoding without drafts (`mla_func.serving.acceptance`; in the default
    mode a verify row's last bits can follow its step's row count, see README "Speculative
    decoding"), and `speculative_stats` counts accepted drafts. `kv_cache_dtype` is the latent
    cache's format: "auto" (the default) the model's dtype, "fp8" FP8 latent values with a float32
    scale per 128 and the RoPE values in the model's dtype (`mla_func.kernels.latent_cache`: 656
    bytes a token and layer at DeepSeek's sizes against 1152 in bf16; a family without an FP8 cache,
    `Family.fp8_cache_layer_kinds`, refuses it; the drafter's cache, with speculative_tokens, stays in
    the model's dtype). `w8a8=True` runs a model's FP8 weights as DeepSeek's checkpoints declare
    (`quantization_config.activation_scheme` "dynamic") and its own inference code runs them: each
    product quantizes its activations per token and group of 128 and multiplies FP8 by FP8 (the FP8
    tensor cores on the Triton backend); off (the default), the weights' products take the activations
    as they are, the dequantized weights' math. Refused for a model without FP8 weights and with
    batch_invariant.

    Under data-parallel attention (`model.params.collectives.tokens_split`) every rank builds the engine
    and makes the same calls on it (module docstring): requests go to ranks by `RankSchedulers`' rule,
    max_num_seqs, max_num_batched_tokens and num_blocks are each rank's (num_blocks the fewest any rank
    would take). A step replays a CUDA graph only when every rank's can: the ranks agree on one padded
    static key from every rank's plan (`parallel.data_parallel.rank_modes`), since a rank that captures
    a graph runs its step's collectives once more than a rank that replays one; a step any rank cannot
    graph runs eagerly on all. A step with a logprobs request gathers each row's logprobs with its token
    (`RanksStep.every_logits_row`). With speculative_tokens every rank drafts and verifies its own rows,
    the drafter's steps exchanging rows as the target's do (`mla_func.serving.speculative`), and gathers
    each verify row's tokens (`RanksStep.every_verify_token`); `speculative_stats` counts the drafts of the
    rank's own rows. The drafter's steps follow the same graph rule as the target's.
    """

    def __init__(
        self,
        model: Model,
        *,
        block_size: int = 16,
        num_blocks: int | None = None,
        max_num_seqs: int = 64,
        max_num_batched_tokens: int = 2048,
        long_prefill_token_threshold: int | None = 512,
        enable_mixed: bool = True,
        enable_prefix_caching: bool = True,
        max_model_len: int | None = None,
        backend: str | None = None,
        graphs: bool = True,
        graph_kinds: tuple[str, ...] = ("decode",),
        seed: int = 0,
        batch_invariant: bool = False,
        speculative_tokens: int = 0,
        kv_cache_dtype: str = "auto",
        w8a8: bool = False,
    ):
        for name, flag in (("enable_mixed", enable_mixed), ("enable_prefix_caching", enable_prefix_caching),
                           ("graphs", graphs), ("batch_invariant", batch_invariant), ("w8a8", w8a8)):
            check_flag(name, flag)
        check_limit("max_num_seqs", max_num_seqs, 1)
        check_limit("max_num_batched_tokens", max_num_batched_tokens, 1)
        check_limit("long_prefill_token_threshold", long_prefill_token_threshold, 0, or_none=True)
        check_limit("seed", seed, None)
        check_limit("speculative_tokens", speculative_tokens, 0, 8, "drafts a decode step verifies")
        check_kv_cache_dtype(kv_cache_dtype, "Engine: kv_cache_dtype")
        check_w8a8("Engine", model, w8a8, batch_invariant)
        if speculative_tokens and model.mtp is None:
            raise ValueError("Engine: speculative_tokens needs the model's MTP layer: load_model(..., mtp=True)")
        # The ranks of a data-parallel group (None: this engine's steps are every rank's steps).
        ranks = model.params.collectives if model.params.collectives.tokens_split else None
        if max_model_len is None:
            max_model_len = model.max_positions
        check_limit("max_model_len", max_model_len, 1, model.config.max_position_embeddings,
                     "the model's max_position_embeddings")
        check_limit("block_size", block_size, 1)
        if num_blocks is not None:
            check_limit("num_blocks", num_blocks, 2, why="block 0 is the scratch block")
        if max_model_len > model.max_positions:  # RoPE tables are built as long as the engine needs
            model = model.with_max_positions(max_model_len)
        self.model = model
        if num_blocks is None:
            num_blocks = default_num_blocks(model, block_size, max_num_seqs, max_model_len,
                                            speculative=bool(speculative_tokens), kv_cache_dtype=kv_cache_dtype,
                                            max_num_batched_tokens=max_num_batched_tokens)
        if ranks is not None:
            num_blocks = _fewest(num_blocks, ranks, model.device)
        self.config = EngineConfig(
            block_size=block_size,
            num_blocks=num_blocks,
            max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
            long_prefill_token_threshold=long_prefill_token_threshold, enable_mixed=enable_mixed,
            enable_prefix_caching=enable_prefix_caching, max_model_len=max_model_len,
            backend=backend or default_backend(model.device), graphs=graphs,
            graph_kinds=tuple(graph_kinds),
            batch_invariant=batch_invariant, speculative_tokens=speculative_tokens, kv_cache_dtype=kv_cache_dtype,
            w8a8=w8a8,
        )
        c = self.config
        # With drafts, the target's steps also return every row's hidden state, which the drafter reads.
        self.step = c.build_step(model, fn=target_step_fn if c.speculative_tokens else None)
        # Each cache group sized by its own rate; a group 0 with a lookback for max_num_seqs sequences only.
        self.state = init_state(model.config, num_blocks=c.num_blocks, block_size=c.block_size,
                                dtype=model.dtype, device=model.device, kv_cache_dtype=c.kv_cache_dtype,
                                max_num_seqs=c.max_num_seqs, max_num_batched_tokens=c.max_num_batched_tokens)
        # The state's own cache groups (group 0 of tokens, then the family's, `Family.cache_groups`), so the
        # scheduler allocates in exactly the geometry the steps write (every rank's state has the same).
        self._ranks = ranks
        self.scheduler: Scheduler | RankSchedulers = (
            Scheduler(c.scheduler_config(self.state.groups)) if ranks is None
            else RankSchedulers(c.scheduler_config(self.state.groups), ranks.size, ranks.rank))
        # The op table whose sampling op draws every token (the steps hold their own tables for the forward).
        self._ops = ops_for(c.backend, batch_invariant=c.batch_invariant, w8a8=c.w8a8)
        # Under data-parallel attention the drafter's steps are decided as the target's are
        # (`parallel.data_parallel.rank_modes`): every rank runs the same drafter steps, so a graph step is
        # one key on every rank, captured or replayed by all at once.
        self._speculative = None if not c.speculative_tokens else SpeculativeDecoder(
            c.build_step(model, fn=DrafterFn(mtp_layer(model.config)), params=drafter_params(model)),
            init_drafter_state(model, self.state), self._ops, hidden_size=drafter_hidden_size(model.config))
        self._rng = random.Random(seed)
        self._next_id = 0
        # Request id -> its record, for exactly the requests the scheduler holds: one leaves as it finishes
        # or is aborted.
        self._live: dict[Hashable, LiveRequest] = {}
        self._offline = False  # a generate_stream is running: add_request refuses

    def warmup(self, *, progress: bool = True, freeze_gc: bool = True) -> int:
        """Capture every decode graph the step's ladders allow (one per batch rung and table-width rung;
        with drafts, for each verify length 1..k+1, and the drafter's), now rather than on first use.
        Without graphs (or off CUDA) it does nothing to the step. Returns how many graphs were captured.
        Under data-parallel attention every rank calls it (a capture runs the step's collectives), and each
        captures the same keys, those its steps agree on (`parallel.data_parallel.rank_graph_modes`).

        freeze_gc: afterwards, move every object alive so far (the model, torch, the captured graphs)
        out of the cyclic garbage collector's sight (`gc.freeze`). They live as long as the engine, and
        a full collection in the middle of generation would otherwise walk all of them, adding tens of
        milliseconds to one step's host time. Objects frozen are still freed when no longer
        referenced; only reference cycles among them are left uncollected (`gc.unfreeze` undoes it).
        """
        max_q = self.config.speculative_tokens + 1
        before = len(self.step.captured_keys)
        modes = [m for q in range(1, max_q + 1) for m in self.step.decode_graph_modes(self.state, decode_q_len=q)]
        if self._ranks is not None:  # every rank captures the keys its steps will agree on, in the same order
            modes = list(rank_graph_modes(modes))
        self.step.warmup(self.state, modes, progress=progress)
        drafter = 0 if self._speculative is None else self._speculative.warmup(
            max_q, drafter_hidden_size(self.model.config), progress=progress, data_parallel=self._ranks is not None)
        if freeze_gc:
            gc.freeze()
        return len(self.step.captured_keys) - before + drafter

    @property
    def speculative_stats(self) -> SpeculativeStats:
        """Drafts proposed and accepted so far (all zero without speculative_tokens)."""
        return self._speculative.stats if self._speculative is not None else SpeculativeStats()

    @property
    def cache_budget(self) -> CacheBudget:
        """The target state's cache: its groups and each group's bytes a block (`mla_func.core.cache_budget`;
        the drafter's cache, with speculative_tokens, is not counted)."""
        c = self.config
        budget = cache_budget(self.model.config, dtype=self.state.dtype, block_size=c.block_size,
                              num_blocks=c.num_blocks, max_num_seqs=c.max_num_seqs,
                              max_num_batched_tokens=c.max_num_batched_tokens, kv_cache_dtype=c.kv_cache_dtype)
        if budget.groups != self.state.groups:  # the state is init_state's of this config: one geometry
            raise ValueError(f"Engine.cache_budget: groups {budget.groups} differ from the state's {self.state.groups}")
        return budget

    def cache_report(self, context: int | None = None) -> CacheReport:
        """Cache bytes a sequence of `context` tokens holds (default max_model_len), bytes a token, the
        longest context one sequence can have in this engine's blocks and how many sequences of `context`
        tokens they hold at once (`CacheReport`)."""
        context = self.config.max_model_len if context is None else context
        check_limit("context", context, 1)
        return self.cache_budget.report(context)

    # ---- requests ---------------------------------------------------------------

    @property
    def requests_started(self) -> int:
        """Requests this engine has accepted so far: the next one's request id (ids count up from 0
        in call order, a bad request taking none)."""
        return self._next_id

    @property
    def limits(self) -> Limits:
        c = self.config
        return Limits(self.model.config.vocab_size, tuple(self.model.config.eos_token_ids), c.max_model_len,
                      c.block_size, self.scheduler.allocator.num_usable_blocks, self.model.tokenizer,
                      speculative_tokens=c.speculative_tokens, chat_template=self.model.chat_template,
                      max_sequence_tokens=self.scheduler.blocks.num_usable_tokens())

    # ---- generation ---------------------------------------------------------------

    def generate(
        self, prompts: Prompt | Sequence[Prompt], params: ParamsLike | Sequence[ParamsLike] = None
    ) -> list[Completion]:
        """One completion per prompt and choice (`SamplingParams.n`, 1 by default), in order of prompt,
        then choice. A bad request's completion has `error` set.

        Raises RequestError (index None) only if the call itself is malformed; see `mla_func.serving.requests`.
        """
        completions = [e.completion for e in self.generate_stream(prompts, params) if e.completion is not None]
        return sorted(completions, key=lambda c: (c.index, c.choice))

    def generate_stream(
        self, prompts: Prompt | Sequence[Prompt], params: ParamsLike | Sequence[ParamsLike] = None
    ) -> Iterator[StreamEvent]:
        """Yield each sampled token as soon as its step ends; a request's last event carries its completion.

        Bad requests come first, as events with token_id -1 and a completion whose
        `error` is set. Closing the stream at any point aborts what is left and
        frees every block it held. A request with `SamplingParams.stop` strings finishes
        at the token whose text completes one (its blocks freed at once); its events carry
        the text released so far (`StreamEvent.text`), never any past a stop string.
        The offline form of the online API below: every request added, then `iterate` until none is left.
        """
        calls = split_call(prompts, params)
        if self.scheduler.has_unfinished():
            raise RuntimeError("generate: the engine is already generating (one generate at a time)")
        limits = self.limits
        checked: list[CheckedRequest] = []
        errors: list[tuple[int, RequestError]] = []
        for index, (prompt, p) in enumerate(calls):
            try:
                checked.append(check_request(index, prompt, p, limits))
            except RequestError as error:
                errors.append((index, error))
        ids: list[int] = []
        self._offline = True
        try:
            for c in checked:
                ids.extend(self._queue(c, stream_text=False))
            for index, failure in errors:
                yield StreamEvent(index, -1, Completion(index, (), (), "error", error=failure))
            while self.scheduler.has_unfinished():
                yield from self.iterate()
        finally:
            # An abandoned stream or an error must not leave requests holding blocks.
            self._offline = False
            for request_id in ids:
                self.abort(request_id)

    # ---- the online API: requests added and aborted between iterations ------------------

    def add_request(self, prompt: Prompt, params: ParamsLike = None, *, index: int | None = None,
                    stream_text: bool = False) -> tuple[int, ...]:
        """Check one request and queue it; returns the request ids of its `SamplingParams.n` choices.

        prompt, params: as one prompt of `generate` (text, token ids or a chat; SamplingParams, a
            mapping of its fields or None).
        index: what its events and completions carry as `index` (default: its first request id).
        stream_text: its events carry the text each token releases (`StreamEvent.text`), as a request
            with stop strings' do, when the model has a tokenizer.
        Raises RequestError naming the bad field (nothing is queued then), or RuntimeError while
        `generate_stream` runs. The requests run in the next `iterate` calls, with whatever else is queued.
        """
        if self._offline:
            raise RuntimeError("add_request: generate_stream is running on this engine (use one or the other)")
        index = self._next_id if index is None else index
        return self._queue(check_request(index, prompt, params, self.limits), stream_text=stream_text)

    def abort(self, request_id: Hashable) -> bool:
        """Finish a queued or running request now, freeing its blocks at once; its events stop (no completion
        event follows). False when the request is not unfinished (it finished, or was never queued)."""
        if self._live.pop(request_id, None) is None:
            return False
        self.scheduler.finish(request_id)
        if (spec := self._speculative) is not None:
            spec.forget(request_id)
        return True

    def has_unfinished(self) -> bool:
        """Whether any request is queued or running (then `iterate` has work)."""
        return self.scheduler.has_unfinished()

    @property
    def num_running(self) -> int:
        """Requests holding cache blocks (being prefilled or decoded)."""
        return self.scheduler.num_running

    @property
    def num_waiting(self) -> int:
        """Requests queued and holding no blocks (new, or preempted to be recomputed)."""
        return self.scheduler.num_waiting

    @property
    def num_blocks_in_use(self) -> int:
        """Cache blocks of group 0 held by requests (cached blocks no request holds count as free)."""
        allocator = self.scheduler.allocator
        return allocator.num_usable_blocks - allocator.num_free_blocks

    def iterate(self) -> list[StreamEvent]:
        """One iteration: schedule, run the step, sample, update; the events of the tokens it sampled.

        Each event carries its request id; a request's last event carries its completion. Returns []
        when nothing is queued. An error or an interrupt inside the iteration reaches the caller with
        the scheduler as it was before it (its requests are scheduled again unless the caller aborts
        them, as `generate_stream` does). Under data-parallel attention every rank's events.
        """
        scheduler = self.scheduler
        if isinstance(scheduler, RankSchedulers):
            return self._iterate(scheduler, self._draw_ranks)
        return self._iterate(scheduler, self._draw_step)

    def _iterate(self, scheduler: StepScheduler[_Step],
                 draw: Callable[[_Step, dict[Hashable, LiveRequest]], list[Drawn]]) -> list[StreamEvent]:
        """`iterate` over `scheduler`'s steps, whose rows' tokens `draw` gives."""
        scheduled = scheduler.schedule()
        if scheduled is None:
            return []
        live = self._live
        try:
            with self._inference():
                sampled = draw(scheduled, live)
        except BaseException:
            scheduler.cancel(scheduled)
            raise
        # Finished requests leave `live` before any event is built: one that ended is never aborted.
        finished = {f.request_id: (f, live.pop(f.request_id)) for f in scheduler.update(scheduled, sampled)}
        if (spec := self._speculative) is not None:
            spec.forget(*finished)
        events: list[StreamEvent] = []
        for request_id, tokens in zip(scheduled.request_ids, sampled):
            if tokens is None:
                continue
            ended = finished.get(request_id)
            if ended is None and type(tokens) is int:
                entry = live[request_id]
                if entry.stop_text is None and entry.logprobs is None:
                    # The common case, once a row every step: one token of a request that goes on.
                    entry.output_token_ids.append(tokens)
                    events.append(StreamEvent(entry.request.index, tokens, None, None, entry.request_id, entry.choice))
                    continue
            done, entry = ended if ended is not None else (None, live[request_id])
            output = entry.output_token_ids
            # A verify row gives several tokens; the scheduler keeps them up to a stop or the length.
            kept = done.output_token_ids[len(output):] if done else ((tokens,) if isinstance(tokens, int) else tokens)
            for j, token in enumerate(kept):
                output.append(token)
                last = done is not None and j == len(kept) - 1
                logprob = None if entry.logprobs is None else entry.logprobs[len(output) - 1]
                if (stop_text := entry.stop_text) is None:
                    events.append(self._event(entry, token, self._completion(entry, done) if last else None,
                                              None, logprob))
                    continue
                text = stop_text.push(self.model.tokenizer, token)
                if stop_text.stopped:
                    # Finished here, whatever the scheduler decided: its later tokens (a verify
                    # row's) are dropped, and a request it still holds gives back its blocks now.
                    if done is None:
                        self.abort(request_id)
                    events.append(self._event(entry, token, self._completion(entry, None), text, logprob))
                    break
                if last:
                    text += stop_text.flush()
                events.append(self._event(entry, token, self._completion(entry, done) if last else None,
                                          text, logprob))
        return events

    def _queue(self, checked: CheckedRequest, *, stream_text: bool) -> tuple[int, ...]:
        """Queue a checked request's choices; returns their request ids."""
        params, ids = checked.params, []
        text = bool(params.stop) or (stream_text and self.model.tokenizer is not None)
        prompt_logprobs = None
        if params.prompt_logprobs is not None:
            try:
                prompt_logprobs = self._prompt_logprobs(checked.prompt_token_ids, params.prompt_logprobs)
            except RequestError as error:  # no room in the cache for the scoring pass: refused, not queued
                raise RequestError(checked.index, f"SamplingParams.prompt_logprobs: {error.reason}") from None
        for choice in range(params.n):
            request_id = self._next_id
            self._next_id += 1
            self.scheduler.add(Request(request_id, checked.prompt_token_ids, params.max_tokens, checked.stop_token_ids))
            self._live[request_id] = LiveRequest(
                checked, choice_seed(params, choice, self._rng), request_id=request_id, choice=choice,
                stop_text=StopText(params.stop) if text else None, logprobs=None if params.logprobs is None else [],
                prompt_logprobs=prompt_logprobs)
            ids.append(request_id)
        return tuple(ids)

    def _prompt_logprobs(self, token_ids: tuple[int, ...], top: int) -> tuple[TokenLogprob | None, ...]:
        """Each prompt token's logprob given those before it, with the `top` likeliest alternatives (None for
        the first token): float32 log-softmax of `score`'s logits, reaching the host in one transfer."""
        logprobs = torch.log_softmax(self.score(token_ids)[:-1].float(), dim=-1)  # [T - 1, V]: row p scores p + 1
        following = torch.tensor(token_ids[1:], device=logprobs.device)
        own = logprobs.gather(1, following[:, None])  # [T - 1, 1]
        best, best_ids = logprobs.topk(top, dim=-1)  # [T - 1, top]
        values = torch.cat([own, best], dim=1).cpu().tolist()
        ids = best_ids.cpu().tolist()
        return (None, *(TokenLogprob(row[0], dict(zip(row_ids, row[1:]))) for row, row_ids in zip(values, ids)))

    @staticmethod
    def _event(entry: LiveRequest, token: int, completion: Completion | None, text: str | None,
               logprob: TokenLogprob | None) -> StreamEvent:
        return StreamEvent(entry.request.index, token, completion, text, request_id=entry.request_id,
                           choice=entry.choice, logprob=logprob)

    def _inference(self) -> torch.inference_mode:
        # Nothing here is differentiated: eager steps skip autograd's per-op bookkeeping; graphs keep theirs.
        return torch.inference_mode(not self.step.graphs)

    def _target_step(self, plan: StepPlan, every_rank: tuple[StepPlan, ...] | None = None) -> StepOutput:
        """Run `plan` on the engine's state: the one place that state is donated.

        every_rank: under data-parallel attention, every rank's plan of the step (`plan` is this rank's,
        empty when it is idle); by default every rank runs `plan` (a prompt scored on every rank).

        The step donates `self.state` and returns a new live state over the same buffers; it is
        stored here as the step returns, before anything after it (drawing, the drafter's catch-up, a
        host sync, an interrupt) can raise, so no fault leaves the engine holding a donated state. A
        step marks its state donated only once it has run, so one that raises part-way leaves it live;
        the cache entries it wrote lie past what the scheduler counts, and later steps overwrite them.
        """
        if self._ranks is None:
            batch, mode = self.step.prepare(self.state, plan)
        else:
            plans = every_rank if every_rank is not None else (plan,) * self._ranks.size
            batch, mode = prepare_rank_step(self.step, self.state, plans, self._ranks.rank)
        self.state, out = self.step(self.state, batch, mode)
        return out

    def _draw_step(self, scheduled: ScheduledStep, live: dict[Hashable, LiveRequest]) -> list[Drawn]:
        """Run one scheduled step, with drafts when speculative; returns a token (or tokens, or None) per row.
        `live` holds the record of every request the step has a row of."""
        spec = self._speculative
        if spec is None:
            return self._run(scheduled, live)
        verify = spec.draft(scheduled, live)
        return spec.accept(verify, self._target_step(verify.plan), live)

    def _draw_ranks(self, scheduled: RanksStep, live: dict[Hashable, LiveRequest]) -> list[Drawn]:
        """Run this rank's step of a data-parallel one (an idle step when it has none), draw its own rows'
        tokens and gather every rank's; returns a token (or None) per row of every rank. When a request of
        any rank's rows asks for logprobs (known alike on every rank: every rank queued every request), each
        row's logprobs travel with its token, and every rank records every row's. With drafts, every rank
        runs the iteration's drafter steps and its verify step alike (`SpeculativeDecoder.draft`), and each
        verify row's tokens travel together (a tuple a row)."""
        ranks, own = self._ranks, scheduled.own
        if ranks is None:
            raise ValueError("Engine: a step of every rank, but the model is not loaded with data-parallel attention")
        if (spec := self._speculative) is not None:
            verify = spec.draft(scheduled, live)
            drawn = spec.accept(verify, self._target_step(verify.plan, every_rank=verify.every_rank), live)
            return [*scheduled.every_verify_token(drawn, ranks, self.model.device)]
        out = self._target_step(StepPlan() if own is None else own.plan, every_rank=scheduled.plans)
        entries = [live[rid] for row, rid in zip(scheduled.rows, scheduled.request_ids) if row.num_logits]
        top = _most_logprobs(entries)
        if top is None:
            drawn = [] if own is None else self._draw(own, out, live)
            tokens: list[Drawn] = [*scheduled.every_token(drawn, ranks, self.model.device)]
            return tokens
        drawing = None if own is None else self._draw_rows(own, live)
        mine = (torch.zeros((0, 2 + 2 * top), dtype=torch.int64, device=self.model.device) if drawing is None
                else self._packed_draw(out.logits, drawing[1], top))
        return _spread(_record_logprobs(scheduled.every_logits_row(mine, ranks), entries, top), scheduled.rows)

    def _run(self, scheduled: ScheduledStep, live: dict[Hashable, LiveRequest]) -> list[Drawn]:
        """Run one scheduled step and draw its logits rows' tokens; returns a token (or None) per row."""
        return self._draw(scheduled, self._target_step(scheduled.plan), live)

    @staticmethod
    def _draw_rows(scheduled: ScheduledStep,
                   live: dict[Hashable, LiveRequest]) -> tuple[list[LiveRequest], DrawRows] | None:
        """The records of the logits rows of `scheduled` and what drawing them reads; None without any."""
        rows, request_ids = scheduled.rows, scheduled.request_ids
        drawn_rows = [i for i, row in enumerate(rows) if row.num_logits]
        if not drawn_rows:
            return None
        entries = [live[request_ids[i]] for i in drawn_rows]
        return entries, DrawRows.of(entries, [rows[i].seq_len for i in drawn_rows])

    def _draw(self, scheduled: ScheduledStep, out: StepOutput, live: dict[Hashable, LiveRequest]) -> list[Drawn]:
        """The tokens of the logits rows of `scheduled`, whose step gave `out`: a token (or None) per row."""
        drawing = self._draw_rows(scheduled, live)
        if drawing is None:
            return [None] * len(scheduled.rows)
        entries, draws = drawing
        top = None if draws.plain else _most_logprobs(entries)
        if top is None:
            drawn = draw_tokens(out.logits, draws, penalties=True, ops=self._ops).tolist()
        else:
            drawn = _record_logprobs(self._packed_draw(out.logits, draws, top).cpu(), entries, top)
        return _spread(drawn, scheduled.rows)

    def _packed_draw(self, logits: torch.Tensor, draws: DrawRows, top: int) -> torch.Tensor:
        """[M, 1 + top + 1 + top] int64 on the device: each row's token, its `top` likeliest ids, then the
        token's logprob and theirs, the float32 logprobs bit-cast to int64, so all of them reach the host
        (or the other ranks) in one transfer."""
        tokens, logprobs, top_ids = draw_tokens_with_logprobs(logits, draws, penalties=True, ops=self._ops, top=top)
        return torch.cat([tokens[:, None], top_ids, logprobs.view(torch.int32).long()], dim=1)

    def _completion(self, entry: LiveRequest, finished: FinishedRequest | None) -> Completion:
        """The completion of a finished request; `finished` None for one whose text reached a stop string
        (its tokens up to the one that completed it). A request with stop strings has the text it
        streamed (up to the stop string), so its events' texts join to the completion's."""
        request, tokenizer = entry.request, self.model.tokenizer
        if finished is None:
            token_ids, reason = tuple(entry.output_token_ids), FinishReason.STOP
        else:
            token_ids, reason = finished.output_token_ids, finished.finish_reason
        text = (entry.stop_text.text if entry.stop_text is not None
                else tokenizer.decode(list(token_ids)) if tokenizer is not None else None)
        logprobs = None if entry.logprobs is None else tuple(entry.logprobs[:len(token_ids)])
        return Completion(request.index, request.prompt_token_ids, token_ids, reason.value, text=text,
                          logprobs=logprobs, choice=entry.choice, prompt_logprobs=entry.prompt_logprobs)

    # ---- scoring ---------------------------------------------------------------------

    def score(self, token_ids: Prompt) -> torch.Tensor:
        """The [T, V] logits of every position of a prompt, through the prefill path.

        Runs in chunks of at most max_num_batched_tokens tokens, in blocks borrowed
        from the cache and returned afterwards. Bad input raises RequestError
        (checked as a generate prompt is, up to max_model_len tokens).
        """
        ids = check_score_ids(token_ids, self.limits)
        c, blocks, tables = self.config, self.scheduler.blocks, self.scheduler.blocks.empty_tables()  # all groups'
        try:
            rows = []
            for start in range(0, len(ids), c.max_num_batched_tokens):
                chunk = ids[start : start + c.max_num_batched_tokens]
                # Each chunk's blocks as it comes, and those behind a group's lookback freed after it (a bounded
                # group 0 holds a window, not the prompt).
                try:
                    blocks.allocate(tables, blocks.blocks_needed(tables, start + len(chunk)))
                except OutOfBlocks as e:
                    raise RequestError(None, f"score: the prompt of {len(ids)} tokens does not fit the free cache "
                                             f"blocks ({e})") from None
                seq_tables = [tuple(t) for t in tables]
                plan = StepPlan(prefill=(SeqPlan(chunk, start, seq_tables[0], len(chunk), tuple(seq_tables[1:])),))
                with self._inference():
                    out = self._target_step(plan)
                rows.append(out.logits)
                blocks.free_behind(tables, start + len(chunk))
            return torch.cat(rows)
        finally:
            blocks.free(tables)
