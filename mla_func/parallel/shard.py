"""Reading one rank's shard of a checkpoint tensor: only its bytes, through the checked reader.

A family's `tensor_split` rule says which dim of a tensor the ranks share evenly (or that every
rank holds it whole); rank r of n reads the r-th of n contiguous ranges of that dim. The bytes
come from the header entry the loader has already checked, so no rank ever reads (or holds) the
whole checkpoint: a row range is one read, a column range one read per row.
"""

from __future__ import annotations

import math
import sys
from collections.abc import Callable
from dataclasses import dataclass
from io import FileIO

import torch

from mla_func.checkpoint.files import CheckpointError, read_exactly
from mla_func.checkpoint.safetensors_file import TensorEntry, read_tensor
from mla_func.core.config import ModelConfig
from mla_func.parallel.config import Parallel

# (name, open file, its label, the name's header entry, the dtype it is stored as) -> the tensor to hold
TensorReader = Callable[[str, FileIO, str, TensorEntry, torch.dtype], torch.Tensor]


@dataclass(frozen=True, slots=True)
class Shard:
    """The `index`-th of `count` even, contiguous ranges of dim `dim`."""

    dim: int
    index: int
    count: int

    def bounds(self, length: int) -> tuple[int, int]:
        """[start, stop) of this shard along a dim of `length` (which `count` divides)."""
        width = length // self.count
        return self.index * width, (self.index + 1) * width


def read_shard(f: FileIO, label: str, entry: TensorEntry, dtype: torch.dtype, shard: Shard) -> torch.Tensor:
    """The `shard` of the tensor of `entry`, as `dtype` (its stored dtype), on the CPU.

    entry.shape [..., L, ...] (L at shard.dim) -> [..., L / count, ...]; CheckpointError when
    count does not divide L, naming the tensor.
    """
    shape = entry.shape
    if not 0 <= shard.dim < len(shape):
        raise CheckpointError(f"{label}: tensor {entry.name!r} of shape {shape} has no dim {shard.dim} to split")
    length = shape[shard.dim]
    if length % shard.count:
        raise CheckpointError(f"{label}: tensor {entry.name!r} of shape {shape}: dim {shard.dim} ({length}) does "
                              f"not split evenly across {shard.count} ranks")
    if sys.byteorder != "little":
        raise CheckpointError(f"{label}: safetensors data is little-endian; this machine is not")
    start, stop = shard.bounds(length)
    out_shape = (*shape[:shard.dim], stop - start, *shape[shard.dim + 1:])
    item = torch.empty((), dtype=dtype).element_size()
    inner = math.prod(shape[shard.dim + 1:]) * item           # bytes of one index of the split dim
    outer = math.prod(shape[:shard.dim])                      # blocks of [L, ...] before it
    size = (stop - start) * inner
    if size == 0 or outer == 0:
        return torch.empty(out_shape, dtype=dtype)
    buf = bytearray(outer * size)
    view = memoryview(buf)
    for block in range(outer):
        begin = entry.begin + block * length * inner + start * inner
        view[block * size:(block + 1) * size] = read_exactly(f, begin, size, label)
    return torch.frombuffer(buf, dtype=dtype).view(out_shape)


def shard_reader(config: ModelConfig, parallel: Parallel) -> TensorReader:
    """The reader of this rank's shard of every tensor, by the family's `tensor_split` rule.

    ValueError when the family cannot be sharded or the config does not divide (the field named).
    """
    split_rule = config.family.tensor_split
    if split_rule is None:
        raise ValueError(f"tensor_parallel={parallel.tensor_parallel}: {config.family.title} models cannot be "
                         "sharded yet")
    rule = split_rule(config, parallel.sharding)
    rank, count = parallel.rank, parallel.tensor_parallel

    def read(name: str, f: FileIO, label: str, entry: TensorEntry, dtype: torch.dtype) -> torch.Tensor:
        dim = rule(name)
        if dim is None or count == 1:
            return read_tensor(f, label, entry, dtype)
        return read_shard(f, label, entry, dtype, Shard(dim, rank, count))

    return read
