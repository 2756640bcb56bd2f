"""Layer kinds: what one kind of layer caches and how it runs, composed by the forward.

A layer kind is a value with four functions:

* `init_cache(config, groups, dtype, device)`: the zeroed cache of one layer of
  this kind (a frozen pytree such as `MLALayerCache`);
* `lookback(config)`: how far back its later steps read cache group 0 -- the
  tokens before a sequence's next position whose group-0 entries a future query
  of this kind can still read, or None for every token. The state's group 0 takes
  the largest of its layers' (`cache_groups`), and the scheduler frees a
  sequence's group-0 blocks behind it;
* `enter(p, delta, residual, ctx)`: the start of the layer, where the previous
  layer's output `delta` meets the residual stream. It returns what the layer's
  body reads and the new residual. Being the kind's own function, it decides how
  the residual is carried: the decoder layer fuses its input norm into its first
  projection (one launch at decode sizes); a kind with another residual form
  writes its own;
* `body(p, entered, residual, cache, ctx)`: the rest of the layer; returns
  (delta, residual, new cache). The residual it hands the next layer's `enter` is
  the kind's own value (a tensor [T, D] for the decoder layers; a kind with several
  residual streams hands on those with a pending write-back); the last layer's is a tensor
  [T, D], which the forward's final norm adds to delta, or a `FinalResidual` holding that tensor
  and the hidden state a drafter continues from, where that is not the final norm's output
  (a kind that collapses several streams itself hands on the streams before the collapse).

The forward runs `enter` then `body` for each layer with that layer's kind, so a
model made of new kinds needs no change in the forward or the step: its family
(`Family.layer_kinds`) says which kind each layer is.
`LayerContext` carries the per-step facts every layer may read: the batch (its
`input_ids` included, for hash routing), the mode, the op table, and every row's
own view (`rows`), built once a step by the forward for the kinds that attend row by row.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any, Protocol

import torch

from mla_func.core.batch import Batch
from mla_func.core.config import ModelConfig
from mla_func.core.exchange import RowExchange
from mla_func.core.mode import ForwardMode
from mla_func.core.rows import RowMetadata
from mla_func.kernels import Ops
from mla_func.state.layer_cache import CacheGroup


@dataclass(frozen=True, slots=True)
class LayerContext:
    """What a layer may read besides its params, its input and its cache.

    valid: [T] bool, True for real rows (padding rows are False; see `Batch.real_rows`)
    rows:  every row as its own query, in every cache group (`rows.RowMetadata`: key_lens [T],
           block_table [T, W], group_tables [T, W_g] per group 1..), made once a step by the forward
           when `rows.rows_needed` (batch-invariant steps, `Family.attends_by_row`, cache groups past 0);
           None otherwise. A kind that reads it raises ValueError when it is None: it is never rebuilt.
    exchange: under data-parallel attention, every rank's real rows and token ids, gathered once a
           step by the forward for every layer's row exchange (`core.exchange.row_exchange`); None
           otherwise.
    """

    batch: Batch
    mode: ForwardMode
    config: ModelConfig
    ops: Ops
    rope_cos: torch.Tensor
    rope_sin: torch.Tensor
    valid: torch.Tensor
    inplace: bool
    rows: RowMetadata | None = None
    exchange: RowExchange | None = None


@dataclass(frozen=True, slots=True)
class FinalResidual:
    """The last layer's residual when the hidden state a drafter continues from is not the final
    norm's output (`ForwardOutput.hidden`): `residual` is what the final norm adds to delta."""

    residual: torch.Tensor   # [T, D]
    hidden: torch.Tensor     # [T, H] the state each row's drafter step continues from


class LayerKind(Protocol):
    """The functions the forward composes for each layer (see the module docstring)."""

    @property
    def name(self) -> str: ...

    def init_cache(self, config: ModelConfig, groups: tuple[CacheGroup, ...], *, dtype: torch.dtype,
                   device: torch.device | str) -> Any: ...

    def lookback(self, config: ModelConfig) -> int | None: ...

    def enter(self, p: Any, delta: torch.Tensor, residual: Any,
              ctx: LayerContext) -> tuple[Any, torch.Tensor]: ...

    def body(self, p: Any, entered: Any, residual: torch.Tensor, cache: Any,
             ctx: LayerContext) -> tuple[torch.Tensor, Any, Any]: ...


def layer_kinds(config: ModelConfig) -> tuple[LayerKind, ...]:
    """The kind of each layer of a model, as its family says (`Family.layer_kinds`)."""
    return config.family.layer_kinds(config)


def group_lookback(config: ModelConfig, kinds: Sequence[LayerKind]) -> int | None:
    """The lookback of cache group 0: the largest of the layer kinds' (None if any reads every token)."""
    lookbacks = [k.lookback(config) for k in kinds]
    return None if not lookbacks or None in lookbacks else max(b for b in lookbacks if b is not None)


def cache_groups(config: ModelConfig, tokens: CacheGroup, *, layers: Sequence[LayerKind] | None = None,
                 max_num_seqs: int | None = None, max_num_batched_tokens: int | None = None
                 ) -> tuple[CacheGroup, ...]:
    """Every cache group a model's state needs, each with its own block count: the one place a state's
    geometry is derived (`init_state`, `cache_budget` and the engine's memory budget all call it).

    tokens: group 0's block size, and as num_blocks the capacity: the state holds as many tokens as
            tokens.num_blocks - 1 blocks of block_size tokens do.
    Groups 1.. (the family's, `Family.cache_groups`) hold the entries of that many tokens. Group 0
    takes the layers' lookback (`group_lookback`; layers default to `layer_kinds(config)`).
    Given the engine's max_num_seqs and max_num_batched_tokens (both or neither): groups 1.. get one
    more block a sequence, for its partly filled last one (so that any max_num_seqs sequences of
    that many tokens in all fit them), and a group 0 with a lookback keeps only the blocks those
    sequences can hold at once (`CacheGroup.blocks_in_flight`), if fewer.
    """
    if (max_num_seqs is None) != (max_num_batched_tokens is None):
        raise ValueError(f"cache_groups: max_num_seqs and max_num_batched_tokens go together, got "
                         f"max_num_seqs={max_num_seqs}, max_num_batched_tokens={max_num_batched_tokens}")
    kinds = layer_kinds(config) if layers is None else layers
    first = replace(tokens, lookback=group_lookback(config, kinds))
    rest = config.family.cache_groups(config, first)
    if max_num_seqs is None or max_num_batched_tokens is None:
        return (first, *rest)
    rest = tuple(replace(g, num_blocks=g.num_blocks + max_num_seqs) for g in rest)
    if first.lookback is not None:
        first = replace(first, num_blocks=min(first.num_blocks,
                                              first.blocks_in_flight(max_num_seqs, max_num_batched_tokens)))
    return (first, *rest)
