"""Triton write_kv, rms_norm, layer_norm, merge_attn_states and zeros against the reference."""

from __future__ import annotations

import pytest
import torch

from support.kernel_cases import LSE_TOLERANCE, assert_close, generator, randn, strided
from mla_func.kernels.reference import attention as ref_attention
from mla_func.kernels.reference import cache as ref_cache
from mla_func.kernels.reference import norm as ref_norm
from mla_func.kernels.triton import cache, fill, merge, norm


# --- write_kv ---------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("block_size", [16, 64])
@pytest.mark.parametrize("slot_dtype", [torch.int32, torch.int64])
def test_write_kv(dtype, block_size, slot_dtype, device):
    gen = generator(block_size, device)
    num_blocks, dim, num_tokens = 6, 72, 9
    kv_cache = randn((num_blocks, block_size, dim), dtype, device, gen)
    # Distinct real slots outside the scratch block, with padding (-1) mixed in.
    slots = torch.randperm((num_blocks - 1) * block_size, generator=gen, device=device)[:num_tokens] + block_size
    slots[[2, 7]] = -1
    kv = randn((num_tokens, dim), dtype, device, gen)
    expected = ref_cache.write_kv(kv_cache.clone(), slots, kv)
    before = kv_cache.clone()
    result = cache.write_kv(kv_cache, slots.to(slot_dtype), kv)
    assert result is kv_cache
    # Padding writes nothing here; the reference parks it in scratch slot 0 of block 0.
    assert torch.equal(result[0, 0], before[0, 0])
    expected[0, 0] = before[0, 0]
    assert torch.equal(result, expected)


def test_write_kv_not_inplace_and_strided(device):
    gen = generator(1, device)
    kv_cache = randn((4, 16, 40), torch.bfloat16, device, gen)
    slots = torch.tensor([17, -1, 63, 16], device=device)
    kv = strided(randn((4, 40), torch.bfloat16, device, gen), gen)
    before = kv_cache.clone()
    result = cache.write_kv(kv_cache, strided(slots, gen), kv, inplace=False)
    assert torch.equal(kv_cache, before)
    expected = ref_cache.write_kv(before.clone(), slots, kv)
    expected[0, 0] = before[0, 0]
    assert torch.equal(result, expected)
    strided_cache = strided(before, gen)
    cache.write_kv(strided_cache, slots, kv)
    assert torch.equal(strided_cache, expected)


def test_write_kv_rejects_bad_shapes(device):
    with pytest.raises(ValueError, match="kv"):
        cache.write_kv(torch.zeros(2, 16, 8, device=device), torch.zeros(3, dtype=torch.long, device=device),
                       torch.zeros(3, 9, device=device))


# --- rms_norm ---------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("dim", [64, 100])
@pytest.mark.parametrize("with_residual", [False, True])
def test_rms_norm(dtype, dim, with_residual, device):
    gen = generator(dim + with_residual, device)
    x = randn((7, dim), dtype, device, gen, scale=3.0)
    weight = randn((dim,), dtype, device, gen)
    residual = randn((7, dim), dtype, device, gen) if with_residual else None
    got = norm.rms_norm(x, weight, 1e-6, residual)
    expected = ref_norm.rms_norm(x, weight, 1e-6, residual)
    if with_residual:
        assert torch.equal(got[1], expected[1])
        got, expected = got[0], expected[0]
    assert got.dtype == expected.dtype
    # Same rounding steps as the reference; only the float32 sum order differs,
    # which can move the two bf16 roundings (normed, then weight * normed) by an ulp.
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=2e-2 if dtype == torch.bfloat16 else 1e-5)


def test_rms_norm_strided_and_mixed_dtypes(device):
    gen = generator(3, device)
    x = strided(randn((5, 48), torch.bfloat16, device, gen), gen)
    residual = strided(randn((5, 48), torch.bfloat16, device, gen), gen)
    weight = randn((48,), torch.float32, device, gen)
    y, res = norm.rms_norm(x, weight, 1e-5, residual)
    ref_y, ref_res = ref_norm.rms_norm(x, weight, 1e-5, residual)
    assert y.dtype == torch.float32
    assert torch.equal(res, ref_res)
    torch.testing.assert_close(y, ref_y, atol=1e-5, rtol=1e-5)


def test_rms_norm_rejects_bad_shapes(device):
    with pytest.raises(ValueError, match="weight"):
        norm.rms_norm(torch.zeros(2, 8, device=device), torch.zeros(9, device=device), 1e-6)
    with pytest.raises(ValueError, match="residual"):
        norm.rms_norm(torch.zeros(2, 8, device=device), torch.zeros(8, device=device), 1e-6,
                      torch.zeros(3, 8, device=device))
    with pytest.raises(ValueError, match="residual"):
        norm.rms_norm(torch.zeros(2, 8, device=device), torch.zeros(8, device=device), 1e-6,
                      torch.zeros(2, 8, dtype=torch.int32, device=device))


def test_rms_norm_float32_input_onto_bf16_residual(device):
    # Float32 expert sums added to a bf16 residual stream: one rounding, to bf16.
    gen = generator(4, device)
    x = randn((6, 80), torch.float32, device, gen)
    residual = randn((6, 80), torch.bfloat16, device, gen)
    weight = randn((80,), torch.bfloat16, device, gen)
    y, res = norm.rms_norm(x, weight, 1e-6, residual)
    ref_y, ref_res = ref_norm.rms_norm(x, weight, 1e-6, residual)
    assert res.dtype == y.dtype == torch.bfloat16
    assert torch.equal(res, (x + residual.float()).to(torch.bfloat16))
    assert torch.equal(res, ref_res)
    torch.testing.assert_close(y, ref_y, atol=1e-5, rtol=2e-2)


# --- layer_norm -------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("dim", [128, 100])
def test_layer_norm_of_strided_columns(dtype, dim, device):
    # The indexer's key: columns of a wider projection's output, normalised in place.
    gen = generator(dim, device)
    wide = randn((9, dim + 70), dtype, device, gen, scale=3.0) + 1.5
    x = wide[:, 50:50 + dim]
    weight = randn((dim,), dtype, device, gen)
    bias = randn((dim,), dtype, device, gen)
    got = norm.layer_norm(x, weight, bias, 1e-6)
    expected = ref_norm.layer_norm(x, weight, bias, 1e-6)
    assert got.dtype == expected.dtype == dtype and got.is_contiguous()
    # One rounding at the end on both sides; only the float32 sums' order differs.
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-2 if dtype == torch.bfloat16 else 1e-5)
    exact = ref_norm.layer_norm(x.double(), weight.double(), bias.double(), 1e-6)
    torch.testing.assert_close(got.double(), exact, atol=1e-5, rtol=1e-2 if dtype == torch.bfloat16 else 1e-5)


def test_layer_norm_rejects_bad_shapes(device):
    x = torch.zeros(2, 8, device=device)
    with pytest.raises(ValueError, match="weight"):
        norm.layer_norm(x, torch.zeros(9, device=device), torch.zeros(8, device=device), 1e-6)
    with pytest.raises(ValueError, match="bias"):
        norm.layer_norm(x, torch.zeros(8, device=device), torch.zeros(7, device=device), 1e-6)


# --- merge_attn_states ------------------------------------------------------------------

def _merge_inputs(num_tokens, num_heads, dim, dtype, device, gen):
    out_a = randn((num_tokens, num_heads, dim), dtype, device, gen)
    out_b = randn((num_tokens, num_heads, dim), dtype, device, gen)
    lse_a = randn((num_tokens, num_heads), torch.float32, device, gen, scale=4.0)
    lse_b = randn((num_tokens, num_heads), torch.float32, device, gen, scale=4.0)
    # Row 0: both sides empty; row 1: only a empty; row 2: only b empty.
    lse_a[0] = lse_b[0] = float("-inf")
    lse_a[1] = float("-inf")
    lse_b[2] = float("-inf")
    out_a[0] = out_b[0] = 0
    return out_a, lse_a, out_b, lse_b


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("dim", [128, 512])
def test_merge(dtype, dim, device):
    gen = generator(dim, device)
    inputs = _merge_inputs(6, 3, dim, dtype, device, gen)
    out, lse = merge.merge_attn_states(*inputs)
    ref_out, ref_lse = ref_attention.merge_attn_states(*(t.double() for t in inputs))
    assert not torch.isnan(out).any() and not torch.isnan(lse).any()
    assert_close(out, ref_out, dtype)
    assert_close(lse, ref_lse, dtype, LSE_TOLERANCE)
    assert torch.all(out[0] == 0) and torch.all(lse[0] == float("-inf"))


def test_merge_non_contiguous(device):
    gen = generator(5, device)
    inputs = _merge_inputs(5, 4, 96, torch.float32, device, gen)
    # A [H, T, D] buffer viewed as [T, H, D], as when heads are the outer dim.
    out_a = inputs[0].transpose(0, 1).contiguous().transpose(0, 1)
    lse_b = inputs[3].t().contiguous().t()
    moved = (out_a, strided(inputs[1], gen), strided(inputs[2], gen), lse_b)
    out, lse = merge.merge_attn_states(*moved)
    ref_out, ref_lse = ref_attention.merge_attn_states(*(t.double() for t in inputs))
    assert_close(out, ref_out, torch.float32)
    assert_close(lse, ref_lse, torch.float32, LSE_TOLERANCE)


def test_merge_rejects_bad_shapes(device):
    a = torch.zeros(2, 3, 8, device=device)
    lse = torch.zeros(2, 3, device=device)
    with pytest.raises(ValueError, match="lse_b"):
        merge.merge_attn_states(a, lse, a, lse[:, :2])
    with pytest.raises(ValueError, match="lse_a"):
        merge.merge_attn_states(a, lse.double(), a, lse)


@pytest.mark.gpu
def test_gpu_small_ops_real_sizes():
    device = torch.device("cuda")
    gen = generator(9, device)
    x = randn((4096, 2048), torch.bfloat16, device, gen)
    residual = randn((4096, 2048), torch.bfloat16, device, gen)
    weight = randn((2048,), torch.bfloat16, device, gen)
    y, res = norm.rms_norm(x, weight, 1e-6, residual)
    ref_y, ref_res = ref_norm.rms_norm(x, weight, 1e-6, residual)
    assert torch.equal(res, ref_res)
    torch.testing.assert_close(y, ref_y, atol=1e-5, rtol=2e-2)
    keys = randn((4096, 2240), torch.bfloat16, device, gen)[:, 2112:]
    ln_weight, ln_bias = randn((128,), torch.bfloat16, device, gen), randn((128,), torch.bfloat16, device, gen)
    torch.testing.assert_close(norm.layer_norm(keys, ln_weight, ln_bias, 1e-6),
                               ref_norm.layer_norm(keys, ln_weight, ln_bias, 1e-6), atol=1e-5, rtol=1e-2)
    inputs = _merge_inputs(1024, 128, 512, torch.bfloat16, device, gen)
    out, lse = merge.merge_attn_states(*inputs)
    ref_out, ref_lse = ref_attention.merge_attn_states(*(t.double() for t in inputs))
    assert_close(out, ref_out, torch.bfloat16)
    assert_close(lse, ref_lse, torch.bfloat16, LSE_TOLERANCE)
    kv_cache = randn((512, 64, 576), torch.bfloat16, device, gen)
    slots = torch.randperm(511 * 64, generator=gen, device=device)[:8192] + 64
    slots[::7] = -1
    kv = randn((8192, 576), torch.bfloat16, device, gen)
    expected = ref_cache.write_kv(kv_cache.clone(), slots, kv)
    expected[0, 0] = kv_cache[0, 0]
    assert torch.equal(cache.write_kv(kv_cache, slots, kv), expected)


# --- zeros -----------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", [torch.float32, torch.int32, torch.bfloat16])
def test_zeros_overwrite_reused_memory(dtype, device):
    # Fill memory with non-zeros, free it, and let the allocator hand it back.
    junk = torch.full((5000,), 7, dtype=dtype, device=device)
    del junk
    out = fill.zeros((3, 1500), dtype, device)
    assert out.shape == (3, 1500) and out.dtype == dtype and out.is_contiguous()
    assert torch.count_nonzero(out).item() == 0
    assert fill.zeros((0, 4), dtype, device).shape == (0, 4)
