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
  on every rank otherwise.
* the router, norms and V3.2's indexer are whole on every rank: routing and the indexer's top-k
  then see the same bits everywhere and agree by construction.

With expert parallelism the experts' tensors are read whole (a rank reads only its own routed
experts, and cuts the shared ones in memory: `expert_shard`). With data-parallel attention the
attention and the embedding and LM head are whole on every rank (each attends for its own
requests); the MLPs and experts are cut as above.
"""

from __future__ import annotations

from dataclasses import dataclass

from mla_func.core.config import ModelConfig, refuse
from mla_func.parallel.config import Sharding

_ATTENTION_ROWS = ("self_attn.q_b_proj.weight", "self_attn.q_proj.weight", "self_attn.kv_b_proj.weight")
_ATTENTION_COLUMNS = ("self_attn.o_proj.weight",)
_MLP_ROWS = ("gate_proj.weight", "up_proj.weight")
_MLP_COLUMNS = ("down_proj.weight",)
_VOCAB = ("model.embed_tokens.weight", "lm_head.weight")
_EXPERTS = (".mlp.experts.", ".mlp.shared_experts.")


@dataclass(frozen=True, slots=True)
class _Rule:
    """Checkpoint tensor name -> the dim a rank reads an even share of, or None (read whole)."""

    heads: bool           # attention split by heads (tensor-parallel attention)
    vocab: bool           # embedding and LM head split by rows
    expert_columns: bool  # experts split by columns (not whole experts a rank)

    def __call__(self, name: str) -> int | None:
        if name in _VOCAB:
            return 0 if self.vocab else None
        if name.endswith(_ATTENTION_ROWS):
            return 0 if self.heads else None
        if name.endswith(_ATTENTION_COLUMNS):
            return 1 if self.heads else None
        if not self.expert_columns and any(part in name for part in _EXPERTS):
            return None
        if name.endswith(_MLP_ROWS):
            return 0
        if name.endswith(_MLP_COLUMNS):
            return 1
        return None


def mla_tensor_split(config: ModelConfig, sharding: Sharding) -> _Rule:
    """The rule of the module docstring for `sharding`, after checking every split width divides."""
    c, ranks = config, sharding.ranks
    widths = {} if sharding.data_parallel_attention else {"num_attention_heads": c.num_attention_heads}
    widths["intermediate_size"] = c.intermediate_size
    if c.n_routed_experts:
        widths["moe_intermediate_size"] = c.moe_intermediate_size
    for field, width in widths.items():
        if width % ranks:
            raise refuse(field, width, f"split evenly across {ranks} ranks: must be a multiple of {ranks}")
    tensor_parallel_attention = not sharding.data_parallel_attention
    return _Rule(heads=tensor_parallel_attention, vocab=tensor_parallel_attention and c.vocab_size % ranks == 0,
                 expert_columns=not sharding.expert_parallel)
