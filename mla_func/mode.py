"""ForwardMode: everything static about a step, decided once by one rule.

`ForwardMode.decide(plan, ...)` is the only place that looks at a plan to choose
the segment kind, the real and padded sizes and whether the step may replay a
CUDA graph. Batch building, the forward and graph memoization read the mode;
none of them re-derives any of it.
"""

from __future__ import annotations

import math
from collections.abc import Collection, Sequence
from dataclasses import dataclass

from .plan import StepPlan

SEGMENT_KINDS = ("prefill", "decode", "mixed")


@dataclass(frozen=True, slots=True)
class PaddingPolicy:
    """Ladders of padded sizes. An empty ladder means "no padding": sizes are exact.

    decode_seqs:        padded decode sequence counts, ascending.
    prefill_tokens:     padded prefill token counts, ascending.
    prefill_seqs:       padded prefill sequence counts, ascending.
    block_table_widths: padded block-table widths, ascending.

    A size above the largest rung of its ladder is not padded, and the step does
    not use a graph (see `ForwardMode.decide`).
    """

    decode_seqs: tuple[int, ...] = ()
    prefill_tokens: tuple[int, ...] = ()
    prefill_seqs: tuple[int, ...] = ()
    block_table_widths: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        for name in ("decode_seqs", "prefill_tokens", "prefill_seqs", "block_table_widths"):
            ladder = getattr(self, name)
            if any(b <= a for a, b in zip(ladder, ladder[1:])) or any(r < 1 for r in ladder):
                raise ValueError(f"PaddingPolicy.{name}: expected positive ascending sizes, got {ladder}")

    @staticmethod
    def exact() -> PaddingPolicy:
        return PaddingPolicy()


def _pad(size: int, ladder: Sequence[int]) -> tuple[int, bool]:
    """(padded size, whether it fits the ladder); 0 stays 0 and always fits."""
    if size == 0:
        return 0, True
    for rung in ladder:
        if rung >= size:
            return rung, True
    return size, not ladder


@dataclass(frozen=True, slots=True)
class ForwardMode:
    """The static description of one step.

    Rows of a step are laid out as [prefill tokens | padding | decode tokens | padding]:
    `padded_prefill_tokens` rows for the prefill segment, then `padded_decode_seqs`
    rows for the decode segment (one token each).
    """

    kind: str
    backend: str
    num_prefill_tokens: int
    num_prefill_seqs: int
    num_decode_seqs: int
    num_logits: int
    padded_prefill_tokens: int
    padded_prefill_seqs: int
    padded_decode_seqs: int
    padded_num_logits: int
    block_table_width: int
    use_graph: bool = False

    @property
    def num_tokens(self) -> int:
        """Rows of the step, padding included."""
        return self.padded_prefill_tokens + self.padded_decode_seqs

    @property
    def static_key(self) -> tuple:
        """What fixes every tensor shape of the step: the key graphs are memoized on."""
        return (
            self.kind,
            self.padded_prefill_tokens,
            self.padded_prefill_seqs,
            self.padded_decode_seqs,
            self.padded_num_logits,
            self.block_table_width,
            self.backend,
        )

    @staticmethod
    def decide(
        plan: StepPlan,
        *,
        block_size: int,
        backend: str = "torch",
        padding: PaddingPolicy | None = None,
        graphs: bool = False,
        graph_kinds: Collection[str] = SEGMENT_KINDS,
    ) -> ForwardMode:
        """The single rule that fixes a step's kind, sizes and graph use.

        A step uses a graph only when `graphs` is on, its kind is in `graph_kinds`
        and every size fits its padding ladder; otherwise its sizes are exact and
        it runs eagerly.
        """
        if not plan.prefill and not plan.decode:
            raise ValueError("StepPlan: a step needs at least one sequence")
        padding = padding or PaddingPolicy.exact()
        kind = "mixed" if plan.prefill and plan.decode else "prefill" if plan.prefill else "decode"
        num_prefill_tokens = plan.num_prefill_tokens
        widths_needed = [math.ceil(s.seq_len / block_size) for s in (*plan.prefill, *plan.decode)]
        sizes = {
            "prefill_tokens": (num_prefill_tokens, padding.prefill_tokens),
            "prefill_seqs": (len(plan.prefill), padding.prefill_seqs),
            "decode_seqs": (len(plan.decode), padding.decode_seqs),
            "width": (max(widths_needed), padding.block_table_widths),
        }
        padded = {name: _pad(size, ladder) for name, (size, ladder) in sizes.items()}
        fits = all(ok for _, ok in padded.values())
        if not fits or (graphs and kind not in graph_kinds):
            # Eager steps run at their exact size: padding buys nothing without a graph.
            padded = {name: (size, True) for name, (size, _) in sizes.items()}
        padded_seqs = padded["prefill_seqs"][0] + padded["decode_seqs"][0]
        num_logits = plan.num_logits
        return ForwardMode(
            kind=kind,
            backend=backend,
            num_prefill_tokens=num_prefill_tokens,
            num_prefill_seqs=len(plan.prefill),
            num_decode_seqs=len(plan.decode),
            num_logits=num_logits,
            padded_prefill_tokens=padded["prefill_tokens"][0],
            padded_prefill_seqs=padded["prefill_seqs"][0],
            padded_decode_seqs=padded["decode_seqs"][0],
            # Ordinary steps have at most one logits row a sequence; scoring a
            # whole prompt has more and is sized exactly.
            padded_num_logits=max(num_logits, padded_seqs),
            block_table_width=padded["width"][0],
            use_graph=graphs and fits and kind in graph_kinds,
        )
