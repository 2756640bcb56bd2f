"""Reading one rank's shard of a checkpoint tensor: only its bytes, through the checked reader.

A family's `tensor_split` rule says which dim of a tensor the ranks share evenly (or that every
rank holds it whole); rank r of n reads the r-th of n contiguous ranges of that dim. The bytes
come from the header entry the loader has already checked, so no rank ever reads (or holds) the
whole checkpoint: a row range is one read, a column range one read per row.

A block-scaled weight (FP8 values with a scale per 128 x 128 block, or FP4 values with one per
1 x 32) is cut as its values are, and its scale grid along the same dim: rank r reads the
scales of exactly the blocks its values fill. That needs every rank's range to hold whole blocks
((L / n) a multiple of the block's side along the cut dim), checked for every weight before a byte
is read (`check_block_aligned`, a CheckpointError naming the tensor and the sizes). A split inside
a block is refused rather than regrouped: each rank's scales would repeat their block's, and a
w8a8 product would quantize the activations in groups that straddle the ranks' columns, which one
process does not. A partial block at the edge of a cut dim (L not a multiple of the block) cannot
meet that rule (an even cut into whole blocks makes L a multiple of them), so it is refused too;
along the dim that is not cut, partial edge blocks stay as stored, every rank reading that side
of the scale grid whole.
"""

from __future__ import annotations

import math
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from io import FileIO

import torch

from mla_func.checkpoint.files import CheckpointError, read_exactly
from mla_func.checkpoint.quant_layout import QuantLayout
from mla_func.checkpoint.safetensors_file import TensorEntry, read_tensor
from mla_func.core.config import ModelConfig, refuse
from mla_func.kernels.fp4_weight import BlockFP4Weight
from mla_func.kernels.quantized import Weight, slice_block
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


_SIDES = ("rows", "columns")


def _misaligned(what: str, shape: tuple[int, ...], dim: int, block: tuple[int, int], fmt: str,
                ranks: int) -> str | None:
    """Why `what` [..., N, K] in `fmt` blocks of `block` cannot be cut into `ranks` whole-block ranges
    along `dim` (0 or 1 of its last two dims), or None when it can."""
    length, side = shape[len(shape) - 2 + dim], block[dim]
    if length % (ranks * side) == 0:
        return None
    return (f"{what} of shape {list(shape)} ({fmt} in {block[0]} x {block[1]} blocks): its {length} "
            f"{_SIDES[dim]} split across {ranks} ranks are {length / ranks:g} a rank, not a multiple of the "
            f"scales' {side}-{_SIDES[dim][:-1]} blocks; each rank must read whole blocks (choose a number of "
            "ranks whose share of this width is a multiple of the block)")


def check_block_aligned(rule: Callable[[str], int | None], layout: QuantLayout,
                        shapes: Mapping[str, tuple[int, ...]], ranks: int, label: str) -> None:
    """CheckpointError naming the first block-scaled weight of `shapes` (the stored shapes of every
    tensor to be read, `quant_layout.stored_shapes`) that `rule` cuts inside a block (module docstring)."""
    for name in sorted(shapes):
        fmt = layout.format_of(name)
        dim = None if fmt is None or layout.weight_of_scale(name) is not None else rule(name)
        if fmt is None or dim is None:
            continue
        stored = shapes[name]
        logical = (*stored[:-1], stored[-1] * fmt.pack)
        why = _misaligned(f"tensor {name!r}", logical, dim, fmt.block, fmt.name, ranks)
        if why is not None:
            raise CheckpointError(f"{label}: {why}")


def cut_weight(w: Weight, shard: Shard, what: str) -> Weight:
    """`shard` of a weight held in memory (`shard.dim` -2: rows, -1: columns of [..., N, K]), for a cut
    the checkpoint's split cannot make (an expert-parallel rank's columns of each shared expert).
    A block-scaled pair keeps the scales of its own blocks, and is refused (ValueError naming `what`)
    where the cut falls inside one (module docstring)."""
    if shard.dim not in (-2, -1):
        raise ValueError(f"cut_weight: shard.dim must be -2 (rows) or -1 (columns), got {shard.dim}")
    start, stop = shard.bounds(w.shape[shard.dim])
    if isinstance(w, BlockFP4Weight):
        raise ValueError(f"cut_weight: {what} is held as FP4, which is read whole or cut by the checkpoint's split")
    if not isinstance(w, torch.Tensor):
        why = _misaligned(what, tuple(w.shape), shard.dim + 2, w.block, "FP8", shard.count)
        if why is not None:
            raise ValueError(f"cut_weight: {why}")
    return slice_block(w, shard.dim, start, stop)


def shard_reader(config: ModelConfig, parallel: Parallel, layout: QuantLayout | None = None,
                 shapes: Mapping[str, tuple[int, ...]] | None = None, label: str = "") -> TensorReader:
    """The reader of this rank's shard of every tensor, by the family's `tensor_split` rule.

    layout: a quantized checkpoint's (`Family.quant_layout`): a weight's scales are cut along the
            weight's dim; `shapes` (the stored shapes of every tensor to be read) are checked first,
            CheckpointError (`label`: the folder) for a weight cut inside a block (module docstring).
    ValueError when the family cannot be sharded or the config does not divide (the field named).
    """
    split_rule = config.family.tensor_split
    if split_rule is None:
        raise ValueError(f"tensor_parallel={parallel.tensor_parallel}: {config.family.title} models cannot be "
                         "sharded yet")
    rule = split_rule(config, parallel.sharding)
    rank, count = parallel.rank, parallel.tensor_parallel
    if layout is not None:
        if shapes is None:
            raise ValueError("shard_reader: a quantized layout needs the stored shapes, to check its cuts first")
        if count > 1:
            check_block_aligned(rule, layout, shapes, count, label)

    def read(name: str, f: FileIO, label: str, entry: TensorEntry, dtype: torch.dtype) -> torch.Tensor:
        weight = None if layout is None else layout.weight_of_scale(name)
        # A scale grid is cut along its weight's dim: [ceil(N / bn), ceil(K / bk)] as [N, K] is.
        dim = rule(name if weight is None else weight)
        if dim is None or count == 1:
            return read_tensor(f, label, entry, dtype)
        return read_shard(f, label, entry, dtype, Shard(dim, rank, count))

    return read
