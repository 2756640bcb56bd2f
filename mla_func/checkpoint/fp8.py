"""The block-scaled FP8 checkpoint format of DeepSeek's released checkpoints: its math, its names, its checks.

A quantized linear weight `<module>.weight` [N, K] is stored as float8_e4m3fn values beside a
float32 `<module>.weight_scale_inv` [ceil(N / bn), ceil(K / bk)], one scale per bn x bk block
(128 x 128 in every released checkpoint; blocks at the bottom and right edges are partial when
N or K is not a multiple), and

    w[i, j] = values[i, j] * scale_inv[i // bn, j // bk]

config.json says so with
`"quantization_config": {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [bn, bk],
"activation_scheme": "dynamic"}`.

Which tensors are quantized is a pure rule on the checkpoint's tensor names (`is_quantized_name`):
the weights of the decoder layers' linear projections are; embeddings, the output head, norms,
the MoE router and its correction bias, the sparse-attention indexer's per-head weights and key
norm, and the multi-token-prediction layer's own projection (`eh_proj`) are not. That is what
DeepSeek's reference inference code builds (its `Linear` layers are fp8, while the embedding, the
head, norms, the router `Gate` and the indexer's `weights_proj` are built in a wider dtype) and
what the released shard indexes list.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from typing import Any

import torch

from mla_func.checkpoint.files import CheckpointError

SCALE_SUFFIX = "_scale_inv"
FP8_DTYPE = torch.float8_e4m3fn
# The largest finite float8_e4m3fn value; a block's largest magnitude maps onto it.
FP8_MAX = 448.0
DEFAULT_BLOCK = (128, 128)

# The fields every released FP8 config.json has, with the only values this format means.
QUANTIZATION_CONFIG: dict[str, Any] = {
    "activation_scheme": "dynamic",
    "fmt": "e4m3",
    "quant_method": "fp8",
    "weight_block_size": list(DEFAULT_BLOCK),
}
# Optional fields that change nothing about the stored weights: later releases add
# `scale_fmt: "ue8m0"`, which rounds the scales of activations at run time to powers of two
# (what the w8a8 products then do: `activation_scale_fmt`).
_OPTIONAL_FIELDS: dict[str, tuple[Any, ...]] = {"scale_fmt": ("ue8m0",)}

# The last module name of every projection whose weight the released layout stores in FP8:
# attention (q_proj without low rank, q_a_proj / q_b_proj with it, kv_a_proj_with_mqa, kv_b_proj,
# o_proj), dense, shared and routed expert MLPs (gate_proj, up_proj, down_proj), and the
# sparse-attention indexer's query and key projections (indexer.wq_b, indexer.wk).
_QUANTIZED_PROJECTIONS = frozenset({
    "q_proj", "q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj",
    "gate_proj", "up_proj", "down_proj",
})
_QUANTIZED_INDEXER_PROJECTIONS = frozenset({"wq_b", "wk"})


def block_size(config: Mapping[str, Any], label: str = "config.json") -> tuple[int, int] | None:
    """The (rows, columns) of a scale block from config.json's `quantization_config`, or None
    when the config has none (a checkpoint of plain float weights).

    Raises CheckpointError naming the field for any quantization_config other than the
    block-scaled FP8 one (`QUANTIZATION_CONFIG`, with any positive block size).
    """
    quant = config.get("quantization_config")
    if quant is None:
        return None
    if not isinstance(quant, dict):
        raise CheckpointError(f"{label}: quantization_config is {quant!r}, not an object")
    for field, want in QUANTIZATION_CONFIG.items():
        if field == "weight_block_size":
            continue
        if field not in quant:
            raise CheckpointError(f"{label}: quantization_config has no {field!r} (expected {want!r})")
        if quant[field] != want:
            raise CheckpointError(
                f"{label}: quantization_config.{field} is {quant[field]!r}; only {want!r} "
                "(block-scaled float8_e4m3fn weights) is supported"
            )
    for field, value in quant.items():
        if field in QUANTIZATION_CONFIG:
            continue
        if field not in _OPTIONAL_FIELDS:
            raise CheckpointError(f"{label}: quantization_config.{field} is not a field of the block-scaled FP8 format")
        if value not in _OPTIONAL_FIELDS[field]:
            raise CheckpointError(
                f"{label}: quantization_config.{field} is {value!r}; expected one of {list(_OPTIONAL_FIELDS[field])}"
            )
    block = quant.get("weight_block_size", list(DEFAULT_BLOCK))
    if (not isinstance(block, list) or len(block) != 2
            or not all(isinstance(b, int) and not isinstance(b, bool) and b > 0 for b in block)):
        raise CheckpointError(
            f"{label}: quantization_config.weight_block_size is {block!r}; expected two positive integers such as [128, 128]"
        )
    return block[0], block[1]


def activation_scale_fmt(config: Mapping[str, Any]) -> str:
    """How the w8a8 products of a checkpoint's FP8 weights scale the activations they quantize
    (`reference.fp8.SCALE_FORMATS`): its quantization_config's `scale_fmt` ("ue8m0"), else "fp32". The
    field's value is checked by `block_size`."""
    quant = config.get("quantization_config")
    return quant.get("scale_fmt", "fp32") if isinstance(quant, dict) else "fp32"


def is_quantized_name(name: str, config: Mapping[str, Any]) -> bool:
    """Whether the checkpoint tensor `name` is stored as FP8 values with a scale in the
    released layout (see the module docstring), given the folder's config.json `config`.

    A config without `quantization_config` quantizes nothing. Scales themselves are not
    quantized tensors.
    """
    if config.get("quantization_config") is None:
        return False
    if not name.startswith("model.layers.") or not name.endswith(".weight"):
        return False
    module = name.removesuffix(".weight").split(".")
    if module[-1] in _QUANTIZED_PROJECTIONS:
        return True
    return len(module) >= 2 and module[-2] == "indexer" and module[-1] in _QUANTIZED_INDEXER_PROJECTIONS


def scale_name(name: str) -> str:
    """`<module>.weight` -> `<module>.weight_scale_inv`."""
    return name + SCALE_SUFFIX


def scale_shape(shape: tuple[int, ...], block: tuple[int, int]) -> tuple[int, int]:
    """The scale_inv shape [ceil(N / bn), ceil(K / bk)] of a weight of shape [N, K]."""
    n, k = shape
    return math.ceil(n / block[0]), math.ceil(k / block[1])


def block_quantize(w: torch.Tensor, block: tuple[int, int] = DEFAULT_BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
    """w [N, K] (finite floats) -> (values [N, K] float8_e4m3fn, scale_inv [ceil(N/bn), ceil(K/bk)] float32).

    Each block's scale is its largest magnitude / 448, so that block maps onto e4m3's whole
    range; an all-zero block gets scale 1 (its values are zeros whatever the scale).
    """
    if w.ndim != 2:
        raise ValueError(f"block_quantize takes a 2-D weight, got shape {tuple(w.shape)}")
    n, k = w.shape
    nb, kb = scale_shape((n, k), block)
    # Zero padding to whole blocks leaves each block's largest magnitude unchanged.
    padded = torch.nn.functional.pad(w.float(), (0, kb * block[1] - k, 0, nb * block[0] - n))
    tiles = padded.view(nb, block[0], kb, block[1])
    amax = tiles.abs().amax(dim=(1, 3))
    scale = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))
    scaled = tiles / scale[:, None, :, None]
    # Rounding in w / scale can step just past 448, and a cast out of e4m3's range gives NaN.
    scaled = scaled.clamp(-FP8_MAX, FP8_MAX).view(nb * block[0], kb * block[1])[:n, :k]
    return scaled.to(FP8_DTYPE).contiguous(), scale.contiguous()


def block_dequantize(values: torch.Tensor, scale_inv: torch.Tensor, dtype: torch.dtype,
                     block: tuple[int, int] = DEFAULT_BLOCK) -> torch.Tensor:
    """values [N, K] float8_e4m3fn, scale_inv [ceil(N/bn), ceil(K/bk)] float32 -> w [N, K] in `dtype`
    (the product taken in float32, then cast once)."""
    n, k = values.shape
    full = scale_inv.float().repeat_interleave(block[0], dim=0)[:n].repeat_interleave(block[1], dim=1)[:, :k]
    return (values.float() * full).to(dtype)


def check_pairs(label: str, names: Iterable[str], config: Mapping[str, Any]) -> None:
    """Every tensor the layout quantizes has its scale, and every scale belongs to such a tensor.

    names: every tensor name of the checkpoint; label: the folder, for the error.
    """
    present = set(names)
    for name in sorted(present):
        if name.endswith(SCALE_SUFFIX):
            weight = name.removesuffix(SCALE_SUFFIX)
            if weight not in present:
                raise CheckpointError(f"{label}: scale {name!r} has no weight {weight!r}")
            if not is_quantized_name(weight, config):
                raise CheckpointError(
                    f"{label}: scale {name!r} belongs to {weight!r}, which the FP8 layout does not quantize"
                    + ("" if config.get("quantization_config") is not None else " (config.json has no quantization_config)")
                )
        elif is_quantized_name(name, config) and scale_name(name) not in present:
            raise CheckpointError(f"{label}: quantized weight {name!r} has no scale {scale_name(name)!r}")


def check_quantized(label: str, name: str, values: torch.Tensor, scale_inv: torch.Tensor,
                    block: tuple[int, int]) -> None:
    """One quantized weight and its scale: dtypes, shapes against the block size, and scales
    finite and positive (a zero, negative or NaN scale would dequantize to nonsense silently)."""
    if values.dtype != FP8_DTYPE:
        raise CheckpointError(f"{label}: quantized weight {name!r} has dtype {values.dtype}, expected {FP8_DTYPE}")
    if values.ndim != 2:
        raise CheckpointError(f"{label}: quantized weight {name!r} has shape {list(values.shape)}, expected 2-D")
    scale = scale_name(name)
    if scale_inv.dtype != torch.float32:
        raise CheckpointError(f"{label}: scale {scale!r} has dtype {scale_inv.dtype}, expected torch.float32")
    want = scale_shape((values.shape[0], values.shape[1]), block)
    if tuple(scale_inv.shape) != want:
        raise CheckpointError(
            f"{label}: scale {scale!r} has shape {list(scale_inv.shape)}; weight {name!r} of shape "
            f"{list(values.shape)} in {block[0]} x {block[1]} blocks needs {list(want)}"
        )
    bad = ~(torch.isfinite(scale_inv) & (scale_inv > 0))
    if bad.any():
        row, col = (int(i) for i in bad.nonzero()[0])
        raise CheckpointError(
            f"{label}: scale {scale!r} has {int(bad.sum())} non-finite or non-positive values "
            f"(first {float(scale_inv[row, col])} at block [{row}, {col}])"
        )
