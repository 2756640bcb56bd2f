"""What a V4 layer reads of each row's keys: its window, its complete entries, their cache slots.

A V4 attention layer treats every query row alone (see `batch.SegmentRows`, built
once per step): the keys it sees are the last `sliding_window` tokens of its
sequence and the compressed entries complete at its position. Both follow from
the row's key count, elementwise, on the device.
"""

from __future__ import annotations

import torch


def window_positions(key_lens: torch.Tensor, window: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's window: (positions [n, window] int64, valid [n, window] bool).

    Row t sees positions [key_lens[t] - window, key_lens[t]) that are >= 0 (invalid ones
    are clamped to 0 for safe indexing).
    """
    offsets = torch.arange(window, device=key_lens.device, dtype=torch.int64) - window
    positions = key_lens.to(torch.int64).unsqueeze(1) + offsets
    valid = positions >= 0
    return positions.clamp(min=0), valid


def entry_counts(key_lens: torch.Tensor, rate: int) -> torch.Tensor:
    """[n] int64: compressed entries complete at each row's position (entry e is complete
    once its last token, position (e + 1) * rate - 1, is in)."""
    return key_lens.to(torch.int64) // rate


def slots_of(block_table: torch.Tensor, indices: torch.Tensor, block_size: int) -> torch.Tensor:
    """Cache slots of per-row indices (token positions or entry numbers).

    block_table [n, W] int32; indices [n, L] int64 (>= 0, within the table) -> [n, L] int64
    """
    blocks = torch.gather(block_table.to(torch.int64), 1, indices // block_size)
    return blocks * block_size + indices % block_size
