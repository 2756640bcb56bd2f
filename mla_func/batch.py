"""Batch: the device tensors of one step, built from a host-side plan and its mode.

Every shape comes from the `ForwardMode`; every value from the `StepPlan`. The
plan's values are checked on the host while building (no device sync), and the
shape contract between the batch and its mode is checked by `check_batch`.

Padded rows: input id 0, position 0, slot -1 (writes nothing), no sequence
(prefill) or a sequence of length 0 (decode), block table entries pointing at
the scratch block, so they attend to nothing and produce zero attention output.
"""

from __future__ import annotations

import array
from dataclasses import dataclass

import torch

from .mode import ForwardMode
from .plan import SeqPlan, StepPlan
from .pytree import register_dataclass
from .state.kv_cache import SCRATCH_BLOCK


class BatchError(ValueError):
    """A plan or batch violates the shape contract; the message says expected vs got."""


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
    """Metadata of the decode segment: one query token per sequence."""

    seq_lens: torch.Tensor      # [Bd] int32 KV length including the new token; 0 for padded rows
    block_table: torch.Tensor   # [Bd, W] int32


@register_dataclass
@dataclass(frozen=True, slots=True)
class Batch:
    """One step's inputs. Rows: [prefill tokens | padding | decode tokens | padding]."""

    input_ids: torch.Tensor       # [T] int64
    positions: torch.Tensor       # [T] int64
    slot_mapping: torch.Tensor    # [T] int64, block * block_size + offset; -1 for padded rows
    logits_indices: torch.Tensor  # [N] int64 rows whose logits are returned (padded entries: row 0)
    prefill: PrefillMetadata | None = None
    decode: DecodeMetadata | None = None


def _check_seq(where: str, seq: SeqPlan, block_size: int, num_blocks: int | None,
               vocab_size: int | None, max_position: int | None) -> None:
    if not seq.token_ids:
        raise BatchError(f"{where}: token_ids is empty")
    if seq.start_pos < 0:
        raise BatchError(f"{where}: start_pos must be >= 0, got {seq.start_pos}")
    if not 0 <= seq.num_logits <= seq.num_tokens:
        raise BatchError(f"{where}: num_logits must be in [0, {seq.num_tokens}], got {seq.num_logits}")
    needed = -(-seq.seq_len // block_size)
    if len(seq.block_table) < needed:
        raise BatchError(
            f"{where}: block_table must cover {seq.seq_len} positions: expected >= {needed} blocks, "
            f"got {len(seq.block_table)}"
        )
    used = seq.block_table[:needed]
    # min/max rather than a generator: this runs for every sequence of every step.
    if SCRATCH_BLOCK in used:
        raise BatchError(f"{where}: block {SCRATCH_BLOCK} is the scratch block and cannot hold a sequence")
    if num_blocks is not None and (min(used) < 0 or max(used) >= num_blocks):
        raise BatchError(f"{where}: block ids must be in [1, {num_blocks}), got {list(used)}")
    if vocab_size is not None and (min(seq.token_ids) < 0 or max(seq.token_ids) >= vocab_size):
        bad = [t for t in seq.token_ids if not 0 <= t < vocab_size]
        raise BatchError(f"{where}: token ids must be in [0, {vocab_size}), got {bad[:8]}")
    if max_position is not None and seq.seq_len > max_position:
        raise BatchError(f"{where}: positions reach {seq.seq_len - 1}, the model's maximum is {max_position - 1}")


def _prefill_slots(seq: SeqPlan, block_size: int) -> list[int]:
    table = seq.block_table
    return [table[p // block_size] * block_size + p % block_size for p in range(seq.start_pos, seq.seq_len)]


def _plan_is_valid(
    plan: StepPlan, used: list[tuple[int, ...]], input_ids: list[int], seq_lens: list[int], needed: list[int],
    block_size: int, num_blocks: int | None, vocab_size: int | None, max_position: int | None,
) -> bool:
    """Every check of `_check_seq` at once, over whole columns of the plan (one pass of C loops).

    Only on failure does `build_batch` walk the sequences one by one to name the bad one.
    """
    rows = (*plan.prefill, *plan.decode)
    if min(len(s.token_ids) for s in rows) < 1 or min(s.start_pos for s in rows) < 0:
        return False
    # From here every sequence has a position, so each `used` entry is non-empty.
    if any(len(s.block_table) < n for s, n in zip(rows, needed)):
        return False
    if not all(0 <= s.num_logits <= len(s.token_ids) for s in rows):
        return False
    # Block ids >= 1: block 0 (SCRATCH_BLOCK) holds no sequence.
    if min(map(min, used)) <= SCRATCH_BLOCK or (num_blocks is not None and max(map(max, used)) >= num_blocks):
        return False
    real_ids = input_ids[: plan.num_prefill_tokens] + [s.token_ids[0] for s in plan.decode]
    if vocab_size is not None and (min(real_ids) < 0 or max(real_ids) >= vocab_size):
        return False
    if max_position is not None and max(seq_lens) > max_position:
        return False
    return all(len(s.token_ids) == 1 and s.start_pos >= 1 for s in plan.decode)


def _raise_for_plan(plan: StepPlan, block_size: int, num_blocks: int | None,
                    vocab_size: int | None, max_position: int | None) -> None:
    for i, seq in enumerate(plan.prefill):
        _check_seq(f"prefill sequence {i}", seq, block_size, num_blocks, vocab_size, max_position)
    for i, seq in enumerate(plan.decode):
        _check_seq(f"decode sequence {i}", seq, block_size, num_blocks, vocab_size, max_position)
        if seq.num_tokens != 1 or seq.start_pos < 1:
            raise BatchError(
                f"decode sequence {i}: expected one token after cached context, got {seq.num_tokens} "
                f"token(s) at start_pos {seq.start_pos}"
            )


def build_batch(
    plan: StepPlan,
    mode: ForwardMode,
    *,
    block_size: int,
    device: torch.device | str,
    num_blocks: int | None = None,
    vocab_size: int | None = None,
    max_position: int | None = None,
) -> Batch:
    """Turn a plan into device tensors shaped by `mode`.

    The optional limits add host-side checks of block ids, token ids and positions.
    Raises BatchError naming the sequence and the expected vs got values.
    The fields of each dtype travel to the device in one copy (they are aligned
    views of one buffer): a decode step of hundreds of sequences runs every step.
    """
    if (len(plan.prefill), len(plan.decode), plan.num_prefill_tokens) != (
        mode.num_prefill_seqs, mode.num_decode_seqs, mode.num_prefill_tokens
    ):
        raise BatchError(
            f"plan does not match mode: expected {mode.num_prefill_seqs} prefill seqs / "
            f"{mode.num_prefill_tokens} tokens / {mode.num_decode_seqs} decode seqs, got "
            f"{len(plan.prefill)} / {plan.num_prefill_tokens} / {len(plan.decode)}"
        )
    rows = (*plan.prefill, *plan.decode)
    seq_lens = [s.start_pos + len(s.token_ids) for s in rows]
    needed = [-(-n // block_size) for n in seq_lens]
    used = [s.block_table[:n] for s, n in zip(rows, needed)]

    input_ids: list[int] = []
    positions: list[int] = []
    slot_mapping: list[int] = []
    logits_rows: list[int] = []
    cu_seqlens = [0]
    for seq in plan.prefill:
        input_ids += seq.token_ids
        positions += range(seq.start_pos, seq.seq_len)
        end = len(input_ids)
        logits_rows += range(end - seq.num_logits, end)
        cu_seqlens.append(end)
    if rows and not _plan_is_valid(plan, used, input_ids, seq_lens, needed, block_size, num_blocks, vocab_size,
                                   max_position):
        _raise_for_plan(plan, block_size, num_blocks, vocab_size, max_position)
    width = mode.block_table_width
    if rows and max(needed) > width:
        raise BatchError(f"mode.block_table_width {width} is narrower than a sequence of the plan needs")
    for seq in plan.prefill:
        slot_mapping += _prefill_slots(seq, block_size)

    pad = mode.padded_prefill_tokens - len(input_ids)
    input_ids += [0] * pad
    positions += [0] * pad
    slot_mapping += [-1] * pad
    cu_seqlens += [cu_seqlens[-1]] * (mode.padded_prefill_seqs - len(plan.prefill))
    first = len(input_ids)
    logits_rows += [first + i for i, s in enumerate(plan.decode) if s.num_logits]
    input_ids += [s.token_ids[0] for s in plan.decode]
    positions += [s.start_pos for s in plan.decode]
    slot_mapping += [s.block_table[s.start_pos // block_size] * block_size + s.start_pos % block_size
                     for s in plan.decode]
    pad = mode.padded_decode_seqs - len(plan.decode)
    input_ids += [0] * pad
    positions += [0] * pad
    slot_mapping += [-1] * pad
    logits_rows += [0] * (mode.padded_num_logits - len(logits_rows))

    real_slots = [s for s in slot_mapping if s >= 0]
    if len(set(real_slots)) != len(real_slots):
        raise BatchError("slot_mapping: two tokens of the step write the same cache slot")

    num_prefill = len(plan.prefill)
    long_fields = _packed([input_ids, positions, slot_mapping, logits_rows], torch.int64, device)
    input_ids_t, positions_t, slot_mapping_t, logits_t = long_fields
    prefill = decode = None
    if mode.padded_prefill_seqs:
        n = mode.padded_prefill_seqs
        cu_t, lens_t, table_t = _packed([
            cu_seqlens,
            seq_lens[:num_prefill] + [0] * (n - num_prefill),
            _table(used[:num_prefill], n, width),
        ], torch.int32, device)
        prefill = PrefillMetadata(cu_seqlens_q=cu_t, seq_lens=lens_t, block_table=table_t.view(n, width))
    if mode.padded_decode_seqs:
        n = mode.padded_decode_seqs
        lens_t, table_t = _packed([
            seq_lens[num_prefill:] + [0] * (n - len(plan.decode)),
            _table(used[num_prefill:], n, width),
        ], torch.int32, device)
        decode = DecodeMetadata(seq_lens=lens_t, block_table=table_t.view(n, width))
    batch = Batch(
        input_ids=input_ids_t,
        positions=positions_t,
        slot_mapping=slot_mapping_t,
        logits_indices=logits_t,
        prefill=prefill,
        decode=decode,
    )
    check_batch(batch, mode)
    return batch


# Triton compiles a kernel variant per 16-byte alignment of each pointer argument,
# so every field starts on a 16-byte boundary of its shared buffer, whatever the
# step's sizes: otherwise eager steps of new sizes would compile kernels mid-run.
_ALIGN_BYTES = 16
_ARRAY_CODES = {torch.int64: "q", torch.int32: "i"}


def _packed(fields: list[list[int]], dtype: torch.dtype, device: torch.device | str) -> list[torch.Tensor]:
    """Views of one device buffer, one a field, each starting 16-byte aligned: one host-to-device copy."""
    per_align = _ALIGN_BYTES // torch.empty((), dtype=dtype).element_size()
    flat: list[int] = []
    bounds = []
    for values in fields:
        bounds.append((len(flat), len(values)))
        flat += values
        flat += [0] * (-len(flat) % per_align)
    # Through array.array: converting a Python list in C is ~10x faster than torch.tensor(list).
    host = (torch.frombuffer(array.array(_ARRAY_CODES[dtype], flat), dtype=dtype) if flat
            else torch.empty(0, dtype=dtype))
    buffer = host.to(device, non_blocking=True)
    return [buffer[start : start + n] for start, n in bounds]


def _table(used: list[tuple[int, ...]], padded_seqs: int, width: int) -> list[int]:
    """Flattened [padded_seqs, width] block table: each sequence's blocks, then the scratch block."""
    flat: list[int] = []
    for blocks in used:
        flat += blocks
        flat += [SCRATCH_BLOCK] * (width - len(blocks))
    flat += [SCRATCH_BLOCK] * (width * (padded_seqs - len(used)))
    return flat


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
