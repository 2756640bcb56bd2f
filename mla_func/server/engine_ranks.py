"""The engine's process over several ranks of this host: `mla-func serve --tensor-parallel N`.

    engine's process = rank 0                              ranks 1 .. N-1 (spawned by rank 0)
    pipe -> commands -> broadcast (gloo) --------------->  the same commands
    EngineDriver.run: apply, iterate (collectives) <---->  EngineDriver.run: apply, iterate
    pipe <- one message a pass                             (passes dropped)

The engine's process starts the other ranks (multiprocessing's spawn, one GPU each on CUDA), joins
their group as rank 0, and every rank loads its shard and builds the same engine. Every rank runs
the same `EngineDriver` loop: each round rank 0 takes the server's commands from its pipe and
broadcasts them (plain objects, over a gloo group of the ranks), and the others apply the same
ones, so every rank's schedulers decide alike by construction and the steps' collectives meet.
Only rank 0 talks to the server. While the engine is idle, rank 0 sends an empty round every
`HEARTBEAT_S`, so a rank waiting for commands never reaches the group's timeout.

Failures: a rank that ends before the group forms (rank 0 waiting in the rendezvous) is named at once
(`watch_rendezvous`); after the build every rank tells the others whether it built (`agree`); a rank that
could not is named in rank 0's start error, which the server reports. Later, a rank that dies makes the
next broadcast or collective raise on rank 0, whose process then ends: the server answers 503 from
then on. A rank whose parent (rank 0) is gone exits; so the ranks end with the engine's process
however it ends.
"""

from __future__ import annotations

import multiprocessing
import multiprocessing.connection
import os
import signal
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess
from typing import TYPE_CHECKING, Protocol

import torch.distributed as dist

from mla_func.parallel.config import Parallel
from mla_func.parallel.launch import DEFAULT_TIMEOUT_S, join, leave
from mla_func.parallel.workers import free_local_port, how_it_ended
from mla_func.server.engine_driver import Command, EngineDriver

if TYPE_CHECKING:
    from mla_func.serving.engine import Engine

__all__ = ["HEARTBEAT_S", "EngineRanks", "RankRecipe", "RankStartError", "start_ranks", "watch_rendezvous"]

# How long rank 0 waits for a command while idle before it sends the other ranks an empty round: well
# inside the group's timeout (`DEFAULT_TIMEOUT_S`), which bounds every broadcast's wait.
HEARTBEAT_S = 5.0
_GRACE_S = 2.0  # rank 0 gone, how long a rank waits before it exits on its own
_JOIN_S = 30.0  # rank 0 stopping, how long the other ranks may take to end before they are killed
_WATCH_S = 0.5  # how often rank 0 looks at the other ranks while their group forms (and whether it has)


class RankRecipe(Protocol):
    """What a rank needs of the engine's recipe (`server.engine_process.EngineRecipe`, which pickles to
    every rank): how many ranks, how to cut a rank's `Parallel`, and how to build its engine."""

    @property
    def tensor_parallel(self) -> int: ...

    def rank_parallel(self, parallel: Parallel) -> Parallel: ...

    def build(self, say: Callable[[str], None], parallel: Parallel | None = None) -> Engine: ...


class RankStartError(RuntimeError):
    """A rank other than rank 0 could not build its engine, or ended before it said."""


@dataclass(frozen=True, slots=True)
class EngineRanks:
    """The ranks of a sharded engine, as rank 0 holds them.

    parallel:  rank 0's `Parallel`, cut as the recipe says
    control:   a gloo group of every rank: the commands of each round go over it
    others:    the processes of ranks 1 .. N-1
    """

    parallel: Parallel
    control: dist.ProcessGroup
    others: tuple[BaseProcess, ...]

    def agree(self) -> None:
        """After rank 0 built its engine: every rank says whether it built its own. RankStartError naming
        those that did not (their own errors are on stderr), or a rank that died before it could say."""
        try:
            failed = _gathered_failures(self.control, True)
        except RuntimeError as error:  # a rank gone: gloo's connection closed, or the group's timeout
            raise RankStartError(f"a rank of {self.parallel.tensor_parallel} ended before its engine was built "
                                 f"(its error is above): {error}") from error
        if failed:
            raise RankStartError(f"{_named(failed)} of {self.parallel.tensor_parallel} could not build the engine "
                                 "(its error is above)")

    def release(self) -> None:
        """After rank 0 could not build its engine: tell the others, which then exit (they may be gone)."""
        try:
            _gathered_failures(self.control, False)
        except RuntimeError:
            # A rank already gone: rank 0's own error is the one reported, and the others end with this
            # process either way (`_exit_after`).
            pass

    def commands(self, conn: Connection, receive: Callable[[Connection, bool, float | None], list[Command[int]]],
                 block: bool) -> list[Command[int]]:
        """The commands waiting in the pipe (`receive`; while idle at most `HEARTBEAT_S` waiting for one), sent
        to every other rank: this round's, the same on every rank."""
        box: list[object] = [receive(conn, block, HEARTBEAT_S)]
        dist.broadcast_object_list(box, src=0, group=self.control)
        return box[0]  # type: ignore[return-value]

    def close(self) -> None:
        """Leave the group (every rank leaves after its last round) and wait for the other ranks to end;
        those still running after `_JOIN_S` are killed."""
        leave(self.parallel)
        deadline = time.monotonic() + _JOIN_S
        for process in self.others:
            process.join(max(0.0, deadline - time.monotonic()))
            if process.is_alive():
                process.kill()
                process.join()


def start_ranks(recipe: RankRecipe, lost: Callable[[str], object]) -> EngineRanks:
    """Start ranks 1 .. N-1 of `recipe.tensor_parallel` and join their group as rank 0 (in the engine's process).

    lost: called with the reason, from another thread, if a rank ends before the group forms (rank 0 is
    then inside the rendezvous, which would wait out the group's timeout for it); it should report the
    reason and end the process."""
    size = recipe.tensor_parallel
    port = free_local_port()
    context = multiprocessing.get_context("spawn")
    others = tuple(context.Process(target=_rank_main, args=(recipe, rank, size, port), name=f"mla-func-engine-{rank}",
                                   daemon=True) for rank in range(1, size))
    for process in others:
        process.start()
    formed = threading.Event()
    threading.Thread(target=watch_rendezvous, args=(others, formed, lost), name="mla-func-rendezvous-watch",
                     daemon=True).start()
    try:
        parallel = join(rank=0, world_size=size, init_method=f"tcp://127.0.0.1:{port}", timeout_s=DEFAULT_TIMEOUT_S)
        control = dist.new_group(backend="gloo")
    except BaseException:
        for process in others:
            process.kill()
        raise
    finally:
        formed.set()
    return EngineRanks(recipe.rank_parallel(parallel), control, others)


def watch_rendezvous(others: tuple[BaseProcess, ...], formed: threading.Event, lost: Callable[[str], object]) -> None:
    """Until `formed` is set, watch ranks 1 .. N-1 (`others`); the first that ends is told to `lost`, naming
    it and how it ended. Returns once the group has formed, or after telling."""
    while not formed.is_set():
        multiprocessing.connection.wait([process.sentinel for process in others], timeout=_WATCH_S)
        ended = [(rank, process.exitcode) for rank, process in enumerate(others, start=1)
                 if process.exitcode is not None]
        if ended and not formed.is_set():
            rank, code = ended[0]
            lost(f"rank {rank} of {len(others) + 1} {how_it_ended(code)} before the ranks' group formed "
                 "(its error is above)")
            return


def _rank_main(recipe: RankRecipe, rank: int, size: int, port: int) -> None:
    """Rank `rank`'s whole life: join, build its engine, say whether it did, then apply rank 0's commands
    round by round until a `Stop`."""
    # As the engine's process: rank 0 decides when the ranks stop, not a Ctrl-C sent to the process group.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    first = multiprocessing.parent_process()
    if first is not None:
        threading.Thread(target=_exit_after, args=(first, rank), name="mla-func-rank-0-watch", daemon=True).start()

    def say(message: str) -> None:
        sys.stderr.write(f"[engine rank {rank}] {message}\n")
        sys.stderr.flush()

    parallel = join(rank=rank, world_size=size, init_method=f"tcp://127.0.0.1:{port}", timeout_s=DEFAULT_TIMEOUT_S)
    control = dist.new_group(backend="gloo")
    engine: Engine | None = None
    try:
        engine = recipe.build(lambda message: None, recipe.rank_parallel(parallel))
    except Exception as error:  # said here; rank 0 names this rank in its start error
        say(f"error: {type(error).__name__}: {error}")
    if _gathered_failures(control, engine is not None) or engine is None:
        sys.exit(1)

    def commands(block: bool) -> list[Command[int]]:
        box: list[object] = [None]
        dist.broadcast_object_list(box, src=0, group=control)
        return box[0]  # type: ignore[return-value]

    EngineDriver[int](engine).run(commands, lambda done: None)
    del engine  # what holds the group goes before the group does
    leave(parallel)


def _gathered_failures(control: dist.ProcessGroup, built: bool) -> list[int]:
    """The ranks that did not build their engine (every rank calls it once, after its build)."""
    every: list[object] = [None] * dist.get_world_size(control)
    dist.all_gather_object(every, built, group=control)
    return [rank for rank, ok in enumerate(every) if not ok]


def _named(ranks: list[int]) -> str:
    return f"rank {ranks[0]}" if len(ranks) == 1 else "ranks " + ", ".join(map(str, ranks))


def _exit_after(first: BaseProcess, rank: int) -> None:
    """End this rank once rank 0's process has ended (where a broadcast or step would wait for it)."""
    first.join()
    time.sleep(_GRACE_S)
    sys.stderr.write(f"[engine rank {rank}] rank 0 is gone: exiting\n")
    sys.stderr.flush()
    os._exit(1)
