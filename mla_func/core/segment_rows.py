"""Each segment's rows as single queries in every cache group: built once per step, on the device.

Layer kinds whose every query row has its own key set (a sliding window and
compressed entries) read, per row, its key count and its sequence's block table in
each cache group. `row_metadata` gives them for group 0; the same function over
each group's tables gives them for the others. `build_batch` stores the result in
`Batch.rows` for models with cache groups past 0, so layers never re-derive it;
nothing here syncs with the host.
"""

from __future__ import annotations

from dataclasses import replace

from mla_func.core.batch import Batch, SegmentRows
from mla_func.core.mode import ForwardMode
from mla_func.core.rows import row_metadata


def step_rows(batch: Batch, mode: ForwardMode) -> tuple[SegmentRows, ...]:
    """The step's segments with rows: prefill rows [0, padded_prefill_tokens), then decode rows,
    each from its own segment's metadata."""
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
    return tuple(
        SegmentRows(key_lens=base.key_lens[start:stop], block_table=base.block_table[start:stop],
                    group_tables=tuple(t[start:stop] for t in group_tables), start=start, stop=stop)
        for start, stop in ((0, split), (split, total)) if stop > start
    )
