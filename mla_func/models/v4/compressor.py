"""V4's token compressor: every `rate` tokens pooled into one compressed entry by learned gates.

For entry w, each channel is a softmax-gated sum of the projected tokens of its
compression block [w * rate, (w + 1) * rate); the gate of slot j gets a learned
position bias. CSA (and its indexer) pool overlapping windows: the tokens' kv and
gate projections hold two series, Ca | Cb, and entry w pools Ca of block w - 1
with Cb of block w (2 * rate slots; block -1 does not exist). The pooled entry is
RMS-normalised, then its trailing rope channels are rotated at position w * rate.

The step first writes every token's projections (`compressor_inputs`, per token in
cache group 0; columns of the attention's one input product, `V4AttentionParams.in_proj`),
then each row that completes an entry ((p + 1) % rate == 0) pools its block(s) from there,
including tokens of the same step, and writes the entry into the layer's compressed group.
A row's carry is therefore whatever tokens of its current block are already cached: no
separate carry state needs updating.
"""

from __future__ import annotations

from typing import overload

import torch

from mla_func.kernels import Ops
from mla_func.kernels.index_cache import FP8IndexCache, IndexCache
from mla_func.kernels.latent_cache import FP8LatentCache, LatentCache
from mla_func.models.v4.params import CompressorParams


@overload
def write_entries(p: CompressorParams, inputs: torch.Tensor, entries: torch.Tensor, group_slots: torch.Tensor,
                  key_lens: torch.Tensor, block_table: torch.Tensor, *, rate: int, overlap: bool, num_seqs: int,
                  cos: torch.Tensor, sin: torch.Tensor, eps: float, ops: Ops, inplace: bool) -> torch.Tensor: ...
@overload
def write_entries(p: CompressorParams, inputs: torch.Tensor, entries: FP8LatentCache, group_slots: torch.Tensor,
                  key_lens: torch.Tensor, block_table: torch.Tensor, *, rate: int, overlap: bool, num_seqs: int,
                  cos: torch.Tensor, sin: torch.Tensor, eps: float, ops: Ops, inplace: bool) -> FP8LatentCache: ...
@overload
def write_entries(p: CompressorParams, inputs: torch.Tensor, entries: FP8IndexCache, group_slots: torch.Tensor,
                  key_lens: torch.Tensor, block_table: torch.Tensor, *, rate: int, overlap: bool, num_seqs: int,
                  cos: torch.Tensor, sin: torch.Tensor, eps: float, ops: Ops, inplace: bool) -> FP8IndexCache: ...


def write_entries(p: CompressorParams, inputs: torch.Tensor, entries: LatentCache | IndexCache,
                  group_slots: torch.Tensor, key_lens: torch.Tensor, block_table: torch.Tensor, *, rate: int,
                  overlap: bool, num_seqs: int, cos: torch.Tensor, sin: torch.Tensor, eps: float, ops: Ops,
                  inplace: bool) -> LatentCache | IndexCache:
    """Pool and write the entries the rows complete (`ops.v4.compress_entries`).

    inputs [nb, bs, 2 * c * Dc] (this step's tokens written); entries [num_blocks_g, bs_g, Dc] (a tensor, or an
    FP8 cache of keys or of indexer keys, returned as the type given);
    group_slots [n] int64 (the entry's slot, -1 for rows that complete none); key_lens [n] int32;
    block_table [n, W] int32; cos, sin [P, R / 2] the compress rope tables -> the entries cache
    with them written.
    """
    return ops.v4.compress_entries(inputs, entries, group_slots, key_lens, block_table, p.position_bias, p.kv_norm,
                                   cos, sin, rate=rate, overlap=overlap, eps=eps, num_seqs=num_seqs, inplace=inplace)
