"""build_batch: a host-side plan and its mode -> the device tensors of one step.

The plan's values are checked on the host while building (`plan_checks`: block
ids, token ids, positions, the decode query length), so no check needs a device
sync; the result satisfies `check_batch` by construction and is checked anyway.
"""

from __future__ import annotations

import array

import torch

from mla_func.core.batch import Batch, BatchError, DecodeMetadata, PrefillMetadata, check_batch
from mla_func.core.batch_groups import build_group_metadata
from mla_func.core.mode import ForwardMode
from mla_func.core.plan import SeqPlan, StepPlan
from mla_func.core.plan_checks import first_read_block, plan_is_valid, raise_for_plan
from mla_func.state.block_allocator import SCRATCH_BLOCK


def _slots(seq: SeqPlan, block_size: int) -> list[int]:
    table = seq.block_table
    return [table[p // block_size] * block_size + p % block_size for p in range(seq.start_pos, seq.seq_len)]


def build_batch(
    plan: StepPlan,
    mode: ForwardMode,
    *,
    device: torch.device | str,
    block_size: int | None = None,
    num_blocks: int | None = None,
    vocab_size: int | None = None,
    max_position: int | None = None,
) -> Batch:
    """Turn a plan into device tensors shaped by `mode`.

    block_size: the state's block size; it must equal `mode.block_size` (the mode
                was decided for it), and defaults to it.
    The optional limits add host-side checks of block ids, token ids and positions.
    Raises BatchError naming the sequence and the expected vs got values.
    The fields of each dtype travel to the device in one copy (they are aligned
    views of one buffer): a decode step of hundreds of sequences runs every step.
    """
    if block_size is None:
        block_size = mode.block_size
    elif mode.block_size and block_size != mode.block_size:
        raise BatchError(f"block_size: the mode was decided for blocks of {mode.block_size} tokens, got {block_size}")
    if block_size < 1:
        raise BatchError(f"block_size: expected a positive block size from the mode or the caller, got {block_size}")
    q_len = mode.decode_q_len
    if (len(plan.prefill), len(plan.decode), plan.num_prefill_tokens, plan.decode_q_len) != (
        mode.num_prefill_seqs, mode.num_decode_seqs, mode.num_prefill_tokens, q_len
    ):
        raise BatchError(
            f"plan does not match mode: expected {mode.num_prefill_seqs} prefill seqs / "
            f"{mode.num_prefill_tokens} tokens / {mode.num_decode_seqs} decode seqs of {q_len} tokens, got "
            f"{len(plan.prefill)} / {plan.num_prefill_tokens} / {len(plan.decode)} of {plan.decode_q_len}"
        )
    rows = (*plan.prefill, *plan.decode)
    seq_lens = [s.start_pos + len(s.token_ids) for s in rows]
    needed = [-(-n // block_size) for n in seq_lens]
    used = [s.block_table[:n] for s, n in zip(rows, needed)]
    # A group 0 with a lookback may hold the scratch block where a sequence's blocks behind it were freed:
    # only the blocks the step reads must be real.
    lookback = mode.cache_groups[0].lookback
    read = used if lookback is None else [s.block_table[first_read_block(s, block_size, lookback):n]
                                          for s, n in zip(rows, needed)]

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
    if q_len == 1:
        decode_ids = [s.token_ids[0] for s in plan.decode]
    else:
        decode_ids = [t for s in plan.decode for t in s.token_ids]
    if rows and not plan_is_valid(plan, read, input_ids[: plan.num_prefill_tokens] + decode_ids, seq_lens,
                                  needed, num_blocks, vocab_size, max_position):
        raise_for_plan(plan, block_size, num_blocks, vocab_size, max_position, lookback)
    width = mode.block_table_width
    if rows and max(needed) > width:
        raise BatchError(f"mode.block_table_width {width} is narrower than a sequence of the plan needs")
    for seq in plan.prefill:
        slot_mapping += _slots(seq, block_size)

    pad = mode.padded_prefill_tokens - len(input_ids)
    input_ids += [0] * pad
    positions += [0] * pad
    slot_mapping += [-1] * pad
    cu_seqlens += [cu_seqlens[-1]] * (mode.padded_prefill_seqs - len(plan.prefill))
    first = len(input_ids)
    input_ids += decode_ids
    if q_len == 1:
        # The one-token path stays a few list comprehensions: it runs for every decode step.
        logits_rows += [first + i for i, s in enumerate(plan.decode) if s.num_logits]
        positions += [s.start_pos for s in plan.decode]
        slot_mapping += [s.block_table[s.start_pos // block_size] * block_size + s.start_pos % block_size
                         for s in plan.decode]
    else:
        for i, s in enumerate(plan.decode):
            end = first + (i + 1) * q_len
            logits_rows += range(end - s.num_logits, end)
            positions += range(s.start_pos, s.seq_len)
            slot_mapping += _slots(s, block_size)
    pad = (mode.padded_decode_seqs - len(plan.decode)) * q_len
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
        groups=build_group_metadata(plan, mode, device) if mode.group_widths else (),
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
