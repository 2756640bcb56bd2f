"""Block-scaled FP4 weights as one value: the leaf pair the params pytree holds for a packed e2m1 weight.

A `BlockFP4Weight` is the layout DeepSeek-V4 ships its routed experts in, kept on the device:
e2m1 values packed two a byte along K, `packed` uint8 [..., N, K / 2] (the even column in the low
nibble, the odd one in the high nibble), beside one power-of-two scale per 1 x bk block, `scale`
float8_e8m0fnu [..., N, K / bk] (one byte a scale), and

    w[..., i, j] = E2M1[nibble(packed[..., i, j // 2], j % 2)] * scale[..., i, j // bk]

where a nibble is sign (bit 3) and a three-bit magnitude code: 0, 0.5, 1, 1.5, 2, 3, 4, 6.
Half a byte a value plus one byte a block (bk = 32: 0.53 bytes a value). Both tensors are pytree
leaves; the block is tree metadata. The product with the dequantized weight is the math every
backend's FP4 product must match (`dequantize`: exact in float32, since each value is a power of
two times a 3-bit significand).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from mla_func.pytree import register_dataclass, static_field

SCALE_DTYPE = torch.float8_e8m0fnu
# The e2m1 magnitudes of the codes 0..7; codes 8..15 are the same with the sign bit set.
E2M1_MAGNITUDES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)


def e2m1_table(device: torch.device | str) -> torch.Tensor:
    """The value of each 4-bit code [16] float32 (codes 8..15 negative; code 8 is -0)."""
    magnitudes = torch.tensor(E2M1_MAGNITUDES, dtype=torch.float32, device=device)
    return torch.cat([magnitudes, -magnitudes])


@register_dataclass
@dataclass(frozen=True, slots=True)
class BlockFP4Weight:
    """A block-scaled FP4 weight [..., N, K]: packed uint8 [..., N, K / 2], scale float8_e8m0fnu
    [..., N / bn, K / bk], block = (bn, bk) with bk even and dividing K, bn dividing N. Leading
    dimensions (experts) are shared by both."""

    packed: torch.Tensor
    scale: torch.Tensor
    block: tuple[int, int] = static_field()

    def __post_init__(self) -> None:
        if self.packed.dtype != torch.uint8:
            raise ValueError(f"BlockFP4Weight: packed has dtype {self.packed.dtype}, expected torch.uint8")
        if self.scale.dtype != SCALE_DTYPE:
            raise ValueError(f"BlockFP4Weight: scale has dtype {self.scale.dtype}, expected {SCALE_DTYPE}")
        if self.packed.ndim < 2:
            raise ValueError(f"BlockFP4Weight: packed has shape {list(self.packed.shape)}, expected [..., N, K / 2]")
        bn, bk = self.block
        *lead, n, half_k = self.packed.shape
        if bn < 1 or bk < 2 or bk % 2 or n % bn or (2 * half_k) % bk:
            raise ValueError(f"BlockFP4Weight: block {self.block} does not tile a weight of shape "
                             f"{[*lead, n, 2 * half_k]} (bk must be even; both must divide the weight)")
        want = (*lead, n // bn, 2 * half_k // bk)
        if tuple(self.scale.shape) != want:
            raise ValueError(f"BlockFP4Weight: scale has shape {list(self.scale.shape)}; a weight of shape "
                             f"{[*lead, n, 2 * half_k]} in {bn} x {bk} blocks needs {list(want)}")

    @property
    def shape(self) -> torch.Size:
        """The weight's shape [..., N, K] (K twice the packed width)."""
        return torch.Size((*self.packed.shape[:-1], 2 * self.packed.shape[-1]))

    @property
    def device(self) -> torch.device:
        return self.packed.device

    def __getitem__(self, index: int | slice) -> BlockFP4Weight:
        """Experts `index` of a stacked weight [E, N, K]: the same slice of values and scales."""
        if self.packed.ndim < 3:
            raise ValueError(f"BlockFP4Weight: only a stacked weight [E, N, K] is indexed, got {list(self.shape)}")
        return BlockFP4Weight(self.packed[index], self.scale[index], self.block)

    def to(self, device: torch.device | str) -> BlockFP4Weight:
        """The pair on `device` (values stay packed, scales e8m0)."""
        return BlockFP4Weight(self.packed.to(device), self.scale.to(device), self.block)

    def values(self) -> torch.Tensor:
        """The unscaled e2m1 values [..., N, K] float32."""
        table = e2m1_table(self.packed.device)
        low, high = table[(self.packed & 0xF).long()], table[(self.packed >> 4).long()]
        return torch.stack([low, high], dim=-1).flatten(-2)

    def dequantize(self, dtype: torch.dtype) -> torch.Tensor:
        """w = value * scale per block [..., N, K]: the product in float32 (exact), cast once to `dtype`."""
        bn, bk = self.block
        scales = self.scale.float().repeat_interleave(bn, dim=-2).repeat_interleave(bk, dim=-1)
        return (self.values() * scales).to(dtype)

    @property
    def nbytes(self) -> int:
        """Bytes the pair holds: half a byte a value plus one a scale."""
        return self.packed.numel() + self.scale.numel()


def fp4_cat_rows(parts: Sequence[BlockFP4Weight]) -> BlockFP4Weight:
    """The rows of every part, in order: [sum N_i, K]. Parts of one block whose heights divide each
    part's row count (1 for DeepSeek-V4's experts), so no block straddles two parts."""
    blocks = {p.block for p in parts}
    if len(blocks) != 1:
        raise ValueError(f"fp4_cat_rows: parts have different blocks {sorted(blocks)}")
    return BlockFP4Weight(torch.cat([p.packed for p in parts], dim=-2), torch.cat([p.scale for p in parts], dim=-2),
                          parts[0].block)


def fp4_stack(weights: Sequence[BlockFP4Weight]) -> BlockFP4Weight:
    """Experts of one shape and block stacked: [E, N, K]."""
    blocks = {w.block for w in weights}
    if len(blocks) != 1:
        raise ValueError(f"fp4_stack: experts have different blocks {sorted(blocks)}")
    return BlockFP4Weight(torch.stack([w.packed for w in weights]), torch.stack([w.scale for w in weights]),
                          weights[0].block)
