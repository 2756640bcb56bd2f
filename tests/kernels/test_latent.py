"""The Triton write_latent kernel (norm + rotary + cache write in one launch) against the reference."""

from __future__ import annotations

import pytest
import torch

from support.kernel_cases import generator, randn, strided
from mla_func.kernels.reference.latent import write_latent as ref_write_latent
from mla_func.kernels.reference.latent import write_latent_absorb as ref_write_latent_absorb
from mla_func.kernels.triton.latent import write_latent, write_latent_absorb

KV_LORA_RANK, ROPE_DIM, HEADS, BLOCK_SIZE, NUM_BLOCKS = 48, 16, 3, 8, 5


def _case(dtype, device, seed, *, weight_dtype=None):
    gen = generator(seed, device)
    tokens = 6
    cache = randn((NUM_BLOCKS, BLOCK_SIZE, KV_LORA_RANK + ROPE_DIM), dtype, device, gen)
    # latent and q_pe as the model has them: strided slices of one projection's output.
    first = randn((tokens, 24 + HEADS * ROPE_DIM + KV_LORA_RANK + ROPE_DIM), dtype, device, gen)
    q_pe = first[:, 24:24 + HEADS * ROPE_DIM].view(tokens, HEADS, ROPE_DIM)
    latent = first[:, 24 + HEADS * ROPE_DIM:]
    norm = (1.0 + 0.2 * randn((KV_LORA_RANK,), torch.float32, device, gen)).to(weight_dtype or dtype)
    angles = torch.rand(64, ROPE_DIM // 2, generator=gen, device=device) * 6.0
    cos, sin = 0.9 * angles.cos(), 0.9 * angles.sin()
    positions = torch.tensor([0, 5, 63, 5, 17, 0], device=device)
    # Real slots outside the scratch block, and two padded rows.
    slots = torch.tensor([9, 10, -1, 31, 8, -1], device=device)
    return cache, slots, latent, norm, q_pe, positions, cos, sin


@pytest.mark.parametrize("interleaved", [True, False])
@pytest.mark.parametrize("dtype, weight_dtype", [(torch.float32, None), (torch.bfloat16, None),
                                                 (torch.bfloat16, torch.float32)])
def test_write_latent_matches_reference(dtype, weight_dtype, interleaved, device):
    cache, slots, latent, norm, q_pe, positions, cos, sin = _case(dtype, device, seed=3, weight_dtype=weight_dtype)
    assert not latent.is_contiguous() and not q_pe.is_contiguous()
    before = cache.clone()
    got_cache, got_q = write_latent(cache, slots, latent, norm, q_pe, positions, cos, sin,
                                    eps=1e-6, interleaved=interleaved)
    want_cache, want_q = ref_write_latent(before.clone(), slots, latent, norm, q_pe, positions, cos, sin,
                                          eps=1e-6, interleaved=interleaved)
    assert got_cache is cache
    tol = dict(rtol=0, atol=1e-5) if dtype == torch.float32 else dict(rtol=1e-2, atol=1e-2)
    torch.testing.assert_close(got_q, want_q, **tol)
    real = slots[slots >= 0]
    flat, want_flat = got_cache.view(-1, got_cache.shape[-1]), want_cache.view(-1, want_cache.shape[-1])
    torch.testing.assert_close(flat[real], want_flat[real], **tol)
    # Padded rows write nothing (the reference parks them in scratch slot 0, which nobody reads).
    untouched = torch.ones(flat.shape[0], dtype=torch.bool, device=device)
    untouched[real] = False
    assert torch.equal(flat[untouched], before.view(-1, before.shape[-1])[untouched])


def test_write_latent_not_inplace_and_strided_cache(device):
    cache, slots, latent, norm, q_pe, positions, cos, sin = _case(torch.bfloat16, device, seed=4)
    before = cache.clone()
    out, _ = write_latent(cache, slots, latent, norm, q_pe, positions, cos, sin, eps=1e-6, interleaved=True,
                          inplace=False)
    assert torch.equal(cache, before) and not torch.equal(out, before)
    strided_cache = strided(before, generator(5, device))
    write_latent(strided_cache, slots, latent, norm, q_pe, positions, cos, sin, eps=1e-6, interleaved=True)
    assert torch.equal(strided_cache, out)


def test_write_latent_rejects_bad_inputs(device):
    cache, slots, latent, norm, q_pe, positions, cos, sin = _case(torch.float32, device, seed=6)
    with pytest.raises(ValueError, match="latent"):
        write_latent(cache, slots, latent[:, 1:], norm, q_pe, positions, cos, sin, eps=1e-6, interleaved=True)
    with pytest.raises(ValueError, match="kv_cache"):
        write_latent(cache[..., 1:], slots, latent, norm, q_pe, positions, cos, sin, eps=1e-6, interleaved=True)
    with pytest.raises(ValueError, match="slot_mapping"):
        write_latent(cache, slots.float(), latent, norm, q_pe, positions, cos, sin, eps=1e-6, interleaved=True)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("absorb_from", [0, 2, 6])                 # all rows decode, a mixed step, no decode row
def test_write_latent_absorb_matches_reference(dtype, absorb_from, device):
    cache, slots, latent, norm, q_pe, positions, cos, sin = _case(dtype, device, seed=8 + absorb_from)
    gen = generator(9 + absorb_from, device)
    nope_dim = 24
    q_nope = strided(randn((q_pe.shape[0], HEADS, nope_dim), dtype, device, gen), gen)
    w_uk = randn((HEADS, nope_dim, KV_LORA_RANK), dtype, device, gen, scale=nope_dim ** -0.5)
    before = cache.clone()
    got_cache, got_q_pe, got_q = write_latent_absorb(cache, slots, latent, norm, q_nope, q_pe, w_uk, positions,
                                                     cos, sin, eps=1e-6, interleaved=False, absorb_from=absorb_from)
    want_cache, want_q_pe, want_q = ref_write_latent_absorb(before.clone(), slots, latent, norm, q_nope, q_pe, w_uk,
                                                            positions, cos, sin, eps=1e-6, interleaved=False,
                                                            absorb_from=absorb_from)
    assert got_q.shape == (q_pe.shape[0] - absorb_from, HEADS, KV_LORA_RANK + ROPE_DIM)
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=1e-2, atol=1e-2)
    torch.testing.assert_close(got_q_pe, want_q_pe, **tol)
    torch.testing.assert_close(got_q, want_q, **tol)
    # The absorbed query's tail is the rotated q_pe of the same rows, bit for bit.
    assert torch.equal(got_q[..., KV_LORA_RANK:], got_q_pe[absorb_from:])
    real = slots[slots >= 0]
    flat, want_flat = got_cache.view(-1, got_cache.shape[-1]), want_cache.view(-1, want_cache.shape[-1])
    torch.testing.assert_close(flat[real], want_flat[real], **tol)
    with pytest.raises(ValueError, match="absorb_from"):
        write_latent_absorb(cache, slots, latent, norm, q_nope, q_pe, w_uk, positions, cos, sin, eps=1e-6,
                            interleaved=False, absorb_from=7)
    with pytest.raises(ValueError, match="w_uk"):
        write_latent_absorb(cache, slots, latent, norm, q_nope, q_pe, w_uk[:, 1:], positions, cos, sin, eps=1e-6,
                            interleaved=False, absorb_from=0)
