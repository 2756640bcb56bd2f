"""One step's latents into the cache: normalise c_kv, rotate k_pe and the queries' q_pe, write."""

from __future__ import annotations

import torch

from ..checks import check_shape
from ..latent_cache import LatentCache
from ..quantized import Weight
from .attention import absorb_query
from .cache import write_kv
from .norm import rms_norm
from .rope import rope


def write_latent(
    kv_cache: LatentCache,
    slot_mapping: torch.Tensor,
    latent: torch.Tensor,
    kv_a_norm: torch.Tensor,
    q_pe: torch.Tensor,
    positions: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    *,
    eps: float,
    interleaved: bool,
    inplace: bool = True,
) -> tuple[LatentCache, torch.Tensor]:
    """`rms_norm`, `rope` and `write_kv` of one step's latents, as one op.

    kv_cache:     [num_blocks, block_size, C + R], or an `FP8LatentCache` (written quantized)
    slot_mapping: [T] integer; -1 marks padding (see `write_kv`)
    latent:       [T, C + R] the kv_a projection: c_kv, then k_pe before rotation
    kv_a_norm:    [C] weight of c_kv's RMSNorm (epsilon `eps`)
    q_pe:         [T, H, R] the queries' rope part before rotation
    positions:    [T]; cos, sin: [max_positions, R / 2] (see `rope`)
    returns       (the cache with [rms_norm(c_kv), rope(k_pe)] written at slot_mapping,
                  the rotated q_pe [T, H, R]); `inplace` as in `write_kv`.
    """
    kv_lora_rank = kv_a_norm.shape[0]
    check_shape("latent", latent, (q_pe.shape[0], kv_cache.shape[2]))
    c_kv, k_pe = latent.split([kv_lora_rank, latent.shape[1] - kv_lora_rank], dim=-1)
    q_pe, k_pe = rope(q_pe, k_pe, positions, cos, sin, interleaved=interleaved)
    kv = torch.cat([rms_norm(c_kv, kv_a_norm, eps), k_pe], dim=-1)
    return write_kv(kv_cache, slot_mapping, kv, inplace=inplace), q_pe


def write_latent_absorb(
    kv_cache: LatentCache,
    slot_mapping: torch.Tensor,
    latent: torch.Tensor,
    kv_a_norm: torch.Tensor,
    q_nope: torch.Tensor,
    q_pe: torch.Tensor,
    w_uk: Weight,
    positions: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    *,
    eps: float,
    interleaved: bool,
    absorb_from: int,
    inplace: bool = True,
) -> tuple[LatentCache, torch.Tensor, torch.Tensor]:
    """`write_latent`, then `absorb_query` of the rows from `absorb_from` on (a step's decode rows).

    q_nope:      [T, H, Dn]; w_uk: [H, Dn, C] (a tensor or a stacked FP8 pair, see `absorb_query`);
                 absorb_from in [0, T]; the rest as `write_latent`
    returns      (kv_cache, rotated q_pe [T, H, R], absorbed q [T - absorb_from, H, C + R])
    """
    if not 0 <= absorb_from <= q_pe.shape[0]:
        raise ValueError(f"absorb_from: expected in [0, {q_pe.shape[0]}], got {absorb_from}")
    kv_cache, q_pe = write_latent(kv_cache, slot_mapping, latent, kv_a_norm, q_pe, positions, cos, sin,
                                  eps=eps, interleaved=interleaved, inplace=inplace)
    return kv_cache, q_pe, absorb_query(q_nope[absorb_from:], q_pe[absorb_from:], w_uk)
