"""Batch: the device tensors of one step, and their shape contract with the mode.

Every shape comes from the `ForwardMode`; every value from the `StepPlan`
(`build_batch` in `batch_build` turns one into the other, checking the plan on the
host). `check_batch` checks shapes and dtypes against the mode, with no device sync.

Padded rows: input id 0, position 0, slot -1 (writes nothing), no sequence
(prefill) or a sequence of length 0 (decode), block table entries pointing at
the scratch block, so they attend to nothing and produce zero attention output.

The batch holds only what the host plans (and what a graph copies in on every
replay): the per-row view layers read (each row's key count and block table in
every cache group) is derived from it on the device by the forward (`rows`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from mla_func.core.mode import ForwardMode
from mla_func.core.plan_checks import BatchError
from mla_func.pytree import register_dataclass

__all__ = ["Batch", "BatchError", "DecodeMetadata", "GroupMetadata", "PrefillMetadata", "check_batch"]


@register_dataclass
@dataclass(frozen=True, slots=True)
class PrefillMetadata:
    """Metadata of the prefill segment (its own values, never views of another segment's)."""

    cu_seqlens_q: torch.Tensor  # [Bp + 1] int32 row offsets in the segment; the padded tail repeats the last
    seq_lens: torch.Tensor      # [Bp] int32 KV length after this step; 0 for padded sequences
    block_table: torch.Tensor   # [Bp, W] int32; unused entries point at the scratch block


@register_dataclass
@dataclass(frozen=True, slots=True)
class DecodeMetadata:
    """Metadata of the decode segment: `mode.decode_q_len` query tokens per sequence."""

    seq_lens: torch.Tensor      # [Bd] int32 KV length including this step's tokens; 0 for padded sequences
    block_table: torch.Tensor   # [Bd, W] int32


@register_dataclass
@dataclass(frozen=True, slots=True)
class GroupMetadata:
    """The addressing of one cache group 1.. for one step (group 0's is the batch's own fields).

    A row writes an entry of the group when its token completes one (position p with
    (p + 1) % tokens_per_entry == 0); other rows, padding included, have slot -1.
    """

    slot_mapping: torch.Tensor                 # [T] int64 entry slot, or -1
    prefill_block_table: torch.Tensor | None   # [Bp, Wg] int32; unused entries point at the scratch block
    decode_block_table: torch.Tensor | None    # [Bd, Wg] int32


@register_dataclass
@dataclass(frozen=True, slots=True)
class Batch:
    """One step's inputs. Rows: [prefill tokens | padding | decode rows | padding]."""

    input_ids: torch.Tensor       # [T] int64
    positions: torch.Tensor       # [T] int64
    slot_mapping: torch.Tensor    # [T] int64, block * block_size + offset; -1 for padded rows
    logits_indices: torch.Tensor  # [N] int64 rows whose logits are returned (padded entries: row 0)
    prefill: PrefillMetadata | None = None
    decode: DecodeMetadata | None = None
    groups: tuple[GroupMetadata, ...] = ()     # cache groups 1.. (none for one group)
    # [T, D] the hidden state each row continues from: the input of a drafter step (an MTP
    # layer reads the target's states beside its tokens); None for a model's own steps.
    hidden: torch.Tensor | None = None

    def real_rows(self) -> torch.Tensor:
        """[T] bool: True for real rows, False for padding.

        Cache group 0 holds one entry per token (`CacheGroup.tokens_per_entry` is 1
        there by contract), so every real row writes one group-0 slot and no padding
        row writes any: that is how rows are told apart, without one more field to
        copy into a graph's buffers on every replay.
        """
        return self.slot_mapping >= 0


def _expect(name: str, tensor: torch.Tensor, shape: tuple[int, ...], dtype: torch.dtype) -> None:
    if tuple(tensor.shape) != shape:
        raise BatchError(f"{name}: expected shape {shape} from the mode, got {tuple(tensor.shape)}")
    if tensor.dtype != dtype:
        raise BatchError(f"{name}: expected dtype {dtype}, got {tensor.dtype}")


def check_batch(batch: Batch, mode: ForwardMode) -> None:
    """The shape contract between a batch and its mode (shapes and dtypes only: no device sync).

    input_ids, positions and slot_mapping have one entry per row; each segment's
    metadata matches that segment's padded sizes; logits_indices matches
    padded_num_logits.
    """
    rows = (mode.num_tokens,)
    _expect("input_ids", batch.input_ids, rows, torch.int64)
    _expect("positions", batch.positions, rows, torch.int64)
    _expect("slot_mapping", batch.slot_mapping, rows, torch.int64)
    _expect("logits_indices", batch.logits_indices, (mode.padded_num_logits,), torch.int64)
    if batch.hidden is not None and (batch.hidden.dim() != 2 or batch.hidden.shape[0] != mode.num_tokens):
        raise BatchError(f"hidden: expected shape ({mode.num_tokens}, D) from the mode, got {tuple(batch.hidden.shape)}")
    width = mode.block_table_width
    if (batch.prefill is None) != (mode.padded_prefill_seqs == 0):
        raise BatchError(f"prefill metadata: mode has {mode.padded_prefill_seqs} prefill seqs, batch has "
                         f"{'none' if batch.prefill is None else 'some'}")
    if batch.prefill is not None:
        n = mode.padded_prefill_seqs
        _expect("prefill.cu_seqlens_q", batch.prefill.cu_seqlens_q, (n + 1,), torch.int32)
        _expect("prefill.seq_lens", batch.prefill.seq_lens, (n,), torch.int32)
        _expect("prefill.block_table", batch.prefill.block_table, (n, width), torch.int32)
    if (batch.decode is None) != (mode.padded_decode_seqs == 0):
        raise BatchError(f"decode metadata: mode has {mode.padded_decode_seqs} decode seqs, batch has "
                         f"{'none' if batch.decode is None else 'some'}")
    if batch.decode is not None:
        n = mode.padded_decode_seqs
        _expect("decode.seq_lens", batch.decode.seq_lens, (n,), torch.int32)
        _expect("decode.block_table", batch.decode.block_table, (n, width), torch.int32)
    if len(batch.groups) != len(mode.group_widths):
        raise BatchError(f"groups: mode has {len(mode.group_widths)} cache groups past group 0, batch has "
                         f"{len(batch.groups)}")
    for i, (meta, group_width) in enumerate(zip(batch.groups, mode.group_widths), start=1):
        _expect(f"groups[{i}].slot_mapping", meta.slot_mapping, rows, torch.int64)
        for name, table, n in (("prefill", meta.prefill_block_table, mode.padded_prefill_seqs),
                               ("decode", meta.decode_block_table, mode.padded_decode_seqs)):
            if (table is None) != (n == 0):
                raise BatchError(f"groups[{i}].{name}_block_table: mode has {n} {name} seqs, batch has "
                                 f"{'no table' if table is None else 'a table'}")
            if table is not None:
                _expect(f"groups[{i}].{name}_block_table", table, (n, group_width), torch.int32)
