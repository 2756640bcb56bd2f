"""The FP8 latent cache: the reference's quantization, the Triton writes against it bit for bit, and
how close attention over it stays to attention over the unquantized cache."""

from __future__ import annotations

import pytest
import torch

from support.fp8_cache_cases import dequantized, fp8_cache_of, same_bits
from support.kernel_cases import generator, paged_cache, randn
from mla_func.kernels.latent_cache import (FP8_GROUP, FP8LatentCache, check_kv_cache_dtype, latent_leaves,
                                           zeroed_latent)
from mla_func.kernels.reference import attention as ref
from mla_func.kernels.reference import cache as ref_cache
from mla_func.kernels.reference import dsa as ref_dsa
from mla_func.kernels.reference.latent import write_latent as ref_write_latent
from mla_func.kernels.triton import cache as tri_cache
from mla_func.kernels.triton.latent import write_latent, write_latent_absorb

ROPE_DIM, NUM_BLOCKS, BLOCK_SIZE = 16, 6, 4
# e4m3 keeps 3 fraction bits: rounding to nearest is off by at most half a step, 2^-4 of the value,
# and every value of a group is at most the group's largest magnitude.
E4M3_BOUND = 2.0 ** -4


def _rows(kv_lora_rank, dtype, device, seed, tokens=9):
    """Latent rows [T, C + R] with a few hard groups, and slots with two padded rows."""
    gen = generator(seed, device)
    kv = randn((tokens, kv_lora_rank + ROPE_DIM), torch.float32, device, gen, scale=3.0)
    kv[1, :kv_lora_rank] = 0.0                                   # an all-zero latent: no division by zero
    kv[2, :kv_lora_rank] *= 1e-3                                 # small values: e4m3 subnormals under the scale
    kv[3, 0] = 1e4                                               # one outlier sets its group's scale
    slots = torch.tensor([5, 9, -1, 23, 4, 6, -1, 17, 12][:tokens], device=device)
    return kv.to(dtype), slots


@pytest.mark.parametrize("kv_lora_rank", [32, 160, 512])        # one partial group, a partial last group, four
def test_quantize_round_trip_within_the_e4m3_bound(kv_lora_rank, device):
    kv, _ = _rows(kv_lora_rank, torch.float32, device, seed=kv_lora_rank)
    values, scales, rope = ref_cache.quantize_latent(kv, kv_lora_rank)
    groups = -(-kv_lora_rank // FP8_GROUP)
    assert values.dtype == torch.float8_e4m3fn and values.shape == (kv.shape[0], kv_lora_rank)
    assert scales.dtype == torch.float32 and scales.shape == (kv.shape[0], groups)
    assert torch.equal(rope, kv[:, kv_lora_rank:])
    group_of = torch.arange(kv_lora_rank, device=device) // FP8_GROUP
    latent = kv[:, :kv_lora_rank]
    amax = torch.zeros_like(scales).scatter_reduce(1, group_of.expand_as(latent), latent.abs(), "amax")
    nonzero = amax > 0
    # scale = the group's largest magnitude / 448 (an IEEE division: a tensor divisor, which CUDA's torch
    # does not turn into a product with the reciprocal), so that magnitude maps onto e4m3's largest value.
    want = amax / torch.full((), 448.0, device=device)
    torch.testing.assert_close(scales[nonzero], want[nonzero], rtol=0, atol=0)
    back = values.float() * scales[:, group_of]
    assert torch.all((back - latent).abs() <= E4M3_BOUND * amax[:, group_of])
    assert torch.all(back[1] == 0)


@pytest.mark.parametrize("kv_lora_rank", [32, 160, 512])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("inplace", [True, False])
def test_triton_write_matches_the_reference_bit_for_bit(kv_lora_rank, dtype, inplace, device):
    kv, slots = _rows(kv_lora_rank, dtype, device, seed=kv_lora_rank + 1)
    make = lambda: zeroed_latent(NUM_BLOCKS, BLOCK_SIZE, kv_lora_rank, ROPE_DIM, kv_cache_dtype="fp8",  # noqa: E731
                                 dtype=dtype, device=device)
    start = make()
    got = tri_cache.write_kv(start, slots, kv, inplace=inplace)
    want = ref_cache.write_kv(make(), slots, kv)
    assert isinstance(got, FP8LatentCache) and (got is start) == inplace
    real = slots[slots >= 0]
    for g, w in zip(got.tensors(), want.tensors()):
        flat_g, flat_w = g.view(NUM_BLOCKS * BLOCK_SIZE, -1), w.view(NUM_BLOCKS * BLOCK_SIZE, -1)
        assert same_bits(flat_g[real], flat_w[real])
        # Padded rows write nothing (the reference parks them in scratch slot 0, which nobody reads).
        untouched = torch.ones(flat_g.shape[0], dtype=torch.bool, device=device)
        untouched[real] = False
        assert not flat_g[untouched].view(torch.uint8).any()
    if not inplace:
        assert not any(t.view(torch.uint8).any() for t in start.tensors())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("kv_lora_rank", [48, 160])
@pytest.mark.parametrize("absorb", [False, True])
def test_fused_latent_write_quantizes_what_it_would_store(dtype, kv_lora_rank, absorb, device):
    """The norm + rope + write kernel into an FP8 cache stores exactly the reference's quantization of
    the rows it stores into a plain cache (the same kernel's norm and rotation): one rounding rule."""
    gen = generator(kv_lora_rank, device)
    tokens, heads = 6, 3
    latent = randn((tokens, kv_lora_rank + ROPE_DIM), dtype, device, gen)
    norm = (1.0 + 0.2 * randn((kv_lora_rank,), torch.float32, device, gen)).to(dtype)
    q_pe = randn((tokens, heads, ROPE_DIM), dtype, device, gen)
    angles = torch.rand(64, ROPE_DIM // 2, generator=gen, device=device) * 6.0
    cos, sin = angles.cos(), angles.sin()
    positions = torch.tensor([0, 5, 63, 5, 17, 0], device=device)
    slots = torch.tensor([9, 10, -1, 23, 8, -1], device=device)
    plain = torch.zeros(NUM_BLOCKS, BLOCK_SIZE, kv_lora_rank + ROPE_DIM, dtype=dtype, device=device)
    fp8 = zeroed_latent(NUM_BLOCKS, BLOCK_SIZE, kv_lora_rank, ROPE_DIM, kv_cache_dtype="fp8", dtype=dtype,
                        device=device)
    args = (slots, latent, norm, q_pe, positions, cos, sin)
    if absorb:
        w_uk = randn((heads, 8, kv_lora_rank), dtype, device, gen)
        q_nope = randn((tokens, heads, 8), dtype, device, gen)
        plain_out = write_latent_absorb(plain, slots, latent, norm, q_nope, q_pe, w_uk, positions, cos, sin,
                                        eps=1e-6, interleaved=True, absorb_from=2)
        fp8_out = write_latent_absorb(fp8, slots, latent, norm, q_nope, q_pe, w_uk, positions, cos, sin,
                                      eps=1e-6, interleaved=True, absorb_from=2)
    else:
        plain_out = write_latent(plain, *args, eps=1e-6, interleaved=True)
        fp8_out = write_latent(fp8, *args, eps=1e-6, interleaved=True)
    for a, b in zip(plain_out[1:], fp8_out[1:]):                        # rotated q_pe, absorbed q: unchanged
        assert same_bits(a, b)
    real = slots[slots >= 0]
    want = fp8_cache_of(plain, kv_lora_rank)
    for g, w in zip(fp8.tensors(), want.tensors()):
        assert same_bits(g.view(-1, g.shape[-1])[real], w.view(-1, w.shape[-1])[real])
    # And it is the reference op's cache write, up to the kernel's own norm rounding.
    ref_fp8 = zeroed_latent(NUM_BLOCKS, BLOCK_SIZE, kv_lora_rank, ROPE_DIM, kv_cache_dtype="fp8", dtype=dtype,
                            device=device)
    ref_write_latent(ref_fp8, *args, eps=1e-6, interleaved=True)
    got, ref_rows = dequantized(fp8).view(-1, kv_lora_rank + ROPE_DIM), dequantized(ref_fp8).view(-1, kv_lora_rank + ROPE_DIM)
    torch.testing.assert_close(got[real].float(), ref_rows[real].float(), rtol=2 * E4M3_BOUND, atol=1e-2)


def test_reference_out_of_place_write_leaves_the_cache(device):
    kv, slots = _rows(160, torch.float32, device, seed=4)
    cache = zeroed_latent(NUM_BLOCKS, BLOCK_SIZE, 160, ROPE_DIM, kv_cache_dtype="fp8", dtype=torch.float32,
                          device=device)
    new = ref_cache.write_kv(cache, slots, kv, inplace=False)
    assert not any(t.view(torch.uint8).any() for t in cache.tensors())
    assert all(a.data_ptr() != b.data_ptr() for a, b in zip(new.tensors(), cache.tensors()))
    assert ref_cache.write_kv(cache, slots, kv) is cache
    assert all(same_bits(a, b) for a, b in zip(new.tensors()[1:], cache.tensors()[1:]))


def test_cache_value_checks_its_leaves(device):
    cache = zeroed_latent(2, 4, 160, ROPE_DIM, kv_cache_dtype="fp8", dtype=torch.bfloat16, device=device)
    assert cache.shape == (2, 4, 160 + ROPE_DIM) and cache.dtype == torch.bfloat16 and cache.kv_lora_rank == 160
    assert [t.element_size() for t in latent_leaves(cache)] == [2, 1, 4]       # rope first: the state's dtype
    with pytest.raises(ValueError, match="scales"):
        FP8LatentCache(cache.values, cache.scales[..., :1], cache.rope)
    with pytest.raises(ValueError, match="float8_e4m3fn"):
        FP8LatentCache(cache.values.float(), cache.scales, cache.rope)
    with pytest.raises(ValueError, match="rope"):
        FP8LatentCache(cache.values, cache.scales, cache.rope[:1])
    with pytest.raises(ValueError, match="kv_cache_dtype.*'fp16'"):
        check_kv_cache_dtype("fp16")


# Attention over the FP8 cache against attention over the rows it quantized. Each latent value is off
# by at most 2^-4 of its group's largest magnitude (random normal rows: about 2% of a value, median),
# and attention averages those errors: the outputs stay within 6% of their largest magnitude. A score
# moves by the softmax scale times q . (the key's error), so the LSE is held to 0.075 per unit of the
# scale factor (measured: outputs 3-5.3%, LSE 0.04-0.05 per unit at these sizes, on CPU and GPU draws).
ATTENTION_TOLERANCE = 0.06
LSE_ATOL_PER_SCALE = 0.075


@pytest.mark.parametrize("kv_lora_rank", [32, 160, 512])
@pytest.mark.parametrize("scale_factor", [1.0, 2.0])
def test_reference_attention_over_fp8_is_close_to_unquantized(kv_lora_rank, scale_factor, device):
    gen = generator(kv_lora_rank, device)
    lens = [1, 30, 77, 0]
    dense, table = paged_cache(lens, 16, kv_lora_rank + ROPE_DIM, torch.float32, device, gen)
    fp8 = fp8_cache_of(dense, kv_lora_rank)
    q = randn((len(lens), 8, kv_lora_rank + ROPE_DIM), torch.float32, device, gen)
    seq_lens = torch.tensor(lens, dtype=torch.int32, device=device)
    kw = dict(softmax_scale=scale_factor * (kv_lora_rank + ROPE_DIM) ** -0.5, kv_lora_rank=kv_lora_rank)
    out, lse = ref.mla_decode(q, dense, table, seq_lens, **kw)
    out8, lse8 = ref.mla_decode(q, fp8, table, seq_lens, **kw)
    assert (out8 - out).abs().max() <= ATTENTION_TOLERANCE * out.abs().max()
    live = seq_lens > 0
    assert (lse8 - lse)[live].abs().max() <= LSE_ATOL_PER_SCALE * scale_factor
    assert torch.all(lse8[~live] == float("-inf"))
    # The sparse path reads the same rows: all of them selected, it is the dense decode.
    indices = torch.where(torch.arange(table.shape[1] * 16, device=device)[None, :] < seq_lens[:, None],
                          torch.arange(table.shape[1] * 16, device=device)[None, :], -1).to(torch.int32)
    sparse8, sparse_lse8 = ref_dsa.sparse_mla_decode(q, fp8, table, indices, **kw)
    torch.testing.assert_close(sparse8, out8, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(sparse_lse8, lse8, rtol=1e-5, atol=1e-5)
