"""DeepSeek Sparse Attention (DSA): the lightning indexer's keys, scores, top-k, and sparse MLA.

Shapes use: T rows (one query token each), Hi indexer heads, Di index_head_dim,
W block-table width, bs block size, L = W * bs key positions a row may see,
H heads, C = kv_lora_rank, R = qk_rope_head_dim, Dv = v_head_dim, k selected keys.

Every row carries its own block table and key count (`mla_func.core.rows.RowMetadata`):
a row at position p sees keys [0, p]; padded rows see none (key_lens 0). These
references keep static shapes and do no host sync, so they capture in a CUDA
graph; they read each row's whole table for the scores (in chunks of rows), and
only the k selected latent rows for the attention.
"""

from __future__ import annotations

from typing import overload

import torch

from ..checks import as_dtype, check_shape
from ..index_cache import FP8IndexCache, IndexCache
from ..latent_cache import LatentCache, latent_rows
from ..quantized import Weight, dequantized
from .attention import _acc_dtype, _softmax_with_lse
from .cache import write_kv, write_rows
from .fp8 import quantize_activations

# Elements of the gathered keys and logits ([rows, L, Di + Hi]) scored at once: rows are taken
# in chunks of a size fixed by the shapes (static under a graph), so a long context or a long
# prefill does not gather every row's whole table at once.
_SCORE_ELEMENTS = 1 << 25


def quantize_index_keys(index_key: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The FP8 indexer cache's form of keys: index_key [T, Di] -> (values [T, Di] float8_e4m3fn, scales [T, 1]
    float32): one scale a key, max(|key|, AMAX_FLOOR) / 448, values rounded as `fp8.quantize_activations`
    rounds one group (the latent cache's FP8 rule)."""
    return quantize_activations(index_key, max(1, index_key.shape[1]))


@overload
def write_index_key(index_cache: torch.Tensor, slot_mapping: torch.Tensor, index_key: torch.Tensor, *,
                    inplace: bool) -> torch.Tensor: ...
@overload
def write_index_key(index_cache: FP8IndexCache, slot_mapping: torch.Tensor, index_key: torch.Tensor, *,
                    inplace: bool) -> FP8IndexCache: ...


def write_index_key(
    index_cache: IndexCache,
    slot_mapping: torch.Tensor,
    index_key: torch.Tensor,
    *,
    inplace: bool,
) -> IndexCache:
    """index_cache [num_blocks, bs, Di] (a tensor, or an `FP8IndexCache`, which takes the keys quantized:
    `quantize_index_keys`), slot_mapping [T] int64 (-1: skip), index_key [T, Di]
    -> the cache with the rows written, of the type given (the same value when `inplace`, else a new one).

    The indexer keys are per token like the latents, so they use the latent cache's
    slots: one `write_rows` a leaf (a skipped row writes only the scratch block).
    """
    if isinstance(index_cache, torch.Tensor):
        return write_kv(index_cache, slot_mapping, index_key, inplace=inplace)
    check_shape("index_key", index_key, (slot_mapping.shape[0], index_cache.shape[2]))
    values, scales = quantize_index_keys(index_key)
    # The FP8 values move as their bytes: index_copy has no float8 kernel, and a byte copy keeps every bit.
    value_bytes = write_rows(index_cache.values.view(torch.uint8), slot_mapping, values.view(torch.uint8),
                             inplace=inplace)
    scale_rows = write_rows(index_cache.scales, slot_mapping, scales, inplace=inplace)
    if inplace:
        return index_cache
    return FP8IndexCache(values=value_bytes.view(index_cache.values.dtype), scales=scale_rows)




def index_scores(
    q: torch.Tensor,
    head_weights: torch.Tensor,
    index_cache: IndexCache,
    block_table: torch.Tensor,
    key_lens: torch.Tensor,
    *,
    weight_scale: float = 1.0,
) -> torch.Tensor:
    """scores[t, j] = sum_h w[t, h] * relu(q[t, h] . key_j) for j < key_lens[t], else -inf.

    q [T, Hi, Di]; head_weights [T, Hi] float32, w = head_weights * weight_scale (in
    head_weights' dtype); index_cache [num_blocks, bs, Di] (a tensor, or an `FP8IndexCache`: its keys
    dequantized, value * scale in float32); block_table [T, W] int32;
    key_lens [T] int32 -> scores [T, W * bs] float32 (dot products and the head sum in
    float32, or float64 for float64 inputs).
    """
    num_rows, num_heads, dim = q.shape
    check_shape("head_weights", head_weights, (num_rows, num_heads))
    check_shape("index_cache", index_cache, (None, None, dim))
    check_shape("block_table", block_table, (num_rows, None))
    check_shape("key_lens", key_lens, (num_rows,))
    head_weights = head_weights * weight_scale
    acc = torch.promote_types(_acc_dtype(q.dtype), head_weights.dtype)
    width, block_size = block_table.shape[1], index_cache.shape[1]
    num_keys = width * block_size
    key_pos = torch.arange(num_keys, device=q.device)
    chunk = max(1, _SCORE_ELEMENTS // (num_keys * (dim + num_heads)))
    parts = []
    for start in range(0, num_rows, chunk):
        rows = slice(start, min(start + chunk, num_rows))
        table = block_table[rows].long()
        # An FP8 cache indexed gives its keys dequantized (value * scale in float32, exact).
        keys = as_dtype(index_cache[table].reshape(table.shape[0], num_keys, dim), acc)    # [t, L, Di]
        logits = torch.bmm(as_dtype(q[rows], acc), keys.transpose(1, 2)).relu_()           # thd,tld->thl
        scores = torch.bmm(as_dtype(head_weights[rows], acc).unsqueeze(1), logits).squeeze(1)  # th,thl->tl
        hidden = key_pos[None, :] >= key_lens[rows, None]
        parts.append(scores.masked_fill(hidden, float("-inf")))
    if not parts:
        return torch.zeros((0, num_keys), dtype=torch.float32, device=q.device)
    scores = parts[0] if len(parts) == 1 else torch.cat(parts)
    return scores if acc == torch.float64 else scores.float()


def top_k_indices(scores: torch.Tensor, key_lens: torch.Tensor, *, k: int) -> torch.Tensor:
    """The k best visible positions of each row, in ascending position order.

    scores [T, L] float32; key_lens [T] int32 -> indices [T, k] int32. Among j < key_lens[t],
    the k largest scores, ties broken toward the lower position; -1 fills the tail when
    key_lens[t] < k. A stable descending sort puts equal scores in position order, which is
    the tie rule; the reference favours that exactness over the speed of a partial top-k.
    """
    if k < 1:
        raise ValueError(f"k: expected at least 1, got {k}")
    num_rows, num_keys = scores.shape
    check_shape("key_lens", key_lens, (num_rows,))
    key_pos = torch.arange(num_keys, device=scores.device)
    visible = key_pos[None, :] < key_lens[:, None]
    masked = scores.masked_fill(~visible, float("-inf"))
    if num_keys < k:
        pad = torch.full((num_rows, k - num_keys), float("-inf"), dtype=scores.dtype, device=scores.device)
        masked = torch.cat([masked, pad], dim=1)
    order = torch.sort(masked, dim=1, descending=True, stable=True).indices[:, :k]         # [T, k]
    chosen = order < key_lens[:, None]
    # Unchosen entries sort past every position, then become -1.
    past_end = max(num_keys, k)
    ascending = torch.sort(torch.where(chosen, order, past_end), dim=1).values
    return torch.where(ascending < past_end, ascending, -1).to(torch.int32)


def sparse_mla_decode(
    q: torch.Tensor,
    kv_cache: LatentCache,
    block_table: torch.Tensor,
    indices: torch.Tensor,
    *,
    softmax_scale: float,
    kv_lora_rank: int,
    w_uv: Weight | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Absorbed MLA of each row over the latent rows its indices select.

    q [T, H, C + R]; kv_cache [num_blocks, bs, C + R] (or an `FP8LatentCache`, its selected rows read
    dequantized); block_table [T, W] int32;
    indices [T, k] int32 key positions (-1, or any outside [0, W * bs): none); w_uv [H, Dv, C] (a tensor, or a stacked FP8 pair:
    dequantized into q's dtype) or None
    -> out [T, H, C] in q's dtype, or [T, H, Dv] with w_uv (out rounded to q's dtype, then
       @ w_uv[h]^T); lse [T, H] float32; a row with no valid index gives out 0, lse -inf.
    """
    num_rows, num_heads, dim = q.shape
    check_shape("kv_cache", kv_cache, (None, None, dim))
    check_shape("block_table", block_table, (num_rows, None))
    check_shape("indices", indices, (num_rows, None))
    block_size = kv_cache.shape[1]
    width = block_table.shape[1]
    acc = _acc_dtype(q.dtype)
    # -1, and any position past the row's table, is no key (the kernels' contract).
    valid = (indices >= 0) & (indices < width * block_size)                 # [T, k]
    pos = indices.long().clamp(min=0)
    # A position past the table is clamped for the read, and masked.
    block = block_table.long().gather(1, (pos // block_size).clamp(max=width - 1))
    kv = as_dtype(latent_rows(kv_cache, block, pos % block_size), acc)      # [T, k, C+R]
    scores = torch.bmm(as_dtype(q, acc), kv.transpose(1, 2)) * softmax_scale   # thd,tkd->thk
    scores = scores.masked_fill(~valid[:, None, :], float("-inf"))
    probs, lse = _softmax_with_lse(scores)
    out = as_dtype(torch.bmm(probs, kv[..., :kv_lora_rank]), q.dtype)       # thk,tkc->thc
    if w_uv is not None:
        check_shape("w_uv", w_uv, (num_heads, None, kv_lora_rank))
        w_uv = dequantized(w_uv, q.dtype)
        out = torch.bmm(out.transpose(0, 1), w_uv.transpose(1, 2)).transpose(0, 1)   # thc,hvc->thv
    return out, lse.float()
