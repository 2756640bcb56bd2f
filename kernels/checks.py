"""Shape and dtype checks shared by every op wrapper."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import torch


class Shaped(Protocol):
    """A tensor, or a value that stands for one (`latent_cache.FP8LatentCache`)."""

    @property
    def shape(self) -> torch.Size: ...


def check_shape(name: str, tensor: Shaped, expected: Sequence[int | None]) -> None:
    """Raise ValueError unless `tensor` has `expected` shape (None matches any size)."""
    got = tensor.shape
    # A plain loop: every op call runs this several times, and a generator costs more than the check.
    if len(got) == len(expected):
        for e, g in zip(expected, got):
            if e is not None and e != g:
                break
        else:
            return
    shown = tuple("*" if e is None else e for e in expected)
    raise ValueError(f"{name}: expected shape {shown}, got {tuple(got)}")


def as_dtype(tensor: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """`tensor.to(dtype)`, skipping the call when it already has that dtype (the same tensor either way):
    the reference ops widen to float32 several times per op, a no-op in a float32 model."""
    return tensor if tensor.dtype == dtype else tensor.to(dtype)


def check_dtype(name: str, tensor: torch.Tensor, allowed: Sequence[torch.dtype]) -> None:
    if tensor.dtype not in allowed:
        raise ValueError(f"{name}: expected dtype in {[str(d) for d in allowed]}, got {tensor.dtype}")


def check_same_device(**tensors: torch.Tensor) -> None:
    devices = {name: t.device for name, t in tensors.items()}
    if len(set(devices.values())) > 1:
        raise ValueError(f"tensors on different devices: {devices}")


# The routing rules by name: the one definition that the config checks and the ops read.
SCORING_FUNCS = ("softmax", "sigmoid", "sqrtsoftplus")
GROUP_LIMITED_METHODS = ("group_limited_greedy", "noaux_tc")
TOPK_METHODS = ("greedy", *GROUP_LIMITED_METHODS)


def check_route_args(num_experts: int, *, top_k: int, scoring_func: str, topk_method: str,
                     n_group: int | None, topk_group: int | None, num_shared: int = 0) -> None:
    """Raise ValueError unless the routing arguments describe a choice of top_k of num_experts experts.

    Group arguments are read only by the group-limited methods, which need n_group
    to divide num_experts and the topk_group kept groups to hold at least top_k experts.
    """
    if scoring_func not in SCORING_FUNCS:
        raise ValueError(f"scoring_func: expected one of {SCORING_FUNCS}, got {scoring_func!r}")
    if topk_method not in TOPK_METHODS:
        raise ValueError(f"topk_method: expected one of {TOPK_METHODS}, got {topk_method!r}")
    if not 1 <= top_k <= num_experts:
        raise ValueError(f"top_k: expected 1 <= top_k <= num_experts={num_experts}, got {top_k}")
    if num_shared < 0:
        raise ValueError(f"num_shared: expected >= 0, got {num_shared}")
    if topk_method == "greedy":
        return
    if not n_group or n_group < 1 or num_experts % n_group:
        raise ValueError(f"n_group: expected a divisor of num_experts={num_experts} for {topk_method}, got {n_group}")
    if not topk_group or not 1 <= topk_group <= n_group:
        raise ValueError(f"topk_group: expected 1 <= topk_group <= n_group={n_group}, got {topk_group}")
    group_size = num_experts // n_group
    if topk_group * group_size < top_k:
        raise ValueError(f"topk_group: {topk_group} groups of {group_size} experts hold fewer than top_k={top_k}")
    if topk_method == "noaux_tc" and group_size < 2:
        raise ValueError(f"n_group: noaux_tc scores a group by its best two experts, got groups of {group_size}")
