"""Collective ops: the identity of one process, and sums and gathers over a torch.distributed group.

A sharded model's layers call `ops.collectives.all_reduce(x)` where a partial result (a row-split
projection's, each rank's share of the experts') becomes the whole one. With one process the ops
are identities, so the same pure forward serves 1 or N ranks; `with_collectives` binds a table to
a group as a new value. The group is an explicit argument, never a global: a process may hold
models sharded over different groups.

The ops are torch.distributed's (NCCL on CUDA, gloo on the CPU): they enqueue on the current
stream without a host sync, so a CUDA graph captures them like any kernel.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.distributed as dist

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
        # A list of buffers rather than one tensor: gloo has no gather into one tensor.
        parts = [torch.empty_like(x) for _ in range(self.size)]
        try:
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


def group_collectives(group: dist.ProcessGroup, *, tokens_split: bool = False) -> CollectiveOps:
    """The collective ops over `group` (an initialised torch.distributed process group), for this rank.

    tokens_split: each rank's steps hold its own requests (data-parallel attention, see `CollectiveOps`).
    """
    size, rank = dist.get_world_size(group), dist.get_rank(group)
    return CollectiveOps(size=size, rank=rank, all_reduce=_GroupReduce(group), all_gather=_GroupGather(group, size),
                         reduce_scatter=_GroupReduceScatter(group, size, rank), tokens_split=tokens_split)


def with_collectives(ops: Ops, collectives: CollectiveOps) -> Ops:
    """`ops` whose collectives are `collectives` (every other op unchanged)."""
    if ops.collectives is collectives:
        return ops
    return dataclasses.replace(ops, collectives=collectives)
