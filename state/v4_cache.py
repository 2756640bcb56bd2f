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

With `kv_cache_dtype="fp8"` the keys a row attends over are held in FP8 as MLA's latents are
(`window` and `entries` as `kernels.latent_cache.FP8LatentCache`: the Dh - R leading values in
float8_e4m3fn with a float32 scale per 128, the R rotated values as they are; at V4-Flash's
Dh = 512, R = 64: 448 + 4 * 4 + 128 = 592 bytes a key against 1,024), and CSA's indexer keys as
V3.2's (`index_keys` an `FP8IndexCache`, one scale a key). The compressor inputs stay in the
activations' dtype: the compressor pools them in float32 before an entry is quantized.

Everything a layer caches is thus a pure function of its sequence's tokens, stored
in blocks: a padded row (slot -1 in every group) writes nothing, and a prefix whose
entries are all in full blocks, and whose group-0 blocks of the last lookback tokens
are cached, restores every leaf a later step reads exactly.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from mla_func.kernels.index_cache import IndexCache, index_leaves, zeroed_index_cache
from mla_func.kernels.latent_cache import LatentCache, check_kv_cache_dtype, latent_leaves, zeroed_latent
from mla_func.pytree import register_dataclass, static_field

from .layer_cache import CacheGroup


@register_dataclass
@dataclass(frozen=True, slots=True)
class V4LayerCache:
    """One V4 layer's cache (see the module docstring for each leaf's shape and group)."""

    window: LatentCache
    compressor_inputs: torch.Tensor | None = None
    entries: LatentCache | None = None
    index_inputs: torch.Tensor | None = None
    index_keys: IndexCache | None = None
    group: int = static_field(default=0)
    entry_group: int = static_field(default=0)  # the compressed group of `entries` and `index_keys` (0: none)

    def paged(self) -> tuple[torch.Tensor, ...]:
        """The tensors paged by group 0's block tables (per token), the window's first (one in the
        activations' dtype leads, `latent_leaves`)."""
        return latent_leaves(self.window) + tuple(t for t in (self.compressor_inputs, self.index_inputs)
                                                  if t is not None)

    def paged_entries(self) -> tuple[torch.Tensor, ...]:
        """The tensors paged by the compressed group's block tables (per entry)."""
        entries = () if self.entries is None else latent_leaves(self.entries)
        return entries + (() if self.index_keys is None else index_leaves(self.index_keys))

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
                    index_dim: int, rope_dim: int, dtype: torch.dtype, device: torch.device | str,
                    kv_cache_dtype: str = "auto") -> V4LayerCache:
    """A zeroed V4 layer cache.

    entry_group: 0 for a sliding-window layer, else the index of its compressed group in `groups`;
    compressor_width: c * Dh (c = 2 for CSA's overlapping windows, 1 for HCA);
    index_dim: Di for a CSA layer's indexer, 0 without one;
    rope_dim: R, the rotated tail of a key (kept in `dtype` by an FP8 cache);
    kv_cache_dtype: "auto" (every leaf in `dtype`) or "fp8" (the keys and index keys in FP8, see the
                    module docstring).
    """
    check_kv_cache_dtype(kv_cache_dtype)
    if not 0 <= rope_dim < head_dim:
        raise ValueError(f"rope_dim: expected in [0, head_dim={head_dim}), got {rope_dim}")
    tokens = groups[0]

    def paged(group: CacheGroup, width: int) -> torch.Tensor:
        return torch.zeros(group.num_blocks, group.block_size, width, dtype=dtype, device=device)

    def keys(group: CacheGroup) -> LatentCache:
        return zeroed_latent(group.num_blocks, group.block_size, head_dim - rope_dim, rope_dim,
                             kv_cache_dtype=kv_cache_dtype, dtype=dtype, device=device)

    if entry_group == 0:
        return V4LayerCache(window=keys(tokens))
    if not 0 < entry_group < len(groups):
        raise ValueError(f"entry_group: expected a compressed group in [1, {len(groups)}), got {entry_group}")
    g = groups[entry_group]
    return V4LayerCache(
        window=keys(tokens),
        compressor_inputs=paged(tokens, 2 * compressor_width),
        entries=keys(g),
        index_inputs=paged(tokens, 2 * 2 * index_dim) if index_dim else None,
        index_keys=zeroed_index_cache(g.num_blocks, g.block_size, index_dim, kv_cache_dtype=kv_cache_dtype,
                                      dtype=dtype, device=device) if index_dim else None,
        entry_group=entry_group,
    )
