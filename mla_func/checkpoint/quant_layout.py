"""Which tensors of a quantized checkpoint are stored quantized, and how: one value the loader reads by.

Every quantized weight [N, K] of a released DeepSeek checkpoint is stored as values beside a scale
tensor, one scale a block; checkpoints differ in which weights are quantized, how the scale is
named, and the format (`StoredFormat`):

* FP8 (`fp8_format`): float8_e4m3fn values [N, K], scales [ceil(N / bn), ceil(K / bk)] in float32
  (`weight_scale_inv`) or float8_e8m0fnu powers of two (the newest releases, `.scale`); held as a
  `BlockFP8Weight` with float32 scales (the e8m0 ones converted exactly);
* FP4 (`FP4_FORMAT`): e2m1 values packed two a byte, stored as int8 [N, K / 2] (even column in the
  low nibble), scales float8_e8m0fnu [N, K / 32]; held as a `BlockFP4Weight` as stored.

A `QuantLayout` is the rule for one checkpoint, named in the loader's canonical tensor names (after
`Family.canonical_names`); the family builds it from config.json (`Family.quant_layout`), and the
functions here check the tensors against it and pair each weight with its scale. They name no family.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass

import torch

from mla_func.checkpoint.files import CheckpointError
from mla_func.kernels.fp4_weight import BlockFP4Weight
from mla_func.kernels.quantized import BlockFP8Weight, Weight

# safetensors dtype code -> the torch dtype its bytes are read as. Packed FP4 is stored as I8 and
# read as uint8: the nibbles are bits, not a signed number.
_READ_AS = {"F8_E4M3": torch.float8_e4m3fn, "F32": torch.float32, "F8_E8M0": torch.float8_e8m0fnu,
            "I8": torch.uint8, "U8": torch.uint8}


@dataclass(frozen=True, slots=True)
class StoredFormat:
    """How one quantized weight [N, K] is stored.

    name:         "fp8" or "fp4", for messages
    values_dtype: the values' safetensors dtype ("F8_E4M3", or "I8" for packed e2m1 pairs)
    scale_dtype:  the scales' safetensors dtype ("F32" or "F8_E8M0")
    block:        (bn, bk): the rows and columns one scale covers
    pack:         values per stored element along K (2 for e2m1 pairs)
    """

    name: str
    values_dtype: str
    scale_dtype: str
    block: tuple[int, int]
    pack: int = 1

    def stored_shape(self, shape: tuple[int, ...]) -> tuple[int, ...]:
        """The values tensor's shape [N, K / pack] for a weight of shape [N, K]."""
        if len(shape) != 2 or shape[1] % self.pack:
            raise CheckpointError(f"a weight of shape {list(shape)} cannot be stored as {self.name} (2-D, "
                                  f"K a multiple of {self.pack})")
        return shape[0], shape[1] // self.pack

    def scale_shape(self, shape: tuple[int, ...]) -> tuple[int, int]:
        """The scale grid [ceil(N / bn), ceil(K / bk)] of a weight of shape [N, K]."""
        return math.ceil(shape[0] / self.block[0]), math.ceil(shape[1] / self.block[1])

    def held_bytes(self, shape: tuple[int, ...]) -> int:
        """Bytes the params hold for a weight of shape [N, K] in this format: the values as stored, and
        the scales as float32 (FP8) or as their e8m0 bytes (FP4)."""
        scale_bytes = 4 if self.pack == 1 else 1
        return math.prod(self.stored_shape(shape)) + math.prod(self.scale_shape(shape)) * scale_bytes


def fp8_format(block: tuple[int, int], scale_dtype: str = "F32") -> StoredFormat:
    """Block-scaled float8_e4m3fn with scales in `scale_dtype` ("F32" or "F8_E8M0")."""
    return StoredFormat("fp8", "F8_E4M3", scale_dtype, block)


# Routed experts of the newest releases: e2m1 pairs, one e8m0 scale per 32 values of a row (OCP MXFP4).
FP4_FORMAT = StoredFormat("fp4", "I8", "F8_E8M0", (1, 32), pack=2)


@dataclass(frozen=True, slots=True)
class QuantLayout:
    """The quantization of one checkpoint, by canonical tensor name.

    block:        the linears' scale block (what `load_model(quantization=)` is compared with)
    format_of:    weight name -> its StoredFormat, or None for a tensor stored unquantized
    scale_suffix: a weight's scale is named `scale_name(weight)`, its name with the suffix replaced
    weight_suffix: the part of a weight's name its scale's replaces (".weight" where `<module>.scale`
                  sits beside `<module>.weight`; "" where scales append "_scale_inv")
    held_dense:   weight name -> whether the family dequantizes it at load (held in the model dtype)
    activation_scale_fmt: how w8a8 products scale the activations they quantize, the quantization_config's
                  `scale_fmt` ("ue8m0") or "fp32" where it has none (`BlockFP8Weight.activation_scale_fmt`)
    """

    block: tuple[int, int]
    format_of: Callable[[str], StoredFormat | None]
    scale_suffix: str
    weight_suffix: str = ""
    held_dense: Callable[[str], bool] = lambda name: False
    activation_scale_fmt: str = "fp32"

    def scale_name(self, weight: str) -> str:
        """`<module>.weight` -> the name of its scale."""
        return weight.removesuffix(self.weight_suffix) + self.scale_suffix

    def weight_of_scale(self, name: str) -> str | None:
        """The weight a scale named `name` belongs to, or None when `name` is not a scale's name."""
        if not name.endswith(self.scale_suffix):
            return None
        return name.removesuffix(self.scale_suffix) + self.weight_suffix


def check_pairs(label: str, names: Iterable[str], layout: QuantLayout) -> None:
    """Every weight the layout quantizes has its scale, and every scale belongs to such a weight
    (names: every tensor of the checkpoint; CheckpointError naming the tensor otherwise)."""
    present = set(names)
    for name in sorted(present):
        weight = layout.weight_of_scale(name)
        if weight is not None:
            if weight not in present:
                raise CheckpointError(f"{label}: scale {name!r} has no weight {weight!r}")
            if layout.format_of(weight) is None:
                raise CheckpointError(f"{label}: scale {name!r} belongs to {weight!r}, which this checkpoint's "
                                      "layout does not quantize")
        elif layout.format_of(name) is not None and layout.scale_name(name) not in present:
            raise CheckpointError(f"{label}: quantized weight {name!r} has no scale {layout.scale_name(name)!r}")


def stored_shapes(shapes: Mapping[str, tuple[int, ...]], layout: QuantLayout) -> dict[str, tuple[int, ...]]:
    """The shape each tensor of `shapes` (the weights' logical shapes) is stored in, with every
    quantized weight's values (packed FP4 is half as wide) and its scale added."""
    out: dict[str, tuple[int, ...]] = dict(shapes)
    for name, shape in shapes.items():
        fmt = layout.format_of(name)
        if fmt is not None:
            out[name] = fmt.stored_shape(shape)
            out[layout.scale_name(name)] = fmt.scale_shape(shape)
    return out


def stored_dtype(name: str, label: str, stored: str, layout: QuantLayout) -> torch.dtype | None:
    """The dtype a quantized weight's values or a scale is read as, or None for any other tensor;
    `stored` is its safetensors dtype. CheckpointError naming the tensor when it is another dtype."""
    weight = layout.weight_of_scale(name)
    fmt = layout.format_of(weight if weight is not None else name)
    if fmt is None:
        return None
    what, want = ("scale", fmt.scale_dtype) if weight is not None else (f"{fmt.name} weight", fmt.values_dtype)
    if stored != want:
        raise CheckpointError(f"{label}: {what} {name!r} has dtype {stored!r}, expected {want!r} "
                              f"({_READ_AS[want]}, this checkpoint's {fmt.name} layout)")
    return _READ_AS[want]


def _check_scales(label: str, name: str, scales: torch.Tensor) -> torch.Tensor:
    """The scales as float32 (e8m0 converts exactly: every value is a power of two), each checked
    finite and positive: a zero, negative or NaN scale would dequantize to nonsense silently."""
    wide = scales.float()
    bad = ~(torch.isfinite(wide) & (wide > 0))
    if bad.any():
        first = [int(i) for i in bad.nonzero()[0]]
        raise CheckpointError(f"{label}: scale {name!r} has {int(bad.sum())} non-finite or non-positive values "
                              f"(first {float(wide[tuple(first)])} at block {first})")
    return wide


def paired(read: Callable[[str], torch.Tensor], label: Callable[[str], str],
           layout: QuantLayout) -> Callable[[str], Weight]:
    """`fetch(name)`: `read(name)` for a plain tensor; for a weight the layout quantizes, its pair
    (`BlockFP8Weight` with float32 scales, or `BlockFP4Weight` as stored), the scales checked finite
    and positive (CheckpointError naming the scale). Shapes and dtypes were checked from the headers
    (`stored_shapes`, `stored_dtype`). label(name): the file that holds `name`, for errors."""

    def fetch(name: str) -> Weight:
        fmt = layout.format_of(name)
        if fmt is None:
            return read(name)
        scale = layout.scale_name(name)
        values, scales = read(name), read(scale)
        wide = _check_scales(label(scale), scale, scales)
        try:
            if fmt.pack == 2:
                return BlockFP4Weight(values, scales.to(torch.float8_e8m0fnu), fmt.block)
            return BlockFP8Weight(values, wide, fmt.block, layout.activation_scale_fmt)
        except ValueError as e:  # the pair's own shape check, for a caller that skipped `stored_shapes`
            raise CheckpointError(f"{label(name)}: {name!r} and its scale {scale!r}: {e}") from None

    return fetch
