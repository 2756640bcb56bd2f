"""The server's Prometheus metrics: the engine's load after each iteration, and each request's latencies.

Everything here is written from the engine's passes (`record`), by the thread that receives them as
they end: the engine's own thread (`EngineLoop`), or the server's reader of the engine's process
(`EngineProcess`), which gets each pass's requests, tokens and load in one message. It is read by the
HTTP side when /metrics is scraped; prometheus_client's values are thread-safe. The registry is the
server's own, not the library's global one, so that two servers in one process (tests) never share a
count.
"""

from __future__ import annotations

import collections
from dataclasses import dataclass
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from mla_func.server.engine_driver import Pass
from mla_func.serving.requests import StreamEvent

# Latency buckets in seconds: a token every few ms on a GPU, every few hundred on a busy CPU.
_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28, 2.56, 5.12, 10.24, 20.48)
_RATE_WINDOW_S = 10.0  # tokens/s is the rate over this many seconds


@dataclass(slots=True)
class _Timing:
    """One request's clock, in `time.monotonic()` seconds: when it arrived and when its last token came."""

    arrived: float
    last_token: float | None = None


class ServerMetrics:
    """Gauges of the engine's load, counters of tokens and requests, histograms of latencies."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.running = Gauge("mla_func_requests_running", "Requests holding KV blocks", registry=r)
        self.waiting = Gauge("mla_func_requests_waiting", "Requests queued for their first step", registry=r)
        self.blocks_in_use = Gauge("mla_func_kv_blocks_in_use", "KV cache blocks held by requests", registry=r)
        self.blocks_total = Gauge("mla_func_kv_blocks_total", "KV cache blocks requests can hold", registry=r)
        self.tokens_per_s = Gauge("mla_func_generation_tokens_per_second",
                                  f"Generated tokens per second over the last {_RATE_WINDOW_S:.0f} s", registry=r)
        self.generated = Counter("mla_func_generation_tokens", "Generated tokens", registry=r)
        self.prompt_tokens = Counter("mla_func_prompt_tokens", "Prompt tokens of finished requests", registry=r)
        self.finished = Counter("mla_func_requests_finished", "Requests finished, by reason", ["reason"], registry=r)
        self.ttft = Histogram("mla_func_time_to_first_token_seconds", "From arrival to the first token",
                              buckets=_LATENCY_BUCKETS, registry=r)
        self.itl = Histogram("mla_func_inter_token_latency_seconds", "Between consecutive tokens of a request",
                             buckets=_LATENCY_BUCKETS, registry=r)
        self.e2e = Histogram("mla_func_request_latency_seconds", "From arrival to the last token",
                             buckets=_LATENCY_BUCKETS, registry=r)
        self._timings: dict[int, _Timing] = {}
        self._recent: collections.deque[tuple[float, int]] = collections.deque()  # (time, tokens) per iteration

    def render(self) -> bytes:
        """The metrics in Prometheus' text format."""
        return generate_latest(self.registry)

    # ---- written by the thread that receives the engine's passes -------------------------

    def record(self, done: Pass[Any], now: float) -> None:
        """One pass of the engine's loop, received at `now` (time.monotonic()): its admissions, tokens,
        completions and aborts, and the engine's load after it."""
        for request_id, arrived in done.arrived:
            self.arrived(request_id, arrived)
        for _, item in done.items:
            if isinstance(item, StreamEvent):
                self.token(item.request_id, now)
                if (completion := item.completion) is not None:
                    self.finished_request(item.request_id, completion.finish_reason,
                                          len(completion.prompt_token_ids), now)
        for request_id, reason in done.ended:
            self.finished_request(request_id, reason, 0, now)
        load = done.load
        self.iteration(running=load.running, waiting=load.waiting, blocks_in_use=load.blocks_in_use,
                       blocks_total=load.blocks_total, tokens=done.tokens, now=now)

    def arrived(self, request_id: int, now: float) -> None:
        self._timings[request_id] = _Timing(now)

    def token(self, request_id: int, now: float) -> None:
        timing = self._timings.get(request_id)
        if timing is None:
            return
        if timing.last_token is None:
            self.ttft.observe(now - timing.arrived)
        else:
            self.itl.observe(now - timing.last_token)
        timing.last_token = now

    def finished_request(self, request_id: int, reason: str, prompt_tokens: int, now: float) -> None:
        timing = self._timings.pop(request_id, None)
        self.finished.labels(reason=reason).inc()
        self.prompt_tokens.inc(prompt_tokens)
        if timing is not None and reason != "abort":
            self.e2e.observe(now - timing.arrived)

    def iteration(self, *, running: int, waiting: int, blocks_in_use: int, blocks_total: int, tokens: int,
                  now: float) -> None:
        """The engine's load after an iteration (or a change of its requests) that sampled `tokens` tokens."""
        self.running.set(running)
        self.waiting.set(waiting)
        self.blocks_in_use.set(blocks_in_use)
        self.blocks_total.set(blocks_total)
        self.generated.inc(tokens)
        self._recent.append((now, tokens))
        while self._recent and self._recent[0][0] < now - _RATE_WINDOW_S:
            self._recent.popleft()
        # The first iteration of the window only opens it: its tokens were made before the span began.
        span = now - self._recent[0][0]
        tokens_in_span = sum(n for _, n in self._recent) - self._recent[0][1]
        self.tokens_per_s.set(tokens_in_span / span if span > 0 else 0.0)
