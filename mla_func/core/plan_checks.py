"""Host-side checks of a plan against the state and the model, run where the batch is built.

Everything here reads plain Python values the plan already holds, so no device
value is ever synced. This is the one place where a step's token ids, block
tables and positions are checked: a fast pass over whole columns runs for every
step, and only when it fails are the sequences walked one by one to name the
bad one (`BatchError`, expected vs got).
"""

from __future__ import annotations

from mla_func.core.plan import SeqPlan, StepPlan
from mla_func.state.block_allocator import SCRATCH_BLOCK


class BatchError(ValueError):
    """A plan or batch violates the shape contract; the message says expected vs got."""


def first_read_block(seq: SeqPlan, block_size: int, lookback: int | None) -> int:
    """The first block of `seq`'s group-0 table its step reads: with a lookback (`CacheGroup.lookback`) the
    blocks wholly before start_pos - lookback may be freed (the scratch block in their place); else 0."""
    return 0 if lookback is None else max(0, seq.start_pos - lookback) // block_size


def check_seq(where: str, seq: SeqPlan, block_size: int, num_blocks: int | None, vocab_size: int | None,
              max_position: int | None, lookback: int | None = None) -> None:
    """Raise BatchError if one sequence's tokens, positions or block table are bad (group 0's `lookback`:
    which of its blocks the step reads, and so must be real)."""
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
    first = first_read_block(seq, block_size, lookback)
    used = seq.block_table[first:needed]
    if SCRATCH_BLOCK in used:
        read = f" (the step reads positions from {seq.start_pos - lookback})" if lookback is not None else ""
        raise BatchError(f"{where}: block {SCRATCH_BLOCK} is the scratch block and cannot hold a sequence{read}")
    # A negative entry would wrap to the last block when the kernels index the cache.
    if min(used) < 0 or (num_blocks is not None and max(used) >= num_blocks):
        raise BatchError(f"{where}: block ids must be in [1, {num_blocks}), got {list(used)}")
    if vocab_size is not None and (min(seq.token_ids) < 0 or max(seq.token_ids) >= vocab_size):
        bad = [t for t in seq.token_ids if not 0 <= t < vocab_size]
        raise BatchError(f"{where}: token ids must be in [0, {vocab_size}), got {bad[:8]}")
    if max_position is not None and seq.seq_len > max_position:
        raise BatchError(f"{where}: positions reach {seq.seq_len - 1}, the model's maximum is {max_position - 1}")


def plan_is_valid(plan: StepPlan, used: list[tuple[int, ...]], real_ids: list[int], seq_lens: list[int],
                  needed: list[int], num_blocks: int | None, vocab_size: int | None,
                  max_position: int | None) -> bool:
    """Every check of `check_seq` at once, over whole columns of the plan (one pass of C loops).
    used: each sequence's blocks the step reads (`first_read_block` to the last it needs)."""
    rows = (*plan.prefill, *plan.decode)
    if min(len(s.token_ids) for s in rows) < 1 or min(s.start_pos for s in rows) < 0:
        return False
    # From here every sequence has a position, so each `used` entry is non-empty.
    if any(len(s.block_table) < n for s, n in zip(rows, needed)):
        return False
    if not all(0 <= s.num_logits <= len(s.token_ids) for s in rows):
        return False
    # Block ids >= 1: block 0 (SCRATCH_BLOCK) holds no sequence, and -1 would wrap.
    if min(map(min, used)) <= SCRATCH_BLOCK or (num_blocks is not None and max(map(max, used)) >= num_blocks):
        return False
    if vocab_size is not None and (min(real_ids) < 0 or max(real_ids) >= vocab_size):
        return False
    if max_position is not None and max(seq_lens) > max_position:
        return False
    q_len = plan.decode_q_len
    return all(len(s.token_ids) == q_len and s.start_pos >= 1 for s in plan.decode)


def raise_for_plan(plan: StepPlan, block_size: int, num_blocks: int | None, vocab_size: int | None,
                   max_position: int | None, lookback: int | None = None) -> None:
    """Walk the sequences one by one and raise BatchError naming the first bad one."""
    for i, seq in enumerate(plan.prefill):
        check_seq(f"prefill sequence {i}", seq, block_size, num_blocks, vocab_size, max_position, lookback)
    q_len = plan.decode_q_len
    for i, seq in enumerate(plan.decode):
        check_seq(f"decode sequence {i}", seq, block_size, num_blocks, vocab_size, max_position, lookback)
        if seq.num_tokens != q_len or seq.start_pos < 1:
            wanted = "one token" if q_len == 1 else f"{q_len} tokens (decode_q_len)"
            raise BatchError(
                f"decode sequence {i}: expected {wanted} after cached context, got {seq.num_tokens} "
                f"token(s) at start_pos {seq.start_pos}"
            )
