"""MLA attention over the paged latent cache, and merging partial results by LSE.

Shapes use: T tokens, B sequences, H heads, W block-table width, bs block size,
S = W * bs gathered context positions, C = kv_lora_rank, R = qk_rope_head_dim,
Dn = qk_nope_head_dim, Dv = v_head_dim.

These references favour clarity and static shapes: they gather each sequence's
whole block table and mask, so they capture in a CUDA graph and run under
torch.func; prefill memory stays linear in the step's tokens (see prefill_attention).
"""

from __future__ import annotations

import torch

from ..checks import as_dtype, check_shape
from ..latent_cache import LatentCache, latent_rows
from ..quantized import Weight, dequantized


def _acc_dtype(dtype: torch.dtype) -> torch.dtype:
    # Low-precision inputs accumulate in float32; float64 stays float64 (test oracle).
    return torch.promote_types(dtype, torch.float32)


def gather_pages(kv_cache: LatentCache, block_table: torch.Tensor) -> torch.Tensor:
    """[num_blocks, bs, D], [B, W] -> [B, W * bs, D]: each sequence's cache rows in position order,
    in the activations' dtype (an FP8 latent cache dequantized, `latent_cache.latent_rows`)."""
    num_seqs, width = block_table.shape
    _, block_size, dim = kv_cache.shape
    return latent_rows(kv_cache, block_table.long()).reshape(num_seqs, width * block_size, dim)


def _softmax_with_lse(scores: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax over the last dim that gives probabilities 0 and LSE -inf for a fully masked row."""
    lse = torch.logsumexp(scores, dim=-1)
    # One op for "infinities to 0, NaN kept"; the difference is fresh, so exp runs in place.
    finite_lse = lse.nan_to_num(nan=float("nan"), posinf=0.0, neginf=0.0)
    return (scores - finite_lse.unsqueeze(-1)).exp_(), lse


def mla_decode(
    q: torch.Tensor,
    kv_cache: LatentCache,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    *,
    softmax_scale: float,
    kv_lora_rank: int,
    w_uv: Weight | None = None,
    q_len: int = 1,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Absorbed MLA decode: `q_len` query tokens per sequence attend causally over the latent cache.

    The cache already holds the step's own keys. Query j of sequence b stands at
    position seq_lens[b] - q_len + j and sees keys [0, seq_lens[b] - q_len + j]
    (so with q_len = 1 it sees the whole sequence; several query tokens per row
    serve speculative verification).

    q:           [B * q_len, H, C + R] absorbed query (q_nope @ W_UK, then q_pe); the
                 rows of sequence b are b * q_len .. b * q_len + q_len - 1, in position order
    kv_cache:    [num_blocks, bs, C + R] latent vectors (normalised c_kv, then rotated k_pe), or
                 an `FP8LatentCache` of that shape, read dequantized
    block_table: [B, W] int32
    seq_lens:    [B] int32 KV length after this step (>= q_len); 0 marks a padded sequence
    w_uv:        [H, Dv, C] value up-projection (a tensor, or a stacked FP8 pair: dequantized into q's
                 dtype), or None
    returns      out [B * q_len, H, C] in q's dtype (values are the first C dims of the cache),
                 or with w_uv out [B * q_len, H, Dv] = out @ w_uv[h]^T (out rounded to q's dtype
                 first); lse [B * q_len, H] float32 (natural log); the rows of a padded
                 sequence give out 0, lse -inf.
    """
    if q_len < 1:
        raise ValueError(f"q_len: expected at least 1, got {q_len}")
    num_rows, num_heads, dim = q.shape
    if num_rows % q_len:
        raise ValueError(f"q: expected a multiple of q_len={q_len} rows, got {num_rows}")
    num_seqs = num_rows // q_len
    check_shape("kv_cache", kv_cache, (None, None, dim))
    check_shape("block_table", block_table, (num_seqs, None))
    check_shape("seq_lens", seq_lens, (num_seqs,))
    acc = _acc_dtype(q.dtype)
    kv = as_dtype(gather_pages(kv_cache, block_table), acc)            # [B, S, C+R]
    qb = as_dtype(q, acc).reshape(num_seqs, q_len, num_heads, dim)
    # The contractions are bmm calls, the einsum each computes in its comment: einsum's
    # equation parsing costs more than the product itself at decode sizes.
    scores = torch.bmm(qb.flatten(1, 2), kv.transpose(1, 2)).view(num_seqs, q_len, num_heads, -1)  # bqhd,bsd->bqhs
    scores = scores * softmax_scale
    key_pos = torch.arange(kv.shape[1], device=q.device)
    # Query j stands at seq_lens - q_len + j: [B, 1], widened to [B, q] only for several queries.
    query_pos = seq_lens[:, None] - q_len
    if q_len > 1:
        query_pos = query_pos + torch.arange(q_len, device=q.device)[None, :]
    # A padded sequence (seq_lens 0) has query positions below 0, so it sees no key either.
    hidden = key_pos[None, None, :] > query_pos[:, :, None]              # [B, q, S]
    scores = scores.masked_fill(hidden[:, :, None, :], float("-inf"))
    probs, lse = _softmax_with_lse(scores)
    out = as_dtype(torch.bmm(probs.flatten(1, 2), kv[..., :kv_lora_rank]), q.dtype)  # bqhs,bsc->b(qh)c
    out, lse = out.view(num_rows, num_heads, kv_lora_rank), lse.flatten(0, 1)
    if w_uv is not None:
        check_shape("w_uv", w_uv, (num_heads, None, kv_lora_rank))
        w_uv = dequantized(w_uv, q.dtype)
        out = torch.bmm(out.transpose(0, 1), w_uv.transpose(1, 2)).transpose(0, 1)   # bhc,hvc->bhv
    return out, lse.float()


def token_to_seq(cu_seqlens_q: torch.Tensor, num_tokens: int) -> torch.Tensor:
    """[B + 1] cumulative query lengths -> [T] index of each token's sequence; B for padded tokens."""
    tokens = torch.arange(num_tokens, device=cu_seqlens_q.device, dtype=cu_seqlens_q.dtype)
    return torch.searchsorted(cu_seqlens_q[1:].contiguous(), tokens, right=True)


def prefill_attention(
    q_nope: torch.Tensor,
    q_pe: torch.Tensor,
    kv_cache: LatentCache,
    block_table: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    seq_lens: torch.Tensor,
    positions: torch.Tensor,
    w_uk: Weight,
    w_uv: Weight,
    *,
    softmax_scale: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """MLA prefill: new tokens attend causally over their own sequence's cache.

    The cache already holds this step's latent vectors, so "context + own keys" is
    one read of positions [0, seq_lens[b]). Computed in latent space (the query
    through W_UK, the attended latent through W_UV), which equals attention over
    the decompressed keys and values.

    q_nope:       [T, H, Dn]      q_pe: [T, H, R] (rotated)
    kv_cache:     [num_blocks, bs, C + R] (or an `FP8LatentCache`, read dequantized)
    block_table:  [B, W] int32
    cu_seqlens_q: [B + 1] int32, tokens of sequence b are rows cu[b]:cu[b+1];
                  rows from cu[B] on are padding
    seq_lens:     [B] int32 KV length of each sequence after this step
    positions:    [T] int64, token t sees key positions j <= positions[t]
    w_uk:         [H, Dn, C]      w_uv: [H, Dv, C] (kv_b_proj split per head; tensors, or stacked FP8
                  pairs, dequantized into q's dtype)
    returns       out [T, H, Dv] in q's dtype, lse [T, H] float32; padded rows give 0 / -inf.

    Memory is O(T * S * (C + R + H)): each token meets only its own sequence's
    keys (one sequence is read in place, several are gathered per token), never
    the [T, B, S] cross product.
    """
    num_tokens, num_heads, nope_dim = q_nope.shape
    num_seqs = block_table.shape[0]
    rope_dim = q_pe.shape[-1]
    kv_lora_rank = w_uk.shape[-1]
    check_shape("q_pe", q_pe, (num_tokens, num_heads, None))
    check_shape("kv_cache", kv_cache, (None, None, kv_lora_rank + rope_dim))
    check_shape("cu_seqlens_q", cu_seqlens_q, (num_seqs + 1,))
    check_shape("seq_lens", seq_lens, (num_seqs,))
    check_shape("positions", positions, (num_tokens,))
    check_shape("w_uk", w_uk, (num_heads, nope_dim, kv_lora_rank))
    check_shape("w_uv", w_uv, (num_heads, None, kv_lora_rank))
    acc = _acc_dtype(q_nope.dtype)
    w_uk, w_uv = dequantized(w_uk, q_nope.dtype), dequantized(w_uv, q_nope.dtype)
    if num_seqs == 0:
        out = torch.zeros((num_tokens, num_heads, w_uv.shape[1]), dtype=q_nope.dtype, device=q_nope.device)
        return out, torch.full((num_tokens, num_heads), float("-inf"), device=q_nope.device)

    kv = gather_pages(kv_cache, block_table).to(acc)                    # [B, S, C+R]
    # The scale goes on the query ([T, H, C+R]) rather than on the scores ([T, H, S]).
    q = torch.cat([torch.einsum("thd,hdc->thc", q_nope.to(acc), w_uk.to(acc)), q_pe.to(acc)], dim=-1)
    q = q * softmax_scale
    seq_of_token = token_to_seq(cu_seqlens_q, num_tokens)              # [T], B = padding
    own = seq_of_token.clamp(max=num_seqs - 1).long()
    if num_seqs == 1:
        keys = kv[0]                                                    # [S, C+R]
        scores = torch.einsum("thd,sd->ths", q, keys)
    else:
        keys = kv[own]                                                  # [T, S, C+R]
        scores = torch.einsum("thd,tsd->ths", q, keys)

    key_pos = torch.arange(kv.shape[1], device=q.device)
    visible = (
        (key_pos[None, :] <= positions[:, None])
        & (key_pos[None, :] < seq_lens[own][:, None])
        & (seq_of_token < num_seqs)[:, None]
    )                                                                   # [T, S]
    # A row with no key (padding) attends to everything instead, so that the
    # softmax stays finite (and its gradient too); its result is replaced below.
    has_key = visible.any(dim=-1)                                       # [T]
    mask = torch.where(visible | ~has_key[:, None], 0.0, float("-inf")).to(acc)
    # In place: the scores are fresh and unsaved, and a second [T, H, S] buffer
    # costs more (page faults) than the addition itself.
    scores.add_(mask[:, None, :])
    probs = torch.softmax(scores, dim=-1)                               # [T, H, S]
    # lse = s - log p at any key; at the arg-max key p >= 1 / S, so the log is safe.
    lse = scores.amax(dim=-1) - torch.log(probs.amax(dim=-1))
    if num_seqs == 1:
        latent = torch.einsum("ths,sc->thc", probs, keys[:, :kv_lora_rank])
    else:
        latent = torch.einsum("ths,tsc->thc", probs, keys[..., :kv_lora_rank])
    out = torch.einsum("thc,hvc->thv", latent, w_uv.to(acc))
    out = torch.where(has_key[:, None, None], out, torch.zeros((), dtype=acc, device=out.device))
    lse = torch.where(has_key[:, None], lse, float("-inf"))
    return out.to(q_nope.dtype), lse.float()


def merge_attn_states(
    out_a: torch.Tensor,
    lse_a: torch.Tensor,
    out_b: torch.Tensor,
    lse_b: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Combine two partial attention results over disjoint key sets.

    out_a, out_b: [T, H, D]; lse_a, lse_b: [T, H] float32 natural-log sums (-inf = empty)
    returns       out [T, H, D] in out_a's dtype, lse [T, H] float32.
    Both sides empty gives out 0 and lse -inf, never NaN.
    """
    check_shape("out_b", out_b, tuple(out_a.shape))
    check_shape("lse_a", lse_a, tuple(out_a.shape[:2]))
    check_shape("lse_b", lse_b, tuple(out_a.shape[:2]))
    acc = _acc_dtype(out_a.dtype)
    lse_a, lse_b = lse_a.to(acc), lse_b.to(acc)
    lse = torch.logaddexp(lse_a, lse_b)
    finite_lse = torch.where(torch.isinf(lse), torch.zeros_like(lse), lse)
    weight_a = torch.exp(lse_a - finite_lse).unsqueeze(-1)
    weight_b = torch.exp(lse_b - finite_lse).unsqueeze(-1)
    out = weight_a * out_a.to(acc) + weight_b * out_b.to(acc)
    return out.to(out_a.dtype), lse.float()


def absorb_query(q_nope: torch.Tensor, q_pe: torch.Tensor, w_uk: Weight) -> torch.Tensor:
    """The absorbed decode query: each head's q_nope through its key up-projection, then q_pe.

    q_nope [B, H, Dn], q_pe [B, H, R], w_uk [H, Dn, C] (a tensor, or a stacked FP8 pair: dequantized
    into q_nope's dtype) -> q [B, H, C + R], which `mla_decode` scores against the latent cache:
    q_nope . (W_UK c_kv) = (q_nope W_UK) . c_kv.
    """
    num_heads, qk_nope_head_dim, _ = w_uk.shape
    check_shape("q_nope", q_nope, (None, num_heads, qk_nope_head_dim))
    check_shape("q_pe", q_pe, (q_nope.shape[0], num_heads, None))
    # bhd,hdc->bhc as a bmm (einsum's parsing outweighs the product at decode sizes)
    product = torch.bmm(q_nope.transpose(0, 1), dequantized(w_uk, q_nope.dtype)).transpose(0, 1)
    return torch.cat([product, q_pe], dim=-1)
