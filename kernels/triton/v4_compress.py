"""DeepSeek-V4's compressor update: a completed block pooled into one compressed entry, in one kernel.

One program per row. A row whose entry slot is -1 (it completes no block: most
prompt tokens, most decode steps) runs no loop iteration and writes nothing. A
row that completes entry w = (key_len - 1) // rate gathers its block's c * rate
token slots from the paged compressor inputs (with overlap, series Ca of block
w - 1 then series Cb of block w), runs a per-channel online softmax of gate +
position bias over them (float32) while accumulating the gated kv, then
RMS-normalises the pooled entry with the norm weight, rotates its rope tail at
position w * rate and writes it to its slot of the entries cache.

Channels are held as (even, odd) halves of each interleaved rope pair, so the
rotation pairs channel 2p with 2p + 1 without moving data between lanes.
Roundings follow the reference: the pooled entry and the normalised one are
rounded to the cache dtype before the norm weight multiplies them; the weighted
entry stays in the wider of the weight's and the cache's dtype until the store.

An FP8 entries cache (`FP8LatentCache` keys, `FP8IndexCache` indexer keys) takes the pooled entries
through its own write: the kernel stores them as rows in the inputs' dtype, which the cache's write
op then quantizes into their slots (the reference's order of roundings: pool, then quantize).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from ..checks import check_dtype, check_same_device, check_shape
from ..index_cache import FP8IndexCache
from ..latent_cache import EntryCacheT, FP8LatentCache
from ._common import check_float, next_pow2, pdl
from .cache import write_kv
from .dsa_indexer import write_index_key

_INTERPRETER_BLOCK_S = 8
_GPU_BLOCK_S = 16


@triton.jit
def _online(m, l, acc, gate, kv, valid):
    """One chunk of slots [S, P] into the per-channel running max, sum and weighted kv [P]."""
    gate = tl.where(valid[:, None], gate, float("-inf"))
    m_new = tl.maximum(m, tl.max(gate, axis=0))
    shift = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp(m - shift)
    p = tl.exp(gate - shift[None, :])
    return m_new, l * alpha + tl.sum(p, axis=0), acc * alpha + tl.sum(p * kv, axis=0)


@triton.jit(do_not_specialize=["rate", "width"])
def _compress_kernel(
    in_ptr, ent_ptr, slot_ptr, klen_ptr, bt_ptr, bias_ptr, norm_ptr, cos_ptr, sin_ptr,
    rate, width, eps,
    s_in, s_ib, s_id,
    s_en, s_eb, s_ed,
    s_btt, s_btw, s_bias_r, s_bias_c, s_cos, s_cos_c, s_sin, s_sin_c,
    OVERLAP: tl.constexpr, C: tl.constexpr, ROUND_NORMED: tl.constexpr, ROPE_PAIRS: tl.constexpr,
    PAGE: tl.constexpr, ENTRY_PAGE: tl.constexpr,
    BLOCK_S: tl.constexpr, BLOCK_P: tl.constexpr, GDC: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    if GDC:
        gdc_wait()
        gdc_launch_dependents()
    slot = tl.load(slot_ptr + t)
    writes = slot >= 0
    key_len = tl.load(klen_ptr + t)
    entry = tl.maximum(key_len - 1, 0) // rate
    last = key_len - 1
    num_slots = tl.where(writes, C * rate, 0)
    pairs = tl.arange(0, BLOCK_P)
    pair_mask = pairs < width // 2
    m_e = tl.full([BLOCK_P], float("-inf"), tl.float32)
    m_o = tl.full([BLOCK_P], float("-inf"), tl.float32)
    l_e = tl.zeros([BLOCK_P], tl.float32)
    l_o = tl.zeros([BLOCK_P], tl.float32)
    a_e = tl.zeros([BLOCK_P], tl.float32)
    a_o = tl.zeros([BLOCK_P], tl.float32)
    bt_row = bt_ptr + t * s_btt
    for s0 in range(0, num_slots, BLOCK_S):
        i = s0 + tl.arange(0, BLOCK_S)
        pos = entry * rate + i - (C - 1) * rate
        valid = (i < num_slots) & (pos >= 0) & (pos <= last)
        page = tl.load(bt_row + (pos // PAGE) * s_btw, mask=valid, other=0).to(tl.int64)
        src = in_ptr + page * s_in + (pos % PAGE).to(tl.int64) * s_ib
        # Slot i reads series i // rate (overlap: Ca, then Cb) of kv and gate, and bias row i % rate.
        if OVERLAP:
            series = i // rate
        else:
            series = i * 0
        kv_cols = series[:, None] * width + 2 * pairs[None, :]
        gate_cols = kv_cols + C * width
        mask2 = valid[:, None] & pair_mask[None, :]
        kv_e = tl.load(src[:, None] + kv_cols * s_id, mask=mask2, other=0.0).to(tl.float32)
        kv_o = tl.load(src[:, None] + (kv_cols + 1) * s_id, mask=mask2, other=0.0).to(tl.float32)
        g_e = tl.load(src[:, None] + gate_cols * s_id, mask=mask2, other=0.0).to(tl.float32)
        g_o = tl.load(src[:, None] + (gate_cols + 1) * s_id, mask=mask2, other=0.0).to(tl.float32)
        bias_row = bias_ptr + (i % rate)[:, None] * s_bias_r
        b_e = tl.load(bias_row + kv_cols * s_bias_c, mask=mask2, other=0.0).to(tl.float32)
        b_o = tl.load(bias_row + (kv_cols + 1) * s_bias_c, mask=mask2, other=0.0).to(tl.float32)
        m_e, l_e, a_e = _online(m_e, l_e, a_e, g_e + b_e, kv_e, valid)
        m_o, l_o, a_o = _online(m_o, l_o, a_o, g_o + b_o, kv_o, valid)

    dtype = ent_ptr.dtype.element_ty
    pooled_e = tl.where(l_e > 0.0, a_e / tl.where(l_e > 0.0, l_e, 1.0), 0.0).to(dtype).to(tl.float32)
    pooled_o = tl.where(l_o > 0.0, a_o / tl.where(l_o > 0.0, l_o, 1.0), 0.0).to(dtype).to(tl.float32)
    pooled_e = tl.where(pair_mask, pooled_e, 0.0)
    pooled_o = tl.where(pair_mask, pooled_o, 0.0)
    mean_sq = (tl.sum(pooled_e * pooled_e, axis=0) + tl.sum(pooled_o * pooled_o, axis=0)) / width
    inv = 1.0 / tl.sqrt(mean_sq + eps)
    w_e = tl.load(norm_ptr + 2 * pairs, mask=pair_mask, other=0.0).to(tl.float32)
    w_o = tl.load(norm_ptr + 2 * pairs + 1, mask=pair_mask, other=0.0).to(tl.float32)
    y_e = w_e * (pooled_e * inv).to(dtype).to(tl.float32)
    y_o = w_o * (pooled_o * inv).to(dtype).to(tl.float32)
    if ROUND_NORMED:
        y_e = y_e.to(dtype).to(tl.float32)
        y_o = y_o.to(dtype).to(tl.float32)
    # The trailing ROPE_PAIRS pairs rotate by the angles of the block's first position.
    angle = pairs - (width // 2 - ROPE_PAIRS)
    is_pe = (angle >= 0) & pair_mask
    start = (entry * rate).to(tl.int64)
    cos = tl.load(cos_ptr + start * s_cos + angle * s_cos_c, mask=is_pe, other=1.0).to(tl.float32)
    sin = tl.load(sin_ptr + start * s_sin + angle * s_sin_c, mask=is_pe, other=0.0).to(tl.float32)
    r_e = tl.where(is_pe, y_e * cos - y_o * sin, y_e)
    r_o = tl.where(is_pe, y_o * cos + y_e * sin, y_o)
    slot64 = tl.maximum(slot, 0).to(tl.int64)
    dst = ent_ptr + (slot64 // ENTRY_PAGE) * s_en + (slot64 % ENTRY_PAGE) * s_eb
    store_mask = pair_mask & ((pairs * 0 + slot) >= 0)
    tl.store(dst + (2 * pairs) * s_ed, r_e.to(dtype), mask=store_mask)
    tl.store(dst + (2 * pairs + 1) * s_ed, r_o.to(dtype), mask=store_mask)


def compress_entries(inputs: torch.Tensor, entries: EntryCacheT, group_slots: torch.Tensor, key_lens: torch.Tensor,
                     block_table: torch.Tensor, position_bias: torch.Tensor, kv_norm: torch.Tensor,
                     cos: torch.Tensor, sin: torch.Tensor, *, rate: int, overlap: bool, eps: float, num_seqs: int,
                     inplace: bool) -> EntryCacheT:
    """The compressor's update (see `reference.v4_paged.compress_entries` for the contract).

    inputs [nb, bs, 2 * c * Dc]; entries [nbg, bsg, Dc] in the inputs' dtype, or an `FP8LatentCache` /
    `FP8IndexCache` of that shape (written through its own write op); group_slots [n] int64;
    key_lens [n] int32; block_table [n, W] int32; position_bias [rate, c * Dc]; kv_norm [Dc];
    cos, sin [P, R / 2] float. `num_seqs` (the reference's bound on completing rows) is not
    needed: rows that complete nothing exit at once. Returns the entries cache.
    """
    n = group_slots.shape[0]
    if not isinstance(entries, torch.Tensor):
        return _compress_fp8(inputs, entries, group_slots, key_lens, block_table, position_bias, kv_norm, cos, sin,
                             rate=rate, overlap=overlap, eps=eps, num_seqs=num_seqs, inplace=inplace)
    c = 2 if overlap else 1
    width = entries.shape[2]
    check_float("inputs", inputs)
    check_shape("inputs", inputs, (None, None, 2 * c * width))
    check_dtype("entries", entries, (inputs.dtype,))
    check_shape("group_slots", group_slots, (n,))
    check_dtype("group_slots", group_slots, (torch.int64,))
    check_shape("key_lens", key_lens, (n,))
    check_dtype("key_lens", key_lens, (torch.int32,))
    check_shape("block_table", block_table, (n, None))
    check_dtype("block_table", block_table, (torch.int32,))
    check_shape("position_bias", position_bias, (rate, c * width))
    check_shape("kv_norm", kv_norm, (width,))
    check_shape("sin", sin, tuple(cos.shape))
    check_same_device(inputs=inputs, entries=entries, group_slots=group_slots, key_lens=key_lens,
                      block_table=block_table, position_bias=position_bias, kv_norm=kv_norm, cos=cos, sin=sin)
    rope_pairs = cos.shape[1]
    if width % 2 or not 0 <= 2 * rope_pairs <= width:
        raise ValueError(f"entries: expected an even width with room for the rope tail (2 * {rope_pairs}), "
                         f"got {width}")
    if rate < 1:
        raise ValueError(f"rate: expected >= 1, got {rate}")
    out = entries if inplace else entries.clone()
    if n == 0:
        return out
    block_s = _GPU_BLOCK_S if inputs.device.type == "cuda" else _INTERPRETER_BLOCK_S
    block_p = max(16, next_pow2(width // 2))
    _compress_kernel[(n,)](
        inputs, out, group_slots, key_lens, block_table, position_bias, kv_norm, cos, sin,
        rate, width, eps,
        *inputs.stride(), *out.stride(), *block_table.stride(), *position_bias.stride(),
        *cos.stride(), *sin.stride(),
        # A norm weight wider than the cache (float32) keeps the normalised entry wide until the final store.
        OVERLAP=overlap, C=c, ROUND_NORMED=torch.promote_types(kv_norm.dtype, inputs.dtype) == inputs.dtype,
        ROPE_PAIRS=rope_pairs, PAGE=inputs.shape[1], ENTRY_PAGE=out.shape[1],
        BLOCK_S=block_s, BLOCK_P=block_p, GDC=pdl(inputs.device), launch_pdl=pdl(inputs.device),
        # Six [BLOCK_S, BLOCK_P] float32 tiles live at once: wide entries (512) take eight warps to hold them.
        num_warps=8 if block_p >= 256 else 4,
    )
    return out


def _compress_fp8(inputs: torch.Tensor, entries: EntryCacheT, group_slots: torch.Tensor, key_lens: torch.Tensor,
                  block_table: torch.Tensor, position_bias: torch.Tensor, kv_norm: torch.Tensor, cos: torch.Tensor,
                  sin: torch.Tensor, *, rate: int, overlap: bool, eps: float, num_seqs: int,
                  inplace: bool) -> EntryCacheT:
    """`compress_entries` into an FP8 cache: row i's entry pooled into row i of a [n, Dc] buffer in the inputs'
    dtype (a cache of one-slot pages, its slot i where the row completes one, else -1), then written at the
    rows' entry slots by the cache's write op, which quantizes it and skips the -1 slots."""
    n = group_slots.shape[0]
    width = entries.shape[2]
    check_shape("group_slots", group_slots, (n,))
    check_dtype("group_slots", group_slots, (torch.int64,))
    check_float("inputs", inputs)
    rows = torch.empty((n, 1, width), dtype=inputs.dtype, device=inputs.device)
    row_slots = torch.where(group_slots >= 0, torch.arange(n, device=group_slots.device), -1)
    compress_entries(inputs, rows, row_slots, key_lens, block_table, position_bias, kv_norm, cos, sin, rate=rate,
                     overlap=overlap, eps=eps, num_seqs=num_seqs, inplace=True)
    if isinstance(entries, FP8IndexCache):
        return write_index_key(entries, group_slots, rows.view(n, width), inplace=inplace)
    if isinstance(entries, FP8LatentCache):
        return write_kv(entries, group_slots, rows.view(n, width), inplace=inplace)
    raise TypeError(f"entries: expected a tensor, an FP8LatentCache or an FP8IndexCache, got {type(entries).__name__}")
