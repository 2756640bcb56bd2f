"""ForwardMode: everything static about a step, decided once by one rule.

`ForwardMode.decide(plan, ...)` is the only place that looks at a plan to choose
the segment kind, the real and padded sizes, the decode query length, whether
the logits rows are the step's rows, and whether the step may replay a CUDA
graph. `ForwardMode.padded_only` builds, with the same constructor, the mode of
an all-padding step of given padded sizes (what graph warm-up captures). Batch
building, the forward and graph memoization read the mode; none of them
re-derives any of it.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Collection, Sequence
from dataclasses import dataclass, replace

from mla_func.core.plan import StepPlan
from mla_func.state.layer_cache import CacheGroup


class SegmentKind(str, enum.Enum):
    """What rows a step holds. A str enum, so "decode" and SegmentKind.DECODE compare equal."""

    PREFILL = "prefill"
    DECODE = "decode"
    MIXED = "mixed"


SEGMENT_KINDS = tuple(SegmentKind)


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


def _groups(cache_groups: Sequence[CacheGroup]) -> tuple[CacheGroup, ...]:
    """`cache_groups` as a mode holds them; raises unless group 0 is there (every size follows its blocks).
    A state's groups are a tuple already, so a step pays no copy."""
    groups = tuple(cache_groups)
    if not groups:
        raise ValueError("ForwardMode: cache_groups must hold group 0 (the state's groups: KVCacheState.groups)")
    return groups


@dataclass(frozen=True, slots=True)
class ForwardMode:
    """The static description of one step.

    Rows of a step are laid out as [prefill tokens | padding | decode rows | padding]:
    `padded_prefill_tokens` rows for the prefill segment, then `padded_decode_seqs`
    sequences of `decode_q_len` rows each for the decode segment (the rows of one
    sequence in position order).

    gather_logits: whether the logits rows must be gathered by `batch.logits_indices`;
                   False when they are the step's rows in order (a decode step whose
                   every row gives logits), which spares a gather.
    graph_fallback: the step asked for a graph (its kind may use one) but a size did
                   not fit the ladders, so it runs eagerly; the step warns once.
    cache_groups:  the geometry of the state the mode was decided for (`KVCacheState.groups`,
                   group 0 always included): the step's one source of block sizes; the forward
                   refuses a state of other groups. Derived from it, read-only:
                   `block_size` (the tokens a block of group 0 holds) and `group_widths`
                   (each group 1..'s block-table width, from `block_table_width`).
    batch_invariant: the step runs the backend's batch-invariant op table and sends every
                   row, prefill rows included, through the absorbed decode path, so that a
                   row's bits depend on its own sequence only (a family's attention decides how).
    w8a8:          the step runs the backend's w8a8 op table (`Ops.w8a8`): products of FP8 weights
                   quantize their activations per token and group of 128, as the checkpoints' "dynamic"
                   activation scheme does; otherwise they multiply by the dequantized weights.
    exchange_rows: with data-parallel attention (`mla_func.parallel`), the rows every rank brings to
                   the blocks the ranks share (MLP, experts): the most rows any rank's step has,
                   the same on every rank (`parallel.data_parallel.plan_rank_step`); 0 otherwise.
    """

    kind: SegmentKind
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
    cache_groups: tuple[CacheGroup, ...]
    use_graph: bool = False
    decode_q_len: int = 1
    gather_logits: bool = True
    graph_fallback: bool = False
    batch_invariant: bool = False
    exchange_rows: int = 0
    w8a8: bool = False

    @property
    def block_size(self) -> int:
        """Tokens a block of cache group 0 holds (group 0 has one entry per token)."""
        return self.cache_groups[0].block_size

    @property
    def group_widths(self) -> tuple[int, ...]:
        """The block-table width of each cache group 1..: the blocks that cover the tokens of
        `block_table_width` group-0 blocks (the same tokens), so groups need no ladder of their own."""
        if len(self.cache_groups) == 1:
            return ()   # the common case, read per layer: no tuple built
        tokens = self.block_table_width * self.cache_groups[0].block_size
        return tuple(-(-tokens // g.tokens_per_block) for g in self.cache_groups[1:])

    @property
    def num_decode_rows(self) -> int:
        """Real decode rows: decode sequences times their query length."""
        return self.num_decode_seqs * self.decode_q_len

    @property
    def padded_decode_rows(self) -> int:
        return self.padded_decode_seqs * self.decode_q_len

    @property
    def num_tokens(self) -> int:
        """Rows of the step, padding included."""
        return self.padded_prefill_tokens + self.padded_decode_rows

    @property
    def static_key(self) -> tuple[object, ...]:
        """What fixes every tensor shape of the step: the key graphs are memoized on. The cache
        groups enter as `block_size` and `group_widths`: their block counts fix no step shape."""
        return (
            self.kind.value,
            self.padded_prefill_tokens,
            self.padded_prefill_seqs,
            self.padded_decode_seqs,
            self.decode_q_len,
            self.padded_num_logits,
            self.gather_logits,
            self.block_table_width,
            self.block_size,
            self.group_widths,
            self.backend,
            self.batch_invariant,
            self.exchange_rows,
            self.w8a8,
        )

    @staticmethod
    def _make(kind: SegmentKind, backend: str, cache_groups: tuple[CacheGroup, ...], real: dict[str, int],
              padded: dict[str, int], num_logits: int, decode_q_len: int, use_graph: bool, graph_fallback: bool,
              batch_invariant: bool = False, w8a8: bool = False) -> ForwardMode:
        """The one constructor: derives the logits sizes from the segment sizes."""
        padded_decode_rows = padded["decode_seqs"] * decode_q_len
        # Ordinary steps have at most one logits row a sequence (a verify row one per
        # query token); scoring a whole prompt has more and is sized exactly.
        padded_num_logits = max(num_logits, padded["prefill_seqs"] + padded_decode_rows)
        rows_are_logits = (kind is SegmentKind.DECODE and num_logits == real["decode_seqs"] * decode_q_len
                           and padded_num_logits == padded_decode_rows)
        return ForwardMode(
            kind=kind, backend=backend,
            num_prefill_tokens=real["prefill_tokens"], num_prefill_seqs=real["prefill_seqs"],
            num_decode_seqs=real["decode_seqs"], num_logits=num_logits,
            padded_prefill_tokens=padded["prefill_tokens"], padded_prefill_seqs=padded["prefill_seqs"],
            padded_decode_seqs=padded["decode_seqs"], padded_num_logits=padded_num_logits,
            block_table_width=padded["width"], cache_groups=cache_groups, use_graph=use_graph,
            decode_q_len=decode_q_len, gather_logits=not rows_are_logits, graph_fallback=graph_fallback,
            batch_invariant=batch_invariant, w8a8=w8a8,
        )

    @staticmethod
    def padded_only(kind: SegmentKind, *, backend: str, cache_groups: Sequence[CacheGroup], prefill_tokens: int = 0,
                    prefill_seqs: int = 0, decode_seqs: int = 0, block_table_width: int, decode_q_len: int = 1,
                    use_graph: bool = True, batch_invariant: bool = False, w8a8: bool = False) -> ForwardMode:
        """The mode of a step of only padding rows with these padded sizes: the static key real
        steps of those sizes have (graph warm-up captures with it). `cache_groups` as in `decide`."""
        zero = {"prefill_tokens": 0, "prefill_seqs": 0, "decode_seqs": 0, "width": 0}
        padded = {"prefill_tokens": prefill_tokens, "prefill_seqs": prefill_seqs, "decode_seqs": decode_seqs,
                  "width": block_table_width}
        return ForwardMode._make(SegmentKind(kind), backend, _groups(cache_groups), zero, padded, 0, decode_q_len,
                                 use_graph, False, batch_invariant, w8a8)

    def without_real_rows(self) -> ForwardMode:
        """This mode's shapes and static key, with every row padding."""
        return replace(self, num_prefill_tokens=0, num_prefill_seqs=0, num_decode_seqs=0, num_logits=0)

    def padded_to(self, *, decode_seqs: int, block_table_width: int, prefill_tokens: int = 0,
                  prefill_seqs: int = 0) -> ForwardMode:
        """This mode's real rows in a step of larger padded sizes: the static key of a step that
        pads them further (the key data-parallel ranks agree on, `parallel.data_parallel.rank_modes`).

        Each size is at least this mode's padded one, and a segment its kind lacks stays empty.
        The logits sizes (`padded_num_logits`, `gather_logits`) are derived from the new sizes as
        `decide` derives them; the kind, graph use and `exchange_rows` are kept.
        """
        padded = {"prefill_tokens": prefill_tokens, "prefill_seqs": prefill_seqs, "decode_seqs": decode_seqs,
                  "width": block_table_width}
        own = {"prefill_tokens": self.padded_prefill_tokens, "prefill_seqs": self.padded_prefill_seqs,
               "decode_seqs": self.padded_decode_seqs, "width": self.block_table_width}
        smaller = [f"{name} {padded[name]} < {size}" for name, size in own.items() if padded[name] < size]
        if smaller:
            raise ValueError(f"ForwardMode.padded_to: padding only grows, got {', '.join(smaller)}")
        lacks = {SegmentKind.PREFILL: ("decode_seqs",), SegmentKind.DECODE: ("prefill_tokens", "prefill_seqs"),
                 SegmentKind.MIXED: ()}[self.kind]
        if any(padded[name] for name in lacks):
            raise ValueError(f"ForwardMode.padded_to: a {self.kind.value} step has no rows of {' or '.join(lacks)}, "
                             f"got {', '.join(f'{name} {padded[name]}' for name in lacks)}")
        real = {"prefill_tokens": self.num_prefill_tokens, "prefill_seqs": self.num_prefill_seqs,
                "decode_seqs": self.num_decode_seqs}
        mode = ForwardMode._make(self.kind, self.backend, self.cache_groups, real, padded, self.num_logits,
                                 self.decode_q_len, self.use_graph, self.graph_fallback, self.batch_invariant,
                                 self.w8a8)
        return replace(mode, exchange_rows=self.exchange_rows)

    @staticmethod
    def decide(
        plan: StepPlan,
        *,
        cache_groups: Sequence[CacheGroup],
        backend: str = "torch",
        padding: PaddingPolicy | None = None,
        graphs: bool = False,
        graph_kinds: Collection[str] = SEGMENT_KINDS,
        batch_invariant: bool = False,
        w8a8: bool = False,
    ) -> ForwardMode:
        """The single rule that fixes a step's kind, sizes and graph use.

        A step uses a graph only when `graphs` is on, its kind is in `graph_kinds`
        and every size fits its padding ladder; otherwise its sizes are exact and
        it runs eagerly. `cache_groups` are the state's (`KVCacheState.groups`, group 0
        first): group 0's block size fixes the block-table width, and the widths of
        groups 1.. follow it. The decode query length is the plan's `decode_q_len` (the
        batch checks that every decode sequence feeds that many tokens).
        """
        if not plan.prefill and not plan.decode:
            raise ValueError("StepPlan: a step needs at least one sequence")
        groups = _groups(cache_groups)
        block_size = groups[0].block_size
        padding = padding or PaddingPolicy.exact()
        kind = (SegmentKind.MIXED if plan.prefill and plan.decode
                else SegmentKind.PREFILL if plan.prefill else SegmentKind.DECODE)
        q_len = plan.decode_q_len
        if q_len < 1:
            raise ValueError(f"StepPlan.decode_q_len: expected at least 1, got {q_len}")
        widths_needed = [math.ceil(s.seq_len / block_size) for s in (*plan.prefill, *plan.decode)]
        real = {"prefill_tokens": plan.num_prefill_tokens, "prefill_seqs": len(plan.prefill),
                "decode_seqs": len(plan.decode), "width": max(widths_needed)}
        ladders = {"prefill_tokens": padding.prefill_tokens, "prefill_seqs": padding.prefill_seqs,
                   "decode_seqs": padding.decode_seqs, "width": padding.block_table_widths}
        fitted = {name: _pad(size, ladders[name]) for name, size in real.items()}
        fits = all(ok for _, ok in fitted.values())
        wanted = graphs and kind in graph_kinds
        use_graph = wanted and fits
        # A step that cannot or may not use a graph runs at its exact size: padding buys
        # nothing there. (Without graphs at all, an explicit ladder still pads.)
        padded = (dict(real) if not fits or (graphs and not wanted)
                  else {name: size for name, (size, _) in fitted.items()})
        return ForwardMode._make(kind, backend, groups, real, padded, plan.num_logits, q_len, use_graph,
                                 graph_fallback=wanted and not fits, batch_invariant=batch_invariant, w8a8=w8a8)

