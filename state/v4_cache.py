"""DeepSeek-V4's per-layer caches: one frozen pytree per layer, with the leaves its kind needs.

Every V4 layer keeps, in cache group 0 (paged like MLA's latents, one entry per token):

* `window`: the layer's key (= value) of each token [nb, bs, Dh]; a row reads the
  last `sliding_window` of its sequence's through its block table.

A compressed layer (CSA or HCA) adds:

* `compressor_inputs` (group 0, per token) [nb, bs, 2 * c * Dh]: the compressor's
  projections (kv | gate) of each token. The compressor's carry -- the tokens of
  the partially filled compression block, and for CSA's overlapping windows the
  previous block's -- is read from here when the token that completes an entry
  arrives, so the carry is paged with the tokens it comes from;
* `entries` (the layer's compressed group g, one entry per `rate` tokens)
  [nb_g, bs_g, Dh]: the compressed keys (= values), written by the completing token.

A CSA layer adds its lightning indexer's own:

* `index_inputs` (group 0) [nb, bs, 4 * Di] and `index_keys` (group g) [nb_g, bs_g, Di].

Group 0 is read only near a sequence's end: a row at position p reads its window
[p - sliding_window + 1, p], and the row that completes an entry reads the
compressor inputs of its block (CSA's and its indexer's also the previous block's).
So group 0 has a lookback (`CacheGroup.lookback`, the largest of the layer kinds'
`V4DecoderLayer.lookback`): the scheduler frees a sequence's group-0 blocks once
they lie wholly before that many tokens behind its next position, and the block
table keeps the scratch block in their place. A group g holds a sequence's entries
for its whole length, in a pool sized by its own rate (`compressed_group`).

Everything a layer caches is thus a pure function of its sequence's tokens, stored
in blocks: a padded row (slot -1 in every group) writes nothing, and a prefix whose
entries are all in full blocks, and whose group-0 blocks of the last lookback tokens
are cached, restores every leaf a later step reads exactly.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from mla_func.pytree import register_dataclass, static_field

from .layer_cache import CacheGroup


@register_dataclass
@dataclass(frozen=True, slots=True)
class V4LayerCache:
    """One V4 layer's cache (see the module docstring for each leaf's shape and group)."""

    window: torch.Tensor
    compressor_inputs: torch.Tensor | None = None
    entries: torch.Tensor | None = None
    index_inputs: torch.Tensor | None = None
    index_keys: torch.Tensor | None = None
    group: int = static_field(default=0)
    entry_group: int = static_field(default=0)  # the compressed group of `entries` and `index_keys` (0: none)

    def paged(self) -> tuple[torch.Tensor, ...]:
        """The leaves paged by group 0's block tables (per token)."""
        return tuple(t for t in (self.window, self.compressor_inputs, self.index_inputs) if t is not None)

    def paged_entries(self) -> tuple[torch.Tensor, ...]:
        """The leaves paged by the compressed group's block tables (per entry)."""
        return tuple(t for t in (self.entries, self.index_keys) if t is not None)

    def paged_in(self, group: int) -> tuple[torch.Tensor, ...]:
        if group == self.group:
            return self.paged()
        return self.paged_entries() if self.entry_group and group == self.entry_group else ()


def compressed_group(tokens: CacheGroup, rate: int) -> CacheGroup:
    """The cache group of entries of `rate` tokens beside a token group.

    A block holds max(1, block_size // rate) entries. The group gets the blocks that
    hold the entries of as many tokens as the token group's usable blocks hold
    (`CacheGroup.sized_for`): its own count, which follows the token group's capacity
    in tokens, not its block count (a bounded token group has few blocks).
    """
    shape = CacheGroup(num_blocks=2, block_size=max(1, tokens.block_size // rate), tokens_per_entry=rate)
    return shape.sized_for((tokens.num_blocks - 1) * tokens.tokens_per_block)


def zeroed_v4_cache(groups: tuple[CacheGroup, ...], *, head_dim: int, entry_group: int, compressor_width: int,
                    index_dim: int, dtype: torch.dtype, device: torch.device | str) -> V4LayerCache:
    """A zeroed V4 layer cache.

    entry_group: 0 for a sliding-window layer, else the index of its compressed group in `groups`;
    compressor_width: c * Dh (c = 2 for CSA's overlapping windows, 1 for HCA);
    index_dim: Di for a CSA layer's indexer, 0 without one.
    """
    tokens = groups[0]

    def paged(group: CacheGroup, width: int) -> torch.Tensor:
        return torch.zeros(group.num_blocks, group.block_size, width, dtype=dtype, device=device)

    if entry_group == 0:
        return V4LayerCache(window=paged(tokens, head_dim))
    if not 0 < entry_group < len(groups):
        raise ValueError(f"entry_group: expected a compressed group in [1, {len(groups)}), got {entry_group}")
    g = groups[entry_group]
    return V4LayerCache(
        window=paged(tokens, head_dim),
        compressor_inputs=paged(tokens, 2 * compressor_width),
        entries=paged(g, head_dim),
        index_inputs=paged(tokens, 2 * 2 * index_dim) if index_dim else None,
        index_keys=paged(g, index_dim) if index_dim else None,
        entry_group=entry_group,
    )
