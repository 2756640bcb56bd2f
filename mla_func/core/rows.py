"""Per-row attention metadata: every row of a step as a query of its own, in every cache group.

Prefill and decode segments describe their rows by sequence (a prefill
sequence's rows are `cu_seqlens_q`-delimited, a decode sequence has
`mode.decode_q_len` rows). Layers that treat every query row alike -- the
batch-invariant attention path, which runs prefill rows through the decode
kernel so that a token gets the same bits in either segment; the sparse
attention whose key set differs per row anyway; a sliding window over
compressed entries in other cache groups -- read the rows' own view: the number
of keys the row sees and its sequence's block table in each cache group.

It is built once a step, inside the pure forward (`forward._run`, when
`rows_needed` says so), and handed to every layer as `LayerContext.rows`; layers
never rebuild it. Everything is computed on the device from the batch, with no
host sync, so it is captured in a step's graph with the layers that read it and
is never copied into a graph's buffers on replay (it is not part of the batch).
`SegmentRows` is one segment's slice of it, for layers that run each segment
on its own.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from mla_func.core.batch import Batch
from mla_func.core.config import ModelConfig
from mla_func.core.mode import ForwardMode

__all__ = ["RowMetadata", "SegmentRows", "row_metadata", "rows_needed"]


@dataclass(frozen=True, slots=True)
class SegmentRows:
    """Rows [start, stop) of one segment (prefill or decode) of a `RowMetadata`, each a query of its own.

    key_lens:     [n] int32, keys the row sees: its position + 1 (0: padding); n = stop - start
    block_table:  [n, W] int32, the row's sequence's group-0 table
    group_tables: per cache group 1.., [n, W_g] int32 the row's sequence's table in that group
    """

    key_lens: torch.Tensor
    block_table: torch.Tensor
    group_tables: tuple[torch.Tensor, ...]
    start: int
    stop: int


@dataclass(frozen=True, slots=True)
class RowMetadata:
    """The keys each row of a step attends to, in every cache group.

    Rows: [prefill tokens | padding | decode rows | padding], T = mode.num_tokens.
    key_lens:     [T] int32, keys row t sees: its position + 1 (causal); 0 for padded rows
    block_table:  [T, W] int32, row t's sequence's group-0 block table (padded rows: a table
                  whose entries are the scratch block, or any real row's: they see no key)
    group_tables: per cache group 1.. (`mode.group_widths`), [T, W_g] int32, row t's sequence's
                  block table in that group; () for a state of one cache group
    """

    key_lens: torch.Tensor
    block_table: torch.Tensor
    group_tables: tuple[torch.Tensor, ...] = ()

    def segments(self, mode: ForwardMode) -> tuple[SegmentRows, ...]:
        """Each segment with rows, as views: prefill rows [0, padded_prefill_tokens), then decode rows
        [padded_prefill_tokens, num_tokens). Slicing is free, so layers take these per call."""
        split, total = mode.padded_prefill_tokens, mode.num_tokens
        return tuple(
            SegmentRows(key_lens=self.key_lens[start:stop], block_table=self.block_table[start:stop],
                        group_tables=tuple(t[start:stop] for t in self.group_tables), start=start, stop=stop)
            for start, stop in ((0, split), (split, total)) if stop > start
        )


def rows_needed(config: ModelConfig, mode: ForwardMode) -> bool:
    """Whether a step's layers read `LayerContext.rows`: the one place that says when the forward builds it.

    Batch-invariant steps send every row through the decode path; a family whose layers attend
    row by row (`Family.attends_by_row`) reads them in every step; and a state with cache groups
    past 0 has layers that address those groups row by row.
    """
    return mode.batch_invariant or config.family.attends_by_row or bool(mode.group_widths)


def row_metadata(batch: Batch, mode: ForwardMode) -> RowMetadata:
    """Rows [prefill tokens | padding | decode rows | padding] as T single-query rows, in every cache group.

    A row at position p sees keys [0, p]: for a decode sequence of `decode_q_len`
    causal queries that is the same as `seq_lens - q_len + 1 + j` for query j.
    Group g's tables come from `batch.groups[g - 1]`, `mode.group_widths[g - 1]` wide.
    """
    key_lens = torch.where(batch.real_rows(), batch.positions + 1, 0).to(torch.int32)     # [T]
    prefill_seq = None                                                                      # [padded_prefill_tokens]
    if mode.padded_prefill_tokens:
        prefill = batch.prefill
        if prefill is None:
            raise ValueError("row_metadata: the mode has a prefill segment, the batch has no prefill metadata")
        rows = torch.arange(mode.padded_prefill_tokens, device=batch.positions.device, dtype=prefill.cu_seqlens_q.dtype)
        # Row t belongs to the sequence whose row range [cu[s], cu[s + 1]) holds it; padded
        # rows lie past the last offset and take the last table (they see no key). Found once,
        # for every group's tables: they share the sequence order.
        prefill_seq = torch.searchsorted(prefill.cu_seqlens_q[1:], rows, right=True)
        prefill_seq = prefill_seq.clamp_(max=prefill.block_table.shape[0] - 1)
    if mode.padded_decode_seqs and batch.decode is None:
        raise ValueError("row_metadata: the mode has a decode segment, the batch has no decode metadata")
    if len(batch.groups) != len(mode.group_widths):
        raise ValueError(f"row_metadata: the mode has {len(mode.group_widths)} cache groups past group 0, the batch "
                         f"has {len(batch.groups)}")

    def per_row(name: str, prefill_table: torch.Tensor | None, decode_table: torch.Tensor | None,
                width: int) -> torch.Tensor:
        """Per-sequence tables [Bp, width], [Bd, width] -> per-row [T, width]."""
        parts = []
        if prefill_seq is not None:
            if prefill_table is None:
                raise ValueError(f"row_metadata: the mode has a prefill segment, {name} has no prefill block table")
            parts.append(prefill_table.index_select(0, prefill_seq))
        if mode.padded_decode_seqs:
            if decode_table is None:
                raise ValueError(f"row_metadata: the mode has a decode segment, {name} has no decode block table")
            q_len = mode.decode_q_len
            parts.append(decode_table.repeat_interleave(q_len, dim=0) if q_len > 1 else decode_table)
        if not parts:
            return torch.zeros((0, width), dtype=torch.int32, device=key_lens.device)
        return parts[0] if len(parts) == 1 else torch.cat(parts, dim=0)

    prefill_meta, decode_meta = batch.prefill, batch.decode
    block_table = per_row("the batch", None if prefill_meta is None else prefill_meta.block_table,
                          None if decode_meta is None else decode_meta.block_table, mode.block_table_width)
    group_tables = tuple(per_row(f"cache group {g}", meta.prefill_block_table, meta.decode_block_table, width)
                         for g, (meta, width) in enumerate(zip(batch.groups, mode.group_widths), start=1))
    return RowMetadata(key_lens=key_lens, block_table=block_table, group_tables=group_tables)
