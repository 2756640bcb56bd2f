"""Offline throughput: many random requests through one engine, with a progress bar.

The bar counts output tokens. Its time-left estimate appears only once every
request has its first token: until then the steps are prefills, whose rate says
nothing about the decode steps that make up the rest of the run.
"""

from __future__ import annotations

import dataclasses
import random
import time
from collections.abc import Callable
from typing import Any

from tqdm.auto import tqdm

from mla_func.core.model import Model
from mla_func.serving.engine import Engine
from mla_func.serving.sampling import SamplingParams
from mla_func.serving.speculative import SpeculativeStats


_NO_ETA = "{desc}: {percentage:3.0f}%|{bar}| {n_fmt}/{total_fmt} [{elapsed}]"


class _PhaseBar:
    """A prefill bar over requests with a first token (no time-left estimate: the
    prefill's rate says nothing of the decode's), then a decode bar over output tokens.

    It is fed whole steps, so the rate it shows is tokens per step time, not the
    rate of one token of a batch.
    """

    def __init__(self, num_requests: int, num_tokens: int, *, enabled: bool) -> None:
        self.num_requests, self.num_tokens, self.enabled = num_requests, num_tokens, enabled
        self.started: set[int] = set()
        self.tokens = 0
        self.bar = tqdm(total=num_requests, desc="prefill", unit="req", disable=not enabled, bar_format=_NO_ETA)
        self.decoding = False

    def step(self, indices: set[int]) -> None:
        self.tokens += len(indices)
        if self.decoding:
            self.bar.update(len(indices))
            return
        self.started |= indices
        self.bar.update(len(self.started) - self.bar.n)
        if len(self.started) == self.num_requests and self.tokens < self.num_tokens:
            self.bar.close()
            self.bar = tqdm(total=self.num_tokens, initial=self.tokens, desc="decode", unit="tok",
                            disable=not self.enabled)
            self.decoding = True

    def close(self) -> None:
        self.bar.close()


def random_requests(vocab_size: int, num_prompts: int, input_len: tuple[int, int], seed: int) -> list[list[int]]:
    """`num_prompts` prompts of uniform random lengths in [input_len[0], input_len[1]] and random tokens."""
    rng = random.Random(seed)
    return [[rng.randrange(vocab_size) for _ in range(rng.randint(*input_len))] for _ in range(num_prompts)]


def run_throughput(
    model: Model,
    *,
    num_prompts: int,
    input_len: tuple[int, int],
    output_len: int,
    backend: str | None = None,
    graphs: bool = True,
    max_num_seqs: int = 256,
    max_num_batched_tokens: int = 8192,
    block_size: int = 16,
    seed: int = 0,
    warmup: bool = True,
    progress: bool = True,
    say: Callable[[str], None] = lambda message: None,
    batch_invariant: bool = False,
    speculative_tokens: int = 0,
    kv_cache_dtype: str = "auto",
    w8a8: bool = False,
) -> dict[str, Any]:
    """Generate `output_len` tokens (greedy, no early stop) for each random prompt; time the whole run.

    Returns counts, seconds, output tokens/s and total (prompt + output) tokens/s, and the engine's cache
    (`Engine.cache_report` at the longest request's context): cache_bytes_per_token at cache_context tokens,
    cache_longest_context (the most tokens one sequence can have in its blocks), cache_sequences (sequences
    of cache_context tokens its blocks hold at once) and cache_bytes (every block).
    `say` receives a line at each phase (warm-up, measuring); `progress` shows the bar;
    `batch_invariant`, `speculative_tokens`, `kv_cache_dtype` and `w8a8` are the engine's (off by default, as the
    engine's; drafts need the model's MTP layer); with drafts the result has the measured acceptance rate.
    The warm-up captures every decode graph (with drafts, the verify and drafter graphs of
    every length), then a short run on other random prompts of the measured prompts'
    lengths compiles kernels, so timing excludes both; its prompts share no prefix with
    the measured ones, so no measured prefill is skipped by the prefix cache.
    """
    # Checked first: a request too long for the model would be refused only after the warm-up.
    longest = input_len[1] + output_len
    if longest > model.config.max_position_embeddings:
        raise ValueError(f"run_throughput: input_len up to {input_len[1]} + output_len {output_len} = {longest} "
                         f"tokens, over the model's max_position_embeddings {model.config.max_position_embeddings}")
    prompts = random_requests(model.config.vocab_size, num_prompts, input_len, seed)
    params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)
    engine = Engine(model, backend=backend, graphs=graphs, max_num_seqs=max_num_seqs,
                    max_num_batched_tokens=max_num_batched_tokens, block_size=block_size,
                    batch_invariant=batch_invariant, speculative_tokens=speculative_tokens,
                    max_model_len=min(model.config.max_position_embeddings, longest + block_size),
                    kv_cache_dtype=kv_cache_dtype, w8a8=w8a8)
    # The cache at the longest request's context: bytes a token, and what the engine's blocks hold.
    cache = engine.cache_report(longest)
    if warmup:
        graphs_to_capture = sum(m.use_graph for m in engine.step.decode_graph_modes())
        if graphs_to_capture:
            say(f"capturing {graphs_to_capture} decode graphs")
            engine.warmup(progress=progress)
        # The measured prompts' own lengths (kernels specialise on some of them), other tokens; enough
        # output tokens to pass every verify length k+1 .. 1 when drafting.
        rng = random.Random(seed + 1)
        others = [[rng.randrange(model.config.vocab_size) for _ in p] for p in prompts[:max_num_seqs]]
        say(f"warming up on {len(others)} other random prompts")
        warm_tokens = min(output_len, 4 + 2 * speculative_tokens)
        engine.generate(others, SamplingParams(temperature=0.0, max_tokens=warm_tokens, ignore_eos=True))
    say(f"measuring {num_prompts} requests x {output_len} output tokens")
    drafts_before = dataclasses.replace(engine.speculative_stats)
    started = time.perf_counter()
    outputs = 0
    bar = _PhaseBar(num_prompts, num_prompts * output_len, enabled=progress)
    step_indices: set[int] = set()
    latency = TokenLatency(started)
    try:
        for event in engine.generate_stream(prompts, params):
            if event.completion is not None and event.completion.error is not None:
                raise event.completion.error
            latency.token(event.index, time.perf_counter())
            outputs += 1
            # A step samples at most one token per request, so a repeated index starts the next step.
            if event.index in step_indices:
                bar.step(step_indices)
                step_indices = set()
            step_indices.add(event.index)
        bar.step(step_indices)
    finally:
        bar.close()
    seconds = time.perf_counter() - started
    prompt_tokens = sum(len(p) for p in prompts)
    return dict(
        num_prompts=num_prompts, prompt_tokens=prompt_tokens, output_tokens=outputs, seconds=seconds,
        output_tok_s=outputs / seconds, total_tok_s=(outputs + prompt_tokens) / seconds,
        max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
        speculative_tokens=speculative_tokens, acceptance_rate=SpeculativeStats(
            engine.speculative_stats.drafted - drafts_before.drafted,
            engine.speculative_stats.accepted - drafts_before.accepted).acceptance_rate,
        cache_context=cache.context, cache_bytes_per_token=cache.bytes_per_token,
        cache_longest_context=cache.longest_context, cache_sequences=cache.sequences,
        cache_bytes=cache.total_bytes,
        **latency.percentiles(),
    )


def percentile(values: list[float], q: float) -> float:
    """The q-th percentile (0..100) of `values`, linearly interpolated; nan for none."""
    if not values:
        return float("nan")
    ordered = sorted(values)
    at = (len(ordered) - 1) * q / 100
    low = int(at)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (at - low)


class TokenLatency:
    """Each request's time to first token (from `started`, when every request was submitted) and the times
    between its consecutive tokens. A step's tokens reach the host together, so these are step times as
    a client of the engine sees them."""

    def __init__(self, started: float):
        self.started = started
        self.ttft: list[float] = []
        self.itl: list[float] = []
        self._last: dict[int, float] = {}

    def token(self, key: int, now: float) -> None:
        last = self._last.get(key)
        if last is None:
            self.ttft.append(now - self.started)
        else:
            self.itl.append(now - last)
        self._last[key] = now

    def percentiles(self) -> dict[str, float]:
        """ttft_ms_p50 .. itl_ms_p99: milliseconds at the 50th, 90th and 99th percentiles."""
        return {f"{name}_ms_p{q}": 1e3 * percentile(values, q)
                for name, values in (("ttft", self.ttft), ("itl", self.itl)) for q in (50, 90, 99)}
