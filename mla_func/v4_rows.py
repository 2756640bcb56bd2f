"""Per-row facts of a V4 step: each segment's rows with their own block tables, in every cache group.

A V4 attention layer treats every query row alone: the keys it sees are the last
`sliding_window` tokens of its sequence, the compressed entries complete at its
position, and (CSA) the indexer's top-k of those. What a row needs is its
position, its key count and its sequence's block table in each cache group;
`row_metadata` gives them for group 0, and the same function over the groups'
tables gives them for the others. The window start and the number of complete
entries follow from the key count (`window_positions`, `entry_counts`).

Each segment (prefill rows, then decode rows) gets its own `SegmentRows`, built
from that segment's own metadata only; nothing here syncs with the host.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from .batch import Batch
from .mode import ForwardMode
from .rows import row_metadata


@dataclass(frozen=True, slots=True)
class SegmentRows:
    """The rows [start, stop) of one segment.

    key_lens:     [n] int32, tokens the row sees (its position + 1; 0 for padding)
    block_table:  [n, W] int32, group 0 (per token)
    group_tables: per cache group 1.., [n, Wg] int32
    """

    start: int
    stop: int
    key_lens: torch.Tensor
    block_table: torch.Tensor
    group_tables: tuple[torch.Tensor, ...]


def step_rows(batch: Batch, mode: ForwardMode) -> tuple[SegmentRows, ...]:
    """The step's segments with rows: prefill rows [0, padded_prefill_tokens), then decode rows."""
    base = row_metadata(batch, mode)
    group_tables = []
    for meta, width in zip(batch.groups, mode.group_widths):
        prefill = batch.prefill if batch.prefill is None or meta.prefill_block_table is None \
            else replace(batch.prefill, block_table=meta.prefill_block_table)
        decode = batch.decode if batch.decode is None or meta.decode_block_table is None \
            else replace(batch.decode, block_table=meta.decode_block_table)
        rows = row_metadata(replace(batch, prefill=prefill, decode=decode), replace(mode, block_table_width=width))
        group_tables.append(rows.block_table)
    split, total = mode.padded_prefill_tokens, mode.num_tokens
    segments = []
    for start, stop in ((0, split), (split, total)):
        if stop > start:
            segments.append(SegmentRows(start, stop, base.key_lens[start:stop], base.block_table[start:stop],
                                        tuple(t[start:stop] for t in group_tables)))
    return tuple(segments)


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
