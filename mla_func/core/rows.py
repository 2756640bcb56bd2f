"""Per-row attention metadata: every row of a step as a query of its own.

Prefill and decode segments describe their rows by sequence (a prefill
sequence's rows are `cu_seqlens_q`-delimited, a decode sequence has
`mode.decode_q_len` rows). Ops that treat every query row alike -- the
batch-invariant attention path, which runs prefill rows through the decode
kernel so that a token gets the same bits in either segment, and the sparse
attention whose key set differs per row anyway -- read the rows' own view:
the block table of the row's sequence and the number of keys the row sees.

Everything is computed on the device from the batch, with no host sync, so it
is part of the pure forward and of a captured graph.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from mla_func.core.batch import Batch
from mla_func.core.mode import ForwardMode

__all__ = ["RowMetadata", "row_metadata"]


@dataclass(frozen=True, slots=True)
class RowMetadata:
    """The keys each row of a step attends to.

    block_table: [T, W] int32, row t's sequence's block table (padded rows: a table
                 whose entries are the scratch block, or any real row's: they see no key)
    key_lens:    [T] int32, keys row t sees: its position + 1 (causal); 0 for padded rows
    """

    block_table: torch.Tensor
    key_lens: torch.Tensor


def row_metadata(batch: Batch, mode: ForwardMode) -> RowMetadata:
    """Rows [prefill tokens | padding | decode rows | padding] as T single-query rows.

    A row at position p sees keys [0, p]: for a decode sequence of `decode_q_len`
    causal queries that is the same as `seq_lens - q_len + 1 + j` for query j.
    """
    key_lens = torch.where(batch.real_rows(), batch.positions + 1, 0).to(torch.int32)     # [T]
    tables = []
    split = mode.padded_prefill_tokens
    if split:
        prefill = batch.prefill
        if prefill is None:
            raise ValueError("row_metadata: the mode has a prefill segment, the batch has no prefill metadata")
        rows = torch.arange(split, device=batch.positions.device, dtype=prefill.cu_seqlens_q.dtype)
        # Row t belongs to the sequence whose row range [cu[s], cu[s + 1]) holds it; padded
        # rows lie past the last offset and take the last table (they see no key).
        seq = torch.searchsorted(prefill.cu_seqlens_q[1:], rows, right=True)
        seq = seq.clamp_(max=prefill.block_table.shape[0] - 1)
        tables.append(prefill.block_table.index_select(0, seq))
    if mode.padded_decode_seqs:
        decode = batch.decode
        if decode is None:
            raise ValueError("row_metadata: the mode has a decode segment, the batch has no decode metadata")
        table = decode.block_table
        tables.append(table.repeat_interleave(mode.decode_q_len, dim=0) if mode.decode_q_len > 1 else table)
    if not tables:
        width = mode.block_table_width
        return RowMetadata(torch.zeros((0, width), dtype=torch.int32, device=key_lens.device), key_lens)
    block_table = tables[0] if len(tables) == 1 else torch.cat(tables, dim=0)
    return RowMetadata(block_table=block_table, key_lens=key_lens)
