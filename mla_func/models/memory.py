"""Whether a model's params fit its device: the bytes they will hold, the bytes free there, and the check.

`load_model` asks before it allocates anything, so a preset or checkpoint too large for
the machine is refused in a moment instead of running out of memory layers into loading
(a 16B-parameter shape preset in float32 is 60 GiB of random weights). The need is what the params
pytree holds once loaded: every tensor of the checkpoint's shapes in the dtype the params
keep it in, the RoPE tables, and the MTP layer when asked for. Loading also holds one
layer's tensors twice for a moment while they are stacked; that is not counted.
"""

from __future__ import annotations

import math
import os
from pathlib import Path

import torch

from mla_func.checkpoint.quant_layout import QuantLayout
from mla_func.core.config import ModelConfig
from mla_func.core.rope_tables import rope_positions
from mla_func.models.mtp.params import mtp_tensor_shapes
from mla_func.models.quant_layouts import preset_layout
from mla_func.models.tensor_shapes import hf_tensor_shapes

__all__ = ["NotEnoughMemory", "available_bytes", "check_fits", "params_bytes", "require_memory"]

_GIB = 1 << 30
_MEMINFO = Path("/proc/meminfo")


class NotEnoughMemory(ValueError):
    """A model's params would need more memory than its device has available (the message says both, in GiB)."""


def params_bytes(config: ModelConfig, dtype: torch.dtype, *, mtp: bool = False, max_model_len: int | None = None,
                 block: tuple[int, int] | None = None, layout: QuantLayout | None = None) -> int:
    """Bytes the params of `config` hold once loaded in `dtype` (with the first MTP layer when `mtp`).

    The tensors of `hf_tensor_shapes` (and `mtp_tensor_shapes`), each in the dtype the params hold
    it in (`Family.held_dtype`); with `layout` (a quantized checkpoint's, `checkpoint.quant_layout`),
    or `block` (a preset quantized as its family's released checkpoints are, `preset_layout`), each
    tensor the layout quantizes as its format holds it (`StoredFormat.held_bytes`: FP8 one byte a value
    plus a float32 scale a block, FP4 half a byte a value plus a byte a block), except those the family
    dequantizes at load (`QuantLayout.held_dense`), in the dtype it holds them in. (MLA's key/value
    up-projection is held as stored, cut per head: on blocks finer than the checkpoint's where a head's
    rows end inside one, whose extra scales are not counted.) Plus the float32 RoPE tables of
    `rope_positions(config, max_model_len)` positions. A tied head and the MTP layer's embedding and
    head are the model's own tensors, counted once. Raises what `mtp_tensor_shapes` raises for a
    model without MTP support, and ValueError for a bad max_model_len, as loading would.
    """
    shapes = {**hf_tensor_shapes(config), **(mtp_tensor_shapes(config) if mtp else {})}
    held = config.family.held_dtype
    layout = layout if layout is not None else preset_layout(config, block)

    def tensor_bytes(name: str, shape: tuple[int, ...]) -> int:
        fmt = None if layout is None or layout.held_dense(name) else layout.format_of(name)
        return math.prod(shape) * held(name, dtype).itemsize if fmt is None else fmt.held_bytes(shape)

    total = sum(tensor_bytes(name, shape) for name, shape in shapes.items())
    # cos and sin, [positions, R / 2] float32 each, per pair the family's layers rotate with.
    pairs = config.family.rope_table_pairs(config)
    table = rope_positions(config, max_model_len) * (config.qk_rope_head_dim // 2) * torch.float32.itemsize
    return total + pairs * 2 * table


def available_bytes(device: torch.device) -> int | None:
    """Bytes free for new tensors on `device`, or None where that cannot be told (the check is then skipped).

    CPU: MemAvailable of /proc/meminfo (what can be allocated without swapping, page cache that can be
    dropped included), else the free physical pages (os.sysconf); CUDA: the free bytes of that device
    (torch.cuda.mem_get_info). Without CUDA a cuda device gives None: loading then fails as it always did.
    """
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0] if torch.cuda.is_available() else None
    if device.type != "cpu":
        return None
    try:
        for line in _MEMINFO.read_text().splitlines():
            key, _, value = line.partition(":")
            if key == "MemAvailable":
                amount, _, unit = value.strip().partition(" ")
                return int(amount) * (1024 if unit == "kB" else 1)
    except (OSError, ValueError):
        pass  # no /proc (macOS, some sandboxes) or an unreadable line: ask the C library
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError):
        return None


def check_fits(needed: int, available: int | None, *, model: str, dtype: torch.dtype, device: torch.device) -> None:
    """NotEnoughMemory unless `needed` bytes fit in `available` (None: unknown, never refused).

    The message names `model`, both byte counts in GiB and a way out: a smaller dtype while one
    is left, else a smaller preset or model, or a device with more memory.
    """
    if available is None or needed <= available:
        return
    dtype_name = str(dtype).removeprefix("torch.")
    smaller = (f"load it in a smaller dtype (bfloat16: 2 bytes a weight, not {dtype.itemsize}), "
               "or choose a smaller preset or model" if dtype.itemsize > 2
               else "choose a smaller preset or model, or a device with more memory")
    raise NotEnoughMemory(
        f"not enough memory to load {model}: its params need {needed / _GIB:.1f} GiB in {dtype_name}, "
        f"but {device} has {available / _GIB:.1f} GiB available; {smaller}"
    )


def require_memory(model: str, config: ModelConfig, *, dtype: torch.dtype, device: torch.device, mtp: bool,
                   max_model_len: int | None, block: tuple[int, int] | None = None,
                   layout: QuantLayout | None = None) -> None:
    """`check_fits` of the params `load_model` is about to make against what `device` has free
    (`layout` of a quantized checkpoint, `block` of a quantized preset: see `params_bytes`)."""
    check_fits(params_bytes(config, dtype, mtp=mtp, max_model_len=max_model_len, block=block, layout=layout),
               available_bytes(device),
               model=model, dtype=dtype, device=device)
