"""Reading a .safetensors file: its header checked whole before any tensor is read.

Layout: 8 bytes (little-endian u64) header size N, N bytes of JSON
`{name: {"dtype", "shape", "data_offsets": [begin, end]}, "__metadata__": {...}}`,
then the data, offsets relative to its start. Every entry is checked against the
file's real size (offsets inside the data, no two tensors overlapping, byte
length = element count x item size), so reading a tensor is a bounded read of
bytes known to exist. Tensors are read in the file's dtype; `load_dtype` says
which dtypes a model may load and refuses the rest by name.
"""

from __future__ import annotations

import json
import math
import os
import sys
from dataclasses import dataclass
from io import FileIO
from typing import Any

import torch

from mla_func.checkpoint.files import CheckpointError, read_exactly

# The safetensors library refuses headers over 100 MB too.
MAX_HEADER_BYTES = 100_000_000

# Bytes per element of the dtypes whose lengths can be checked.
ITEM_BYTES = {
    "BOOL": 1, "U8": 1, "I8": 1, "F8_E5M2": 1, "F8_E4M3": 1, "F8_E8M0": 1,
    "I16": 2, "U16": 2, "F16": 2, "BF16": 2,
    "I32": 4, "U32": 4, "F32": 4,
    "I64": 8, "U64": 8, "F64": 8, "C64": 8,
}
_FLOATS = {"F16": torch.float16, "BF16": torch.bfloat16, "F32": torch.float32, "F64": torch.float64}


@dataclass(frozen=True, slots=True)
class TensorEntry:
    """One tensor of a file's header; `begin`/`end` are absolute byte offsets in the file."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    begin: int
    end: int


def _is_count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _entry(label: str, name: str, info: Any, data_start: int, data_size: int) -> TensorEntry:
    def bad(why: str) -> CheckpointError:
        return CheckpointError(f"{label}: header entry {name!r}: {why}")

    if not isinstance(info, dict):
        raise bad(f"expected an object, got {type(info).__name__}")
    dtype, shape, offsets = info.get("dtype"), info.get("shape"), info.get("data_offsets")
    if not isinstance(dtype, str):
        raise bad(f"dtype {dtype!r} is not a string")
    if not isinstance(shape, list) or not all(_is_count(d) for d in shape):
        raise bad(f"shape {shape!r} is not a list of non-negative integers")
    if not isinstance(offsets, list) or len(offsets) != 2 or not all(_is_count(o) for o in offsets):
        raise bad(f"data_offsets {offsets!r} is not [begin, end]")
    begin, end = offsets
    if not begin <= end <= data_size:
        raise bad(f"data_offsets {offsets} fall outside the {data_size} data bytes of the file")
    if dtype in ITEM_BYTES and end - begin != math.prod(shape) * ITEM_BYTES[dtype]:
        raise bad(f"{dtype} {shape} needs {math.prod(shape) * ITEM_BYTES[dtype]} bytes, data_offsets give {end - begin}")
    return TensorEntry(name=name, dtype=dtype, shape=tuple(shape), begin=data_start + begin, end=data_start + end)


def read_header(f: FileIO, label: str) -> dict[str, TensorEntry]:
    """Every tensor entry of the open file `f`, checked (see the module docstring)."""
    size = os.fstat(f.fileno()).st_size
    if size < 8:
        raise CheckpointError(f"{label}: {size} bytes, too short for a safetensors header")
    header_size = int.from_bytes(read_exactly(f, 0, 8, label), "little")
    if header_size > min(MAX_HEADER_BYTES, size - 8):
        raise CheckpointError(
            f"{label}: header size {header_size} exceeds the file ({size} bytes) or the {MAX_HEADER_BYTES}-byte limit"
        )
    try:
        header = json.loads(read_exactly(f, 8, header_size, label).decode("utf-8"))
    except UnicodeDecodeError as e:
        raise CheckpointError(f"{label}: header is not UTF-8 ({e.reason} at byte {8 + e.start})") from None
    except RecursionError:
        raise CheckpointError(f"{label}: header JSON nested too deeply") from None
    except ValueError as e:
        raise CheckpointError(f"{label}: header is not valid JSON: {e}") from None
    if not isinstance(header, dict):
        raise CheckpointError(f"{label}: header must be a JSON object, got {type(header).__name__}")
    data_start = 8 + header_size
    entries = [_entry(label, name, info, data_start, size - data_start)
               for name, info in header.items() if name != "__metadata__"]
    spans = sorted((e.begin, e.end, e.name) for e in entries if e.end > e.begin)
    for (_, end, first), (begin, _, second) in zip(spans, spans[1:]):
        if begin < end:
            raise CheckpointError(f"{label}: tensors {first!r} and {second!r} overlap in the file's data")
    return {e.name: e for e in entries}


def load_dtype(label: str, entry: TensorEntry, model_dtype: torch.dtype) -> torch.dtype:
    """The torch dtype to read `entry` as, or CheckpointError naming the tensor and its dtype.

    float32, float16 and bfloat16 weights convert to the model dtype (the usual
    serving cast). float64 loads only into a float64 model: narrowing it is a
    choice the user makes by converting the file or passing dtype=torch.float64.
    Integer, bool and fp8 tensors are quantized or not weights at all, and fp8
    needs scales that mla-func does not read: all refused.
    """
    dtype = _FLOATS.get(entry.dtype)
    if dtype is None:
        why = "fp8 weights need their scales; dequantize first" if entry.dtype.startswith("F8") else "not a float weight"
        raise CheckpointError(f"{label}: tensor {entry.name!r} has dtype {entry.dtype!r}: {why}")
    if dtype == torch.float64 and model_dtype != torch.float64:
        raise CheckpointError(
            f"{label}: tensor {entry.name!r} has dtype 'F64'; refusing to narrow it to {model_dtype} silently "
            "(load with dtype=torch.float64, or convert the file)"
        )
    return dtype


def read_tensor(f: FileIO, label: str, entry: TensorEntry, dtype: torch.dtype) -> torch.Tensor:
    """The tensor of `entry` as `dtype` (from `load_dtype`), on the CPU. shape: entry.shape."""
    if sys.byteorder != "little":
        raise CheckpointError(f"{label}: safetensors data is little-endian; this machine is not")
    size = entry.end - entry.begin
    if size == 0:
        return torch.empty(entry.shape, dtype=dtype)
    return torch.frombuffer(read_exactly(f, entry.begin, size, label), dtype=dtype).view(entry.shape)

