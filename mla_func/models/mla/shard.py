"""How a DeepSeek-V2/V3/V3.2 checkpoint is cut across tensor-parallel ranks (`Family.tensor_split`).

Every cut is an even, contiguous range of one dim of one checkpoint tensor, so a rank reads
only its bytes:

* attention: query heads split. `q_b_proj` (or `q_proj` without a low-rank query) and
  `kv_b_proj` hold their heads' rows one head after another: rank r reads heads
  [r H / n, (r + 1) H / n); `o_proj` [D, H * Dv] reads those heads' input columns, so its
  output is a partial sum (the layer all-reduces it). The latent projection, its norm and the
  latent cache are whole on every rank: MLA caches one latent a token for all heads.
* MLPs and experts: gate and up rows, down columns, each rank 1 / n of every expert's (routed
  and shared) intermediate columns, so the stacked experts keep one width; the layer
  all-reduces the partial sum once for routed and shared experts together.
* embedding and LM head: vocab rows split (`core.vocab`) when n divides the vocabulary, whole
  on every rank otherwise; so are the MTP layer's copies of them (`model.layers.{L}.embed_tokens`,
  `shared_head.head`, L = num_hidden_layers), whose decoder layer is cut as every other.
* the router, norms and V3.2's indexer are whole on every rank: routing and the indexer's top-k
  then see the same bits everywhere and agree by construction.

With expert parallelism the experts' tensors are read whole (a rank reads only its own routed
experts, and every shared expert: `expert_shard`). With data-parallel attention the
attention and the embedding and LM head are whole on every rank (each attends for its own
requests); the MLPs and experts are cut as above.
"""

from __future__ import annotations

import dataclasses

from mla_func.core.config import ModelConfig
from mla_func.parallel.config import Sharding
from mla_func.parallel.shard import SplitNames, SplitRule, split_rule

NAMES = SplitNames(
    vocab=("model.embed_tokens.weight", "lm_head.weight"),
    head_rows=("self_attn.q_b_proj.weight", "self_attn.q_proj.weight", "self_attn.kv_b_proj.weight"),
    head_columns=("self_attn.o_proj.weight",),
    whole_experts=(".mlp.experts.", ".mlp.shared_experts."),
    mlp_rows=("gate_proj.weight", "up_proj.weight"),
    mlp_columns=("down_proj.weight",),
)


def mla_tensor_split(config: ModelConfig, sharding: Sharding) -> SplitRule:
    """The rule of the module docstring for `sharding`, after checking every split width divides."""
    c = config
    mlp_widths = {"intermediate_size": c.intermediate_size}
    if c.n_routed_experts and not sharding.expert_parallel:  # expert-parallel: every expert whole
        mlp_widths["moe_intermediate_size"] = c.moe_intermediate_size
    # The MTP layer (`models.mtp.params`) follows the decoder layers; its copies are cut as the originals.
    mtp = f"model.layers.{c.num_hidden_layers}."
    copies = (f"{mtp}embed_tokens.weight", f"{mtp}shared_head.head.weight")
    names = dataclasses.replace(NAMES, vocab=(*NAMES.vocab, *copies))
    return split_rule(names, sharding, vocab_size=c.vocab_size,
                      head_widths={"num_attention_heads": c.num_attention_heads}, mlp_widths=mlp_widths)
