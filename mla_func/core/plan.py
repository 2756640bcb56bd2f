"""The host-side plan of one step: what each sequence feeds, where it sits in the cache.

A plan is plain data (Python ints and tuples) built by the scheduler or by hand.
`ForwardMode.decide` reads it once to fix the step's sizes, and `build_batch` turns
it into the device tensors of a `Batch`. Nothing on the device is consulted, so
no host sync is ever needed to know a shape.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class SeqPlan:
    """One sequence's part of a step.

    token_ids:   the tokens fed this step (a prefill chunk, or the decode segment's
                 query length of tokens: one to decode, k + 1 to verify k drafts).
    start_pos:   how many tokens of this sequence are already in the cache; the
                 first token of `token_ids` sits at this position.
    block_table: physical block ids of cache group 0 covering positions
                 [0, start_pos + len(token_ids)), in order.
    num_logits:  how many trailing tokens of `token_ids` produce logits: 1 for a
                 decode token or a prefill chunk that completes its prompt, 0 for
                 a chunk that does not, len(token_ids) to score every token.
    group_block_tables: the block tables of cache groups 1.. (empty for a model with
                 one group), each covering the entries of positions [0, seq_len).
    """

    token_ids: tuple[int, ...]
    start_pos: int
    block_table: tuple[int, ...]
    num_logits: int = 1
    group_block_tables: tuple[tuple[int, ...], ...] = ()

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def seq_len(self) -> int:
        """KV length once this step's tokens are written."""
        return self.start_pos + len(self.token_ids)


@dataclass(frozen=True, slots=True)
class StepPlan:
    """All sequences of one step: prefill rows first, then decode rows.

    Every decode sequence has cached context and feeds exactly `decode_q_len`
    tokens (the decode segment's query length: 1 to decode, k + 1 to verify k
    drafted tokens), attended causally.
    """

    prefill: tuple[SeqPlan, ...] = ()
    decode: tuple[SeqPlan, ...] = ()
    decode_q_len: int = 1

    @property
    def num_prefill_tokens(self) -> int:
        return sum(s.num_tokens for s in self.prefill)

    @property
    def num_seqs(self) -> int:
        return len(self.prefill) + len(self.decode)

    @property
    def num_logits(self) -> int:
        return sum(s.num_logits for s in self.prefill) + sum(s.num_logits for s in self.decode)
