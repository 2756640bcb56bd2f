"""Triton MLA prefill (decompress + varlen causal flash attention) against the reference."""

from __future__ import annotations

import pytest
import torch

from support.kernel_cases import LSE_TOLERANCE, assert_close, generator, paged_cache, randn, strided
from mla_func.kernels.reference import attention as ref
from mla_func.kernels.triton import prefill as tri


def _batch(specs, block_size, num_heads, dims, dtype, device, seed, pad_tokens=0):
    """specs: (cached context length, new tokens) per sequence; the cache already holds both."""
    nope_dim, rope_dim, v_dim, kv_lora_rank = dims
    gen = generator(seed, device)
    seq_lens = [c + n for c, n in specs]
    kv_cache, block_table = paged_cache(seq_lens, block_size, kv_lora_rank + rope_dim, dtype, device, gen)
    new = [n for _, n in specs]
    num_tokens = sum(new) + pad_tokens
    cu = torch.tensor([0] + new, device=device).cumsum(0).to(torch.int32)
    pieces = [torch.arange(c, c + n, device=device) for c, n in specs]
    # Padded tokens carry arbitrary positions; the kernel must not use them.
    pieces.append(torch.randint(0, 1000, (pad_tokens,), generator=gen, device=device))
    return dict(
        q_nope=randn((num_tokens, num_heads, nope_dim), dtype, device, gen),
        q_pe=randn((num_tokens, num_heads, rope_dim), dtype, device, gen),
        kv_cache=kv_cache,
        block_table=block_table,
        cu_seqlens_q=cu,
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
        positions=torch.cat(pieces).long(),
        w_uk=randn((num_heads, nope_dim, kv_lora_rank), dtype, device, gen, scale=kv_lora_rank ** -0.5),
        w_uv=randn((num_heads, v_dim, kv_lora_rank), dtype, device, gen, scale=kv_lora_rank ** -0.5),
    )


SMALL = (16, 16, 16, 32)        # Dn, R, Dv, C
REAL = (128, 64, 128, 512)


def _check(batch, dtype, pad_rows=0):
    scale = (batch["q_nope"].shape[-1] + batch["q_pe"].shape[-1]) ** -0.5
    out, lse = tri.prefill_attention(**batch, softmax_scale=scale)
    as64 = {k: (v.double() if v.is_floating_point() else v) for k, v in batch.items()}
    ref_out, ref_lse = ref.prefill_attention(**as64, softmax_scale=scale)
    assert out.dtype == dtype and lse.dtype == torch.float32
    assert_close(out, ref_out, dtype)
    assert_close(lse, ref_lse, dtype, LSE_TOLERANCE)
    if pad_rows:
        assert torch.all(out[-pad_rows:] == 0) and torch.all(lse[-pad_rows:] == float("-inf"))
    return out, lse


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("block_size", [16, 64])
@pytest.mark.parametrize("num_heads", [1, 3])
def test_empty_context(dtype, block_size, num_heads, device):
    batch = _batch([(0, 37)], block_size, num_heads, SMALL, dtype, device, seed=block_size + num_heads)
    _check(batch, dtype)


@pytest.mark.parametrize("block_size", [16, 64])
def test_chunks_starting_mid_sequence(block_size, device):
    # Context ends exactly on, just past and well past a block boundary; a
    # one-token chunk; a sequence with no new tokens; then padded rows.
    specs = [(block_size, 9), (block_size + 1, 30), (70, 1), (20, 0), (3, 20)]
    batch = _batch(specs, block_size, 2, SMALL, torch.bfloat16, device, seed=3 + block_size, pad_tokens=5)
    _check(batch, torch.bfloat16, pad_rows=5)


def test_fp32_mixed_batch(device):
    specs = [(0, 1), (31, 17), (0, 16), (15, 1)]
    batch = _batch(specs, 16, 2, SMALL, torch.float32, device, seed=4, pad_tokens=3)
    _check(batch, torch.float32, pad_rows=3)


def test_all_rows_padded(device):
    batch = _batch([(5, 0), (0, 0)], 16, 2, SMALL, torch.float32, device, seed=5, pad_tokens=7)
    _check(batch, torch.float32, pad_rows=7)


def test_real_head_dims(device):
    batch = _batch([(20, 18), (0, 5)], 64, 2, REAL, torch.bfloat16, device, seed=6, pad_tokens=2)
    _check(batch, torch.bfloat16, pad_rows=2)


def test_non_contiguous_inputs(device):
    batch = _batch([(7, 20), (0, 9)], 16, 2, SMALL, torch.bfloat16, device, seed=8, pad_tokens=1)
    gen = generator(9, device)
    # The model slices q_nope and q_pe out of one projection: neither is contiguous.
    q = torch.cat([batch["q_nope"], batch["q_pe"]], dim=-1)
    batch["q_nope"], batch["q_pe"] = q[..., :16], q[..., 16:]
    for name in ("kv_cache", "w_uk", "w_uv", "positions", "seq_lens", "cu_seqlens_q", "block_table"):
        batch[name] = strided(batch[name], gen)
    _check(batch, torch.bfloat16, pad_rows=1)


def test_chunking_does_not_change_results(device):
    # The same tokens prefilled in one chunk or in two give the same outputs.
    whole = _batch([(0, 45)], 16, 2, SMALL, torch.float32, device, seed=10)
    out_whole, lse_whole = tri.prefill_attention(**whole, softmax_scale=0.2)
    second = dict(whole)
    second.update(q_nope=whole["q_nope"][30:], q_pe=whole["q_pe"][30:], positions=whole["positions"][30:],
                  cu_seqlens_q=torch.tensor([0, 15], dtype=torch.int32, device=device))
    out_second, lse_second = tri.prefill_attention(**second, softmax_scale=0.2)
    torch.testing.assert_close(out_second, out_whole[30:], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(lse_second, lse_whole[30:], atol=1e-5, rtol=1e-5)


def test_rejects_bad_inputs(device):
    batch = _batch([(0, 4)], 16, 2, SMALL, torch.float32, device, seed=11)
    with pytest.raises(ValueError, match="positions"):
        tri.prefill_attention(**{**batch, "positions": batch["positions"].int()}, softmax_scale=1.0)
    with pytest.raises(ValueError, match="cu_seqlens_q"):
        tri.prefill_attention(**{**batch, "cu_seqlens_q": batch["cu_seqlens_q"][:1]}, softmax_scale=1.0)
    odd = _batch([(0, 4)], 16, 2, (24, 16, 16, 32), torch.float32, device, seed=12)
    with pytest.raises(ValueError, match="Dn"):
        tri.prefill_attention(**odd, softmax_scale=1.0)


@pytest.mark.gpu
@pytest.mark.parametrize("num_heads, specs", [
    (16, [(0, 1500), (2500, 700), (4000, 1), (64, 64)]),
    # Fewer tokens at 128 heads: the float64 reference holds [T, H, B, S] scores.
    (128, [(0, 256), (700, 100), (1500, 1), (64, 64)]),
])
def test_gpu_real_sizes(num_heads, specs):
    batch = _batch(specs, 64, num_heads, REAL, torch.bfloat16, torch.device("cuda"), seed=num_heads,
                   pad_tokens=40)
    _check(batch, torch.bfloat16, pad_rows=40)


@pytest.mark.gpu
def test_gpu_fp32():
    batch = _batch([(0, 300), (129, 200)], 64, 16, REAL, torch.float32, torch.device("cuda"), seed=2,
                   pad_tokens=3)
    _check(batch, torch.float32, pad_rows=3)
