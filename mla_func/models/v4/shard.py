"""How a DeepSeek-V4 checkpoint is cut across tensor-parallel ranks (`Family.tensor_split`).

Every cut is an even, contiguous range of one dim of one checkpoint tensor, so a rank reads
only its bytes (`parallel.shard`):

* attention: query heads split, each rank holding whole groups of the grouped output
  projection. `wq_b` [H * Dh, Q] reads its heads' rows and `attn_sink` [H] their sinks;
  `wo_a` [G * Og, H * Dh / G] reads its groups' rows (group g projects heads
  [g H / G, (g + 1) H / G): G / n whole groups are exactly the rank's H / n heads), and
  `wo_b` [D, G * Og] those groups' input columns, so its product is a partial sum that the
  layer all-reduces (`core.exchange.attention_output`). n must divide o_groups (and so the heads).
* MoE: every expert, routed and shared, split by intermediate columns (`w1`, `w3` rows, `w2`
  columns; the SwiGLU clamp is per column, so the cut is exact), one all-reduce for both. With
  expert parallelism a rank reads E / n routed experts whole (`expert_shard`), the shared
  experts still by columns.
* embedding and LM head (`head.weight`): vocabulary rows split when n divides the vocabulary
  (`core.vocab`), whole on every rank otherwise.

Whole on every rank: the query's low rank (`wq_a`, `q_norm`), the one shared key-value head
(`wkv`, its norm), the compressors, the lightning indexer (its compressor, `wq_b` rows and head
weights), the router and hash table, every hyper-connection site and the hyper head, and the
norms. Routing, the indexer's top-k and the mHC weights then see the same bits on every rank (the
all-reduce gives every rank the same sum) and agree without a broadcast.

What that costs a rank, in V4's real per-layer shapes (`v4-mini`: D 4096, Q 1024, Dh 512,
indexer 64 x 128): the replicated weights of a CSA layer are `in_proj`'s 4096 x 4096 (query low
rank, key-value, both compressors) and the indexer's 8192 x 1024 queries, 25 M values against the
100 M of the split query and output projections; the shared key-value, the compressors and the
indexer's scores over every compressed entry are computed on every rank; and the whole cache is on
every rank, as MLA's latent is: a CSA layer caches 512 (window key) + 2048 (compressor inputs) +
512 (indexer inputs) values a token in group 0 and 160 a token in compressed entries, an HCA layer
512 + 1024 and 4, a sliding layer 512, none of it shrinking with n. One head would not split: K = V
is one head for all, so it is cached once and read by every rank's heads.

The MTP layer (`mtp.0.`) is cut by the same suffixes as a decoder layer; its `e_proj` and `h_proj`
are whole on every rank (`mtp` says why).

With data-parallel attention the attention and the embedding and LM head are whole on every
rank (each attends for its own requests over a cache of its own requests); the MoE blocks are
cut as above and take every rank's rows, their token ids with them (hash routing reads them).
"""

from __future__ import annotations

from mla_func.core.config import ModelConfig, refuse
from mla_func.models.v4.config import v4_fields
from mla_func.parallel.config import Sharding
from mla_func.parallel.shard import SplitNames, SplitRule, split_rule

NAMES = SplitNames(
    vocab=("model.embed_tokens.weight", "head.weight"),
    head_rows=(".attn.wq_b.weight", ".attn.wo_a.weight", ".attn.attn_sink"),
    head_columns=(".attn.wo_b.weight",),
    # Only the routed experts are held whole under expert parallelism: the shared ones stay cut by columns.
    whole_experts=(".ffn.experts.",),
    mlp_rows=(".w1.weight", ".w3.weight"),
    mlp_columns=(".w2.weight",),
)


def v4_tensor_split(config: ModelConfig, sharding: Sharding) -> SplitRule:
    """The rule of the module docstring for `sharding`, after checking every split width divides
    (ConfigError, a ValueError, naming the field and the sizes)."""
    c, v, ranks = config, v4_fields(config), sharding.ranks
    rule = split_rule(NAMES, sharding, vocab_size=c.vocab_size,
                      head_widths={"num_attention_heads": c.num_attention_heads},
                      mlp_widths={"moe_intermediate_size": c.moe_intermediate_size})
    if rule.heads and v.o_groups % ranks:
        raise refuse("o_groups", v.o_groups, f"each of {ranks} ranks holds whole groups of the grouped output "
                     f"projection (num_attention_heads={c.num_attention_heads} in {v.o_groups} groups of "
                     f"{c.num_attention_heads // v.o_groups} heads): must be a multiple of {ranks}")
    return rule
