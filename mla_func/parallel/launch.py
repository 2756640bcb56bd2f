"""Joining a group of ranks: torch.distributed's process group with a timeout, as a `Parallel`.

Under `torchrun --nproc-per-node N` every rank calls `join()` (rank, world size and the
rendezvous come from the environment torchrun sets); tests pass them explicitly. The timeout
bounds every wait: a rank that never joins fails the others' `join`, and a collective a rank
never enters fails on the others, each with an error rather than a hang.
"""

from __future__ import annotations

import os
from datetime import timedelta

import torch
import torch.distributed as dist

from mla_func.parallel.config import Parallel

DEFAULT_TIMEOUT_S = 300.0


def join(*, rank: int | None = None, world_size: int | None = None, init_method: str = "env://",
         backend: str | None = None, timeout_s: float = DEFAULT_TIMEOUT_S) -> Parallel:
    """Join the group of every rank (tensor_parallel = world size) and return this rank's `Parallel`.

    rank, world_size: default to torchrun's RANK and WORLD_SIZE; without them (a plain `python`
               run) this process is the only rank, and no group is made.
    backend:   "nccl" when CUDA is available, else "gloo".
    timeout_s: how long a rendezvous or a collective waits for the other ranks before it raises.
    """
    if rank is None and world_size is None and "RANK" not in os.environ:
        return Parallel()
    rank = int(os.environ["RANK"]) if rank is None else rank
    world_size = int(os.environ["WORLD_SIZE"]) if world_size is None else world_size
    if not 0 <= rank < world_size:
        raise ValueError(f"join: rank {rank} is outside a group of {world_size}")
    backend = backend or ("nccl" if torch.cuda.is_available() else "gloo")
    if backend == "nccl":
        # One GPU a rank of this host: "cuda" (load_model's default device) then names this rank's.
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", rank)))
    if not dist.is_initialized():
        try:
            dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=world_size,
                                    timeout=timedelta(seconds=timeout_s))
        except RuntimeError as e:  # the store's timeout (DistStoreError) and a refused rendezvous alike
            raise RuntimeError(f"join: rank {rank} of {world_size} at {init_method}: the group could not form (a "
                               f"rank that did not join within {timeout_s:g} s, or a rendezvous error): {e}") from e
    group = dist.group.WORLD
    if group is None:
        raise RuntimeError("join: torch.distributed has no default group after init_process_group")
    return Parallel(tensor_parallel=world_size, group=group)


def leave(parallel: Parallel) -> None:
    """Destroy the process group `parallel` names (after the last collective of this process, and after
    the last reference to what holds the group, a model or an engine: one still referenced when the
    interpreter exits is torn down during finalization, which can abort the process)."""
    if parallel.group is not None and dist.is_initialized():
        # Every rank reaches here before any tears its connections down: a rank still in its last
        # collective would otherwise see its peer vanish (gloo then aborts the process).
        dist.barrier(group=parallel.group)
        dist.destroy_process_group(parallel.group)
