"""The engine in a process of its own, the HTTP side in the server's: two GILs, not one.

    server process                                            engine process (spawned)
    submit / abort -> command queue -> sender thread  --pipe-->  EngineDriver.run: apply commands,
    sinks <- call_soon_threadsafe <- reader thread    <--pipe--  iterate, send one message a pass

On a thread of the server's process (`engine_loop.EngineLoop`) the engine waits for the GIL while the
event loop frames and writes each token of every stream; here it never does. The engine's process
owns the model and the GPU: it is started with the `spawn` method (CUDA must not be forked) and builds
the engine itself from an `EngineRecipe`, a picklable description of it, then sends the server an
`EngineInfo` ("ready"), or why it could not (`EngineStartError` in the server, which waits at most a
given time).

One duplex pipe carries both ways. Server -> engine: commands (`Submit` with the request's prompts
and checked `SamplingParams`, `Abort`, `Stop`), pickled and written by a sender thread, so the event
loop never waits on a full pipe. Engine -> server: one message per pass of the engine's loop (its
items, the requests it admitted and ended, its tokens and the engine's load), each token a plain tuple
(pickling a tuple costs a twentieth of a dataclass's), and at the end the `ShutdownReport`. The
server's reader thread unpickles each pass, records it in the metrics and hands its items to the
sinks in one batch (one `call_soon_threadsafe` a pass). A submission crosses the pipe as a number;
the server keeps its sink until its last item has come.

The engine's process follows the server: it stops when told (`Stop`, after uvicorn's graceful
shutdown), and when its end of the pipe reads EOF (the server's process died, even by SIGKILL) or, while
it loads the model or runs a step, when multiprocessing's sentinel of its parent says so. It
ignores SIGINT and SIGTERM, which a terminal's Ctrl-C or a service manager send to the whole process
group, so the streams the server is still finishing keep their engine. It writes its log lines to
the stderr it shares with the server, as "[engine] ...".

A model split across ranks (`EngineRecipe.tensor_parallel` > 1) makes this process rank 0 of a group it
starts (`engine_ranks`): it alone talks to the server, and hands each round's commands to the others.
"""

from __future__ import annotations

import functools
import inspect
import itertools
import multiprocessing
import os
import queue
import signal
import sys
import threading
import time
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from multiprocessing.connection import Connection, wait
from multiprocessing.process import BaseProcess
from types import TracebackType
from typing import Any, NoReturn

import torch

from mla_func.models.load import load_model
from mla_func.parallel.config import Parallel
from mla_func.server.engine_driver import (Abort, Admitted, Command, EngineDriver, Failure, Item, Load, Pass,
                                           ShutdownReport, Stop, Submit)
from mla_func.server.engine_loop import Batch, Deliver, EngineInfo, Sink, call_each
from mla_func.server.engine_ranks import EngineRanks, RankStartError, start_ranks
from mla_func.server.metrics import ServerMetrics
from mla_func.serving.engine import Engine
from mla_func.serving.requests import ParamsLike, Prompt, RequestError, StreamEvent

__all__ = ["EngineProcess", "EngineRecipe", "EngineStartError"]

_STOP_WAIT_S = 10.0  # `close`: how long a live engine process may take to stop before it is killed
_EOF_GRACE_S = 2.0  # the server gone, how long the engine's process may take to see its pipe's EOF


@dataclass(frozen=True, slots=True)
class EngineRecipe:
    """How to build an engine: picklable, so that a process of its own builds it.

    model:         a checkpoint folder or a preset name, as `load_model` takes it
    device:        "cpu", "cuda" or "cuda:N"
    dtype:         the weights' dtype; None for the loader's default on the device
    threads:       torch's CPU threads in the process that builds it; None leaves torch's choice
    engine_kwargs: `Engine`'s keyword arguments (max_num_seqs, backend, max_model_len, ...); with
                   speculative_tokens > 0 the model's MTP layer is loaded too
    warmup:        run `Engine.warmup` (graph captures included) before the engine takes requests
    tensor_parallel: ranks of this host the model is split across (`engine_ranks`: the engine's
                   process is rank 0 and starts the others; one GPU each on CUDA); 1: one process
    expert_parallel, data_parallel_attention: how the ranks cut it (`Parallel`'s fields of those names)
    """

    model: str
    device: str = "cpu"
    dtype: torch.dtype | None = None
    threads: int | None = None
    engine_kwargs: dict[str, Any] = field(default_factory=dict)
    warmup: bool = True
    tensor_parallel: int = 1
    expert_parallel: bool = False
    data_parallel_attention: bool = False

    def __post_init__(self) -> None:
        # Checked here, in the server's process, so that a mistake is named before a process starts.
        if not isinstance(self.model, str) or not self.model:
            raise ValueError(f"EngineRecipe.model: expected a checkpoint folder or preset name, got {self.model!r}")
        try:
            torch.device(self.device)
        except (RuntimeError, TypeError):
            raise ValueError(f"EngineRecipe.device: expected cpu, cuda or cuda:N, got {self.device!r}") from None
        if self.threads is not None and (type(self.threads) is not int or self.threads < 1):
            raise ValueError(f"EngineRecipe.threads: expected an int >= 1 or None, got {self.threads!r}")
        try:
            inspect.signature(Engine).bind(None, **self.engine_kwargs)
        except TypeError as error:
            raise ValueError(f"EngineRecipe.engine_kwargs: {error} (Engine's keyword arguments)") from None
        if type(self.tensor_parallel) is not int or self.tensor_parallel < 1:
            raise ValueError(f"EngineRecipe.tensor_parallel: expected an int >= 1, got {self.tensor_parallel!r}")
        if (self.expert_parallel or self.data_parallel_attention) and self.tensor_parallel < 2:
            raise ValueError("EngineRecipe: expert_parallel and data_parallel_attention cut the model across ranks: "
                             f"they need tensor_parallel >= 2, got {self.tensor_parallel}")

    def rank_parallel(self, parallel: Parallel) -> Parallel:
        """A rank's `Parallel` (from `join`), cut as the recipe says."""
        return replace(parallel, expert_parallel=self.expert_parallel,
                       data_parallel_attention=self.data_parallel_attention)

    def build(self, say: Callable[[str], None], parallel: Parallel | None = None) -> Engine:
        """Load the model (this rank's shard of it, given `parallel`) and build the engine (warmed up with
        `warmup`), saying what it does. On CUDA a rank of several takes the GPU of its rank."""
        if self.threads is not None:
            torch.set_num_threads(self.threads)
        device = torch.device(self.device)
        if parallel is not None and parallel.tensor_parallel > 1 and device.type == "cuda":
            device = torch.device("cuda", parallel.rank)
        started = time.perf_counter()
        say(f"loading {self.model} on {device}")
        model = load_model(self.model, dtype=self.dtype, device=device,
                           mtp=self.engine_kwargs.get("speculative_tokens", 0) > 0, parallel=parallel)
        say(f"loaded in {time.perf_counter() - started:.1f} s")
        engine = Engine(model, **self.engine_kwargs)
        if self.warmup:
            if any(m.use_graph for m in engine.step.decode_graph_modes()):
                say("capturing decode graphs")
            engine.warmup(progress=False)  # also takes what lives as long as the engine out of the collector's walks
        return engine


class EngineStartError(RuntimeError):
    """The engine's process could not build the engine, exited, or was not ready in time."""


@dataclass(frozen=True, slots=True)
class _StartFailed:
    """Engine -> server instead of "ready": why the engine could not be built."""

    message: str


@dataclass(frozen=True, slots=True)
class _Refused:
    """A `RequestError` across the pipe (its own pickling would call its constructor with the wrong arguments)."""

    index: int | None
    reason: str


# A pass across the pipe: (items, arrived, ended, tokens, load) of `Pass`, each StreamEvent as the tuple
# of its fields in declaration order and each RequestError as a `_Refused`.
_Wire = tuple[list[tuple[int, object]], list[tuple[int, float]], list[tuple[int, str]], int, Load]


def _encode(done: Pass[int]) -> _Wire:
    items: list[tuple[int, object]] = []
    for key, item in done.items:
        if type(item) is StreamEvent:
            items.append((key, (item.index, item.token_id, item.completion, item.text, item.request_id, item.choice,
                                item.logprob)))
        elif isinstance(item, RequestError):
            items.append((key, _Refused(item.index, item.reason)))
        else:
            items.append((key, item))
    return items, done.arrived, done.ended, done.tokens, done.load


def _decode(wire: _Wire) -> Pass[int]:
    encoded, arrived, ended, tokens, load = wire
    items: list[tuple[int, Item]] = []
    for key, item in encoded:
        if type(item) is tuple:
            items.append((key, StreamEvent(*item)))
        elif isinstance(item, _Refused):
            items.append((key, RequestError(item.index, item.reason)))
        else:
            assert isinstance(item, Admitted | Failure), item
            items.append((key, item))
    return Pass(items, arrived, ended, tokens, load)


# ---- the engine's process ---------------------------------------------------------------------


def _say(message: str) -> None:
    # One write a line: the server and the engine process share stderr, and a message written apart from
    # its newline can have the other process's line land between them.
    sys.stderr.write(f"[engine] {message}\n")
    sys.stderr.flush()


def _engine_main(recipe: EngineRecipe, conn: Connection) -> None:
    """The engine process's whole life: build the engine, say ready (or why not), run its loop."""
    # The server decides when the engine stops (a Stop command, or EOF once the server's process is gone):
    # a Ctrl-C or SIGTERM sent to the process group must not cut the streams the server is finishing.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    server = multiprocessing.parent_process()
    if server is not None:
        threading.Thread(target=_exit_after, args=(server,), name="mla-func-server-watch", daemon=True).start()
    ranks: EngineRanks | None = None
    try:
        if recipe.tensor_parallel > 1:
            ranks = start_ranks(recipe, functools.partial(_start_failed, conn))
            others = "rank 1" if recipe.tensor_parallel == 2 else f"ranks 1-{recipe.tensor_parallel - 1}"
            _say(f"{others} started; this process is rank 0")
        try:
            engine = recipe.build(_say, None if ranks is None else ranks.parallel)
        except BaseException:
            if ranks is not None:
                ranks.release()
            raise
        if ranks is not None:
            ranks.agree()
    except BaseException as error:  # anything at all: the server must hear of it rather than wait
        # The server reports the error; a bad checkpoint's message says it all, anything else needs its trace.
        if not isinstance(error, ValueError | OSError | RankStartError):
            traceback.print_exc()
        try:
            conn.send(_StartFailed(f"{type(error).__name__}: {error}"))
        except OSError:
            pass  # the server is gone already
        sys.exit(1)
    # Each round's commands: from the pipe, and with several ranks sent on to the others.
    commands = functools.partial(_receive, conn) if ranks is None else functools.partial(ranks.commands, conn, _receive)
    try:
        conn.send(EngineInfo.of(engine))
        _say("ready")
        conn.send(EngineDriver[int](engine).run(commands, lambda done: conn.send(_encode(done))))
    except OSError:  # a write to a server that is gone (EPIPE, ECONNRESET)
        _say("the server's process is gone: stopping")
    if ranks is not None:
        del engine  # what holds the group goes before the group does
        ranks.close()


def _start_failed(conn: Connection, reason: str) -> NoReturn:
    """Report a start failure found off the main thread (which is blocked in a rendezvous) and end the process."""
    try:
        conn.send(_StartFailed(f"RankStartError: {reason}"))
    except OSError:
        pass  # the server is gone already
    os._exit(1)


def _exit_after(server: BaseProcess) -> None:
    """End this process once the server's has ended. The main thread reads the pipe's EOF between
    iterations and stops cleanly; this ends it where it reads none, loading the model or inside a long step."""
    server.join()
    time.sleep(_EOF_GRACE_S)
    _say("the server's process is gone: exiting")
    os._exit(1)


def _receive(conn: Connection, block: bool, wait_s: float | None = None) -> list[Command[int]]:
    """The commands waiting in the pipe; with `block`, waits for one (at most `wait_s` seconds, if given).
    EOF (the server's process is gone) reads as a Stop."""
    commands: list[Command[int]] = []
    try:
        if block and conn.poll(wait_s):
            commands.append(conn.recv())
        while conn.poll():
            commands.append(conn.recv())
    except (EOFError, OSError):
        commands.append(Stop())
    return commands


# ---- the server's side ------------------------------------------------------------------------


class _Addresses:
    """The sinks of the submissions whose items are still to come, by the number each crosses the pipe as.
    A sink is dropped after its last item: a refusal, or the end of each of its requests."""

    def __init__(self) -> None:
        # add() runs on the event loop's thread, the rest on the reader's.
        self._lock = threading.Lock()
        self._sinks: dict[int, Sink] = {}
        self._open: dict[int, int] = {}  # submission -> its requests not yet ended
        self._owner: dict[int, int] = {}  # request id -> its submission
        self._numbers = itertools.count()
        self._closed = False

    def add(self, sink: Sink) -> int | None:
        """The number of a new submission to `sink`; None once closed (the engine is gone)."""
        with self._lock:
            if self._closed:
                return None
            key = next(self._numbers)
            self._sinks[key] = sink
            return key

    def address(self, done: Pass[int]) -> Batch:
        """The pass's items, each with its sink."""
        with self._lock:
            batch: Batch = []
            for key, item in done.items:
                batch.append((self._sinks[key], item))
                if isinstance(item, Admitted):
                    self._open[key] = len(item.request_ids)
                    self._owner.update((request_id, key) for request_id in item.request_ids)
                elif isinstance(item, RequestError):
                    del self._sinks[key]
                elif isinstance(item, StreamEvent) and item.completion is not None:
                    self._end(item.request_id)
            for request_id, _ in done.ended:
                self._end(request_id)
            return batch

    def _end(self, request_id: int) -> None:
        key = self._owner.pop(request_id)
        self._open[key] -= 1
        if not self._open[key]:
            del self._open[key], self._sinks[key]

    def close(self, failure: Failure) -> Batch:
        """`failure` for every sink still waiting; later submissions are refused (`add` gives None)."""
        with self._lock:
            self._closed = True
            batch: Batch = [(sink, failure) for sink in self._sinks.values()]
            self._sinks.clear()
            return batch


class EngineProcess:
    """An `EngineRunner` whose engine runs in a process of its own; `launch` starts one. Use it as a context
    manager (or call `close`), so that the process is gone whatever happens to the server."""

    def __init__(self, process: BaseProcess, conn: Connection, info: EngineInfo, metrics: ServerMetrics,
                 say: Callable[[str], None]):
        self._process, self._conn, self._info, self._metrics, self._say = process, conn, info, metrics, say
        self._addresses = _Addresses()
        self._deliver: Deliver = call_each
        self._report: ShutdownReport | None = None
        self._ended = threading.Event()  # set once the reader has read the last message it will get
        self._stopping = False  # stop() was called: the process ending is no news
        self._commands: queue.SimpleQueue[Command[int] | None] = queue.SimpleQueue()  # None ends the sender
        self._sender = threading.Thread(target=self._send, name="mla-func-engine-commands", daemon=True)
        self._reader = threading.Thread(target=self._read, name="mla-func-engine-events", daemon=True)
        self._sender.start()

    @classmethod
    def launch(cls, recipe: EngineRecipe, metrics: ServerMetrics, *, timeout_s: float,
               say: Callable[[str], None]) -> EngineProcess:
        """Start the engine's process and wait until it has built the engine (at most `timeout_s` seconds).
        EngineStartError if it could not (its log, on stderr, says more), exited, or took longer; it is
        killed then."""
        context = multiprocessing.get_context("spawn")
        ours, theirs = context.Pipe()
        process = context.Process(target=_engine_main, args=(recipe, theirs), name="mla-func-engine")
        process.start()
        theirs.close()  # the child has its own copy: once it exits, ours reads EOF
        try:
            info = _ready(ours, process, timeout_s)
        except BaseException:  # EngineStartError, or a Ctrl-C while waiting: no engine is left behind
            process.kill()
            process.join()
            ours.close()
            raise
        say(f"engine ready in process {process.pid}")
        return cls(process, ours, info, metrics, say)

    @property
    def info(self) -> EngineInfo:
        return self._info

    @property
    def pid(self) -> int | None:
        """The engine process's id."""
        return self._process.pid

    @property
    def alive(self) -> bool:
        return not self._ended.is_set() and self._process.is_alive()

    def start(self, deliver: Deliver = call_each) -> None:
        """Start reading the engine's passes; each batch of items is handed to `deliver` (from the reader's thread)."""
        self._deliver = deliver
        self._reader.start()

    def submit(self, prompts: Sequence[Prompt], params: ParamsLike, sink: Sink) -> None:
        key = self._addresses.add(sink)
        if key is None:
            self._deliver([(sink, Failure("the engine's process has ended"))])
            return
        self._commands.put(Submit(tuple(prompts), params, key, time.monotonic()))

    def abort(self, request_ids: tuple[int, ...]) -> None:
        self._commands.put(Abort(request_ids))

    def stop(self, timeout: float | None = None) -> ShutdownReport | None:
        deadline = None if timeout is None else time.monotonic() + timeout
        self._stopping = True
        self._commands.put(Stop())
        if self._reader.ident is None:  # never started: its last passes are read here, for the report
            self._reader.start()
        self._reader.join(_left(deadline))
        self._process.join(_left(deadline))
        return None if self._process.is_alive() else self._report

    def close(self) -> None:
        """Make sure the engine's process has ended (stopped, or killed after a grace of `_STOP_WAIT_S`),
        then end the threads and close the pipe."""
        if self._process.is_alive():
            self.stop(timeout=_STOP_WAIT_S)
        if self._process.is_alive():
            self._say(f"the engine's process did not stop within {_STOP_WAIT_S:g} s: killing it")
            self._process.kill()
            self._process.join()
        self._commands.put(None)
        self._sender.join()
        if self._reader.ident is not None:
            self._reader.join()  # the process is gone: the reader has read EOF, or will at once
        self._conn.close()

    def __enter__(self) -> EngineProcess:
        return self

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None,
                 trace: TracebackType | None) -> None:
        self.close()

    # ---- the sender's and the reader's threads ------------------------------------------------

    def _send(self) -> None:
        while (command := self._commands.get()) is not None:
            try:
                self._conn.send(command)
            except OSError:  # the engine's process is gone: the reader fails what is open
                return

    def _read(self) -> None:
        metrics, addresses = self._metrics, self._addresses
        try:
            while True:
                message = self._conn.recv()
                if isinstance(message, ShutdownReport):
                    self._report = message
                    break
                done = _decode(message)
                metrics.record(done, time.monotonic())
                batch = addresses.address(done)
                if batch:
                    self._deliver(batch)
        except (EOFError, OSError):  # the engine's process ended without its report: it crashed or was killed
            if not self._stopping:
                self._process.join(_STOP_WAIT_S)
                self._say(f"the engine's process exited unexpectedly (exit code {self._process.exitcode}); "
                          "the server answers 503 from now on")
        finally:
            self._ended.set()
            left = addresses.close(Failure("the engine's process has ended"))
            if left:
                self._deliver(left)


def _ready(conn: Connection, process: BaseProcess, timeout_s: float) -> EngineInfo:
    """The engine's info once its process has built the engine; EngineStartError if the process said it
    could not, exited first, or said nothing within `timeout_s` seconds."""
    if not wait([conn, process.sentinel], timeout_s):
        raise EngineStartError(f"the engine's process was not ready within {timeout_s:g} s (loading the model "
                               "and warming it up); it was stopped")
    try:
        message = conn.recv()
    except (EOFError, OSError):  # it exited without a word (killed, or a crash below Python)
        process.join()
        raise EngineStartError(f"the engine's process exited with code {process.exitcode} before it was ready") \
            from None
    if isinstance(message, _StartFailed):
        raise EngineStartError(f"the engine could not be built: {message.message}")
    assert isinstance(message, EngineInfo), message
    return message


def _left(deadline: float | None) -> float | None:
    return None if deadline is None else max(0.0, deadline - time.monotonic())
