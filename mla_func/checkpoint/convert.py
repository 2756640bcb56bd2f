"""Converting checkpoint folders between float weights and the block-scaled FP8 layout (`fp8.py`).

Both directions read every file through the checked reader (`CheckpointFolder`,
`safetensors_file`: no pickle, headers checked before data), keep the source's shard
layout (each shard is written under its own name; an index, where the source has one,
is rewritten to match), copy the other small files (tokenizer, generation config), and
check everything that can be checked before a tensor is converted: the source's
config.json and quantization_config, the tensor names and scale pairs, and that the
destination is new. The output is written into a hidden sibling folder and renamed into
place at the end, so a conversion that fails halfway leaves no half-written checkpoint.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file
from tqdm import tqdm

from mla_func.checkpoint.files import CheckpointError, CheckpointFolder
from mla_func.checkpoint.fp8 import (
    FP8_DTYPE, QUANTIZATION_CONFIG, SCALE_SUFFIX, block_dequantize, block_quantize, block_size, check_pairs,
    check_quantized, is_quantized_name, scale_name,
)
from mla_func.checkpoint.safetensors_file import TensorEntry, read_header, read_tensor

INDEX = "model.safetensors.index.json"
CONFIG = "config.json"
# The safetensors dtypes a checkpoint of either layout holds.
_DTYPES = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16, "F8_E4M3": FP8_DTYPE}
# Weights in Python's pickle format are never read, so never copied either.
_PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".pkl", ".pickle", ".ckpt")


@dataclass(frozen=True, slots=True)
class Source:
    """A checkpoint folder, read without its tensors: config.json, and each shard's checked header
    in file order. `indexed`: whether the folder has a shard index (the output then has one too)."""

    folder: CheckpointFolder
    config: dict[str, Any]
    shards: dict[str, dict[str, TensorEntry]]
    indexed: bool

    def names(self) -> list[str]:
        return [name for entries in self.shards.values() for name in entries]

    def where(self) -> dict[str, str]:
        return {name: file for file, entries in self.shards.items() for name in entries}


def read_source(path: Path) -> Source:
    """The folder's config and shard headers; a tensor in two shards, or where the index does not
    say, is refused (as the loader refuses it)."""
    folder = CheckpointFolder.at(path)
    config = folder.read_json(CONFIG)
    if not isinstance(config, dict):
        raise CheckpointError(f"{folder.label(CONFIG)}: expected a JSON object, got {type(config).__name__}")
    indexed = folder.has(INDEX)
    weight_map: dict[str, Any] = {}
    if indexed:
        index = folder.read_json(INDEX)
        found = index.get("weight_map") if isinstance(index, dict) else None
        if not isinstance(found, dict) or not found:
            raise CheckpointError(f"{folder.label(INDEX)}: no weight_map object of tensor names to shard files")
        weight_map = found
        files = sorted(set(weight_map.values()), key=str)
    else:
        files = [name for name in folder.names() if name.endswith(".safetensors")]
    if not files:
        raise CheckpointError(f"{folder.root}: no .safetensors files")
    shards: dict[str, dict[str, TensorEntry]] = {}
    seen: dict[str, str] = {}
    for file in files:
        with folder.open(file, named_by=folder.label(INDEX) if indexed else "") as handle:
            entries = read_header(handle, folder.label(file))
        for name in entries:
            if name in seen:
                raise CheckpointError(f"{folder.label(file)}: tensor {name!r} is also in {seen[name]}")
            if indexed and weight_map.get(name) != file:
                raise CheckpointError(
                    f"{folder.label(file)}: tensor {name!r} is here, but {INDEX} puts it in {weight_map.get(name)!r}"
                )
            seen[name] = file
        shards[file] = entries
    if indexed and (missing := sorted(set(weight_map) - set(seen))):
        raise CheckpointError(f"{folder.label(INDEX)}: tensor {missing[0]!r} is in no shard ({len(missing)} missing)")
    return Source(folder=folder, config=config, shards=shards, indexed=indexed)


def _dtype(source: Source, file: str, entry: TensorEntry) -> torch.dtype:
    dtype = _DTYPES.get(entry.dtype)
    if dtype is None:
        raise CheckpointError(f"{source.folder.label(file)}: tensor {entry.name!r} has dtype {entry.dtype!r}; "
                              f"expected one of {sorted(_DTYPES)}")
    return dtype


def _read(source: Source, file: str, entry: TensorEntry) -> torch.Tensor:
    """One tensor, in its file's dtype. shape: entry.shape."""
    with source.folder.open(file) as handle:
        return read_tensor(handle, source.folder.label(file), entry, _dtype(source, file, entry))


def check_destination(src: Path, dst: Path) -> None:
    """The destination must be new (or an empty folder) and not the source."""
    if dst.exists() and (not dst.is_dir() or any(dst.iterdir())):
        raise CheckpointError(f"{dst}: already exists; the destination must be a new or empty folder")
    if dst.resolve() == src.resolve():
        raise CheckpointError(f"{dst}: the destination is the source folder")


@contextmanager
def _staging(dst: Path) -> Iterator[Path]:
    """A hidden sibling of `dst` to write into; renamed to `dst` when the block ends, removed on error."""
    dst.parent.mkdir(parents=True, exist_ok=True)
    staging = dst.parent / f".{dst.name}.partial-{os.getpid()}"
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir()
    try:
        yield staging
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    if dst.is_dir():
        dst.rmdir()  # empty, as check_destination found it
    os.replace(staging, dst)


def _copy_other_files(source: Source, out: Path) -> None:
    """Copy the folder's other regular files (tokenizer, generation config, ...) as they are."""
    weights = {CONFIG, INDEX, *source.shards}
    for name in source.folder.names():
        if name in weights or name.endswith(".safetensors") or name.endswith(_PICKLE_SUFFIXES) or name.startswith("."):
            continue
        if not (source.folder.root / name).is_file():
            continue  # subfolders are not part of a checkpoint's files
        with source.folder.open(name) as handle, open(out / name, "wb") as copy:
            shutil.copyfileobj(handle, copy)


def _write_shard(out: Path, file: str, shard: Mapping[str, torch.Tensor]) -> dict[str, int]:
    """Write one shard; returns its tensor names with their byte sizes, for the index."""
    save_file(dict(shard), str(out / file), metadata={"format": "pt"})
    return {name: t.numel() * t.element_size() for name, t in shard.items()}


def _finish(out: Path, source: Source, config: Mapping[str, Any], written: Mapping[str, Mapping[str, int]]) -> None:
    """config.json, the index (where the source has one) and the other files, after the shards."""
    if source.indexed:
        total = sum(size for shard in written.values() for size in shard.values())
        weight_map = {name: file for file, shard in written.items() for name in shard}
        index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
        (out / INDEX).write_text(json.dumps(index, indent=2) + "\n")
    (out / CONFIG).write_text(json.dumps(config, indent=2) + "\n")
    _copy_other_files(source, out)


def _bar(total: int, progress: bool, what: str) -> tqdm:
    return tqdm(total=total, disable=not progress, unit="tensor", desc=what)


def quantize_checkpoint(src: Path, dst: Path, *, progress: bool = True) -> None:
    """A float (float32 / float16 / bfloat16) checkpoint folder `src` -> the block-scaled FP8 layout in `dst`.

    Every tensor `is_quantized_name` names becomes float8_e4m3fn values plus a float32
    `_scale_inv` in the same shard, in 128 x 128 blocks; every other tensor is copied
    unchanged; config.json gains `quantization_config`.
    """
    src, dst = Path(src), Path(dst)
    source = read_source(src)
    check_destination(src, dst)
    label = source.folder.label(CONFIG)
    if source.config.get("quantization_config") is not None:
        raise CheckpointError(f"{label}: already has a quantization_config; this folder is quantized already")
    config = {**source.config, "quantization_config": dict(QUANTIZATION_CONFIG)}
    block = block_size(config, label)
    assert block is not None
    for file, entries in source.shards.items():
        for name, entry in entries.items():
            if name.endswith(SCALE_SUFFIX):
                raise CheckpointError(f"{source.folder.label(file)}: tensor {name!r} is a scale, but config.json "
                                      "has no quantization_config")
            if entry.dtype not in ("F32", "F16", "BF16"):
                raise CheckpointError(f"{source.folder.label(file)}: tensor {name!r} has dtype {entry.dtype!r}; "
                                      "quantizing takes float32, float16 or bfloat16 weights")
            if is_quantized_name(name, config) and len(entry.shape) != 2:
                raise CheckpointError(f"{source.folder.label(file)}: tensor {name!r} has shape {list(entry.shape)}, "
                                      "expected a 2-D projection weight")
    with _staging(dst) as out, _bar(len(source.names()), progress, "quantize") as bar:
        written: dict[str, dict[str, int]] = {}
        for file, entries in source.shards.items():
            shard: dict[str, torch.Tensor] = {}
            with source.folder.open(file) as handle:
                for name, entry in entries.items():
                    tensor = read_tensor(handle, source.folder.label(file), entry, _dtype(source, file, entry))
                    if is_quantized_name(name, config):
                        if not torch.isfinite(tensor).all():
                            raise CheckpointError(f"{source.folder.label(file)}: tensor {name!r} has non-finite values")
                        shard[name], shard[scale_name(name)] = block_quantize(tensor, block)
                    else:
                        shard[name] = tensor
                    bar.update()
            written[file] = _write_shard(out, file, shard)
        _finish(out, source, config, written)


def dequantize_checkpoint(src: Path, dst: Path, *, dtype: torch.dtype = torch.bfloat16, progress: bool = True) -> None:
    """A block-scaled FP8 checkpoint folder `src` (the released layout) -> float weights in `dst`.

    Each FP8 weight becomes `values * scale_inv` (per block) in `dtype` and its scale is dropped;
    every other tensor is copied unchanged (the released files keep some, such as the router's
    correction bias, in float32 on purpose); config.json loses `quantization_config`.
    Every scale is read and checked (dtype, shape against its weight and the block size, finite
    and positive) before anything is written.
    """
    if dtype not in (torch.float32, torch.float16, torch.bfloat16):
        raise ValueError(f"dtype {dtype} is not float32, float16 or bfloat16")
    src, dst = Path(src), Path(dst)
    source = read_source(src)
    check_destination(src, dst)
    label = source.folder.label(CONFIG)
    block = block_size(source.config, label)
    if block is None:
        raise CheckpointError(f"{label}: has no quantization_config; this folder is not an FP8 checkpoint")
    check_pairs(str(source.folder.root), source.names(), source.config)
    where = source.where()
    scales: dict[str, torch.Tensor] = {}
    for file, entries in source.shards.items():
        for name, entry in entries.items():
            dtype_here = _dtype(source, file, entry)
            if name.endswith(SCALE_SUFFIX):
                continue
            if not is_quantized_name(name, source.config):
                if dtype_here == FP8_DTYPE:
                    raise CheckpointError(f"{source.folder.label(file)}: tensor {name!r} is FP8, but the layout does "
                                          "not quantize it and it has no scale")
                continue
            scale_file = where[scale_name(name)]
            scale = _read(source, scale_file, source.shards[scale_file][scale_name(name)])
            # The weight's dtype and shape are known from its header: checked before any weight is read.
            check_quantized(source.folder.label(file), name, torch.empty(entry.shape, dtype=dtype_here, device="meta"),
                            scale, block)
            scales[name] = scale
    config = {key: value for key, value in source.config.items() if key != "quantization_config"}
    with _staging(dst) as out, _bar(len(source.names()) - len(scales), progress, "dequantize") as bar:
        written: dict[str, dict[str, int]] = {}
        for file, entries in source.shards.items():
            shard: dict[str, torch.Tensor] = {}
            with source.folder.open(file) as handle:
                for name, entry in entries.items():
                    if name.endswith(SCALE_SUFFIX):
                        continue
                    tensor = read_tensor(handle, source.folder.label(file), entry, _dtype(source, file, entry))
                    shard[name] = block_dequantize(tensor, scales[name], dtype, block) if name in scales else tensor
                    bar.update()
            if shard:
                written[file] = _write_shard(out, file, shard)
        _finish(out, source, config, written)
