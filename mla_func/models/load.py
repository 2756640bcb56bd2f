"""Loading a model: a Hugging Face checkpoint folder or a named preset, into `Model`."""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Mapping
from contextlib import ExitStack
from dataclasses import dataclass
from io import FileIO
from pathlib import Path
from typing import Any

import torch

from mla_func.checkpoint.chat_template import read_chat_template
from mla_func.checkpoint.files import CheckpointError, CheckpointFolder
from mla_func.checkpoint.fp8 import DEFAULT_BLOCK
from mla_func.checkpoint.quant_layout import QuantLayout, check_pairs, paired, stored_dtype, stored_shapes
from mla_func.checkpoint.safetensors_file import TensorEntry, read_header, read_tensor
from mla_func.core.config import ConfigError, ModelConfig
from mla_func.core.family import Family
from mla_func.core.model import Model
from mla_func.core.params import Params, TensorFetch, params_from_hf
from mla_func.models.memory import require_memory
from mla_func.models.mtp.params import NO_MTP_LAYER, load_mtp, mtp_family, mtp_optional_shapes, mtp_tensor_shapes
from mla_func.models.presets import PRESETS, SHIPPED_PRESETS, preset_names
from mla_func.models.quant_layouts import layout_of
from mla_func.models.random_weights import random_params
from mla_func.models.registry import FAMILIES, config_from_json
from mla_func.models.tensor_shapes import hf_tensor_count, hf_tensor_shapes
from mla_func.parallel.config import Parallel
from mla_func.parallel.shard import shard_reader

__all__ = ["CheckpointError", "Model", "default_dtype", "load_model"]


_PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl")
# load_model's quantization= values, with the scale block each makes (None: float weights).
QUANTIZATIONS: dict[str | None, tuple[int, int] | None] = {None: None, "fp8": DEFAULT_BLOCK}
# Layers past num_hidden_layers (DeepSeek-V3's multi-token-prediction layer), `mtp.` tensors
# (DeepSeek-V4's multi-token-prediction layers), both read only with mtp=True, and rotary
# buffers that old exports saved are not part of the forward.
_SKIPPED = re.compile(r"(^|\.)rotary_emb\.inv_freq$|(^|\.)mtp\.")


def default_dtype(device: torch.device | str) -> torch.dtype:
    """bfloat16 on CUDA, float32 elsewhere."""
    return torch.bfloat16 if torch.device(device).type == "cuda" else torch.float32


def load_model(
    path_or_preset: str | Path,
    *,
    dtype: torch.dtype | None = None,
    device: torch.device | str | None = None,
    seed: int = 0,
    progress: bool | None = None,
    max_model_len: int | None = None,
    mtp: bool = False,
    quantization: str | None = None,
    families: Mapping[str, Family] = FAMILIES,
    parallel: Parallel | None = None,
) -> Model:
    """Load a checkpoint folder (config.json + *.safetensors) or a preset name.

    Every file of a folder is resolved, opened and checked by `CheckpointFolder`
    (names stay inside the folder, only regular files, symlinks only into the
    folder or a hub cache's blobs); every header, tensor name, shape and dtype is
    checked before a tensor is read, and every weight must be finite. Errors are
    `CheckpointError` (files, tensors) or `ConfigError` (config.json), naming
    the file and the tensor or field. Before a tensor is allocated, the bytes the params
    will hold are checked against the memory available on `device`: `NotEnoughMemory`
    (a ValueError, from `mla_func.models.memory`) names both.

    A folder's chat template (chat_template.jinja, or tokenizer_config.json's `chat_template`) is
    `Model.chat_template`, read by `mla_func.checkpoint.chat_template`; None without one.

    A shipped preset ("demo") is a checkpoint folder inside the package; a shape
    preset ("tiny", "v2-lite") gets random weights. A folder path of the same
    name as a preset wins over the preset.

    dtype:  the activation dtype, and the dtype of every weight a checkpoint does not store
            quantized; defaults to bfloat16 on CUDA and float32 elsewhere.
    device: defaults to "cuda" when available, else "cpu".
    seed:   for shape presets with random weights, the seed of their initialisation
            (done directly on `device`).
    mtp:    also load the first multi-token-prediction layer (`model.layers.{num_hidden_layers}.` of
            V2/V3, `mtp.0.` of V4; see `models.mtp.params`) as `Model.mtp`, the drafter of
            `Engine(speculative_tokens=)`; a checkpoint without one is refused. A shape preset gets a
            random one. A family without MTP support (`Family.mtp` None) refuses it.
    progress: a progress bar over layers; by default shown for models of over a
            billion parameters.
    max_model_len: positions the RoPE tables cover (`Model.max_positions`); by
            default max_position_embeddings, capped at `DEFAULT_MAX_POSITIONS`
            (an engine with a longer max_model_len extends them).
    quantization: None, or "fp8": a shape preset's projections as block-scaled FP8 pairs (random
            weights quantized in 128 x 128 blocks, as DeepSeek's FP8 checkpoints store them). A
            folder loads as it is stored (an FP8 checkpoint as FP8 pairs, see `checkpoint.fp8`):
            "fp8" for a folder of float weights is refused (`mla-func quantize` writes one).
    families: config.json's model_type -> the `Family` that reads and runs it (`models.registry.FAMILIES`;
            pass `{**FAMILIES, "my_model": MY_FAMILY}` to load a family of one's own).
    parallel: this rank's place in a tensor-parallel group (`mla_func.parallel.Parallel`): each rank
            reads only its shard of each tensor (`Family.tensor_split`; a block-scaled weight's values
            and the scales of their blocks, `mla_func.parallel.shard`) and the params know their ranks
            (`Params.collectives`). A checkpoint folder (its MTP layer cut as its other layers are).
    """
    # Truthiness would read mtp="no" as True and load a layer nobody asked for.
    if not isinstance(mtp, bool):
        raise ValueError(f"load_model: mtp must be a bool, got {mtp!r}")
    if progress is not None and not isinstance(progress, bool):
        raise ValueError(f"load_model: progress must be a bool or None, got {progress!r}")
    if quantization not in QUANTIZATIONS:
        raise ValueError(f"load_model: quantization must be one of {list(QUANTIZATIONS)}, got {quantization!r}")
    sharded = parallel is not None and parallel.tensor_parallel > 1
    device = torch.device(device if device is not None else ("cuda" if torch.cuda.is_available() else "cpu"))
    dtype = dtype or default_dtype(device)
    name = str(path_or_preset)
    if name in SHIPPED_PRESETS and not Path(name).exists():
        folder = SHIPPED_PRESETS[name]
        if not (folder / "config.json").is_file():
            raise CheckpointError(
                f"preset {name!r} ships as the folder {folder}, which has no config.json: "
                "this installation lacks the model files (for 'demo', python -m mla_func.demo.train writes them)"
            )
        return _load_folder(folder, dtype=dtype, device=device, progress=progress, max_model_len=max_model_len,
                            mtp=mtp, label=name, families=families, quantization=quantization, parallel=parallel)
    if name in PRESETS and not Path(name).exists():
        if sharded:
            raise ValueError(f"load_model: parallel= shards a checkpoint folder; preset {name!r} has random weights")
        config = PRESETS[name]()
        block = QUANTIZATIONS[quantization]
        require_memory(f"preset {name!r}", config, dtype=dtype, device=device, mtp=mtp, max_model_len=max_model_len,
                       block=block)
        params, drafter = random_params(config, dtype=dtype, device=device, seed=seed, mtp=mtp,
                                        progress=_show_progress(config, progress), max_model_len=max_model_len,
                                        block=block)
        return Model(config=config, params=params, mtp=drafter)
    path = Path(path_or_preset)
    if not path.is_dir():
        raise CheckpointError(
            f"{name!r} is neither a checkpoint folder nor a preset (presets: {preset_names()})"
        )
    return _load_folder(path, dtype=dtype, device=device, progress=progress, max_model_len=max_model_len, mtp=mtp,
                        label=str(path), families=families, quantization=quantization, parallel=parallel)


def _show_progress(config: ModelConfig, progress: bool | None) -> bool:
    if progress is not None:
        return progress
    return sum(math.prod(shape) for shape in hf_tensor_shapes(config).values()) > 1e9


_INDEX = "model.safetensors.index.json"
_MAX_LISTED = 20  # names shown of a longer list in an error


def _listing(names: list[str]) -> str:
    shown = repr(names[:_MAX_LISTED])
    return shown if len(names) <= _MAX_LISTED else f"{shown[:-1]}, ... and {len(names) - _MAX_LISTED} more]"


@dataclass(frozen=True, slots=True)
class _Located:
    """Where one tensor lives: its shard's file name and open handle, and its header entry."""

    file: str
    handle: FileIO
    entry: TensorEntry


def _load_folder(
    path: Path, *, dtype: torch.dtype, device: torch.device, progress: bool | None, max_model_len: int | None,
    mtp: bool = False, label: str, families: Mapping[str, Family], quantization: str | None = None,
    parallel: Parallel | None = None,
) -> Model:
    """Every file of the folder goes through `CheckpointFolder` (see checkpoint_files for the policy);
    `label` names the model in a memory error (the preset's name for a shipped preset)."""
    folder = CheckpointFolder.at(path)
    if not folder.has("config.json"):
        raise CheckpointError(f"{path}: no config.json")
    raw = folder.read_json("config.json", error=ConfigError)
    config = config_from_json(raw, folder.label("config.json"), families)
    # The family's reader has checked the fields; this is the format's own check of quantization_config.
    layout = layout_of(config, raw, folder.label("config.json"))
    block = None if layout is None else layout.block
    if quantization is not None and QUANTIZATIONS[quantization] != block:
        raise CheckpointError(f"{path}: load_model(quantization={quantization!r}), but the checkpoint stores "
                              f"{'float weights' if block is None else f'FP8 in {block[0]} x {block[1]} blocks'}: "
                              "a folder loads as it is stored (`mla-func quantize` writes an FP8 copy)")
    chat_template = read_chat_template(folder)  # read before the weights: a malformed one costs no load time
    with ExitStack() as stack:
        located = config.family.canonical_names(config, _locate_tensors(folder, stack), folder.root)
        expected = _expected_tensors(folder, config, located)
        if mtp:
            expected.update(mtp_tensor_shapes(config))
            _require_mtp_layer(folder, config, located)
            expected.update({n: s for n, s in mtp_optional_shapes(config).items() if n in located})
        if layout is not None:
            # A missing or stray scale is named as such before the shapes are compared.
            check_pairs(str(folder.root), located, layout)
            expected = stored_shapes(expected, layout)
        _check_tensor_names(folder, config, expected, located)
        require_memory(label, config, dtype=dtype, device=device, mtp=mtp, max_model_len=max_model_len,
                       layout=layout)
        dtypes = {name: _stored_dtype(config, layout, name, folder.label(located[name].file), located[name].entry, dtype)
                  for name in expected}
        shard = None if parallel is None else shard_reader(config, parallel, layout, expected, str(folder.root))

        def read(name: str) -> torch.Tensor:
            where = located[name]
            if shard is not None:
                return shard(name, where.handle, folder.label(where.file), where.entry, dtypes[name])
            return read_tensor(where.handle, folder.label(where.file), where.entry, dtypes[name])

        fetch = read if layout is None else paired(read, lambda name: folder.label(located[name].file), layout)
        if parallel is not None and parallel.expert_parallel and parallel.tensor_parallel > 1:
            params = _expert_parallel_params(config, parallel, fetch, dtype=dtype, device=device,
                                             progress=_show_progress(config, progress), max_model_len=max_model_len)
        else:
            params = params_from_hf(config, fetch, dtype=dtype, device=device,
                                    progress=_show_progress(config, progress), max_model_len=max_model_len)
        drafter = (load_mtp(config, params, fetch, dtype, device, frozenset(expected), parallel=parallel)
                   if mtp else None)
        if parallel is not None:
            params = dataclasses.replace(params, collectives=parallel.collectives)
    return Model(config=config, params=params, tokenizer=_load_tokenizer(folder), mtp=drafter,
                 chat_template=chat_template)


def _expert_parallel_params(config: ModelConfig, parallel: Parallel, fetch: TensorFetch, *, dtype: torch.dtype,
                            device: torch.device, progress: bool, max_model_len: int | None) -> Params:
    """This rank's params with whole routed experts (`Family.expert_parallel_params`)."""
    build = config.family.expert_parallel_params
    if build is None:
        raise ValueError(f"Parallel(expert_parallel=True): {config.family.title} models have no expert-parallel "
                         "params yet")
    return build(config, fetch, rank=parallel.rank, ranks=parallel.tensor_parallel, dtype=dtype, device=device,
                 progress=progress, max_model_len=max_model_len)


def _stored_dtype(config: ModelConfig, layout: QuantLayout | None, name: str, label: str, entry: TensorEntry,
                  dtype: torch.dtype) -> torch.dtype:
    """The dtype tensor `name` is read as: an FP8 pair's parts as the format stores them, every
    other tensor as its family says."""
    stored = None if layout is None else stored_dtype(name, label, entry.dtype, layout)
    return stored if stored is not None else config.family.checkpoint_dtype(name, label, entry, dtype)


def _require_mtp_layer(folder: CheckpointFolder, config: ModelConfig, located: Mapping[str, _Located]) -> None:
    """CheckpointError when not one tensor of the MTP layer is there (a checkpoint saved without it); a
    partial layer is left to `_check_tensor_names`, which lists what is missing."""
    prefix = mtp_family(config).prefix(config)
    if not any(name.startswith(prefix) for name in located):
        raise CheckpointError(
            f"{folder.root}: {NO_MTP_LAYER} (no tensor named {prefix}*), "
            "which speculative decoding (load_model(..., mtp=True)) needs; load it without mtp"
        )


def _shard_names(folder: CheckpointFolder) -> tuple[list[str], dict[str, str]]:
    """The shard file names, and the index's weight map ({} without an index)."""
    if folder.has(_INDEX):
        label = folder.label(_INDEX)
        index = folder.read_json(_INDEX)
        weight_map = index.get("weight_map") if isinstance(index, dict) else None
        if not isinstance(weight_map, dict) or not weight_map:
            raise CheckpointError(f"{label}: field 'weight_map' must be a non-empty object of tensor name -> file name")
        named_by: dict[str, str] = {}  # each file, checked once (an index lists ~90,000 tensors), by its first tensor
        for name, file in weight_map.items():
            if not isinstance(file, str) or not file.endswith(".safetensors"):
                raise CheckpointError(f"{label}: weight_map[{name!r}] = {file!r}: expected a *.safetensors file name")
            named_by.setdefault(file, name)
        for file, name in named_by.items():
            folder.resolve(file, named_by=f"{label}: weight_map[{name!r}]")
        return sorted(named_by), weight_map
    files = [name for name in folder.names() if name.endswith(".safetensors")]
    if files:
        return files, {}
    pickles = [name for name in folder.names() if Path(name).suffix in _PICKLE_SUFFIXES]
    if pickles:
        raise CheckpointError(
            f"{folder.root}: refusing pickle checkpoint files {pickles}: loading them can run arbitrary code. "
            "Convert them to safetensors first."
        )
    raise CheckpointError(f"{folder.root}: no *.safetensors files")


def _locate_tensors(folder: CheckpointFolder, stack: ExitStack) -> dict[str, _Located]:
    """Every tensor of every shard, its header checked; shards stay open on `stack`."""
    files, weight_map = _shard_names(folder)
    located: dict[str, _Located] = {}
    for file in files:
        handle = stack.enter_context(folder.open(file))
        for name, entry in read_header(handle, folder.label(file)).items():
            if name in located:
                raise CheckpointError(
                    f"{folder.root}: tensor {name!r} is in two shards, {located[name].file} and {file}"
                )
            located[name] = _Located(file, handle, entry)
    index_label = folder.label(_INDEX)
    for name, file in weight_map.items():
        if name not in located:
            raise CheckpointError(f"{index_label}: weight_map[{name!r}] = {file!r}, which does not hold it")
        if located[name].file != file:
            raise CheckpointError(
                f"{index_label}: weight_map[{name!r}] = {file!r}, but the tensor is in {located[name].file}"
            )
    return located


def _expected_tensors(folder: CheckpointFolder, config: ModelConfig,
                      located: Mapping[str, _Located]) -> dict[str, tuple[int, ...]]:
    # Counted first: listing the names of a config that claims 10**9 layers would never end.
    count = hf_tensor_count(config)
    if count > len(located) + _MAX_LISTED:
        raise CheckpointError(
            f"{folder.label('config.json')} describes {count} tensors, the safetensors files hold {len(located)}: "
            "check num_hidden_layers, n_routed_experts and first_k_dense_replace"
        )
    return hf_tensor_shapes(config)


def _check_tensor_names(
    folder: CheckpointFolder,
    config: ModelConfig,
    expected: Mapping[str, tuple[int, ...]],
    located: Mapping[str, _Located],
) -> None:
    problems: list[str] = []
    missing = sorted(set(expected) - set(located))
    if missing:
        problems.append(f"missing tensors: {_listing(missing)}")
    unexpected = []
    for name in sorted(set(located) - set(expected)):
        layer = re.match(r"model\.layers\.(\d{1,9})\.", name)
        if layer and int(layer.group(1)) >= config.num_hidden_layers:
            continue
        if _SKIPPED.search(name) or (name == "lm_head.weight" and config.tie_word_embeddings):
            continue
        unexpected.append(name)
    if unexpected:
        problems.append(f"unexpected tensors: {_listing(unexpected)}")
    misshaped = [
        f"{name}: expected {expected[name]}, got {located[name].entry.shape}"
        for name in sorted(set(expected) & set(located))
        if located[name].entry.shape != expected[name]
    ]
    if misshaped:
        problems.append(f"mis-shaped tensors: {_listing(misshaped)}")
    if problems:
        raise CheckpointError(f"{folder.root}: checkpoint does not match config.json; " + "; ".join(problems))


# tokenizer.json of DeepSeek-V3 is 8 MB.
_MAX_TOKENIZER_BYTES = 256 << 20


def _load_tokenizer(folder: CheckpointFolder) -> Any:
    if not folder.has("tokenizer.json"):
        return None
    from tokenizers import Tokenizer

    text = folder.read_text("tokenizer.json", _MAX_TOKENIZER_BYTES)
    try:
        return Tokenizer.from_str(text)
    except Exception as e:  # tokenizers raises plain Exception for a malformed file
        raise CheckpointError(f"{folder.label('tokenizer.json')}: not a tokenizers file: {e}") from e

