"""The addressing of cache groups 1.. for one step: slot mappings and block tables per group.

Only models with several cache groups build these (an MLA model has one, whose
addressing is the batch's own `slot_mapping` and block tables). Group g's entry
e = p // tokens_per_entry is written by the token at position p that completes
it ((p + 1) % tokens_per_entry == 0), in slot table[e // block_size] * block_size
+ e % block_size; every other row, padding included, writes nothing (-1).
"""

from __future__ import annotations

import torch

from mla_func.core.batch import BatchError, GroupMetadata
from mla_func.core.mode import ForwardMode
from mla_func.core.plan import SeqPlan, StepPlan
from mla_func.state.block_allocator import SCRATCH_BLOCK
from mla_func.state.layer_cache import CacheGroup


def _group_table(where: str, seq: SeqPlan, index: int, group: CacheGroup) -> tuple[int, ...]:
    if len(seq.group_block_tables) < index:
        raise BatchError(f"{where}: group_block_tables must hold a table for cache group {index}, got "
                         f"{len(seq.group_block_tables)} table(s)")
    table = seq.group_block_tables[index - 1]
    needed = group.blocks_for(seq.seq_len)
    if len(table) < needed:
        raise BatchError(f"{where}: cache group {index}'s block table must cover {group.entries(seq.seq_len)} "
                         f"entries: expected >= {needed} blocks, got {len(table)}")
    used = table[:needed]
    if used and (min(used) <= SCRATCH_BLOCK or max(used) >= group.num_blocks):
        raise BatchError(f"{where}: cache group {index}'s block ids must be in [1, {group.num_blocks}), "
                         f"got {list(used)}")
    return used


def _slots(seq: SeqPlan, table: tuple[int, ...], group: CacheGroup) -> list[int]:
    r, bs = group.tokens_per_entry, group.block_size
    out = []
    for p in range(seq.start_pos, seq.seq_len):
        e = p // r
        out.append(table[e // bs] * bs + e % bs if (p + 1) % r == 0 else -1)
    return out


def _padded_table(tables: list[tuple[int, ...]], padded_seqs: int, width: int) -> list[int]:
    flat: list[int] = []
    for t in tables:
        flat += t
        flat += [SCRATCH_BLOCK] * (width - len(t))
    flat += [SCRATCH_BLOCK] * (width * (padded_seqs - len(tables)))
    return flat


def build_group_metadata(plan: StepPlan, mode: ForwardMode, device: torch.device | str) -> tuple[GroupMetadata, ...]:
    """Each cache group 1..'s slot mapping [T] and block tables [Bp, Wg], [Bd, Wg] (see the module docstring)."""
    out = []
    for index, (group, width) in enumerate(zip(mode.cache_groups[1:], mode.group_widths), start=1):
        slots: list[int] = []
        tables: list[tuple[int, ...]] = []
        for kind, seqs in (("prefill", plan.prefill), ("decode", plan.decode)):
            for i, seq in enumerate(seqs):
                table = _group_table(f"{kind} sequence {i}", seq, index, group)
                if len(table) > width:
                    raise BatchError(f"cache group {index}: width {width} is narrower than {kind} sequence {i} needs")
                tables.append(table)
                slots += _slots(seq, table, group)
            if kind == "prefill":
                slots += [-1] * (mode.padded_prefill_tokens - len(slots))
        slots += [-1] * (mode.num_tokens - len(slots))
        real = [s for s in slots if s >= 0]
        if len(set(real)) != len(real):
            raise BatchError(f"cache group {index}: two tokens of the step write the same entry slot")
        n_p = len(plan.prefill)
        prefill = (torch.tensor(_padded_table(tables[:n_p], mode.padded_prefill_seqs, width), dtype=torch.int32,
                                device=device).view(mode.padded_prefill_seqs, width)
                   if mode.padded_prefill_seqs else None)
        decode = (torch.tensor(_padded_table(tables[n_p:], mode.padded_decode_seqs, width), dtype=torch.int32,
                               device=device).view(mode.padded_decode_seqs, width)
                  if mode.padded_decode_seqs else None)
        out.append(GroupMetadata(slot_mapping=torch.tensor(slots, dtype=torch.int64, device=device),
                                 prefill_block_table=prefill, decode_block_table=decode))
    return tuple(out)
