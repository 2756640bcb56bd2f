"""The default padding ladders of a memoized step: which padded sizes get a graph."""

from __future__ import annotations

from collections.abc import Sequence

from mla_func.core.mode import PaddingPolicy

# Up to this many block-table entries a step (max_num_seqs x blocks a sequence,
# 256 KiB of int32), every step uses the full table width: graphs are then keyed
# on batch sizes alone, so one warm-up captures every decode graph a run can meet,
# and copying the wider table costs microseconds.
_FULL_WIDTH_TABLE_ENTRIES = 1 << 16


def padding_ladders(
    *,
    max_num_seqs: int,
    max_num_batched_tokens: int,
    max_blocks_per_seq: int,
    prefill_token_sizes: Sequence[int] | None = None,
) -> PaddingPolicy:
    """The default ladders: decode sequences 1, 2, 4, 8, then steps of 8 up to 64 and of 16 beyond;
    prefill tokens and prefill sequences in powers of two (the last rung is the maximum itself);
    block-table widths one rung, `max_blocks_per_seq`, when a full table has at most 65536
    entries (max_num_seqs x max_blocks_per_seq), else powers of two as well."""

    def powers_of_two(start: int, top: int) -> tuple[int, ...]:
        rungs, r = [], start
        while r < top:
            rungs.append(r)
            r *= 2
        return (*rungs, top)

    decode = [r for r in (1, 2, 4) if r < max_num_seqs]
    r = 8
    while r < max_num_seqs:
        decode.append(r)
        r += 8 if r < 64 else 16
    decode.append(max_num_seqs)
    tokens = tuple(sorted(set(prefill_token_sizes))) if prefill_token_sizes else powers_of_two(16, max_num_batched_tokens)
    return PaddingPolicy(
        decode_seqs=tuple(decode),
        prefill_tokens=tokens,
        prefill_seqs=powers_of_two(1, max_num_seqs),
        block_table_widths=(
            (max_blocks_per_seq,) if max_num_seqs * max_blocks_per_seq <= _FULL_WIDTH_TABLE_ENTRIES
            else powers_of_two(1, max_blocks_per_seq)
        ),
    )


