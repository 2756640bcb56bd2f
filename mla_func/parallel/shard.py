"""Reading one rank's shard of a checkpoint tensor: only its bytes, through the checked reader.

A family's `tensor_split` rule says which dim of a tensor the ranks share evenly (or that every
rank holds it whole); rank r of n reads the r-th of n contiguous ranges of that dim. The bytes
come from the header entry the loader has already checked, so no rank ever reads (or holds) the
whole checkpoint: a row range is one read, a column range one read per row.
"""

from __future__ import annotations

import math
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from io import FileIO

import torch

from mla_func.checkpoint.files import CheckpointError, read_exactly
from mla_func.checkpoint.safetensors_file import TensorEntry, read_tensor
from mla_func.core.config import ModelConfig, refuse
from mla_func.parallel.config import Parallel, Sharding

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


@dataclass(frozen=True, slots=True)
class SplitNames:
    """Which checkpoint tensors a family cuts, and how, by name (see `SplitRule`).

    vocab:        the embedding's and the LM head's whole names: vocabulary rows
    head_rows:    name suffixes of tensors whose rows (dim 0) are query heads, or whole groups of them
    head_columns: name suffixes of tensors whose input columns (dim 1) are heads': a partial sum
    whole_experts: parts of the names of experts held whole under expert parallelism
    mlp_rows:     name suffixes of MLP and expert tensors cut by intermediate rows (gate, up)
    mlp_columns:  name suffixes of MLP and expert tensors cut by intermediate columns (down)
    """

    vocab: tuple[str, ...]
    head_rows: tuple[str, ...]
    head_columns: tuple[str, ...]
    whole_experts: tuple[str, ...]
    mlp_rows: tuple[str, ...]
    mlp_columns: tuple[str, ...]


@dataclass(frozen=True, slots=True)
class SplitRule:
    """Checkpoint tensor name -> the dim a rank reads an even share of, or None (read whole).

    A family's `tensor_split` returns one (`split_rule`); anything its `names` do not list is read
    whole on every rank.
    """

    names: SplitNames
    heads: bool           # attention split by heads (tensor-parallel attention)
    vocab: bool           # embedding and LM head split by rows
    expert_columns: bool  # experts split by columns (not whole experts a rank)

    def __call__(self, name: str) -> int | None:
        n = self.names
        if name in n.vocab:
            return 0 if self.vocab else None
        if name.endswith(n.head_rows):
            return 0 if self.heads else None
        if name.endswith(n.head_columns):
            return 1 if self.heads else None
        if not self.expert_columns and any(part in name for part in n.whole_experts):
            return None
        if name.endswith(n.mlp_rows):
            return 0
        if name.endswith(n.mlp_columns):
            return 1
        return None


def split_rule(names: SplitNames, sharding: Sharding, *, vocab_size: int, head_widths: Mapping[str, int],
               mlp_widths: Mapping[str, int]) -> SplitRule:
    """The rule that cuts `names` for `sharding`, after checking every width it splits divides.

    head_widths: config field -> width cut by heads (checked only with tensor-parallel attention);
    mlp_widths:  config field -> width cut across the ranks in every mode.
    ConfigError (a ValueError) names the first field the ranks do not divide. The vocabulary is cut
    only where the ranks divide it (held whole otherwise), and never under data-parallel attention.
    """
    ranks, tensor_parallel_attention = sharding.ranks, not sharding.data_parallel_attention
    widths = {**(head_widths if tensor_parallel_attention else {}), **mlp_widths}
    for field, width in widths.items():
        if width % ranks:
            raise refuse(field, width, f"split evenly across {ranks} ranks: must be a multiple of {ranks}")
    return SplitRule(names, heads=tensor_parallel_attention,
                     vocab=tensor_parallel_attention and vocab_size % ranks == 0,
                     expert_columns=not sharding.expert_parallel)


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
