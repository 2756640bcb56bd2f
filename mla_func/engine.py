"""Engine: continuous batching of generation requests over the memoized step.

The engine owns the KV state, the scheduler and the step. Each iteration asks
the scheduler for a plan, runs it through `make_step`, samples the rows that
produce logits on the device with each request's own key (seed, position), and
feeds the tokens back. A request with bad input fails alone: its completion
carries the error, and every other request of the batch runs to its end.
"""

from __future__ import annotations

import os
import random
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from .checkpoint import Model
from .kernels import default_backend
from .plan import SeqPlan, StepPlan
from .sampling import SamplingParams, request_seed, sample
from .scheduler import FinishedRequest, Request, ScheduledStep, Scheduler, SchedulerConfig
from .state.block_allocator import OutOfBlocks
from .step import make_step
from .stepping import init_state

Prompt = str | Sequence[int]


class RequestError(ValueError):
    """One request of a batch is invalid; the message names it. The others still run."""

    def __init__(self, index: int, message: str):
        super().__init__(f"request {index}: {message}")
        self.index = index


@dataclass(frozen=True, slots=True)
class Completion:
    """The result of one prompt.

    finish_reason: "stop" (a stop or end-of-sequence token), "length" (max_tokens
    or the model's maximum length), "abort", or "error" (then `error` says why and
    token_ids is empty).
    """

    index: int
    prompt_token_ids: tuple[int, ...]
    token_ids: tuple[int, ...]
    finish_reason: str
    text: str | None = None
    error: RequestError | None = None

    def raise_for_error(self) -> Completion:
        if self.error is not None:
            raise self.error
        return self


@dataclass(frozen=True, slots=True)
class StreamEvent:
    """One sampled token of one request; `completion` is set on its last event."""

    index: int
    token_id: int
    completion: Completion | None = None


@dataclass(frozen=True, slots=True)
class EngineConfig:
    """The engine's limits; every field has a documented default (see `Engine`)."""

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


def _default_num_blocks(model: Model, block_size: int, max_num_seqs: int, max_model_len: int) -> int:
    bytes_per_block = model.config.num_hidden_layers * block_size * model.config.kv_cache_dim * model.dtype.itemsize
    wanted = 1 + max_num_seqs * -(-max_model_len // block_size)
    if model.device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(model.device)
        # Leave room for activations, graph pools and the sampler's [N, V] buffers.
        budget = int(free * 0.85) - (2 << 30)
    else:
        budget = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // 8
    return max(2, min(wanted, budget // bytes_per_block))


class Engine:
    """Scheduler + sampler + state around one model.

    Defaults: block_size 16; num_blocks from free memory (85% of free GPU memory
    less 2 GiB on CUDA, an eighth of RAM on CPU), at most what max_num_seqs
    full-length sequences need; max_num_seqs 64; max_num_batched_tokens 2048;
    long_prefill_token_threshold 512; mixed batches and prefix caching on;
    max_model_len the model's maximum; backend "triton" on CUDA, "torch"
    elsewhere; CUDA graphs on where CUDA is, for decode steps only
    (`graph_kinds`): decode steps are launch-bound and few shapes recur, while
    prefill and mixed steps are compute-bound and would each need a graph for
    every combination of padded sizes they meet.
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
    ):
        max_model_len = max_model_len or model.max_positions
        if max_model_len > model.config.max_position_embeddings:
            raise ValueError(
                f"max_model_len {max_model_len} exceeds the model's max_position_embeddings "
                f"{model.config.max_position_embeddings}"
            )
        if max_model_len > model.max_positions:  # RoPE tables are built as long as the engine needs
            model = model.with_max_positions(max_model_len)
        self.model = model
        self.config = EngineConfig(
            block_size=block_size,
            num_blocks=num_blocks or _default_num_blocks(model, block_size, max_num_seqs, max_model_len),
            max_num_seqs=max_num_seqs,
            max_num_batched_tokens=max_num_batched_tokens,
            long_prefill_token_threshold=long_prefill_token_threshold,
            enable_mixed=enable_mixed,
            enable_prefix_caching=enable_prefix_caching,
            max_model_len=max_model_len,
            backend=backend or default_backend(model.device),
            graphs=graphs,
            graph_kinds=tuple(graph_kinds),
        )
        c = self.config
        self.scheduler = Scheduler(SchedulerConfig(
            max_num_seqs=c.max_num_seqs,
            max_num_batched_tokens=c.max_num_batched_tokens,
            block_size=c.block_size,
            num_blocks=c.num_blocks,
            max_model_len=c.max_model_len,
            long_prefill_token_threshold=c.long_prefill_token_threshold,
            enable_mixed=c.enable_mixed,
            enable_prefix_caching=c.enable_prefix_caching,
        ))
        self.step = make_step(
            model, backend=c.backend, graphs=c.graphs, graph_kinds=c.graph_kinds, max_num_seqs=c.max_num_seqs,
            max_num_batched_tokens=c.max_num_batched_tokens, max_model_len=c.max_model_len, block_size=c.block_size,
        )
        self.state = init_state(model.config, num_blocks=c.num_blocks, block_size=c.block_size,
                                dtype=model.dtype, device=model.device)
        self._rng = random.Random(seed)
        self._next_id = 0

    def warmup(self, *, progress: bool = True) -> int:
        """Capture every decode graph the step's ladders allow, now rather than on first use.

        One graph per (decode batch rung, block-table width rung); with the default
        ladders and a table of at most 65536 entries, one per batch rung. Without
        graphs (or off CUDA) it does nothing. Returns how many graphs were captured.
        """
        before = len(self.step.captured_keys)
        self.step.warmup(self.state, self.step.decode_graph_modes(), progress=progress)
        return len(self.step.captured_keys) - before

    # ---- requests ---------------------------------------------------------------

    def _tokenize(self, index: int, prompt: Prompt) -> tuple[int, ...]:
        if isinstance(prompt, str):
            if self.model.tokenizer is None:
                raise RequestError(index, "the prompt is text but the model has no tokenizer.json; pass token ids")
            return tuple(self.model.tokenizer.encode(prompt).ids)
        try:
            ids = tuple(int(t) for t in prompt)
        except (TypeError, ValueError):
            raise RequestError(index, f"a prompt must be a string or a sequence of token ids, got {type(prompt).__name__}") from None
        return ids

    def _make_request(self, index: int, prompt: Prompt, params: SamplingParams | Mapping[str, Any]) -> Request:
        """Validate one prompt and its parameters into a scheduler request (RequestError if bad)."""
        if isinstance(params, Mapping):
            try:
                params = SamplingParams(**params)
            except (TypeError, ValueError) as e:
                raise RequestError(index, str(e)) from None
        ids = self._tokenize(index, prompt)
        vocab = self.model.config.vocab_size
        if not ids:
            raise RequestError(index, "the prompt is empty")
        bad = [t for t in ids if not 0 <= t < vocab]
        if bad:
            raise RequestError(index, f"token ids must be in [0, {vocab}), got {bad[:8]}")
        if len(ids) >= self.config.max_model_len:
            raise RequestError(
                index, f"the prompt has {len(ids)} tokens; the maximum length is {self.config.max_model_len} "
                "(prompt plus at least one generated token)"
            )
        stop = params.stop_token_ids
        if not params.ignore_eos:
            stop = stop + self._eos_ids()
        request = Request(
            request_id=self._next_id, prompt_token_ids=ids, max_tokens=params.max_tokens, stop_token_ids=stop,
            sampling_params=(params, request_seed(params, self._rng), index),
        )
        try:
            self.scheduler.add(request)
        except ValueError as e:
            raise RequestError(index, str(e)) from None
        self._next_id += 1
        return request

    def _eos_ids(self) -> tuple[int, ...]:
        return tuple(self.model.config.eos_token_ids)

    # ---- generation ---------------------------------------------------------------

    def generate(
        self,
        prompts: Sequence[Prompt],
        params: SamplingParams | Mapping[str, Any] | Sequence[SamplingParams | Mapping[str, Any]] | None = None,
    ) -> list[Completion]:
        """One completion per prompt, in order. A bad request's completion has `error` set."""
        completions: dict[int, Completion] = {}
        for event in self.generate_stream(prompts, params):
            if event.completion is not None:
                completions[event.completion.index] = event.completion
        return [completions[i] for i in range(len(prompts))]

    def generate_stream(
        self,
        prompts: Sequence[Prompt],
        params: SamplingParams | Mapping[str, Any] | Sequence[SamplingParams | Mapping[str, Any]] | None = None,
    ) -> Iterator[StreamEvent]:
        """Yield each sampled token as soon as its step ends; a request's last event carries its completion.

        Bad requests come first, as events with token_id -1 and a completion whose `error` is set.
        """
        if isinstance(prompts, str):
            prompts = [prompts]
        if params is None or isinstance(params, (SamplingParams, Mapping)):
            params = [params or SamplingParams()] * len(prompts)
        if len(params) != len(prompts):
            raise ValueError(f"params: expected one per prompt ({len(prompts)}), got {len(params)}")
        if self.scheduler.has_unfinished():
            raise RuntimeError("generate: the engine is already generating (one generate at a time)")
        live: dict[int, Request] = {}
        for index, (prompt, p) in enumerate(zip(prompts, params)):
            try:
                request = self._make_request(index, prompt, p)
            except RequestError as error:
                yield StreamEvent(index, -1, Completion(index, (), (), "error", error=error))
                continue
            live[request.request_id] = request
        unfinished = set(live)
        try:
            while (scheduled := self.scheduler.schedule()) is not None:
                sampled = self._run(scheduled, live)
                finished = {f.request_id: f for f in self.scheduler.update(scheduled, sampled)}
                unfinished -= finished.keys()
                for request_id, token in zip(scheduled.request_ids, sampled):
                    if token is None:
                        continue
                    done = finished.get(request_id)
                    yield StreamEvent(live[request_id].sampling_params[2], token,
                                      self._completion(live[request_id], done) if done else None)
        finally:
            # An abandoned stream or an error must not leave requests holding blocks.
            for request_id in unfinished:
                self.scheduler.finish(request_id)

    def _run(self, scheduled: ScheduledStep, live: Mapping[int, Request]) -> list[int | None]:
        """Run one scheduled step and sample its logits rows; returns a token (or None) per row."""
        batch, mode = self.step.prepare(self.state, scheduled.plan)
        self.state, out = self.step(self.state, batch, mode)
        rows = scheduled.rows
        with_logits = [i for i, row in enumerate(rows) if row.num_logits]
        if not with_logits:
            return [None] * len(rows)
        settings = [live[scheduled.request_ids[i]].sampling_params for i in with_logits]
        if all(p.temperature == 0 for p, _, _ in settings):
            # Greedy rows need no noise: skip the [N, V] draw (a host-side fact, so no sync).
            tokens = out.logits.argmax(dim=-1).tolist()
        else:
            device = out.logits.device
            tokens = sample(
                out.logits,
                temperature=torch.tensor([p.temperature for p, _, _ in settings], device=device),
                top_k=torch.tensor([p.top_k for p, _, _ in settings], device=device),
                top_p=torch.tensor([p.top_p for p, _, _ in settings], device=device),
                seeds=torch.tensor([seed for _, seed, _ in settings], dtype=torch.int64, device=device),
                positions=torch.tensor([rows[i].seq_len for i in with_logits], dtype=torch.int64, device=device),
                use_top_k_top_p=any(p.top_k or p.top_p < 1 for p, _, _ in settings),
            ).tolist()
        sampled: list[int | None] = [None] * len(rows)
        for i, token in zip(with_logits, tokens):
            sampled[i] = token
        return sampled

    def _completion(self, request: Request, finished: FinishedRequest) -> Completion:
        params, _, index = request.sampling_params
        tokenizer = self.model.tokenizer
        text = tokenizer.decode(list(finished.output_token_ids)) if tokenizer is not None else None
        return Completion(index, finished.prompt_token_ids, finished.output_token_ids,
                          finished.finish_reason.value, text=text)

    # ---- scoring ---------------------------------------------------------------------

    def score(self, token_ids: Sequence[int]) -> torch.Tensor:
        """The [T, V] logits of every position of a prompt, through the prefill path.

        Runs in chunks of at most max_num_batched_tokens tokens, in blocks borrowed
        from the cache and returned afterwards.
        """
        ids = self._make_score_ids(token_ids)
        c = self.config
        try:
            blocks = tuple(self.scheduler.allocator.allocate(-(-len(ids) // c.block_size)))
        except OutOfBlocks as e:
            raise ValueError(f"score: the prompt of {len(ids)} tokens does not fit the free cache blocks ({e})") from None
        try:
            rows = []
            for start in range(0, len(ids), c.max_num_batched_tokens):
                chunk = ids[start : start + c.max_num_batched_tokens]
                plan = StepPlan(prefill=(SeqPlan(chunk, start, blocks, num_logits=len(chunk)),))
                batch, mode = self.step.prepare(self.state, plan)
                self.state, out = self.step(self.state, batch, mode)
                rows.append(out.logits)
            return torch.cat(rows)
        finally:
            self.scheduler.allocator.free(blocks)

    def _make_score_ids(self, token_ids: Sequence[int]) -> tuple[int, ...]:
        ids = tuple(int(t) for t in token_ids)
        vocab = self.model.config.vocab_size
        if not ids:
            raise ValueError("score: token_ids is empty")
        bad = [t for t in ids if not 0 <= t < vocab]
        if bad:
            raise ValueError(f"score: token ids must be in [0, {vocab}), got {bad[:8]}")
        if len(ids) > self.config.max_model_len:
            raise ValueError(f"score: {len(ids)} tokens exceed max_model_len {self.config.max_model_len}")
        return ids
