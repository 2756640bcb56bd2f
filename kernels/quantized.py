"""Block-scaled FP8 weights as one value: the leaf pair the params pytree holds for a quantized projection.

A `BlockFP8Weight` is the released checkpoints' layout kept on the device: float8_e4m3fn
values [..., N, K] (one byte a value) beside float32 `scale_inv` [..., ceil(N / bn), ceil(K / bk)],
one scale per bn x bk block (partial at the bottom and right edges), and

    w[..., i, j] = values[..., i, j] * scale_inv[..., i // bn, j // bk]

Both tensors are pytree leaves; the block is tree metadata, and so is `activation_scale_fmt`, how the
w8a8 products scale the activations they quantize for this weight (the checkpoint's `scale_fmt`:
"ue8m0" where it declares one, else "fp32"). Ops whose contract says they take a `Weight` accept a
tensor or this pair (`contracts`); the reference defines the pair's math as the product with the
dequantized weight (`dequantize`), and `reference.w8a8` the variant with activations quantized too.

Loading builds one matrix from several checkpoint projections (rows of one GEMM) and cuts the
shared MLP into experts. A block boundary of one piece need not fall on a boundary of the whole,
so `cat_rows` and `slice_block` regroup the scales to a finer block that divides every boundary
(each scale repeated over the sub-blocks it covered): the values and their dequantized weight are
unchanged bit for bit, and the scales grow by the factor of the regrouping (for DeepSeek-V3's
shapes at most 2x, on a matrix whose scales are under 1% of its bytes). MLA's kv_b_proj is cut per
head the same way (`split_heads`): W_UK [H, Dn, C] and W_UV [H, Dv, C] stay pairs, whose products
the attention ops take (`contracts`).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Union

import torch

from mla_func.pytree import register_dataclass, static_field

from .fp4_weight import BlockFP4Weight, fp4_cat_rows, fp4_stack
from .reference.fp8 import check_scale_fmt

FP8_DTYPE = torch.float8_e4m3fn


@register_dataclass
@dataclass(frozen=True, slots=True)
class BlockFP8Weight:
    """A block-scaled FP8 weight: values [..., N, K] float8_e4m3fn, scale_inv [..., ceil(N / bn),
    ceil(K / bk)] float32, block = (bn, bk). Leading dimensions (experts) are shared by both.
    activation_scale_fmt: `reference.fp8.SCALE_FORMATS`, how w8a8 products with it scale activations."""

    values: torch.Tensor
    scale_inv: torch.Tensor
    block: tuple[int, int] = static_field()
    activation_scale_fmt: str = static_field(default="fp32")

    def __post_init__(self) -> None:
        check_scale_fmt(self.activation_scale_fmt)
        if self.values.dtype != FP8_DTYPE:
            raise ValueError(f"BlockFP8Weight: values have dtype {self.values.dtype}, expected {FP8_DTYPE}")
        if self.scale_inv.dtype != torch.float32:
            raise ValueError(f"BlockFP8Weight: scale_inv has dtype {self.scale_inv.dtype}, expected torch.float32")
        if self.values.ndim < 2:
            raise ValueError(f"BlockFP8Weight: values have shape {list(self.values.shape)}, expected [..., N, K]")
        bn, bk = self.block
        *lead, n, k = self.values.shape
        want = (*lead, math.ceil(n / bn), math.ceil(k / bk))
        if tuple(self.scale_inv.shape) != want:
            raise ValueError(f"BlockFP8Weight: scale_inv has shape {list(self.scale_inv.shape)}; values of shape "
                             f"{list(self.values.shape)} in {bn} x {bk} blocks need {list(want)}")

    @property
    def shape(self) -> torch.Size:
        """The weight's shape [..., N, K] (the values')."""
        return self.values.shape

    @property
    def device(self) -> torch.device:
        return self.values.device

    def __getitem__(self, index: int | slice) -> BlockFP8Weight:
        """Experts `index` of a stacked weight [E, N, K]: the same slice of values and scales."""
        if self.values.ndim < 3:
            raise ValueError(f"BlockFP8Weight: only a stacked weight [E, N, K] is indexed, got {list(self.shape)}")
        return BlockFP8Weight(self.values[index], self.scale_inv[index], self.block, self.activation_scale_fmt)

    def to(self, device: torch.device | str) -> BlockFP8Weight:
        """The pair on `device` (values stay FP8, scales float32)."""
        return BlockFP8Weight(self.values.to(device), self.scale_inv.to(device), self.block,
                              self.activation_scale_fmt)

    def expanded_scales(self) -> torch.Tensor:
        """scale_inv repeated over its blocks: [..., N, K] float32."""
        n, k = self.values.shape[-2:]
        rows = self.scale_inv.repeat_interleave(self.block[0], dim=-2)[..., :n, :]
        return rows.repeat_interleave(self.block[1], dim=-1)[..., :k]

    def dequantize(self, dtype: torch.dtype) -> torch.Tensor:
        """w = values * scale_inv per block [..., N, K]: the product in float32, cast once to `dtype`."""
        return (self.values.float() * self.expanded_scales()).to(dtype)

    @property
    def nbytes(self) -> int:
        """Bytes the pair holds: one a value plus four a scale."""
        return self.values.numel() * self.values.element_size() + self.scale_inv.numel() * 4


# What a projection field of the params holds, and what `Linear`, `RmsNormLinear` and `FusedMoe` take.
Weight = Union[torch.Tensor, BlockFP8Weight, BlockFP4Weight]


def dequantized(w: Weight, dtype: torch.dtype) -> torch.Tensor:
    """A dense weight: a tensor as it is, a pair (FP8 or FP4) dequantized into `dtype`. shape: w's."""
    return w if isinstance(w, torch.Tensor) else w.dequantize(dtype)


def regrouped(w: BlockFP8Weight, block: tuple[int, int]) -> BlockFP8Weight:
    """The same weight with its scales on a finer `block`, each of whose sides divides w's."""
    (bn, bk), (gn, gk) = w.block, block
    if gn <= 0 or gk <= 0 or bn % gn or bk % gk:
        raise ValueError(f"regrouped: block {block} does not divide {w.block}")
    n, k = w.values.shape[-2:]
    scales = w.scale_inv.repeat_interleave(bn // gn, dim=-2)[..., :math.ceil(n / gn), :]
    scales = scales.repeat_interleave(bk // gk, dim=-1)[..., :math.ceil(k / gk)]
    return BlockFP8Weight(w.values, scales.contiguous(), (gn, gk), w.activation_scale_fmt)


def shared_scale_fmt(user: str, pairs: Sequence[BlockFP8Weight]) -> str:
    """The `activation_scale_fmt` every pair shares (ValueError naming `user` and the formats otherwise): the
    pieces of one matrix, or the two expert stacks of one MoE, come from one checkpoint."""
    formats = {p.activation_scale_fmt for p in pairs}
    if len(formats) != 1:
        raise ValueError(f"{user}: the weights scale their w8a8 activations differently ({sorted(formats)})")
    return formats.pop()


def cat_rows(parts: Sequence[Weight]) -> Weight:
    """The rows of every part, in order: [sum N_i, K]. Tensors concatenate as `torch.cat`; pairs
    (all of one block) regroup their scales to the block whose height divides every part's first
    row (see the module docstring). A mix of tensors and pairs is a ValueError."""
    if all(isinstance(p, torch.Tensor) for p in parts):
        return torch.cat(list(parts))  # type: ignore[arg-type]
    fp4 = [p for p in parts if isinstance(p, BlockFP4Weight)]
    if fp4 and len(fp4) == len(parts):
        return fp4_cat_rows(fp4)
    pairs = [p for p in parts if isinstance(p, BlockFP8Weight)]
    if len(pairs) != len(parts):
        raise ValueError("cat_rows: cannot join FP8 and plain weights into one matrix")
    blocks = {p.block for p in pairs}
    if len(blocks) != 1:
        raise ValueError(f"cat_rows: parts have different blocks {sorted(blocks)}")
    scale_fmt = shared_scale_fmt("cat_rows", pairs)
    bn, bk = pairs[0].block
    starts = [sum(p.values.shape[-2] for p in pairs[:i]) for i in range(1, len(pairs))]
    height = math.gcd(bn, *starts)
    grouped = [regrouped(p, (height, bk)) for p in pairs]
    return BlockFP8Weight(torch.cat([p.values for p in grouped], dim=-2),
                          torch.cat([p.scale_inv for p in grouped], dim=-2), (height, bk), scale_fmt)


def slice_block(w: Weight, dim: int, start: int, stop: int) -> Weight:
    """w's rows (dim -2) or columns (dim -1) [start, stop), contiguous. A pair regroups its scales on
    that side to the largest height that divides both its block and `start`."""
    if dim not in (-2, -1):
        raise ValueError(f"slice_block: dim must be -2 (rows) or -1 (columns), got {dim}")
    if isinstance(w, torch.Tensor):
        return w.narrow(dim, start, stop - start).contiguous()
    if isinstance(w, BlockFP4Weight):
        raise ValueError("slice_block: FP4 weights are held whole (no family cuts one yet)")
    side = w.block[dim]
    g = math.gcd(side, start)
    grouped = regrouped(w, (g, w.block[1]) if dim == -2 else (w.block[0], g))
    values = w.values.narrow(dim, start, stop - start).contiguous()
    first, last = start // g, math.ceil(stop / g)
    scales = grouped.scale_inv.narrow(dim, first, last - first).contiguous()
    return BlockFP8Weight(values, scales, grouped.block, w.activation_scale_fmt)


def split_heads(w: BlockFP8Weight, heads: int, parts: Sequence[int]) -> list[BlockFP8Weight]:
    """A matrix whose rows are `heads` heads of sum(parts) rows each, [H * sum(parts), K], cut per head into
    one stacked pair a part: [H, parts[i], K] (MLA's kv_b_proj: W_UK then W_UV of each head).

    Each piece keeps its scales per head: where a head's or a part's first row falls inside a block (parts
    not multiples of the block's height), the scales are first regrouped to the largest height that divides
    the block and every part (`regrouped`), so no block straddles two pieces. DeepSeek-V2/V3's parts (128,
    128) fill their 128-row blocks and keep them."""
    n, k = w.values.shape[-2:]
    per_head = sum(parts)
    if w.values.ndim != 2 or heads < 1 or min(parts, default=0) < 1 or n != heads * per_head:
        raise ValueError(f"split_heads: a weight of shape {list(w.shape)} is not {heads} heads of parts {list(parts)}")
    height = math.gcd(w.block[0], *parts)
    grouped = regrouped(w, (height, w.block[1]))
    values = grouped.values.reshape(heads, per_head, k)
    scales = grouped.scale_inv.reshape(heads, per_head // height, -1)
    pieces, start = [], 0
    for rows in parts:
        pieces.append(BlockFP8Weight(values[:, start:start + rows].contiguous(),
                                     scales[:, start // height:(start + rows) // height].contiguous(), grouped.block,
                                     w.activation_scale_fmt))
        start += rows
    return pieces


def stack_experts(weights: Sequence[Weight]) -> Weight:
    """Experts of one shape stacked: [E, N, K]. Pairs of different blocks (a shared expert cut inside
    a block) are first regrouped to the block whose sides divide every one's."""
    if all(isinstance(w, torch.Tensor) for w in weights):
        return torch.stack(list(weights))  # type: ignore[arg-type]
    fp4 = [w for w in weights if isinstance(w, BlockFP4Weight)]
    if fp4 and len(fp4) == len(weights):
        return fp4_stack(fp4)
    pairs = [w for w in weights if isinstance(w, BlockFP8Weight)]
    if len(pairs) != len(weights):
        raise ValueError("stack_experts: experts must all be FP8 pairs, or all plain tensors")
    block = (math.gcd(*(p.block[0] for p in pairs)), math.gcd(*(p.block[1] for p in pairs)))
    grouped = [regrouped(p, block) for p in pairs]
    return BlockFP8Weight(torch.stack([p.values for p in grouped]), torch.stack([p.scale_inv for p in grouped]), block,
                          shared_scale_fmt("stack_experts", pairs))
