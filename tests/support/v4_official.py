"""DeepSeek-V4's released checkpoint layout, written here independently of mla-func's loader.

`write_v4_official(src, official, dequantized, expert_dtype)` reads a float V4 checkpoint that
transformers saved and writes it twice:

* `official`: as DeepSeek ships V4 -- DeepSeek's own tensor names (`embed.weight`, `layers.N.`,
  `attn.kv_norm.weight`, `hc_head_fn`), the attention's and indexer's query projections, `wkv`,
  `wo_a`, `wo_b` and the shared expert as float8_e4m3fn with a float8_e8m0fnu `.scale` per
  128 x 128 block (the power of two at or above the block's largest magnitude / 448), the routed
  experts as e2m1 pairs packed into int8 [N, K / 2] (even column in the low nibble) with a
  float8_e8m0fnu `.scale` per 32 values of a row (the power of two at or above the block's largest
  magnitude / 6) when expert_dtype is "fp4" (FP8 as the linears when "fp8"), the compressors'
  projections and everything else unquantized (bfloat16, float32 where DeepSeek keeps it), and
  config.json's released `quantization_config` and `expert_dtype`;
* `dequantized`: the transformers-saved checkpoint with each quantized weight replaced by its
  dequantized float32 values and every other tensor as stored in `official`: the oracle's weights.
"""

from __future__ import annotations

import re
from pathlib import Path

import torch
from safetensors.torch import load_file

from support.fp8_official import write_beside

FP8_BLOCK = 128
FP4_GROUP = 32
E4M3_MAX = 448.0
E2M1_GRID = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
RELEASED_QUANTIZATION_CONFIG = {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
                                "scale_fmt": "ue8m0", "weight_block_size": [FP8_BLOCK, FP8_BLOCK]}
# transformers' saved names of the weights DeepSeek-V4 stores quantized.
LINEAR = re.compile(r"^model\.layers\.\d+\.(attn\.(wq_a|wq_b|wkv|wo_a|wo_b|indexer\.wq_b)|ffn\.shared_experts\.w[123])"
                    r"\.weight$")
ROUTED = re.compile(r"^model\.layers\.\d+\.ffn\.experts\.\d+\.w[123]\.weight$")
FLOAT32 = re.compile(r"(attn_sink|\.ape$|gate\.bias$|hc_)")


def power_of_two_at_least(x: torch.Tensor) -> torch.Tensor:
    """The smallest power of two >= x (x > 0), float32."""
    return torch.exp2(torch.ceil(torch.log2(x)))


def fp8_blocks(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """w [N, K] -> (values float8_e4m3fn [N, K], scale float8_e8m0fnu [ceil(N/128), ceil(K/128)], dequantized float32)."""
    n, k = w.shape
    rows, cols = -(-n // FP8_BLOCK), -(-k // FP8_BLOCK)
    values = torch.empty(n, k, dtype=torch.float8_e4m3fn)
    scales = torch.empty(rows, cols, dtype=torch.float32)
    for i in range(rows):
        for j in range(cols):
            tile = w[i * FP8_BLOCK:(i + 1) * FP8_BLOCK, j * FP8_BLOCK:(j + 1) * FP8_BLOCK].float()
            scale = power_of_two_at_least(tile.abs().max().clamp(min=1e-30) / E4M3_MAX)
            scales[i, j] = scale
            values[i * FP8_BLOCK:(i + 1) * FP8_BLOCK, j * FP8_BLOCK:(j + 1) * FP8_BLOCK] = (tile / scale).to(
                torch.float8_e4m3fn)
    full = scales.repeat_interleave(FP8_BLOCK, 0)[:n].repeat_interleave(FP8_BLOCK, 1)[:, :k]
    return values, scales.to(torch.float8_e8m0fnu), values.float() * full


def fp4_rows(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """w [N, K] (K a multiple of 32) -> (packed int8 [N, K / 2], scale float8_e8m0fnu [N, K / 32], dequantized float32).

    Each value is rounded to the nearest e2m1 value of (w / scale) (the larger magnitude on a tie), coded as
    sign << 3 | index into E2M1_GRID."""
    n, k = w.shape
    groups = w.float().view(n, k // FP4_GROUP, FP4_GROUP)
    scale = power_of_two_at_least(groups.abs().amax(dim=-1).clamp(min=1e-30) / E2M1_GRID[-1])     # [N, K / 32]
    scaled = groups / scale[..., None]
    grid = torch.tensor(E2M1_GRID)
    distance = (scaled.abs()[..., None] - grid).abs()                                             # [N, G, 32, 8]
    # The last index of the smallest distance: ties round away from zero.
    index = (distance.shape[-1] - 1) - distance.flip(-1).argmin(dim=-1)
    codes = (index | ((scaled < 0).long() << 3)).view(n, k)
    packed = (codes[:, 0::2] | (codes[:, 1::2] << 4)).to(torch.uint8)
    signs = torch.where(codes >= 8, -1.0, 1.0)
    dequantized = (signs * grid[codes & 7]).view(n, k // FP4_GROUP, FP4_GROUP) * scale[..., None]
    return packed.view(torch.int8), scale.to(torch.float8_e8m0fnu), dequantized.view(n, k)


def deepseek_name(saved: str) -> str:
    """A transformers-saved V4 tensor name as DeepSeek's files name it."""
    tops = {"model.embed_tokens.weight": "embed.weight", "model.norm.weight": "norm.weight",
            "model.hc_head.hc_fn": "hc_head_fn", "model.hc_head.hc_base": "hc_head_base",
            "model.hc_head.hc_scale": "hc_head_scale"}
    if saved in tops:
        return tops[saved]
    name = saved.removeprefix("model.")
    return re.sub(r"^(layers\.\d+\.attn)\.norm\.weight$", r"\1.kv_norm.weight", name)


def stored_plain(name: str, tensor: torch.Tensor) -> torch.Tensor:
    """An unquantized tensor as DeepSeek stores it: float32 where it keeps it, integers as they are, else bfloat16."""
    if not tensor.dtype.is_floating_point:
        return tensor
    return tensor.float() if FLOAT32.search(name) else tensor.to(torch.bfloat16)


def write_v4_official(src: Path, official: Path, dequantized: Path, expert_dtype: str = "fp4") -> dict[str, str]:
    """Write both folders (see the module docstring); returns each quantized weight's saved name -> "fp8" / "fp4"."""
    tensors: dict[str, torch.Tensor] = {}
    for shard in sorted(src.glob("*.safetensors")):
        tensors.update(load_file(shard))
    stored: dict[str, torch.Tensor] = {}
    dense: dict[str, torch.Tensor] = {}
    formats: dict[str, str] = {}
    for name, tensor in tensors.items():
        raw = deepseek_name(name)
        fp4 = expert_dtype == "fp4" and ROUTED.match(name)
        if fp4 or LINEAR.match(name) or ROUTED.match(name):
            values, scale, dense[name] = fp4_rows(tensor) if fp4 else fp8_blocks(tensor)
            stored[raw], stored[raw.removesuffix(".weight") + ".scale"] = values, scale
            formats[name] = "fp4" if fp4 else "fp8"
        else:
            stored[raw] = dense[name] = stored_plain(name, tensor)
    write_beside(src, official, stored, {"quantization_config": RELEASED_QUANTIZATION_CONFIG,
                                         "expert_dtype": expert_dtype})
    write_beside(src, dequantized, dense, {})
    return formats
