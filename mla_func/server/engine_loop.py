"""The HTTP side's handle on the engine (`EngineRunner`), and the engine on a thread of the server's process.

    HTTP handlers (asyncio)  --submit / abort-->  command queue  -->  engine thread
    engine thread: EngineDriver.run (apply commands; iterate; hand each pass over whole)

`EngineRunner` is what `app.build_app` needs of the engine, whichever way it runs: `EngineLoop` here,
on a daemon thread (for an `Engine` built in this process: the Python API, tests), or
`engine_process.EngineProcess`, in a process of its own (what `mla-func serve` runs). Each submitted
request names a sink, a callable its items go to (`engine_driver`: `Admitted` or the `RequestError`
that refused it, then its `StreamEvent`s, or a `Failure`). The items of each pass reach `deliver` as
one batch of (sink, item) pairs: the HTTP side passes one `loop.call_soon_threadsafe` per batch, which
fans the batch out on the event loop's thread, so an iteration of many rows costs one wake-up of the
event loop, not one per token.

On a thread the engine shares the GIL with the HTTP side: under load the event loop's per-token work
(JSON framing, h11, socket writes) delays the engine's next step, which is why `mla-func serve` runs
the engine in a process of its own.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

from mla_func.server.engine_driver import (Abort, Admitted, Command, EngineDriver, Failure, Item, Pass,
                                           ShutdownReport, Stop, Submit)
from mla_func.server.metrics import ServerMetrics
from mla_func.serving.engine import Engine
from mla_func.serving.requests import ParamsLike, Prompt, Tokenizer

__all__ = ["Admitted", "Batch", "Deliver", "EngineInfo", "EngineLoop", "EngineRunner", "Failure", "Item",
           "ShutdownReport", "Sink", "call_each"]

Sink = Callable[[Item], object]  # what it returns is ignored
Batch = list[tuple[Sink, Item]]  # one pass's items, in the order they were made
Deliver = Callable[[Batch], object]  # hands a batch to whoever calls its sinks; what it returns is ignored


def call_each(batch: Batch) -> None:
    """Call each pair's sink with its item, in order (on the engine's thread when `EngineLoop.start`'s
    deliver is left as this)."""
    for sink, item in batch:
        sink(item)


@dataclass(frozen=True, slots=True)
class EngineInfo:
    """What the HTTP side needs to know of the engine it serves.

    max_model_len: longest prompt + output, in tokens
    max_num_seqs:  requests in one step
    tokenizer:     the model's (names tokens in logprobs), or None
    """

    max_model_len: int
    max_num_seqs: int
    tokenizer: Tokenizer | None

    @staticmethod
    def of(engine: Engine) -> EngineInfo:
        return EngineInfo(engine.config.max_model_len, engine.config.max_num_seqs, engine.model.tokenizer)


class EngineRunner(Protocol):
    """The engine as the HTTP side drives it: on a thread (`EngineLoop`) or in a process (`EngineProcess`).
    `submit` and `abort` may be called from any thread; they never wait for the engine."""

    @property
    def info(self) -> EngineInfo: ...

    @property
    def alive(self) -> bool:
        """Whether the engine still takes requests (False once stopped, or if its process died)."""
        ...

    def start(self, deliver: Deliver) -> None:
        """Start handing each pass's items to `deliver`, one batch per pass (called from another thread)."""

    def submit(self, prompts: Sequence[Prompt], params: ParamsLike, sink: Sink) -> None:
        """Queue requests (prompts as `Engine.add_request` takes them, each with the same params) as one:
        all are added, their events carrying the prompt's index, or none (the first `RequestError`)."""

    def abort(self, request_ids: tuple[int, ...]) -> None:
        """Abort requests (those already finished are skipped); no more items reach their sink."""

    def stop(self, timeout: float | None = None) -> ShutdownReport | None:
        """Abort every request, free its blocks and end the engine's loop; what it left, or None if it did
        not end cleanly within `timeout` seconds (an iteration still running, or its process gone)."""


class EngineLoop:
    """An `EngineRunner` that runs `engine` on a daemon thread of this process."""

    def __init__(self, engine: Engine, metrics: ServerMetrics):
        self._engine = engine
        self._metrics = metrics
        self._commands: queue.SimpleQueue[Command[Sink]] = queue.SimpleQueue()
        self._report: ShutdownReport | None = None
        self._deliver: Deliver = call_each
        self._thread = threading.Thread(target=self._run, name="mla-func-engine", daemon=True)

    @property
    def info(self) -> EngineInfo:
        return EngineInfo.of(self._engine)

    def start(self, deliver: Deliver = call_each) -> None:
        """Start the engine's thread; each batch of items is handed to `deliver` (from that thread)."""
        self._deliver = deliver
        self._thread.start()

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    def submit(self, prompts: Sequence[Prompt], params: ParamsLike, sink: Sink) -> None:
        self._commands.put(Submit(tuple(prompts), params, sink, time.monotonic()))

    def abort(self, request_ids: tuple[int, ...]) -> None:
        self._commands.put(Abort(request_ids))

    def stop(self, timeout: float | None = None) -> ShutdownReport | None:
        self._commands.put(Stop())
        self._thread.join(timeout)
        return self._report

    # ---- the engine's thread ------------------------------------------------------------

    def _run(self) -> None:
        self._report = EngineDriver[Sink](self._engine).run(self._pending, self._emit)

    def _emit(self, done: Pass[Sink]) -> None:
        self._metrics.record(done, time.monotonic())
        if done.items:
            self._deliver(done.items)

    def _pending(self, block: bool) -> list[Command[Sink]]:
        """The commands queued now; with `block`, waits for at least one (the engine has nothing to do)."""
        commands = [self._commands.get()] if block else []
        while True:
            try:
                commands.append(self._commands.get_nowait())
            except queue.Empty:
                return commands
