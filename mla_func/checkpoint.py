"""Loading a model: a Hugging Face checkpoint folder or a named preset, into `Model`."""

from __future__ import annotations

import json
import math
import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from .config import ModelConfig
from .params import Params, hf_tensor_shapes, params_from_hf
from .presets import PRESETS, SHIPPED_PRESETS, preset_names


class CheckpointError(ValueError):
    """A checkpoint cannot be loaded: missing, unexpected or mis-shaped tensors, or an unsafe format."""


@dataclass(frozen=True, slots=True)
class Model:
    """A loaded model: its config, its params pytree, and its tokenizer when it has one."""

    config: ModelConfig
    params: Params
    tokenizer: Any = None  # tokenizers.Tokenizer, or None

    @property
    def device(self) -> torch.device:
        return self.params.embed.device

    @property
    def dtype(self) -> torch.dtype:
        return self.params.embed.dtype


_PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl")
# Layers past num_hidden_layers (DeepSeek-V3's multi-token-prediction layer) and
# rotary buffers that old exports saved are not part of the forward.
_SKIPPED = re.compile(r"(^|\.)rotary_emb\.inv_freq$")


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
) -> Model:
    """Load a checkpoint folder (config.json + *.safetensors) or a preset name.

    A shipped preset ("demo") is a checkpoint folder inside the package; a shape
    preset ("tiny", "v2-lite") gets random weights. A folder path of the same
    name as a preset wins over the preset.

    dtype:  weight dtype; defaults to bfloat16 on CUDA and float32 elsewhere.
    device: defaults to "cuda" when available, else "cpu".
    seed:   for shape presets with random weights, the seed of their initialisation
            (done directly on `device`).
    progress: a progress bar over layers; by default shown for models of over a
            billion parameters.
    """
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
        return _load_folder(folder, dtype=dtype, device=device, progress=progress)
    if name in PRESETS and not Path(name).exists():
        config = PRESETS[name]()
        return _random_model(config, dtype=dtype, device=device, seed=seed, progress=_show_progress(config, progress))
    path = Path(path_or_preset)
    if not path.is_dir():
        raise CheckpointError(
            f"{name!r} is neither a checkpoint folder nor a preset (presets: {preset_names()})"
        )
    return _load_folder(path, dtype=dtype, device=device, progress=progress)


def _show_progress(config: ModelConfig, progress: bool | None) -> bool:
    if progress is not None:
        return progress
    return sum(math.prod(shape) for shape in hf_tensor_shapes(config).values()) > 1e9


def _load_folder(path: Path, *, dtype: torch.dtype, device: torch.device, progress: bool | None) -> Model:
    config_file = path / "config.json"
    if not config_file.is_file():
        raise CheckpointError(f"{path}: no config.json")
    config = ModelConfig.from_file(config_file)
    files = _safetensors_files(path)
    available: dict[str, Path] = {}
    for file in files:
        with safe_open(file, framework="pt") as f:
            for key in f.keys():
                available[key] = file
    expected = hf_tensor_shapes(config)
    _check_tensor_names(path, config, expected, available)

    handles: dict[Path, Any] = {}

    def fetch(name: str) -> torch.Tensor:
        file = available[name]
        if file not in handles:
            handles[file] = safe_open(file, framework="pt", device="cpu")
        return handles[file].get_tensor(name)

    params = params_from_hf(config, fetch, dtype=dtype, device=device, progress=_show_progress(config, progress))
    return Model(config=config, params=params, tokenizer=_load_tokenizer(path))


def _safetensors_files(path: Path) -> list[Path]:
    index = path / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        files = sorted({path / f for f in weight_map.values()})
        missing = [str(f.name) for f in files if not f.is_file()]
        if missing:
            raise CheckpointError(f"{path}: shards named in {index.name} are missing: {missing}")
        return files
    files = sorted(path.glob("*.safetensors"))
    if files:
        return files
    pickles = sorted(p.name for p in path.iterdir() if p.suffix in _PICKLE_SUFFIXES)
    if pickles:
        raise CheckpointError(
            f"{path}: refusing pickle checkpoint files {pickles}: loading them can run arbitrary code. "
            "Convert them to safetensors first."
        )
    raise CheckpointError(f"{path}: no *.safetensors files")


def _check_tensor_names(
    path: Path,
    config: ModelConfig,
    expected: Mapping[str, tuple[int, ...]],
    available: Mapping[str, Path],
) -> None:
    problems: list[str] = []
    missing = sorted(set(expected) - set(available))
    if missing:
        problems.append(f"missing tensors: {missing}")
    unexpected = []
    for name in sorted(set(available) - set(expected)):
        layer = re.match(r"model\.layers\.(\d+)\.", name)
        if layer and int(layer.group(1)) >= config.num_hidden_layers:
            continue
        if _SKIPPED.search(name) or (name == "lm_head.weight" and config.tie_word_embeddings):
            continue
        unexpected.append(name)
    if unexpected:
        problems.append(f"unexpected tensors: {unexpected}")
    handles: dict[Path, Any] = {}
    misshaped = []
    for name in sorted(set(expected) & set(available)):
        file = available[name]
        if file not in handles:
            handles[file] = safe_open(file, framework="pt")
        shape = tuple(handles[file].get_slice(name).get_shape())
        if shape != expected[name]:
            misshaped.append(f"{name}: expected {expected[name]}, got {shape}")
    if misshaped:
        problems.append(f"mis-shaped tensors: {misshaped}")
    if problems:
        raise CheckpointError(f"{path}: checkpoint does not match config.json; " + "; ".join(problems))


def _load_tokenizer(path: Path) -> Any:
    file = path / "tokenizer.json"
    if not file.is_file():
        return None
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(file))


def _random_model(config: ModelConfig, *, dtype: torch.dtype, device: torch.device, seed: int, progress: bool) -> Model:
    """Random weights with the shapes of `config`, made on `device`, through the checkpoint path."""
    shapes = hf_tensor_shapes(config)
    generator = torch.Generator(device=device).manual_seed(seed)

    def fetch(name: str) -> torch.Tensor:
        shape = shapes[name]
        if name.endswith("e_score_correction_bias"):
            return torch.zeros(shape, device=device)
        if len(shape) == 1:  # norm weights
            return torch.ones(shape, device=device)
        # std 1/sqrt(fan_in) keeps activations of order one through every layer. Drawn in
        # float32 (and cast by params_from_hf), so a seed gives the same weights in every dtype.
        std = shape[1] ** -0.5
        return torch.empty(shape, device=device).normal_(0.0, std, generator=generator)

    return Model(config=config, params=params_from_hf(config, fetch, dtype=dtype, device=device, progress=progress))
