"""The engine's limits: the `EngineConfig` and the checks and defaults of its arguments."""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from mla_func.core.model import Model
from mla_func.core.prepare import state_bytes_per_block
from mla_func.models.mtp.layer import drafter_bytes_per_block


@dataclass(frozen=True, slots=True)
class EngineConfig:
    """The engine's limits; every field has a documented default (see `Engine`)."""

    block_size: int
    num_blocks: int
    max_num_seqs: int
    max_num_batched_tokens: int
    long_prefill_token_threshold: int | None
    enable_mixed: bool
    enable_prefix_caching: bool
    max_model_len: int
    backend: str
    graphs: bool
    graph_kinds: tuple[str, ...]
    batch_invariant: bool
    speculative_tokens: int = 0


def check_limit(name: str, value: object, low: int | None, high: int | None = None, what: str = "",
                 why: str = "", *, or_none: bool = False) -> None:
    """ValueError naming the Engine argument unless `value` is an int in [low, high] (low None: any int),
    or None when `or_none`. A bool is refused: True would pass as 1."""
    if or_none and value is None:
        return
    if (not isinstance(value, int) or isinstance(value, bool) or (low is not None and value < low)
            or (high is not None and value > high)):
        bound = "" if low is None else f" >= {low}" if high is None else f" in [{low}, {high}] ({what})"
        none = " or None" if or_none else ""
        raise ValueError(f"Engine: {name} must be an int{bound}{none}{f', as {why}' if why else ''}, got {value!r}")


def check_flag(name: str, value: object) -> None:
    """ValueError naming the Engine argument unless `value` is a bool: a string such as "no" or "false"
    is truthy, and 0 or 1 may be a misplaced count, so only True and False are taken."""
    if not isinstance(value, bool):
        raise ValueError(f"Engine: {name} must be a bool, got {value!r}")


def default_num_blocks(model: Model, block_size: int, max_num_seqs: int, max_model_len: int, *,
                       speculative: bool = False) -> int:
    """Blocks for the cache: what max_num_seqs full-length sequences need, within a share of free memory
    (the drafter's cache, with `speculative`, is in every block too)."""
    bytes_per_block = state_bytes_per_block(model, block_size)
    if speculative:
        bytes_per_block += drafter_bytes_per_block(model, block_size)
    wanted = 1 + max_num_seqs * -(-max_model_len // block_size)
    if model.device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(model.device)
        # Leave room for activations, graph pools and the sampler's [N, V] buffers.
        budget = int(free * 0.85) - (2 << 30)
    else:
        budget = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // 8
    return max(2, min(wanted, budget // bytes_per_block))
