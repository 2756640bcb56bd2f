"""Shape and dtype checks shared by every op wrapper."""

from __future__ import annotations

from collections.abc import Sequence

import torch


def check_shape(name: str, tensor: torch.Tensor, expected: Sequence[int | None]) -> None:
    """Raise ValueError unless `tensor` has `expected` shape (None matches any size)."""
    got = tuple(tensor.shape)
    if len(got) != len(expected) or any(e is not None and e != g for e, g in zip(expected, got)):
        shown = tuple("*" if e is None else e for e in expected)
        raise ValueError(f"{name}: expected shape {shown}, got {got}")


def check_dtype(name: str, tensor: torch.Tensor, allowed: Sequence[torch.dtype]) -> None:
    if tensor.dtype not in allowed:
        raise ValueError(f"{name}: expected dtype in {[str(d) for d in allowed]}, got {tensor.dtype}")


def check_same_device(**tensors: torch.Tensor) -> None:
    devices = {name: t.device for name, t in tensors.items()}
    if len(set(devices.values())) > 1:
        raise ValueError(f"tensors on different devices: {devices}")
