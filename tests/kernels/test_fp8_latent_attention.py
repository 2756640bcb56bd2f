"""Every Triton read of the latent cache with an FP8 cache, against the reference over the same FP8 cache.

The reference reads the cache dequantized (`FP8LatentCache.rows`: value * scale in float32, rounded to
the activations' dtype) and is evaluated in float64 on those rows; the kernels dequantize each tile as
they load it, so the tolerances are the 16-bit cache's (`support.kernel_cases`): only the kernels' own
rounding differs.
"""

from __future__ import annotations

import pytest
import torch

from support.fp8_cache_cases import fp8_cache_of
from support.kernel_cases import LSE_TOLERANCE, assert_close, generator, paged_cache, randn
from mla_func.kernels.reference import attention as ref
from mla_func.kernels.reference import dsa as ref_dsa
from mla_func.kernels.reference import invariant as ref_invariant
from mla_func.kernels.triton import decode as tri_decode
from mla_func.kernels.triton import decode_invariant as tri_invariant
from mla_func.kernels.triton import dsa_decode as tri_dsa
from mla_func.kernels.triton import prefill as tri_prefill
from test_dsa_decode import random_indices


def _cache(seq_lens, block_size, kv_lora_rank, rope_dim, dtype, device, gen):
    dense, table = paged_cache(seq_lens, block_size, kv_lora_rank + rope_dim, dtype, device, gen)
    return fp8_cache_of(dense, kv_lora_rank), table


def _check_decode(seq_lens, num_heads, kv_lora_rank, rope_dim, block_size, dtype, device, seed, *, q_len=1,
                  num_splits=None, value_dim=None, invariant=False, config=None):
    gen = generator(seed, device)
    cache, table = _cache(seq_lens, block_size, kv_lora_rank, rope_dim, dtype, device, gen)
    q = randn((len(seq_lens) * q_len, num_heads, kv_lora_rank + rope_dim), dtype, device, gen)
    lens = torch.tensor(seq_lens, dtype=torch.int32, device=device)
    w_uv = None if value_dim is None else randn((num_heads, value_dim, kv_lora_rank), dtype, device, gen,
                                                scale=kv_lora_rank ** -0.5)
    kw = dict(softmax_scale=(kv_lora_rank + rope_dim) ** -0.5, kv_lora_rank=kv_lora_rank)
    if invariant:
        out, lse = tri_invariant.mla_decode(q, cache, table, lens, w_uv=w_uv, **kw)
        want, want_lse = ref_invariant.mla_decode(q.double(), cache, table, lens, **kw)
    else:
        out, lse = tri_decode.mla_decode(q, cache, table, lens, w_uv=w_uv, q_len=q_len, num_splits=num_splits,
                                         config=config, **kw)
        want, want_lse = ref.mla_decode(q.double(), cache, table, lens, q_len=q_len, **kw)
    if w_uv is not None:
        want = torch.einsum("bhc,hvc->bhv", want, w_uv.double())
    assert out.dtype == dtype and out.shape == want.shape
    assert_close(out, want, dtype)
    assert_close(lse, want_lse, dtype, LSE_TOLERANCE)
    padded = (lens == 0).repeat_interleave(q_len)
    assert torch.all(out[padded] == 0) and torch.all(lse[padded] == float("-inf"))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("kv_lora_rank", [32, 160])               # one partial group; a partial last group
@pytest.mark.parametrize("num_splits", [None, 3])
def test_decode(dtype, kv_lora_rank, num_splits, device):
    lens = [1, 16, 17, 0, 31]
    _check_decode(lens, 4, kv_lora_rank, 16, 16, dtype, device, seed=kv_lora_rank, num_splits=num_splits)


def test_decode_of_four_whole_groups(device):
    """C = 512: every tile covers whole scale groups (the kernels' grouped dequantization)."""
    _check_decode([5, 40, 0], 2, 512, 64, 16, torch.bfloat16, device, seed=13, num_splits=2)


@pytest.mark.parametrize("kv_lora_rank", [512, 64])              # a scale group a chunk; four chunks of one group
def test_decode_in_four_chunks(kv_lora_rank, device):
    """The chunked kernel (`DecodeConfig.chunks == 4`): the latent's columns in four chunks."""
    config = tri_decode.DecodeConfig(block_h=16, block_n=16, num_warps=4, num_stages=1, chunks=4)
    _check_decode([5, 40, 0, 17], 3, kv_lora_rank, 64, 16, torch.bfloat16, device, seed=14, num_splits=2,
                  config=config)


@pytest.mark.parametrize("q_len", [2, 3])
def test_decode_of_several_queries(q_len, device):
    """MTP verification's path: q_len causal queries a sequence over the FP8 cache."""
    _check_decode([5, 33, 0], 3, 32, 16, 16, torch.bfloat16, device, seed=q_len, q_len=q_len, num_splits=2)


def test_decode_with_value_projection(device):
    _check_decode([9, 40], 4, 160, 16, 16, torch.bfloat16, device, seed=5, value_dim=16)


def test_batch_invariant_decode(device):
    _check_decode([1, 16, 17, 0, 70], 4, 160, 16, 16, torch.float32, device, seed=6, invariant=True)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_prefill_reads_the_context_dequantized(dtype, device):
    gen = generator(7, device)
    nope_dim, rope_dim, v_dim, kv_lora_rank, heads = 16, 16, 16, 160, 2
    specs = [(0, 9), (17, 12), (40, 1)]                    # (cached context, new tokens) per sequence
    seq_lens = [c + n for c, n in specs]
    cache, table = _cache(seq_lens, 16, kv_lora_rank, rope_dim, dtype, device, gen)
    new = [n for _, n in specs]
    tokens = sum(new)
    batch = dict(
        q_nope=randn((tokens, heads, nope_dim), dtype, device, gen),
        q_pe=randn((tokens, heads, rope_dim), dtype, device, gen),
        kv_cache=cache, block_table=table,
        cu_seqlens_q=torch.tensor([0] + new, device=device).cumsum(0).to(torch.int32),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
        positions=torch.cat([torch.arange(c, c + n, device=device) for c, n in specs]).long(),
        w_uk=randn((heads, nope_dim, kv_lora_rank), dtype, device, gen, scale=kv_lora_rank ** -0.5),
        w_uv=randn((heads, v_dim, kv_lora_rank), dtype, device, gen, scale=kv_lora_rank ** -0.5),
    )
    scale = (nope_dim + rope_dim) ** -0.5
    out, lse = tri_prefill.prefill_attention(**batch, softmax_scale=scale)
    as64 = {k: (v.double() if isinstance(v, torch.Tensor) and v.is_floating_point() else v) for k, v in batch.items()}
    want, want_lse = ref.prefill_attention(**as64, softmax_scale=scale)
    assert_close(out, want, dtype)
    assert_close(lse, want_lse, dtype, LSE_TOLERANCE)


def _check_sparse(key_lens, top_k, num_heads, kv_lora_rank, dtype, device, seed, *, num_splits=None, value_dim=None):
    gen = generator(seed, device)
    cache, table = _cache(key_lens, 16, kv_lora_rank, 16, dtype, device, gen)
    q = randn((len(key_lens), num_heads, kv_lora_rank + 16), dtype, device, gen)
    indices = random_indices(key_lens, top_k, device, gen)
    w_uv = None if value_dim is None else randn((num_heads, value_dim, kv_lora_rank), dtype, device, gen,
                                                scale=kv_lora_rank ** -0.5)
    kw = dict(softmax_scale=(kv_lora_rank + 16) ** -0.5, kv_lora_rank=kv_lora_rank)
    out, lse = tri_dsa.sparse_mla_decode(q, cache, table, indices, w_uv=w_uv, num_splits=num_splits, **kw)
    want, want_lse = ref_dsa.sparse_mla_decode(q.double(), cache, table, indices, **kw)
    if w_uv is not None:
        want = torch.einsum("thc,hvc->thv", want, w_uv.double())
    assert_close(out, want, dtype)
    assert_close(lse, want_lse, dtype, LSE_TOLERANCE)
    empty = torch.tensor([n == 0 for n in key_lens], device=device)
    assert torch.all(out[empty] == 0) and torch.all(lse[empty] == float("-inf"))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("kv_lora_rank", [64, 160])               # four whole chunks; chunks past the latent
@pytest.mark.parametrize("num_splits", [None, 3])
def test_sparse_decode(dtype, kv_lora_rank, num_splits, device):
    _check_sparse([90, 24, 9, 0, 1], 24, 4, kv_lora_rank, dtype, device, seed=kv_lora_rank, num_splits=num_splits)


def test_sparse_decode_of_four_whole_groups(device):
    _check_sparse([40, 7], 16, 2, 512, torch.bfloat16, device, seed=14)


def test_sparse_decode_with_value_projection(device):
    _check_sparse([50, 7], 16, 4, 160, torch.bfloat16, device, seed=8, value_dim=16)


# ---- DeepSeek's sizes on a GPU: C = 512 (four scale groups), R = 64, blocks of 64, bf16 ----------------

@pytest.mark.gpu
@pytest.mark.parametrize("num_heads", [16, 128])
def test_gpu_decode_real_sizes(num_heads):
    _check_decode([1, 63, 64, 65, 1000, 4096, 0, 3000], num_heads, 512, 64, 64, torch.bfloat16,
                  torch.device("cuda"), seed=num_heads)


@pytest.mark.gpu
def test_gpu_decode_of_several_queries_real_sizes():
    _check_decode([4, 700, 0, 2049], 16, 512, 64, 64, torch.bfloat16, torch.device("cuda"), seed=9, q_len=3)


@pytest.mark.gpu
def test_gpu_batch_invariant_decode_real_sizes():
    _check_decode([1, 64, 1000, 4096, 0], 16, 512, 64, 64, torch.bfloat16, torch.device("cuda"), seed=10,
                  invariant=True)


@pytest.mark.gpu
# 16 heads: the latent in four chunks; 64: whole rows (on Hopper, the warpgroup-MMA kernel's widened tiles)
@pytest.mark.parametrize("num_heads", [16, 64])
def test_gpu_sparse_decode_real_sizes(num_heads):
    device = torch.device("cuda")
    gen = generator(num_heads, device)
    key_lens = [3000, 2048, 100, 0]
    cache, table = _cache(key_lens, 64, 512, 64, torch.bfloat16, device, gen)
    q = randn((len(key_lens), num_heads, 576), torch.bfloat16, device, gen)
    indices = random_indices(key_lens, 2048, device, gen)
    kw = dict(softmax_scale=576 ** -0.5, kv_lora_rank=512)
    out, lse = tri_dsa.sparse_mla_decode(q, cache, table, indices, **kw)
    want, want_lse = ref_dsa.sparse_mla_decode(q.double(), cache, table, indices, **kw)
    assert_close(out, want, torch.bfloat16)
    assert_close(lse, want_lse, torch.bfloat16, LSE_TOLERANCE)
