"""The engine's loop, wherever it runs: commands applied between iterations, each pass handed on whole.

    run: apply the commands waiting (wait for one while the engine is idle)  -> emit a Pass
         iterate (schedule -> step -> sample -> update)                        -> emit a Pass

`EngineDriver.run` is the one code that touches the engine, on a thread of the server's process
(`engine_loop.EngineLoop`) or in a process of its own (`engine_process`). Requests are added and
aborted only between iterations, where no step is in flight. Each submission carries a key, the
address of its items: first `Admitted` or the `RequestError` that refused it, then its requests'
`StreamEvent`s (each request's last one carrying its completion), or a `Failure` if an iteration
raised. The key is the submission's sink on a thread, a number standing for it across processes.

A pass is what one round of the loop made, handed over in one `emit`: its items in order, the
requests it admitted (with when their submission arrived) and ended without a completion, the
tokens it sampled and the engine's load after it. The metrics (`ServerMetrics.record`) are a
function of the passes alone, so they come out the same whichever side of a process boundary
reads them.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Generic, TypeVar

from mla_func.serving.engine import Engine
from mla_func.serving.requests import ParamsLike, Prompt, RequestError, StreamEvent

__all__ = ["Abort", "Admitted", "Command", "EngineDriver", "Failure", "Item", "Load", "Pass", "ShutdownReport",
           "Stop", "Submit"]

K = TypeVar("K")  # a submission's key, never None: its sink (on a thread), or its number (across processes)


@dataclass(frozen=True, slots=True)
class Admitted:
    """A submitted request passed the engine's checks: the request ids of its choices (`SamplingParams.n`)."""

    request_ids: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class Failure:
    """An iteration raised, or the engine stopped: the request was aborted. `message` says why."""

    message: str


Item = Admitted | RequestError | StreamEvent | Failure


@dataclass(frozen=True, slots=True)
class Submit(Generic[K]):
    """Add `prompts` (as `Engine.add_request` takes them, each with `params`) as one: all or none.

    arrived: time.monotonic() when the HTTP side took the request; its time to first token counts
    from here (the clock is the machine's, the same in every process).
    """

    prompts: tuple[Prompt, ...]
    params: ParamsLike
    key: K
    arrived: float


@dataclass(frozen=True, slots=True)
class Abort:
    """Abort these requests (those already finished are skipped)."""

    request_ids: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class Stop:
    """Abort every request, free its blocks and end `EngineDriver.run`."""


Command = Submit[K] | Abort | Stop


@dataclass(frozen=True, slots=True)
class Load:
    """The engine's load after a pass: requests running and waiting, KV blocks held and usable."""

    running: int
    waiting: int
    blocks_in_use: int
    blocks_total: int


@dataclass(frozen=True, slots=True)
class Pass(Generic[K]):
    """What one pass of the loop made.

    items:   (key, item) in the order they were made
    arrived: (request id, its submission's `Submit.arrived`) of each request admitted
    ended:   (request id, "abort" | "error") of each request that ended without a completion
    tokens:  tokens sampled (0 for a pass that applied commands)
    """

    items: list[tuple[K, Item]]
    arrived: list[tuple[int, float]]
    ended: list[tuple[int, str]]
    tokens: int
    load: Load


@dataclass(frozen=True, slots=True)
class ShutdownReport:
    """What stopping the engine left: requests it aborted, and KV blocks still held (0 unless something leaked)."""

    aborted: int
    blocks_in_use: int


Pending = Callable[[bool], list[Command[K]]]  # the commands waiting; with True, waits for at least one
Emit = Callable[[Pass[K]], object]  # what it returns is ignored


class EngineDriver(Generic[K]):
    """Runs `engine`'s loop in `run`; nothing else may touch the engine meanwhile."""

    def __init__(self, engine: Engine):
        self._engine = engine
        self._keys: dict[int, K] = {}  # request id -> its submission's key, for the requests not yet ended
        self._items: list[tuple[K, Item]] = []  # this pass's, and so on below
        self._arrived: list[tuple[int, float]] = []
        self._ended: list[tuple[int, str]] = []

    def run(self, pending: Pending[K], emit: Emit[K]) -> ShutdownReport:
        """Apply commands and iterate until a `Stop`; every pass goes to `emit`, one call each."""
        engine = self._engine
        emit(self._take(0))
        while True:
            commands = pending(not engine.has_unfinished())
            for command in commands:
                if isinstance(command, Stop):
                    aborted = self._abort(tuple(self._keys), None)
                    emit(self._take(0))
                    return ShutdownReport(aborted, engine.num_blocks_in_use)
                if isinstance(command, Submit):
                    self._add(command)
                else:
                    self._abort(command.request_ids, None)
            if commands:
                emit(self._take(0))  # admissions and refusals go out before the iteration, not after it
            if not engine.has_unfinished():
                continue
            try:
                events = engine.iterate()
            except Exception as error:  # the requests of the failed iteration fail; the server keeps running
                self._abort(tuple(self._keys), Failure(f"{type(error).__name__}: {error}"))
                emit(self._take(0))
                continue
            self._collect(events)
            emit(self._take(len(events)))

    def _take(self, tokens: int) -> Pass[K]:
        """This pass, handed over; the next one starts empty."""
        engine = self._engine
        load = Load(engine.num_running, engine.num_waiting, engine.num_blocks_in_use,
                    engine.scheduler.allocator.num_usable_blocks)
        done = Pass(self._items, self._arrived, self._ended, tokens, load)
        self._items, self._arrived, self._ended = [], [], []
        return done

    def _add(self, command: Submit[K]) -> None:
        ids: list[int] = []
        try:
            for index, prompt in enumerate(command.prompts):
                ids.extend(self._engine.add_request(prompt, command.params, index=index, stream_text=True))
        except RequestError as error:
            for request_id in ids:
                self._engine.abort(request_id)
            self._items.append((command.key, error))
            return
        for request_id in ids:
            self._keys[request_id] = command.key
            self._arrived.append((request_id, command.arrived))
        self._items.append((command.key, Admitted(tuple(ids))))

    def _abort(self, request_ids: tuple[int, ...], failure: Failure | None) -> int:
        """Abort the requests not yet ended, telling each one's key `failure` if given; returns how many."""
        count = 0
        for request_id in request_ids:
            key = self._keys.pop(request_id, None)
            if key is None:
                continue
            self._engine.abort(request_id)
            self._ended.append((request_id, "abort" if failure is None else "error"))
            count += 1
            if failure is not None:
                self._items.append((key, failure))
        return count

    def _collect(self, events: list[StreamEvent]) -> None:
        keys, items = self._keys, self._items
        for event in events:
            key = keys.get(event.request_id)
            if key is None:  # aborted in an earlier pass
                continue
            if event.completion is not None:
                del keys[event.request_id]
            items.append((key, event))
