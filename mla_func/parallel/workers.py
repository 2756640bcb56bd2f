"""Starting the ranks of one host from one command: `mla-func generate --tensor-parallel N`.

The command's process starts N fresh processes (multiprocessing's spawn), each of which joins the
group on a free local port and runs the same function; it only watches them. Rank 0 keeps the
terminal; the others print nothing but their own error. When a rank exits with an error or dies,
the others are stopped at once and the command fails naming that rank: a dead worker never
leaves the others waiting in a collective.
"""

from __future__ import annotations

import multiprocessing
import multiprocessing.connection
import os
import socket
import sys
import time
import traceback
from collections.abc import Callable
from typing import Any

from mla_func.parallel.config import Parallel
from mla_func.parallel.launch import join, leave

# How long a rank's last peers get to finish once rank 0 is done, and to stop when told to.
_GRACE_S = 30.0

RankFn = Callable[[Any, Parallel], int]


def free_local_port() -> int:
    """A TCP port free on 127.0.0.1 now (the group's rendezvous binds it moments later)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _rank_main(fn: RankFn, payload: Any, rank: int, size: int, port: int, timeout_s: float) -> None:
    if rank > 0:  # only rank 0 prints; another rank's own error still reaches the terminal (sys.__stderr__)
        quiet = open(os.devnull, "w")
        sys.stdout = sys.stderr = quiet
    code = 1
    try:
        parallel = join(rank=rank, world_size=size, init_method=f"tcp://127.0.0.1:{port}", timeout_s=timeout_s)
        try:
            code = fn(payload, parallel)
        finally:
            leave(parallel)
    except KeyboardInterrupt:
        code = 130
    except BaseException as e:  # reported on this rank's stderr, then its exit code tells the parent
        err = sys.__stderr__ if sys.__stderr__ is not None else sys.stderr
        print(f"[rank {rank}] error: {type(e).__name__}: {e}", file=err, flush=True)
        if not isinstance(e, (ValueError, OSError)):
            traceback.print_exc(file=err)
    sys.stdout.flush()
    sys.stderr.flush()
    sys.exit(code)


def run_ranks(size: int, fn: RankFn, payload: Any, *, timeout_s: float = 300.0) -> int:
    """Run `fn(payload, parallel)` on ranks 0..size-1 of a new group on this host; rank 0's exit code.

    fn and payload must pickle (a module-level function, plain data). Raises ChildProcessError
    naming the first rank that failed (its exit code, or the signal that killed it); the other
    ranks are then stopped. timeout_s bounds the group's rendezvous and every collective.
    """
    if size < 1:
        raise ValueError(f"run_ranks: size must be >= 1, got {size}")
    context = multiprocessing.get_context("spawn")
    port = free_local_port()
    procs = [context.Process(target=_rank_main, args=(fn, payload, rank, size, port, timeout_s), daemon=True)
             for rank in range(size)]
    for p in procs:
        p.start()
    try:
        return _watch(procs)
    finally:
        _stop(procs)


def _watch(procs: list[Any]) -> int:
    running = set(range(len(procs)))
    done_at: float | None = None
    while running:
        wait_s = None if done_at is None else max(0.0, done_at + _GRACE_S - time.monotonic())
        ready = multiprocessing.connection.wait([procs[r].sentinel for r in running], timeout=wait_s)
        if not ready:
            late = sorted(running)
            raise ChildProcessError(f"ranks {late} still ran {_GRACE_S:g} s after rank 0 finished")
        for rank in sorted(running):
            p = procs[rank]
            if p.exitcode is None:
                continue
            running.discard(rank)
            if p.exitcode != 0:
                raise ChildProcessError(f"rank {rank} of {len(procs)} {how_it_ended(p.exitcode)}; "
                                        "the other ranks were stopped")
            if rank == 0:
                done_at = time.monotonic()
    return 0


def how_it_ended(exitcode: int) -> str:
    """A finished process's exit code in words: "exited with code N" or "was killed by signal N"."""
    return f"was killed by signal {-exitcode}" if exitcode < 0 else f"exited with code {exitcode}"


def _stop(procs: list[Any]) -> None:
    for p in procs:
        if p.is_alive():
            p.terminate()
    end = time.monotonic() + _GRACE_S
    for p in procs:
        p.join(max(0.0, end - time.monotonic()))
        if p.is_alive():
            p.kill()
            p.join()
