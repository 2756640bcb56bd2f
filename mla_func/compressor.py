"""V4's token compressor: every `rate` tokens pooled into one compressed entry by learned gates.

For entry w, each channel is a softmax-gated sum of the projected tokens of its
compression block [w * rate, (w + 1) * rate); the gate of slot j gets a learned
position bias. CSA (and its indexer) pool overlapping windows: the tokens' kv and
gate projections hold two series, Ca | Cb, and entry w pools Ca of block w - 1
with Cb of block w (2 * rate slots; block -1 does not exist). The pooled entry is
RMS-normalised, then its trailing rope channels are rotated at position w * rate.

The step first writes every token's projections (`compressor_inputs`, per token in
cache group 0), then each row that completes an entry ((p + 1) % rate == 0) pools
its block(s) from there, including tokens of the same step, and writes the entry
into the layer's compressed group. A row's carry is therefore whatever tokens of
its current block are already cached: no separate carry state needs updating.
"""

from __future__ import annotations

import torch

from .kernels import Ops
from .v4_params import CompressorParams
from .v4_rows import slots_of


def project_inputs(p: CompressorParams, x: torch.Tensor, ops: Ops) -> torch.Tensor:
    """x [T, D] -> the compressor's inputs [T, 2 * c * Dc]: kv projection, then gate projection."""
    return torch.cat([ops.dense.linear(x, p.kv_proj), ops.dense.linear(x, p.gate_proj)], dim=-1)


def completing_rows(group_slots: torch.Tensor, rate: int, num_seqs: int) -> torch.Tensor:
    """Row indices [n_max] (static size) listing first every row whose group slot is >= 0.

    A chunk of L tokens of one sequence completes at most L // rate + 1 entries, so
    n_max = min(n, n // rate + num_seqs) rows hold every completing row; the rest of
    the list are rows that complete nothing (their slot is -1: they write nothing).
    """
    n = group_slots.shape[0]
    n_max = min(n, n // rate + num_seqs)
    order = torch.argsort((group_slots < 0).to(torch.int8), stable=True)
    return order[:n_max]


def pool_block(p: CompressorParams, inputs: torch.Tensor, key_lens: torch.Tensor, block_table: torch.Tensor, *,
               rate: int, overlap: bool, cos: torch.Tensor, sin: torch.Tensor, eps: float, ops: Ops) -> torch.Tensor:
    """The entry each row completes (its last block of `rate` tokens ends at its position).

    inputs:      [num_blocks, bs, 2 * c * Dc] the compressor inputs cache (this step's tokens written)
    key_lens:    [n] int32 the row's position + 1 (0 for padding, whose result is unused)
    block_table: [n, W] int32 the row's sequence's group-0 table
    cos, sin:    [P, R / 2] the compress rope tables
    returns      [n, Dc] in the inputs' dtype
    """
    c = 2 if overlap else 1
    width = p.kv_norm.shape[0]
    block_size = inputs.shape[1]
    entry = (key_lens.to(torch.int64) - 1).clamp(min=0) // rate                              # [n]
    offsets = torch.arange(c * rate, device=entry.device, dtype=torch.int64) - (c - 1) * rate
    positions = entry.unsqueeze(1) * rate + offsets                                         # [n, c * rate]
    # A row that completes no entry reads nothing past its own position (its result is not written).
    last = (key_lens.to(torch.int64) - 1).unsqueeze(1)
    valid = (positions >= 0) & (positions <= last)
    slots = slots_of(block_table, torch.minimum(positions, last).clamp(min=0), block_size)
    src = inputs.view(-1, inputs.shape[-1])[slots]                                          # [n, c * rate, 2cDc]
    kv, gate = src.split([c * width, c * width], dim=-1)
    bias = p.position_bias
    if overlap:
        # Slots [0, rate): series Ca of the previous block; [rate, 2 * rate): series Cb of this one.
        kv = torch.cat([kv[:, :rate, :width], kv[:, rate:, width:]], dim=1)
        gate = torch.cat([gate[:, :rate, :width] + bias[:, :width], gate[:, rate:, width:] + bias[:, width:]], dim=1)
    else:
        gate = gate + bias
    pooled = ops.dense.rms_norm(ops.v4.pool_entries(kv, gate, valid), p.kv_norm, eps)
    start = entry * rate
    return ops.v4.rope_tail(pooled, cos[start], sin[start])


def write_entries(p: CompressorParams, inputs: torch.Tensor, entries: torch.Tensor, group_slots: torch.Tensor,
                  key_lens: torch.Tensor, block_table: torch.Tensor, *, rate: int, overlap: bool, num_seqs: int,
                  cos: torch.Tensor, sin: torch.Tensor, eps: float, ops: Ops, inplace: bool) -> torch.Tensor:
    """Pool and write the entries the rows complete.

    entries [num_blocks_g, bs_g, Dc]; group_slots [n] int64 (the entry's slot, -1 for rows that
    complete none); key_lens [n]; block_table [n, W] -> the entries cache with them written.
    """
    rows = completing_rows(group_slots, rate, num_seqs)
    pooled = pool_block(p, inputs, key_lens[rows], block_table[rows], rate=rate, overlap=overlap, cos=cos, sin=sin,
                        eps=eps, ops=ops)
    return ops.mla.write_kv(entries, group_slots[rows], pooled, inplace=inplace)
