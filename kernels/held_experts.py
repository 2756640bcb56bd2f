"""The experts of a MoE block one rank runs under expert parallelism: the route op's `held` argument.

Rank r of n holds routed experts [first, first + count) whole. The router scores all E experts on
every rank and sees the same bits everywhere, so every rank makes the same choice; the route op keeps
the chosen experts the rank holds, numbered from 0 (its w13[0] is expert `first`), and gives the
others id -1 and weight 0, so they take no expert here. Shared experts, which every token takes, are
held whole on every rank (DeepSeek-V2/V3/V3.2's, stacked after the routed ones) and run on one rank a
token: rank r takes them for rows t with t % n == r. The ranks' partial sums then add up to every
token's routed and shared outputs once, in one fused call a rank with no id arithmetic of its own,
and the shared experts' work is dealt evenly at any batch (at batch 1 one rank takes it). Which rank's
partial sum carries a token's shared output follows the token's row, so the sum's rounding does too
(batch invariance is promised for one process only). V4 holds its shared experts apart, cut by
columns, and routes with no shared experts here (rank 0 of 1).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class HeldExperts:
    """Routed experts [first, first + count) of the router's E, and the shared experts of rows t with
    t % ranks == rank (shared ids count .. count + S - 1 in the route op's output)."""

    first: int
    count: int
    rank: int = 0
    ranks: int = 1

    def __post_init__(self) -> None:
        for name in ("first", "count", "rank", "ranks"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool):
                raise ValueError(f"HeldExperts.{name}: expected an int, got {value!r}")
        if self.first < 0 or self.count < 1:
            raise ValueError(f"HeldExperts: expected first >= 0 and count >= 1, got first={self.first}, "
                             f"count={self.count}")
        if not 0 <= self.rank < self.ranks:
            raise ValueError(f"HeldExperts: expected 0 <= rank < ranks, got rank={self.rank}, ranks={self.ranks}")

    def check(self, num_experts: int) -> None:
        """ValueError unless the held experts lie among the router's `num_experts`."""
        if self.first + self.count > num_experts:
            raise ValueError(f"held: experts [{self.first}, {self.first + self.count}) are not all among the "
                             f"router's {num_experts}")
