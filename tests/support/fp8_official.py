"""DeepSeek's block-scaled FP8 checkpoint layout, written here independently of mla-func's converter.

`write_fp8_checkpoint(src, fp8, dequantized)` reads a float checkpoint that transformers saved,
quantizes each linear projection of the decoder layers the way DeepSeek's released files store it
(float8_e4m3fn values, one float32 `weight_scale_inv` per 128 x 128 block, partial blocks at the
edges, scale = the block's largest magnitude / 448), writes that folder with the released
`quantization_config`, and writes beside it the same checkpoint with every quantized weight
replaced by values * scale: the float weights transformers runs as the oracle.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

BLOCK = (128, 128)
E4M3_MAX = 448.0
RELEASED_QUANTIZATION_CONFIG = {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
                                "weight_block_size": list(BLOCK)}
# The decoder layers' projections DeepSeek's inference code builds as FP8 `Linear`s.
PROJECTIONS = ("q_proj", "q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj",
               "gate_proj", "up_proj", "down_proj", "indexer.wq_b", "indexer.wk")


def is_projection(name: str) -> bool:
    return name.startswith("model.layers.") and name.endswith(tuple(f".{p}.weight" for p in PROJECTIONS))


def quantize_block(w: torch.Tensor, block: tuple[int, int] = BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
    """w [N, K] -> (values [N, K] float8_e4m3fn, scale_inv [ceil(N/bn), ceil(K/bk)] float32), block by block."""
    n, k = w.shape
    rows, cols = -(-n // block[0]), -(-k // block[1])
    values = torch.empty(n, k, dtype=torch.float8_e4m3fn)
    scales = torch.empty(rows, cols, dtype=torch.float32)
    for i in range(rows):
        for j in range(cols):
            tile = w[i * block[0]:(i + 1) * block[0], j * block[1]:(j + 1) * block[1]].float()
            amax = float(tile.abs().max())
            scale = amax / E4M3_MAX if amax > 0 else 1.0
            scales[i, j] = scale
            values[i * block[0]:(i + 1) * block[0], j * block[1]:(j + 1) * block[1]] = (
                (tile / scale).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn))
    return values, scales


def dequantize_block(values: torch.Tensor, scales: torch.Tensor, block: tuple[int, int] = BLOCK) -> torch.Tensor:
    """values * scale_inv of each value's block, float32 [N, K]."""
    out = values.float()
    for i in range(scales.shape[0]):
        for j in range(scales.shape[1]):
            out[i * block[0]:(i + 1) * block[0], j * block[1]:(j + 1) * block[1]] *= scales[i, j]
    return out


def write_fp8_checkpoint(src: Path, fp8: Path, dequantized: Path) -> list[str]:
    """`fp8`: src in the released FP8 layout; `dequantized`: src with the FP8 weights' float values.
    Returns the names of the quantized weights."""
    tensors: dict[str, torch.Tensor] = {}
    for shard in sorted(src.glob("*.safetensors")):
        tensors.update(load_file(shard))
    quantized, dense = {}, {}
    for name, tensor in tensors.items():
        if is_projection(name):
            values, scales = quantize_block(tensor)
            quantized[name], quantized[name + "_scale_inv"] = values, scales
            dense[name] = dequantize_block(values, scales).to(tensor.dtype)
        else:
            quantized[name] = dense[name] = tensor
    write_beside(src, fp8, quantized, {"quantization_config": RELEASED_QUANTIZATION_CONFIG})
    write_beside(src, dequantized, dense, {})
    return sorted(n for n in tensors if is_projection(n))


def write_beside(src: Path, folder: Path, weights: dict[str, torch.Tensor], extra_config: dict) -> None:
    """A new checkpoint folder of `weights` (one shard), src's config.json updated with `extra_config`,
    and src's other files (tokenizer, ...) copied."""
    config = json.loads((src / "config.json").read_text())
    folder.mkdir(parents=True)
    save_file({k: v.contiguous() for k, v in weights.items()}, str(folder / "model.safetensors"),
              metadata={"format": "pt"})
    (folder / "config.json").write_text(json.dumps({**config, **extra_config}, indent=2))
    for other in src.iterdir():
        if other.name != "config.json" and "safetensors" not in other.name and other.is_file():
            shutil.copy(other, folder / other.name)
