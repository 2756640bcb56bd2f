"""Triton split-KV MLA decode with several causal query tokens per sequence, against the reference."""

from __future__ import annotations

import pytest
import torch

from support.kernel_cases import LSE_TOLERANCE, assert_close, generator, paged_cache, randn, strided
from mla_func.kernels.reference import attention as ref
from mla_func.kernels.triton import decode as tri


def _check(seq_lens, q_len, num_heads, kv_lora_rank, rope_dim, block_size, dtype, device, seed,
           num_splits=None, value_dim=None, workspace=False, non_contiguous=False):
    gen = generator(seed, device)
    dim = kv_lora_rank + rope_dim
    kv_cache, block_table = paged_cache(seq_lens, block_size, dim, dtype, device, gen)
    q = randn((len(seq_lens) * q_len, num_heads, dim), dtype, device, gen)
    lens = torch.tensor(seq_lens, dtype=torch.int32, device=device)
    w_uv = None
    if value_dim is not None:
        w_uv = randn((num_heads, value_dim, kv_lora_rank), dtype, device, gen, scale=kv_lora_rank ** -0.5)
    if non_contiguous:
        q, kv_cache, block_table = strided(q, gen), strided(kv_cache, gen), strided(block_table, gen)
        lens = strided(lens, gen)
        w_uv = None if w_uv is None else strided(w_uv, gen)
    scale = dim ** -0.5
    kwargs = {}
    if workspace:
        kwargs["workspace"] = tri.mla_decode_workspace(
            len(seq_lens), num_heads, kv_lora_rank, block_table.shape[1], block_size, device, q_len=q_len)
    out, lse = tri.mla_decode(q, kv_cache, block_table, lens, softmax_scale=scale, kv_lora_rank=kv_lora_rank,
                              num_splits=num_splits, w_uv=w_uv, q_len=q_len, **kwargs)
    ref_out, ref_lse = ref.mla_decode(q.double(), kv_cache.double(), block_table, lens, softmax_scale=scale,
                                      kv_lora_rank=kv_lora_rank, q_len=q_len,
                                      w_uv=None if w_uv is None else w_uv.double())
    rows = len(seq_lens) * q_len
    assert out.dtype == dtype and out.shape == (rows, num_heads, value_dim or kv_lora_rank)
    assert lse.dtype == torch.float32 and lse.shape == (rows, num_heads)
    assert_close(out, ref_out, dtype)
    assert_close(lse, ref_lse, dtype, LSE_TOLERANCE)
    padded = (lens == 0).repeat_interleave(q_len)
    assert torch.all(out[padded] == 0) and torch.all(lse[padded] == float("-inf"))
    assert torch.isfinite(out).all() and torch.isfinite(lse[~padded]).all()


@pytest.mark.parametrize("q_len", [1, 2, 3, 4])
@pytest.mark.parametrize("num_splits", [None, 1, 3])
@pytest.mark.parametrize("num_heads", [2, 16])
def test_lengths_around_block_boundaries(q_len, num_splits, num_heads, device):
    # The shortest legal sequence, one block, a block + 1, a padded sequence, and a
    # sequence whose first queries end just below a block boundary that its last cross.
    block_size = 16
    lens = [q_len, block_size, block_size + 1, 0, block_size + q_len - 2 if q_len > 1 else 2 * block_size - 1]
    _check(lens, q_len, num_heads, 32, 16, block_size, torch.float32, device,
           seed=10 * q_len + num_heads, num_splits=num_splits)


@pytest.mark.parametrize("q_len", [2, 4])
@pytest.mark.parametrize("num_splits", [2, 5])
def test_splits_past_an_early_query_are_empty_for_it(q_len, num_splits, device):
    # Short sequences split 5 ways: the last split holds only keys the first query
    # must not see, so that query's partial there is empty (lse -inf) and must merge away.
    _check([q_len + 1, 33, 40], q_len, 3, 32, 16, 8, torch.float32, device, seed=q_len + num_splits,
           num_splits=num_splits)


@pytest.mark.parametrize("q_len", [2, 3])
@pytest.mark.parametrize("num_seqs", [2, 5])        # 2 * q_len rows fuse W_UV in stage 2, 5 * q_len use a GEMM
@pytest.mark.parametrize("num_splits", [1, 3])
def test_value_projection(q_len, num_seqs, num_splits, device):
    lens = [(29 * i + 7) % 50 + q_len for i in range(num_seqs)]
    lens[1] = 0
    _check(lens, q_len, 3, 32, 16, 16, torch.float32, device, seed=num_seqs + q_len, num_splits=num_splits,
           value_dim=40)


@pytest.mark.parametrize("q_len", [2, 4])
def test_bf16_non_contiguous(q_len, device):
    _check([q_len, 21, 0, 37], q_len, 4, 32, 16, 16, torch.bfloat16, device, seed=q_len,
           num_splits=2, non_contiguous=True)


def test_preallocated_workspace(device):
    _check([5, 40], 3, 4, 32, 16, 16, torch.float32, device, seed=31, workspace=True)
    width, block_size = 4, 16
    partial_out, partial_lse = tri.mla_decode_workspace(2, 4, 32, width, block_size, device, q_len=3)
    splits = tri.mla_decode_num_splits(2, 4, width, block_size, device, q_len=3)
    assert partial_out.shape == (6, 4, splits, 32) and partial_lse.shape == (6, 4, splits)


def test_more_queries_than_a_tile_of_heads(device):
    # 16 heads x 4 queries are 64 (head, query) rows: several head groups per sequence.
    _check([4, 30, 0], 4, 16, 32, 16, 16, torch.float32, device, seed=41, num_splits=2, value_dim=24)


def test_rejects_rows_not_a_multiple_of_q_len(device):
    q = torch.zeros(5, 2, 48, device=device)
    cache = torch.zeros(4, 16, 48, device=device)
    table = torch.zeros(2, 1, dtype=torch.int32, device=device)
    lens = torch.zeros(2, dtype=torch.int32, device=device)
    with pytest.raises(ValueError, match="multiple of q_len=2"):
        tri.mla_decode(q, cache, table, lens, softmax_scale=1.0, kv_lora_rank=32, q_len=2)
    with pytest.raises(ValueError, match="q_len"):
        tri.mla_decode(q, cache, table, lens, softmax_scale=1.0, kv_lora_rank=32, q_len=0)
    with pytest.raises(ValueError, match="workspace"):
        bad = (torch.zeros(2, 2, 2, 32, device=device), torch.zeros(2, 2, 2, device=device))  # rows of q_len 1
        tri.mla_decode(q[:4], cache, table, lens, softmax_scale=1.0, kv_lora_rank=32, q_len=2, num_splits=2,
                       workspace=bad)


@pytest.mark.parametrize("q_len", [2, 4])
def test_equals_prefill_with_context(q_len, device):
    # q_len decode queries of a sequence are q_len prefill tokens after its context,
    # on the same cache: absorbed (decode) and decompressed (prefill) give one answer.
    gen = generator(50 + q_len, device)
    heads, nope, rope, value_dim, rank, block_size = 3, 8, 16, 12, 32, 8
    context = [0, 5, 17, 30]
    lens = [c + q_len for c in context]
    kv_cache, block_table = paged_cache(lens, block_size, rank + rope, torch.float64, device, gen)
    rows = len(lens) * q_len
    q_nope = randn((rows, heads, nope), torch.float64, device, gen)
    q_pe = randn((rows, heads, rope), torch.float64, device, gen)
    w_uk = randn((heads, nope, rank), torch.float64, device, gen, scale=rank ** -0.5)
    w_uv = randn((heads, value_dim, rank), torch.float64, device, gen, scale=rank ** -0.5)
    seq_lens = torch.tensor(lens, dtype=torch.int32, device=device)
    positions = torch.cat([torch.arange(c, c + q_len, device=device) for c in context])
    cu_seqlens_q = (torch.arange(len(lens) + 1, device=device) * q_len).to(torch.int32)
    expected, expected_lse = ref.prefill_attention(q_nope, q_pe, kv_cache, block_table, cu_seqlens_q, seq_lens,
                                                   positions, w_uk, w_uv, softmax_scale=0.25)
    q = ref.absorb_query(q_nope, q_pe, w_uk).float()
    out, lse = tri.mla_decode(q, kv_cache.float(), block_table, seq_lens, softmax_scale=0.25, kv_lora_rank=rank,
                              w_uv=w_uv.float(), q_len=q_len, num_splits=2)
    assert_close(out, expected, torch.float32)
    assert_close(lse, expected_lse, torch.float32, LSE_TOLERANCE)


@pytest.mark.gpu
@pytest.mark.parametrize("num_heads", [16, 128])
@pytest.mark.parametrize("q_len", [2, 3, 4])
def test_gpu_real_sizes(num_heads, q_len):
    lens = [q_len, 63 + q_len, 64, 65, 1000, 4096, 0, 3000]
    device = torch.device("cuda")
    _check(lens, q_len, num_heads, 512, 64, 64, torch.bfloat16, device, seed=num_heads + q_len)
    _check(lens[:2], q_len, num_heads, 512, 64, 64, torch.bfloat16, device, seed=q_len, value_dim=128)
    _check(lens, q_len, num_heads, 512, 64, 64, torch.bfloat16, device, seed=q_len, value_dim=128)


@pytest.mark.gpu
def test_gpu_graph_replay_with_new_lengths():
    device = torch.device("cuda")
    gen = generator(22, device)
    num_seqs, num_heads, block_size, q_len = 8, 16, 64, 3
    kv_cache, block_table = paged_cache([2048] * num_seqs, block_size, 576, torch.bfloat16, device, gen)
    q = randn((num_seqs * q_len, num_heads, 576), torch.bfloat16, device, gen)
    lens = torch.full((num_seqs,), 5, dtype=torch.int32, device=device)
    workspace = tri.mla_decode_workspace(num_seqs, num_heads, 512, block_table.shape[1], block_size, device,
                                         q_len=q_len)

    def step():
        return tri.mla_decode(q, kv_cache, block_table, lens, softmax_scale=0.07, kv_lora_rank=512,
                              workspace=workspace, q_len=q_len)

    step()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out, lse = step()
    for new_lens in ([3, 2048, 0, 700, 64, 65, 1999, 4], [2048] * num_seqs):
        lens.copy_(torch.tensor(new_lens, dtype=torch.int32))
        graph.replay()
        expected_out, expected_lse = step()
        torch.testing.assert_close(out, expected_out, atol=0, rtol=0)
        torch.testing.assert_close(lse, expected_lse, atol=0, rtol=0)
        ref_out, _ = ref.mla_decode(q.double(), kv_cache.double(), block_table, lens,
                                    softmax_scale=0.07, kv_lora_rank=512, q_len=q_len)
        assert_close(out, ref_out, torch.bfloat16)
