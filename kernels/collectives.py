"""Collective ops: the identity of one process, and sums and gathers over a torch.distributed group.

A sharded model's layers call `ops.collectives.all_reduce(x)` where a partial result (a row-split
projection's, each rank's share of the experts') becomes the whole one. With one process the ops
are identities, so the same pure forward serves 1 or N ranks; `with_collectives` binds a table to
a group as a new value. The group is an explicit argument, never a global: a process may hold
models sharded over different groups.

The ops are torch.distributed's (NCCL on CUDA, gloo on the CPU): they enqueue on the current
stream without a host sync, so a CUDA graph captures them like any kernel. On one host's GPUs a
group may also sum, gather and reduce-scatter through symmetric memory (`SymmetricReduce`,
`SymmetricGather`, `SymmetricReduceScatter`): a buffer every rank maps, whose peers' copies a
kernel reads over NVLink.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from .ops import CollectiveOps, Ops

if TYPE_CHECKING:
    from torch.distributed._symmetric_memory import _SymmetricMemory


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
class SymmetricBuffer:
    """A buffer every rank of a group on one host maps, with the handle that reads the peers' copies.

    buffer:     [SYMMETRIC_BUFFER_BYTES] uint8 on this rank's GPU (`symm_mem.empty`), rendezvoused
                on every rank of the group (`symmetric_buffer`)
    handle:     torch's rendezvous handle: a peer's copy as a tensor (`get_buffer`), barriers
    group_name: the group's name, which the symm_mem ops take
    rank, size: this rank's place in the group, and its ranks

    One op uses a buffer, one call at a time: calls in stream order (a step's, a graph's) never
    overlap, as NCCL's on one communicator do not.
    """

    buffer: torch.Tensor
    handle: _SymmetricMemory
    group_name: str
    rank: int
    size: int

    def holds(self, numel: int, dtype: torch.dtype) -> bool:
        """Whether numel values of dtype fit the buffer."""
        return numel * dtype.itemsize <= self.buffer.numel()

    def peer(self, rank: int, numel: int, dtype: torch.dtype) -> torch.Tensor:
        """The first numel values of rank's copy, as dtype: [numel]."""
        return self.handle.get_buffer(rank, [numel], dtype, 0)


def symmetric_buffer(group: dist.ProcessGroup) -> SymmetricBuffer:
    """A `SymmetricBuffer` over `group`, on this rank's current CUDA device: a collective (every rank of
    the group calls it together).

    Raises ValueError unless the group is NCCL's; CollectiveError where the ranks cannot share it
    (GPUs without peer access, ranks on several hosts).
    """
    backend = dist.get_backend(group)
    if backend != "nccl":
        raise ValueError(f"symmetric memory needs an NCCL group of CUDA ranks, got backend {backend!r}")
    import torch.distributed._symmetric_memory as symm_mem  # CUDA builds only

    device = torch.device("cuda", torch.cuda.current_device())
    try:
        buffer = symm_mem.empty(SYMMETRIC_BUFFER_BYTES, dtype=torch.uint8, device=device)
        handle = symm_mem.rendezvous(buffer, group.group_name)
    except RuntimeError as e:
        raise CollectiveError(f"symmetric memory on rank {dist.get_rank(group)} of {dist.get_world_size(group)}: "
                              f"the buffer could not be shared (GPUs without peer access, or ranks on several "
                              f"hosts; Parallel(symmetric_memory=False) goes through NCCL): {e}") from e
    return SymmetricBuffer(buffer=buffer, handle=handle, group_name=group.group_name, rank=dist.get_rank(group),
                           size=dist.get_world_size(group))


@dataclasses.dataclass(frozen=True, slots=True)
class SymmetricReduce:
    """The all-reduce through a `SymmetricBuffer` (torch's `symm_mem` one-shot and two-shot all-reduce).

    fallback: the sum for what the buffer cannot hold (larger tensors, dtypes the kernels lack).

    Every rank adds the ranks' values in rank order, so every rank gets the same bits; with two
    ranks they are NCCL's bits too (one rounding of a + b), so the size thresholds change nothing.
    """

    symmetric: SymmetricBuffer
    fallback: _GroupReduce

    def __call__(self, x: torch.Tensor, /) -> torch.Tensor:
        nbytes = x.numel() * x.element_size()
        if x.dtype not in (torch.bfloat16, torch.float32) or not self.symmetric.holds(x.numel(), x.dtype) \
                or nbytes % 16 or not x.is_contiguous():
            return self.fallback(x)
        flat = x.view(-1)
        operand = self.symmetric.buffer.view(x.dtype)[:flat.numel()]
        name = self.symmetric.group_name
        try:
            if nbytes <= ONE_SHOT_MAX_BYTES:   # copies x into the buffer itself, sums into a new tensor
                out = torch.ops.symm_mem.one_shot_all_reduce_copy(operand, flat, "sum", name)
            else:   # x is in the buffer before the sum: the sum may land in x's own memory
                operand.copy_(flat)
                out = torch.ops.symm_mem.two_shot_all_reduce_out(operand, "sum", name, flat)
        except RuntimeError as e:
            raise _failed("all_reduce (symmetric memory)", self.fallback.group, e) from e
        return out.view_as(x)


@dataclasses.dataclass(frozen=True, slots=True)
class SymmetricGather:
    """The all-gather through a `SymmetricBuffer`: each rank copies its tensor into its own slot of its
    buffer; after a barrier every rank reads each peer's slot over NVLink, in rank order, into one new
    tensor; a second barrier holds a rank's next copy until every peer has read this one. The values
    are copied, never summed: NCCL's result, bit for bit. Past the buffer's size, NCCL's (`fallback`).

    On two H200s, 27 gathers captured in a graph, bf16 [rows, 2048] a rank: 32 rows 9.5 us a gather
    against NCCL's 12.4, 128 rows 11.4 against 18.9.
    """

    symmetric: SymmetricBuffer
    fallback: _GroupGather

    def __call__(self, x: torch.Tensor, /, *, dim: int) -> torch.Tensor:
        sym, numel = self.symmetric, x.numel()
        if not sym.holds(sym.size * numel, x.dtype):
            return self.fallback(x, dim=dim)
        try:
            sym.peer(sym.rank, sym.size * numel, x.dtype)[sym.rank * numel:(sym.rank + 1) * numel].copy_(x.reshape(-1))
            sym.handle.barrier(channel=0)
            every = torch.cat([sym.peer(r, sym.size * numel, x.dtype)[r * numel:(r + 1) * numel]
                               for r in range(sym.size)])
            sym.handle.barrier(channel=0)
        except RuntimeError as e:
            raise _failed("all_gather (symmetric memory)", self.fallback.group, e) from e
        every = every.view(sym.size * x.shape[0], *x.shape[1:])
        return every if dim == 0 else torch.cat(every.chunk(sym.size), dim=dim)


@dataclasses.dataclass(frozen=True, slots=True)
class SymmetricReduceScatter:
    """The reduce-scatter through a `SymmetricBuffer`: each rank copies its tensor into its buffer; after
    a barrier every rank adds the ranks' pieces of its own slice, read over NVLink, in rank order
    (with two ranks one rounding of a + b: NCCL's bits); a second barrier holds a rank's next copy
    until every peer has read this one. Past the buffer's size, NCCL's (`fallback`).

    On two H200s, 27 reduce-scatters captured in a graph, bf16 [2 x 128, 2048]: 11.6 us against
    NCCL's 21.6 (float32: 29.1); [2 x 32, 2048]: 9.4 against 12.3.
    """

    symmetric: SymmetricBuffer
    fallback: _GroupReduceScatter

    def __call__(self, x: torch.Tensor, /, *, dim: int) -> torch.Tensor:
        sym = self.symmetric
        if not x.dtype.is_floating_point or not sym.holds(x.numel(), x.dtype):
            return self.fallback(x, dim=dim)
        x = x.movedim(dim, 0)
        piece = x.numel() // sym.size
        try:
            sym.peer(sym.rank, x.numel(), x.dtype).view(x.shape).copy_(x)
            sym.handle.barrier(channel=0)
            mine = slice(sym.rank * piece, (sym.rank + 1) * piece)
            parts = [sym.peer(r, x.numel(), x.dtype)[mine] for r in range(sym.size)]
            out = parts[0] + parts[1] if sym.size > 1 else parts[0].clone()   # never a view of the buffer
            for part in parts[2:]:
                out = out + part
            sym.handle.barrier(channel=0)
        except RuntimeError as e:
            raise _failed("reduce_scatter (symmetric memory)", self.fallback.group, e) from e
        return out.view(x.shape[0] // sym.size, *x.shape[1:]).movedim(0, dim)


def group_collectives(group: dist.ProcessGroup, *, tokens_split: bool = False,
                      symmetric_memory: bool = False) -> CollectiveOps:
    """The collective ops over `group` (an initialised torch.distributed process group), for this rank.

    tokens_split:     each rank's steps hold its own requests (data-parallel attention, see `CollectiveOps`).
    symmetric_memory: sum, gather and reduce-scatter through symmetric-memory buffers (an NCCL group on
                      one host; one `symmetric_buffer` an op) up to their size, NCCL past it.
    """
    size, rank = dist.get_world_size(group), dist.get_rank(group)
    nccl_reduce, nccl_gather = _GroupReduce(group), _GroupGather(group, size)
    nccl_scatter = _GroupReduceScatter(group, size, rank)
    if not symmetric_memory:
        return CollectiveOps(size=size, rank=rank, all_reduce=nccl_reduce, all_gather=nccl_gather,
                             reduce_scatter=nccl_scatter, tokens_split=tokens_split)
    return CollectiveOps(size=size, rank=rank, all_reduce=SymmetricReduce(symmetric_buffer(group), nccl_reduce),
                         all_gather=SymmetricGather(symmetric_buffer(group), nccl_gather),
                         reduce_scatter=SymmetricReduceScatter(symmetric_buffer(group), nccl_scatter),
                         tokens_split=tokens_split)


def with_collectives(ops: Ops, collectives: CollectiveOps) -> Ops:
    """`ops` whose collectives are `collectives` (every other op unchanged)."""
    if ops.collectives is collectives:
        return ops
    return dataclasses.replace(ops, collectives=collectives)
