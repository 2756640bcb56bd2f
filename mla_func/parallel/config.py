"""`Parallel`: how one process's share of a sharded model is chosen, as one frozen value.

Every rank of a tensor-parallel group runs the same pure forward on its shard of the params
pytree; the collectives that join the shards' partial results are ops of the table, bound to
the group this value names (`collectives`). The group is passed in, never looked up: nothing
about parallelism is global, so one process may hold models sharded over different groups.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch.distributed as dist

from mla_func.kernels import SINGLE_PROCESS, CollectiveOps, group_collectives


@dataclass(frozen=True, slots=True)
class Sharding:
    """How a model is cut, as a family's `tensor_split` rule reads it (see `Parallel`'s fields)."""

    ranks: int
    expert_parallel: bool = False
    data_parallel_attention: bool = False


@dataclass(frozen=True, slots=True)
class Parallel:
    """One rank's place in a sharded model.

    tensor_parallel: ranks the model is split across (query heads, MLP and expert columns; see
                     `Family.tensor_split`); 1: not sharded.
    group:           the torch.distributed process group of those ranks (None only with one rank);
                     this process's rank in it picks its shard.
    expert_parallel: hold the routed experts whole, E / tensor_parallel of them a rank, instead of
                     1 / tensor_parallel of every expert's columns (`Family.expert_parallel_params`);
                     attention and dense layers stay tensor-parallel, over the same group.
    data_parallel_attention: each rank attends for its own requests with every head, over a latent
                     cache of its own requests only; the MLPs and experts stay split across the
                     ranks, which bring their rows to them (`mla_func.core.exchange`; each step's
                     plan is `data_parallel.plan_rank_step`'s).
    symmetric_memory: sum, gather and reduce-scatter through symmetric-memory buffers every rank maps
                     (NCCL ranks of one host; `kernels.collectives.symmetric_buffer`) instead of NCCL,
                     up to their size. Off by default: on two H100s a sum's kernel takes 10 us against
                     NCCL's 15, yet v2-lite's TP 2 decode step is no faster (bench/notes/parallel.md).
    """

    tensor_parallel: int = 1
    group: dist.ProcessGroup | None = None
    expert_parallel: bool = False
    data_parallel_attention: bool = False
    symmetric_memory: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.tensor_parallel, int) or isinstance(self.tensor_parallel, bool) \
                or self.tensor_parallel < 1:
            raise ValueError(f"Parallel: tensor_parallel must be an int >= 1, got {self.tensor_parallel!r}")
        if not isinstance(self.expert_parallel, bool):
            raise ValueError(f"Parallel: expert_parallel must be a bool, got {self.expert_parallel!r}")
        if not isinstance(self.data_parallel_attention, bool):
            raise ValueError(f"Parallel: data_parallel_attention must be a bool, got {self.data_parallel_attention!r}")
        if not isinstance(self.symmetric_memory, bool):
            raise ValueError(f"Parallel: symmetric_memory must be a bool, got {self.symmetric_memory!r}")
        if self.group is None:
            if self.symmetric_memory:
                raise ValueError("Parallel: symmetric_memory needs the process group of the ranks (group=)")
            if self.tensor_parallel != 1:
                raise ValueError(f"Parallel: tensor_parallel={self.tensor_parallel} needs the process group of its "
                                 "ranks (group=)")
            return
        size = dist.get_world_size(self.group)
        if size != self.tensor_parallel:
            raise ValueError(f"Parallel: tensor_parallel={self.tensor_parallel}, but the group has {size} ranks")

    @property
    def rank(self) -> int:
        """This process's rank in the group (0 with one rank)."""
        return 0 if self.group is None else dist.get_rank(self.group)

    @property
    def sharding(self) -> Sharding:
        """How the model is cut (without the group: what a family's cutting rule reads)."""
        return Sharding(self.tensor_parallel, self.expert_parallel, self.data_parallel_attention)

    @property
    def collectives(self) -> CollectiveOps:
        """The collective ops over the group (`SINGLE_PROCESS` with one rank). With symmetric_memory each call
        allocates and rendezvouses three buffers: a collective every rank makes together (a model's load makes it
        once)."""
        if self.group is None:
            return SINGLE_PROCESS
        return group_collectives(self.group, tokens_split=self.data_parallel_attention,
                                 symmetric_memory=self.symmetric_memory)
