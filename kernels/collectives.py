"""Collective ops: the identity of one process, and sums and gathers over a torch.distributed group.

A sharded model's layers call `ops.collectives.all_reduce(x)` where a partial result (a row-split
projection's, each rank's share of the experts') becomes the whole one. With one process the ops
are identities, so the same pure forward serves 1 or N ranks; `with_collectives` binds a table to
a group as a new value. The group is an explicit argument, never a global: a process may hold
models sharded over different groups.

The ops are torch.distributed's (NCCL on CUDA, gloo on the CPU): they enqueue on the current
stream without a host sync, so a CUDA graph captures them like any kernel. On one host's GPUs a
group may also sum through symmetric memory (`SymmetricReduce`): a buffer every rank maps, whose
peers' copies a kernel reads over NVLink.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.distributed as dist

from . import contracts as c
from .ops import CollectiveOps, Ops


def _identity_reduce(x: torch.Tensor, /) -> torch.Tensor:
    return x


def _identity_along(x: torch.Tensor, /, *, dim: int) -> torch.Tensor:
    return x


SINGLE_PROCESS = CollectiveOps(size=1, rank=0, all_reduce=_identity_reduce, all_gather=_identity_along,
                               reduce_scatter=_identity_along)


class CollectiveError(RuntimeError):
    """A collective failed: a rank of the group died, or did not enter it within the group's timeout."""


def _failed(op: str, group: dist.ProcessGroup, error: RuntimeError) -> CollectiveError:
    return CollectiveError(f"{op} on rank {dist.get_rank(group)} of {dist.get_world_size(group)}: another rank "
                           f"died or did not answer within the group's timeout ({error})")


@dataclasses.dataclass(frozen=True, slots=True)
class _GroupReduce:
    group: dist.ProcessGroup

    def __call__(self, x: torch.Tensor, /) -> torch.Tensor:
        # In place: the contract lets the op consume x, which spares a buffer per call.
        try:
            dist.all_reduce(x, op=dist.ReduceOp.SUM, group=self.group)
        except RuntimeError as e:  # torch.distributed's errors (DistBackendError, gloo's) are RuntimeErrors
            raise _failed("all_reduce", self.group, e) from e
        return x


@dataclasses.dataclass(frozen=True, slots=True)
class _GroupGather:
    group: dist.ProcessGroup
    size: int

    def __call__(self, x: torch.Tensor, /, *, dim: int) -> torch.Tensor:
        x = x.contiguous()
        try:
            if dist.get_backend(self.group) == "nccl":
                # Into one tensor, rank-major: along dim 0 that is the result, with no copy after.
                every = torch.empty((self.size * x.shape[0], *x.shape[1:]), dtype=x.dtype, device=x.device)
                dist.all_gather_into_tensor(every, x, group=self.group)
                return every if dim == 0 else torch.cat(every.chunk(self.size), dim=dim)
            # gloo gathers into a list of buffers
            parts = [torch.empty_like(x) for _ in range(self.size)]
            dist.all_gather(parts, x, group=self.group)
        except RuntimeError as e:
            raise _failed("all_gather", self.group, e) from e
        return torch.cat(parts, dim=dim)


@dataclasses.dataclass(frozen=True, slots=True)
class _GroupReduceScatter:
    group: dist.ProcessGroup
    size: int
    rank: int

    def __call__(self, x: torch.Tensor, /, *, dim: int) -> torch.Tensor:
        x = x.movedim(dim, 0).contiguous()
        try:
            if dist.get_backend(self.group) == "nccl":
                out = torch.empty((x.shape[0] // self.size, *x.shape[1:]), dtype=x.dtype, device=x.device)
                dist.reduce_scatter_tensor(out, x, op=dist.ReduceOp.SUM, group=self.group)
            else:  # gloo has no reduce-scatter: the whole sum, of which this rank keeps its piece
                dist.all_reduce(x, op=dist.ReduceOp.SUM, group=self.group)
                out = x.chunk(self.size, dim=0)[self.rank]
        except RuntimeError as e:
            raise _failed("reduce_scatter", self.group, e) from e
        return out.movedim(0, dim)


# H100 x 2 (NVLink), CUDA-graph replays of bf16 sums (NCCL / one-shot with its copy / two-shot alone):
# [1, 2048] 18.7 / 8.3 / 7.0 us, [64, 2048] 21.1 / 11.4 / 8.1, [256, 7168] 43.6 / 33.2 / 18.4,
# [1024, 7168] 79.6 / 122.6 / 52.0. One-shot (every rank reads every peer's whole tensor, one kernel)
# wins while latency rules; two-shot (each rank sums a slice, then gathers the others' slices: two
# copies around it here) past that; NCCL past the buffer.
ONE_SHOT_MAX_BYTES = 128 * 1024
SYMMETRIC_BUFFER_BYTES = 16 * 1024 * 1024


@dataclasses.dataclass(frozen=True, slots=True)
class SymmetricReduce:
    """The all-reduce over one host's GPUs through a symmetric-memory buffer (torch's `symm_mem` ops).

    buffer:     [SYMMETRIC_BUFFER_BYTES] uint8, allocated by `symm_mem.empty` and rendezvoused on every
                rank of the group (`symmetric_reduce`); it holds one call's operand at a time: calls
                in stream order (a step's, a graph's) never overlap, as NCCL's on one communicator.
    group_name: the group's name, which the symm_mem ops take.
    fallback:   the sum for what the buffer cannot hold (larger tensors, dtypes the kernels lack).

    Every rank adds the ranks' values in rank order, so every rank gets the same bits; with two
    ranks they are NCCL's bits too (one rounding of a + b), so the size thresholds change nothing.
    """

    buffer: torch.Tensor
    group_name: str
    fallback: _GroupReduce

    def __call__(self, x: torch.Tensor, /) -> torch.Tensor:
        nbytes = x.numel() * x.element_size()
        if x.dtype not in (torch.bfloat16, torch.float32) or nbytes > self.buffer.numel() \
                or nbytes % 16 or not x.is_contiguous():
            return self.fallback(x)
        flat = x.view(-1)
        operand = self.buffer.view(x.dtype)[:flat.numel()]
        try:
            if nbytes <= ONE_SHOT_MAX_BYTES:   # copies x into the buffer itself, sums into a new tensor
                out = torch.ops.symm_mem.one_shot_all_reduce_copy(operand, flat, "sum", self.group_name)
            else:   # x is in the buffer before the sum: the sum may land in x's own memory
                operand.copy_(flat)
                out = torch.ops.symm_mem.two_shot_all_reduce_out(operand, "sum", self.group_name, flat)
        except RuntimeError as e:
            raise _failed("all_reduce (symmetric memory)", self.fallback.group, e) from e
        return out.view_as(x)


def symmetric_reduce(group: dist.ProcessGroup) -> SymmetricReduce:
    """The symmetric-memory all-reduce over `group`: allocates its buffer on this rank's current CUDA device and
    rendezvouses it with every rank of the group (a collective: every rank calls this together).

    Raises ValueError unless the group is NCCL's; the ranks must share one host (peer-to-peer access).
    """
    backend = dist.get_backend(group)
    if backend != "nccl":
        raise ValueError(f"symmetric_reduce: symmetric memory needs an NCCL group of CUDA ranks, got backend "
                         f"{backend!r}")
    import torch.distributed._symmetric_memory as symm_mem  # CUDA builds only

    device = torch.device("cuda", torch.cuda.current_device())
    try:
        buffer = symm_mem.empty(SYMMETRIC_BUFFER_BYTES, dtype=torch.uint8, device=device)
        symm_mem.rendezvous(buffer, group.group_name)
    except RuntimeError as e:
        raise CollectiveError(f"symmetric_reduce on rank {dist.get_rank(group)} of {dist.get_world_size(group)}: "
                              f"the symmetric-memory buffer could not be shared (GPUs without peer access, or "
                              f"ranks on several hosts; Parallel(symmetric_memory=False) sums through NCCL): "
                              f"{e}") from e
    return SymmetricReduce(buffer=buffer, group_name=group.group_name, fallback=_GroupReduce(group))


def group_collectives(group: dist.ProcessGroup, *, tokens_split: bool = False,
                      symmetric_memory: bool = False) -> CollectiveOps:
    """The collective ops over `group` (an initialised torch.distributed process group), for this rank.

    tokens_split:     each rank's steps hold its own requests (data-parallel attention, see `CollectiveOps`).
    symmetric_memory: sum through a symmetric-memory buffer (`symmetric_reduce`: an NCCL group on one
                      host) up to its size, NCCL past it; gathers and reduce-scatters stay NCCL's.
    """
    size, rank = dist.get_world_size(group), dist.get_rank(group)
    all_reduce: c.AllReduce = symmetric_reduce(group) if symmetric_memory else _GroupReduce(group)
    return CollectiveOps(size=size, rank=rank, all_reduce=all_reduce, all_gather=_GroupGather(group, size),
                         reduce_scatter=_GroupReduceScatter(group, size, rank), tokens_split=tokens_split)


def with_collectives(ops: Ops, collectives: CollectiveOps) -> Ops:
    """`ops` whose collectives are `collectives` (every other op unchanged)."""
    if ops.collectives is collectives:
        return ops
    return dataclasses.replace(ops, collectives=collectives)
