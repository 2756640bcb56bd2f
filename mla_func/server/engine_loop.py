"""The engine on a thread of its own: the one place the server touches it.

    HTTP handlers (asyncio)  --submit / abort-->  command queue  -->  engine thread
    engine thread: apply commands; iterate (schedule -> step -> sample -> update); deliver events

Other threads never call the engine: they put commands on a thread-safe queue, which the engine's
thread applies between iterations, so the engine loop stays `schedule -> step -> sample -> update`
and a request is added or aborted only where no step is in flight. Each submitted request names a
sink, a callable its items go to: first `Admitted` or the `RequestError` that refused it, then its
`StreamEvent`s, the last one carrying its completion, or a `Failure` if an iteration raised. The
engine's thread collects the items of each pass (the commands applied, or one iteration) and hands
them over as one batch of (sink, item) pairs to `deliver`: the HTTP side passes one
`loop.call_soon_threadsafe` per batch, which fans the batch out on the event loop's thread, so an
iteration of many rows costs one wake-up of the event loop, not one per token. An aborted request's
blocks are freed when its command is applied, before the next iteration.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from mla_func.server.metrics import ServerMetrics
from mla_func.serving.engine import Engine
from mla_func.serving.requests import ParamsLike, Prompt, RequestError, StreamEvent

__all__ = ["Admitted", "Batch", "Deliver", "EngineLoop", "Failure", "Item", "Sink", "call_each"]


@dataclass(frozen=True, slots=True)
class Admitted:
    """A submitted request passed the engine's checks: the request ids of its choices (`SamplingParams.n`)."""

    request_ids: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class Failure:
    """An iteration raised: the request was aborted. `message` is the error's."""

    message: str


Item = Admitted | RequestError | StreamEvent | Failure
Sink = Callable[[Item], object]  # what it returns is ignored
Batch = list[tuple[Sink, Item]]  # one pass's items, in the order they were made
Deliver = Callable[[Batch], object]  # hands a batch to whoever calls its sinks; what it returns is ignored


def call_each(batch: Batch) -> None:
    """Call each pair's sink with its item, in order (on the engine's thread when `EngineLoop.start`'s
    deliver is left as this)."""
    for sink, item in batch:
        sink(item)


@dataclass(frozen=True, slots=True)
class _Submit:
    prompts: tuple[Prompt, ...]
    params: ParamsLike
    sink: Sink
    arrived: float  # time.monotonic() when it was submitted: its time to first token counts from here


@dataclass(frozen=True, slots=True)
class _Abort:
    request_ids: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class _Stop:
    pass


_Command = _Submit | _Abort | _Stop


@dataclass(frozen=True, slots=True)
class ShutdownReport:
    """What `EngineLoop.stop` left: requests it aborted, and KV blocks still held (0 unless something leaked)."""

    aborted: int
    blocks_in_use: int


class EngineLoop:
    """Runs `engine` on a daemon thread; `submit` and `abort` may be called from any thread."""

    def __init__(self, engine: Engine, metrics: ServerMetrics):
        self._engine = engine
        self._metrics = metrics
        self._commands: queue.SimpleQueue[_Command] = queue.SimpleQueue()
        self._sinks: dict[int, Sink] = {}  # request id -> its sink; the engine's thread alone reads and writes it
        self._report: ShutdownReport | None = None
        self._deliver_batch: Deliver = call_each
        self._outbox: Batch = []  # the items of this pass; the engine's thread alone touches it
        self._thread = threading.Thread(target=self._run, name="mla-func-engine", daemon=True)

    def start(self, deliver: Deliver = call_each) -> None:
        """Start the engine's thread; each batch of items is handed to `deliver` (from that thread)."""
        self._deliver_batch = deliver
        self._thread.start()

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    def submit(self, prompts: Sequence[Prompt], params: ParamsLike, sink: Sink) -> None:
        """Queue requests (prompts as `Engine.add_request` takes them, each with the same params) as one:
        all are added, their events carrying the prompt's index, or none (the first `RequestError`)."""
        self._commands.put(_Submit(tuple(prompts), params, sink, time.monotonic()))

    def abort(self, request_ids: tuple[int, ...]) -> None:
        """Abort requests (those already finished are skipped); no more items reach their sink."""
        self._commands.put(_Abort(request_ids))

    def stop(self, timeout: float | None = None) -> ShutdownReport | None:
        """Abort every request, free its blocks and end the thread; what it left, or None if the thread
        did not end within `timeout` seconds (an iteration still running)."""
        self._commands.put(_Stop())
        self._thread.join(timeout)
        return self._report

    # ---- the engine's thread ------------------------------------------------------------

    def _run(self) -> None:
        engine = self._engine
        self._record(0)
        while True:
            for command in self._pending(block=not engine.has_unfinished()):
                if isinstance(command, _Stop):
                    aborted = self._abort(tuple(self._sinks), None)
                    self._report = ShutdownReport(aborted, engine.num_blocks_in_use)
                    self._record(0)
                    self._flush()
                    return
                if isinstance(command, _Submit):
                    self._add(command)
                else:
                    self._abort(command.request_ids, None)
            self._flush()  # admissions and refusals go out before the iteration, not after it
            if not engine.has_unfinished():
                self._record(0)
                continue
            try:
                events = engine.iterate()
            except Exception as error:  # the requests of the failed iteration fail; the server keeps running
                self._abort(tuple(self._sinks), Failure(f"{type(error).__name__}: {error}"))
                self._record(0)
                self._flush()
                continue
            self._deliver(events)
            self._flush()

    def _flush(self) -> None:
        """Hand this pass's items over as one batch, if there are any."""
        if self._outbox:
            batch, self._outbox = self._outbox, []
            self._deliver_batch(batch)

    def _pending(self, *, block: bool) -> list[_Command]:
        """The commands queued now; with `block`, waits for at least one (the engine has nothing to do)."""
        commands = [self._commands.get()] if block else []
        while True:
            try:
                commands.append(self._commands.get_nowait())
            except queue.Empty:
                return commands

    def _add(self, command: _Submit) -> None:
        ids: list[int] = []
        try:
            for index, prompt in enumerate(command.prompts):
                ids.extend(self._engine.add_request(prompt, command.params, index=index, stream_text=True))
        except RequestError as error:
            for request_id in ids:
                self._engine.abort(request_id)
            self._outbox.append((command.sink, error))
            return
        for request_id in ids:
            self._sinks[request_id] = command.sink
            self._metrics.arrived(request_id, command.arrived)
        self._outbox.append((command.sink, Admitted(tuple(ids))))

    def _abort(self, request_ids: tuple[int, ...], failure: Failure | None) -> int:
        """Abort the requests still unfinished, telling each sink `failure` if given; returns how many."""
        count = 0
        for request_id in request_ids:
            sink = self._sinks.pop(request_id, None)
            if sink is None:
                continue
            self._engine.abort(request_id)
            self._metrics.finished_request(request_id, "abort" if failure is None else "error", 0, time.monotonic())
            count += 1
            if failure is not None:
                self._outbox.append((sink, failure))
        return count

    def _deliver(self, events: list[StreamEvent]) -> None:
        now = time.monotonic()
        outbox = self._outbox
        for event in events:
            sink = self._sinks.get(event.request_id)
            if sink is None:
                continue
            self._metrics.token(event.request_id, now)
            if (completion := event.completion) is not None:
                del self._sinks[event.request_id]
                self._metrics.finished_request(event.request_id, completion.finish_reason,
                                               len(completion.prompt_token_ids), now)
            outbox.append((sink, event))
        self._record(len(events))

    def _record(self, tokens: int) -> None:
        engine = self._engine
        self._metrics.iteration(running=engine.num_running, waiting=engine.num_waiting,
                                blocks_in_use=engine.num_blocks_in_use,
                                blocks_total=engine.scheduler.allocator.num_usable_blocks, tokens=tokens,
                                now=time.monotonic())
