"""The family registry: each config.json `model_type` to its `Family`, and reading configs through it.

The one module that imports every family: a new family is its own modules and one
line in `FAMILIES`. The loader and the config readers take the registry as an
argument (default `FAMILIES`), so a caller can run a family of its own by passing
`{**FAMILIES, "my_model": MY_FAMILY}` without editing mla-func.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from types import MappingProxyType
from typing import Any

from mla_func.checkpoint.files import read_json_file
from mla_func.core.config import ConfigError, ModelConfig, refuse
from mla_func.core.family import Family
from mla_func.models.dsa.family import DSA
from mla_func.models.mla.family import MLA
from mla_func.models.v4.family import V4

__all__ = ["FAMILIES", "config_from_hf_dict", "config_from_json", "family_for", "read_config", "registry"]


def registry(*families: Family) -> Mapping[str, Family]:
    """model_type -> family, for every model_type of `families` (ValueError when two claim one)."""
    out: dict[str, Family] = {}
    for family in families:
        for model_type in family.model_types:
            if model_type in out:
                raise ValueError(f"registry: model_type {model_type!r} is claimed by families "
                                 f"{out[model_type].name!r} and {family.name!r}")
            out[model_type] = family
    return MappingProxyType(out)


FAMILIES = registry(MLA, DSA, V4)


def family_for(model_type: Any, families: Mapping[str, Family] = FAMILIES) -> Family:
    """The family that reads `model_type`; ConfigError naming the field when none does."""
    family = families.get(model_type) if isinstance(model_type, str) else None
    if family is None:
        raise refuse("model_type", model_type, f"expected one of {tuple(families)}")
    return family


def config_from_hf_dict(raw: Any, families: Mapping[str, Family] = FAMILIES) -> ModelConfig:
    """Read a Hugging Face config.json dict, as the family of its model_type does; ConfigError names the field."""
    if not isinstance(raw, Mapping):
        raise ConfigError(f"config.json must hold a JSON object, got {type(raw).__name__}")
    family = family_for(raw.get("model_type"), families)
    return family.config_from_hf(raw, family)


def config_from_json(raw: Any, label: str, families: Mapping[str, Family] = FAMILIES) -> ModelConfig:
    """`config_from_hf_dict`, with the file `label` in every error."""
    try:
        return config_from_hf_dict(raw, families)
    except ConfigError as e:
        raise ConfigError(f"{label}: {e}") from None


def read_config(path: str | Path, families: Mapping[str, Family] = FAMILIES) -> ModelConfig:
    """Read config.json at `path` (a regular file, at most a few MiB of JSON); errors name the file and the field."""
    path = Path(path)
    return config_from_json(read_json_file(path, error=ConfigError), str(path), families)
