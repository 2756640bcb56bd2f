"""Triton split-KV MLA decode against the reference."""

from __future__ import annotations

import pytest
import torch

from support.kernel_cases import LSE_TOLERANCE, assert_close, generator, paged_cache, randn, strided
from mla_func.kernels.reference import attention as ref
from mla_func.kernels.triton import decode as tri


def _check(seq_lens, num_heads, kv_lora_rank, rope_dim, block_size, dtype, device, seed,
           num_splits=None, non_contiguous=False, workspace=False, config=None):
    gen = generator(seed, device)
    dim = kv_lora_rank + rope_dim
    kv_cache, block_table = paged_cache(seq_lens, block_size, dim, dtype, device, gen)
    q = randn((len(seq_lens), num_heads, dim), dtype, device, gen)
    lens = torch.tensor(seq_lens, dtype=torch.int32, device=device)
    if non_contiguous:
        q, kv_cache, block_table = strided(q, gen), strided(kv_cache, gen), strided(block_table, gen)
        lens = strided(lens, gen)
    scale = dim ** -0.5
    kwargs = {}
    if workspace:
        kwargs["workspace"] = tri.mla_decode_workspace(
            len(seq_lens), num_heads, kv_lora_rank, block_table.shape[1], block_size, device)
    out, lse = tri.mla_decode(q, kv_cache, block_table, lens, softmax_scale=scale,
                              kv_lora_rank=kv_lora_rank, num_splits=num_splits, config=config, **kwargs)
    ref_out, ref_lse = ref.mla_decode(q.double(), kv_cache.double(), block_table, lens,
                                      softmax_scale=scale, kv_lora_rank=kv_lora_rank)
    assert out.dtype == dtype and out.shape == (len(seq_lens), num_heads, kv_lora_rank)
    assert lse.dtype == torch.float32
    assert_close(out, ref_out, dtype)
    assert_close(lse, ref_lse, dtype, LSE_TOLERANCE)
    padded = lens == 0
    assert torch.all(out[padded] == 0) and torch.all(lse[padded] == float("-inf"))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("block_size", [16, 64])
@pytest.mark.parametrize("num_heads", [2, 16])
@pytest.mark.parametrize("num_splits", [None, 3])
def test_lengths_around_block_boundaries(dtype, block_size, num_heads, num_splits, device):
    # 1 key, exactly one block, one past it, a padded row, just below two blocks.
    lens = [1, block_size, block_size + 1, 0, 2 * block_size - 1]
    _check(lens, num_heads, 32, 16, block_size, dtype, device, seed=block_size + num_heads, num_splits=num_splits)


@pytest.mark.parametrize("num_splits", [1, 2, 5])
def test_split_counts_agree(num_splits, device):
    # More splits than a short sequence has key tiles leaves some splits empty.
    _check([3, 40, 77], 4, 32, 16, 16, torch.float32, device, seed=num_splits, num_splits=num_splits)


CHUNKED = tri.DecodeConfig(block_h=16, block_n=16, num_warps=4, num_stages=1, chunks=4)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("num_splits", [None, 3])
def test_latent_in_four_chunks(dtype, num_splits, device):
    """The chunked twin (`DecodeConfig.chunks == 4`), which one query a row over a plain cache takes on a GPU."""
    _check([1, 16, 17, 0, 47], 3, 64, 16, 16, dtype, device, seed=31, num_splits=num_splits, config=CHUNKED)
    _check([5, 70], 4, 512, 64, 16, torch.bfloat16, device, seed=32, non_contiguous=True, config=CHUNKED)


def test_chunks_refuse_what_they_cannot_take(device):
    q = torch.zeros((2, 4, 2 * 48), device=device)
    cache = torch.zeros((4, 16, 96), device=device)
    table = torch.ones((1, 2), dtype=torch.int32, device=device)
    lens = torch.tensor([3], dtype=torch.int32, device=device)
    with pytest.raises(ValueError, match="four chunks"):
        tri.mla_decode(q, cache, table, lens, softmax_scale=1.0, kv_lora_rank=48, q_len=2, config=CHUNKED)


def test_real_mla_dims(device):
    _check([1, 64, 65, 130], 16, 512, 64, 64, torch.bfloat16, device, seed=7)


def test_non_contiguous_inputs(device):
    _check([5, 33, 0], 3, 32, 16, 16, torch.bfloat16, device, seed=11, non_contiguous=True, num_splits=2)


def test_fp16(device):
    _check([9, 31], 4, 32, 16, 16, torch.float16, device, seed=12)


def test_preallocated_workspace(device):
    _check([17, 50], 4, 32, 16, 16, torch.float32, device, seed=13, workspace=True)


def test_a_workspace_sets_the_split_count(device):
    """A caller's workspace of S splits is used with S splits (whichever kernel the launch config takes)."""
    gen = generator(15, device)
    kv_cache, table = paged_cache([40, 70], 16, 48, torch.float32, device, gen)
    q = randn((2, 4, 48), torch.float32, device, gen)
    lens = torch.tensor([40, 70], dtype=torch.int32, device=device)
    workspace = (torch.full((2, 4, 3, 32), float("nan"), device=device),
                 torch.full((2, 4, 3), float("nan"), device=device))
    out, lse = tri.mla_decode(q, kv_cache, table, lens, softmax_scale=0.2, kv_lora_rank=32, workspace=workspace)
    want, want_lse = ref.mla_decode(q.double(), kv_cache.double(), table, lens, softmax_scale=0.2, kv_lora_rank=32)
    assert not workspace[1].isnan().any()          # every one of the 3 splits wrote its LSE
    assert_close(out, want, torch.float32)
    assert_close(lse, want_lse, torch.float32, LSE_TOLERANCE)


def test_all_rows_padded(device):
    _check([0, 0], 4, 32, 16, 16, torch.float32, device, seed=14, num_splits=3)


def test_split_count_is_static(device):
    # Depends on shapes and the device only: never on lengths (graph capture).
    a = tri.mla_decode_num_splits(4, 16, 64, 64, device)
    b = tri.mla_decode_num_splits(4, 16, 64, 64, device)
    assert a == b >= 1
    assert tri.mla_decode_num_splits(4, 16, 1, 16, device) == 1
    # Never more programs than fit at once: a partial second wave is slow.
    assert tri.mla_decode_num_splits(1, 16, 4096, 64, device) <= 2 * tri.sm_count(device)


def test_rejects_bad_inputs(device):
    q = torch.zeros(2, 4, 48, device=device)
    cache = torch.zeros(5, 16, 48, device=device)
    table = torch.zeros(2, 3, dtype=torch.int32, device=device)
    lens = torch.zeros(2, dtype=torch.int32, device=device)
    with pytest.raises(ValueError, match="kv_cache"):
        tri.mla_decode(q, cache[..., :40], table, lens, softmax_scale=1.0, kv_lora_rank=32)
    with pytest.raises(ValueError, match="block_table"):
        tri.mla_decode(q, cache, table.long(), lens, softmax_scale=1.0, kv_lora_rank=32)
    with pytest.raises(ValueError, match="seq_lens"):
        tri.mla_decode(q, cache, table, lens[:1], softmax_scale=1.0, kv_lora_rank=32)
    with pytest.raises(ValueError, match="workspace"):
        bad = (torch.zeros(2, 4, 7, 32, device=device), torch.zeros(2, 4, 7, device=device))
        tri.mla_decode(q, cache, table, lens, softmax_scale=1.0, kv_lora_rank=32, num_splits=2, workspace=bad)


@pytest.mark.gpu
@pytest.mark.parametrize("num_heads", [16, 128])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_gpu_real_sizes(num_heads, dtype):
    lens = [1, 63, 64, 65, 1000, 4096, 0, 3000]
    _check(lens, num_heads, 512, 64, 64, dtype, torch.device("cuda"), seed=num_heads)


@pytest.mark.gpu
@pytest.mark.parametrize("num_heads", [16, 128])
def test_gpu_chunked_twin_agrees_with_whole_rows(num_heads):
    """The chunked kernel (the GPU's default for one query a row) and the whole-row kernel at the bench's
    sizes: each equal to the reference, and to each other within bf16 rounding."""
    device = torch.device("cuda")
    gen = generator(num_heads + 1, device)
    lens = [1, 63, 64, 65, 1000, 4096, 0, 3000]
    kv_cache, table = paged_cache(lens, 64, 576, torch.bfloat16, device, gen)
    q = randn((len(lens), num_heads, 576), torch.bfloat16, device, gen)
    seq_lens = torch.tensor(lens, dtype=torch.int32, device=device)
    kw = dict(softmax_scale=576 ** -0.5, kv_lora_rank=512)
    chunked, chunked_lse = tri.mla_decode(q, kv_cache, table, seq_lens, **kw)
    whole, whole_lse = tri.mla_decode(q, kv_cache, table, seq_lens, config=tri.decode_config(num_heads, device), **kw)
    want, want_lse = ref.mla_decode(q.double(), kv_cache.double(), table, seq_lens, **kw)
    for out, lse in ((chunked, chunked_lse), (whole, whole_lse)):
        assert_close(out, want, torch.bfloat16)
        assert_close(lse, want_lse, torch.bfloat16, LSE_TOLERANCE)
    assert_close(chunked, whole, torch.bfloat16)


@pytest.mark.gpu
def test_gpu_graph_replay_with_new_lengths():
    device = torch.device("cuda")
    gen = generator(21, device)
    num_seqs, num_heads, block_size = 8, 16, 64
    kv_cache, block_table = paged_cache([2048] * num_seqs, block_size, 576, torch.bfloat16, device, gen)
    q = randn((num_seqs, num_heads, 576), torch.bfloat16, device, gen)
    lens = torch.full((num_seqs,), 5, dtype=torch.int32, device=device)
    workspace = tri.mla_decode_workspace(num_seqs, num_heads, 512, block_table.shape[1], block_size, device)

    def step():
        return tri.mla_decode(q, kv_cache, block_table, lens, softmax_scale=0.07, kv_lora_rank=512,
                              workspace=workspace)

    step()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out, lse = step()
    for new_lens in ([1, 2048, 0, 700, 64, 65, 1999, 3], [2048] * num_seqs):
        lens.copy_(torch.tensor(new_lens, dtype=torch.int32))
        graph.replay()
        expected_out, expected_lse = step()
        torch.testing.assert_close(out, expected_out, atol=0, rtol=0)
        torch.testing.assert_close(lse, expected_lse, atol=0, rtol=0)
        ref_out, _ = ref.mla_decode(q.double(), kv_cache.double(), block_table, lens,
                                    softmax_scale=0.07, kv_lora_rank=512)
        assert_close(out, ref_out, torch.bfloat16)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("num_splits", [1, 3, 23])                 # 23: more than one merge step of splits
@pytest.mark.parametrize("num_seqs", [1, 4, tri._FUSED_VALUE_MAX_SEQS + 1])  # merged with W_UV, then a GEMM
def test_value_projection(dtype, num_splits, num_seqs, device):
    gen = generator(num_seqs * 7 + num_splits, device)
    heads, kv_lora_rank, rope_dim, value_dim, block_size = 3, 32, 16, 40, 16
    lens = [(37 * i + 5) % 90 for i in range(num_seqs)]
    lens[-1] = 0                                                    # a padded row
    kv_cache, block_table = paged_cache(lens, block_size, kv_lora_rank + rope_dim, dtype, device, gen)
    q = randn((num_seqs, heads, kv_lora_rank + rope_dim), dtype, device, gen)
    w_uv = strided(randn((heads, value_dim, kv_lora_rank), dtype, device, gen, scale=kv_lora_rank ** -0.5), gen)
    seq_lens = torch.tensor(lens, dtype=torch.int32, device=device)
    scale = 0.2
    out, lse = tri.mla_decode(q, kv_cache, block_table, seq_lens, softmax_scale=scale, kv_lora_rank=kv_lora_rank,
                              num_splits=num_splits, w_uv=w_uv)
    latent, ref_lse = ref.mla_decode(q.double(), kv_cache.double(), block_table, seq_lens,
                                     softmax_scale=scale, kv_lora_rank=kv_lora_rank)
    assert out.shape == (num_seqs, heads, value_dim) and out.dtype == dtype
    assert_close(out, torch.einsum("bhc,hvc->bhv", latent, w_uv.double()), dtype)
    assert_close(lse, ref_lse, dtype, LSE_TOLERANCE)
    assert torch.all(out[-1] == 0) and torch.all(lse[-1] == float("-inf"))
    with pytest.raises(ValueError, match="w_uv"):
        tri.mla_decode(q, kv_cache, block_table, seq_lens, softmax_scale=scale, kv_lora_rank=kv_lora_rank,
                       w_uv=w_uv[:, :, :-1])


def test_value_projection_one_program_a_head(device):
    # 8 rows x 16 heads: each (row, head) merges its splits through all of W_UV in one program.
    gen = generator(91, device)
    num_seqs, heads, kv_lora_rank, rope_dim, value_dim, block_size = tri._FUSED_VALUE_MAX_SEQS, 16, 32, 16, 40, 16
    lens = [(29 * i + 11) % 70 for i in range(num_seqs)]
    kv_cache, block_table = paged_cache(lens, block_size, kv_lora_rank + rope_dim, torch.float32, device, gen)
    q = randn((num_seqs, heads, kv_lora_rank + rope_dim), torch.float32, device, gen)
    w_uv = randn((heads, value_dim, kv_lora_rank), torch.float32, device, gen, scale=kv_lora_rank ** -0.5)
    seq_lens = torch.tensor(lens, dtype=torch.int32, device=device)
    out, lse = tri.mla_decode(q, kv_cache, block_table, seq_lens, softmax_scale=0.2, kv_lora_rank=kv_lora_rank,
                              num_splits=5, w_uv=w_uv)
    latent, ref_lse = ref.mla_decode(q.double(), kv_cache.double(), block_table, seq_lens,
                                     softmax_scale=0.2, kv_lora_rank=kv_lora_rank)
    assert_close(out, torch.einsum("bhc,hvc->bhv", latent, w_uv.double()), torch.float32)
    assert_close(lse, ref_lse, torch.float32, LSE_TOLERANCE)
