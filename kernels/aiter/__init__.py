"""AMD AITER kernels on ROCm: MLA decode (one query a sequence) and fused MoE; every other op is the reference.

AITER's MLA decode reads the cache as [num_pages, page_size, 1, C + R] through a
CSR page list (kv_indptr, kv_indices) rather than a block table. The wrapper
below views the paged cache with page size 1 and builds a token-level page list
of static length B * W * bs on the device, so the step stays graph-capturable
and host-sync free. Padded rows (seq_len 0) are masked to out 0 / lse -inf
afterwards rather than trusted to the kernel.

Written against aiter's `mla_decode_fwd(q, kv_buffer, o, qo_indptr, kv_indptr,
kv_indices, kv_last_page_lens, max_seqlen_q, ..., return_lse=...)` and
`fused_moe(hidden_states, w1, w2, topk_weight, topk_ids)`; aiter's Python API
changes between releases, so tests/kernels/test_aiter.py runs these against the
reference wherever aiter imports.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from ..checks import check_dtype, check_shape
from ..dequantizing import DequantizingFusedMoe, DequantizingMlaDecode
from ..latent_cache import LatentCache
from ..reference import attention as ref_attention
from ..ops import Ops
from ..reference.table import REFERENCE


def _import_aiter() -> tuple[Any, Any]:
    try:
        import aiter  # noqa: F401
        from aiter import fused_moe as aiter_fused_moe
        from aiter import mla as aiter_mla
    except ImportError as exc:
        raise RuntimeError(
            "backend 'aiter' needs AMD's AITER library (ROCm GPUs), and `import aiter` failed: "
            f"{exc}. Use backend 'triton' on NVIDIA GPUs or 'torch' elsewhere."
        ) from exc
    return aiter_mla, aiter_fused_moe


def token_page_list(block_table: torch.Tensor, seq_lens: torch.Tensor, block_size: int
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """[B, W] block table -> (kv_indptr [B + 1], kv_indices [B * W * bs]) over cache rows.

    Row j < seq_lens[b] of sequence b lands at kv_indices[kv_indptr[b] + j]; the
    tail past kv_indptr[B] is left 0 and never read. Static shapes, no host sync.
    """
    num_seqs, width = block_table.shape
    device = block_table.device
    positions = torch.arange(width * block_size, device=device)                            # [S]
    rows = block_table.long()[:, positions // block_size] * block_size + positions % block_size  # [B, S]
    lens = seq_lens.long()
    indptr = torch.zeros(num_seqs + 1, dtype=torch.long, device=device)
    indptr[1:] = torch.cumsum(lens, 0)
    visible = positions[None, :] < lens[:, None]
    total = num_seqs * width * block_size
    # Invisible positions are sent to a spare slot at the end, then dropped.
    dest = torch.where(visible, indptr[:-1, None] + positions[None, :], total)
    indices = torch.zeros(total + 1, dtype=torch.long, device=device)
    indices.scatter_(0, dest.flatten(), rows.flatten())
    return indptr.int(), indices[:total].int()


def mla_decode(
    q: torch.Tensor,
    kv_cache: LatentCache,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    *,
    softmax_scale: float,
    kv_lora_rank: int,
    w_uv: torch.Tensor | None = None,
    q_len: int = 1,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Contract of `reference.attention.mla_decode`, run by AITER's MLA decode kernel for q_len = 1.

    q [B, H, C + R]; kv_cache [num_blocks, bs, C + R]; block_table [B, W] int32;
    seq_lens [B] int32; w_uv [H, Dv, C] or None -> out [B, H, C] (or [B, H, Dv] with
    w_uv, one batched GEMM after the kernel) in q's dtype, lse [B, H] float32.
    Head counts and dtypes are those AITER's kernels support (16 or 128 heads, bf16).

    Several causal query tokens per sequence (q_len > 1, q [B * q_len, H, C + R]) run
    the torch reference, `reference.attention.mla_decode`: AITER's causal rule for
    several queries of one sequence differs between releases and is not relied on.
    So does an FP8 latent cache (`latent_cache.FP8LatentCache`): AITER's FP8 MLA decode
    takes its own cache layout and scales, not this one's.
    """
    if q_len != 1 or not isinstance(kv_cache, torch.Tensor):
        return ref_attention.mla_decode(q, kv_cache, block_table, seq_lens, softmax_scale=softmax_scale,
                                        kv_lora_rank=kv_lora_rank, w_uv=w_uv, q_len=q_len)
    aiter_mla, _ = _import_aiter()
    num_seqs, num_heads, dim = q.shape
    num_blocks, block_size, _ = kv_cache.shape
    check_shape("kv_cache", kv_cache, (num_blocks, block_size, dim))
    check_shape("block_table", block_table, (num_seqs, None))
    check_shape("seq_lens", seq_lens, (num_seqs,))
    check_dtype("kv_cache", kv_cache, (q.dtype,))
    kv_indptr, kv_indices = token_page_list(block_table, seq_lens, block_size)
    qo_indptr = torch.arange(num_seqs + 1, dtype=torch.int32, device=q.device)
    last_page_lens = torch.ones(num_seqs, dtype=torch.int32, device=q.device)
    out = torch.empty((num_seqs, num_heads, kv_lora_rank), dtype=q.dtype, device=q.device)
    _, lse = aiter_mla.mla_decode_fwd(
        q.contiguous(), kv_cache.view(num_blocks * block_size, 1, 1, dim), out,
        qo_indptr, kv_indptr, kv_indices, last_page_lens, 1,
        sm_scale=softmax_scale, return_lse=True,
    )
    live = (seq_lens > 0)[:, None]
    out = torch.where(live[..., None], out, torch.zeros((), dtype=out.dtype, device=out.device))
    lse = torch.where(live, lse.view(num_seqs, num_heads).float(), float("-inf"))
    if w_uv is not None:
        out = torch.einsum("bhc,hvc->bhv", out, w_uv)
    return out, lse


def fused_moe(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    *,
    out_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """Contract of `reference.moe.fused_moe`, run by AITER's fused MoE (which returns x's dtype).

    AITER has no "no expert" id, so -1 is routed to expert 0 with weight 0, and
    rows whose every id is -1 are zeroed afterwards.
    """
    _, aiter_fused_moe = _import_aiter()
    check_shape("topk_ids", topk_ids, tuple(topk_weights.shape))
    chosen = topk_ids >= 0
    ids = torch.where(chosen, topk_ids, 0).to(torch.int32)
    weights = torch.where(chosen, topk_weights, 0.0).float()
    y = aiter_fused_moe.fused_moe(x, w13, w2, weights, ids)
    y = torch.where(chosen.any(dim=1, keepdim=True), y, torch.zeros((), dtype=y.dtype, device=y.device))
    return y.to(out_dtype or x.dtype)


def ops() -> Ops:
    """The AITER op table: its MLA decode and fused MoE, the reference for every other op."""
    _import_aiter()
    return dataclasses.replace(
        REFERENCE,
        backend="aiter",
        mla=dataclasses.replace(REFERENCE.mla, mla_decode=DequantizingMlaDecode(mla_decode)),
        moe=dataclasses.replace(REFERENCE.moe, fused_moe=DequantizingFusedMoe(fused_moe)),
    )
