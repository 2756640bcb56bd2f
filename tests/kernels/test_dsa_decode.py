"""Triton sparse MLA decode against a plain-torch oracle, and the whole DSA pipeline."""

from __future__ import annotations

import pytest
import torch

from support.kernel_cases import LSE_TOLERANCE, assert_close, generator, paged_cache, randn, strided
from mla_func.kernels.gluon import mla_decode as gluon_decode
from mla_func.kernels.reference import attention as ref
from mla_func.kernels.triton import dsa_decode as tri
from mla_func.kernels.triton import dsa_indexer, dsa_topk
from mla_func.kernels.triton.decode import DecodeConfig
from test_dsa_topk import oracle_top_k


def oracle_sparse_decode(q, kv_cache, block_table, indices, softmax_scale, kv_lora_rank):
    """Absorbed attention of each row over its valid indices, float64: (out [T, H, C], lse [T, H])."""
    num_rows, num_heads, _ = q.shape
    block_size = kv_cache.shape[1]
    num_positions = block_table.shape[1] * block_size
    pos = indices.long()
    valid = (pos >= 0) & (pos < num_positions)                                       # [T, k]
    pos = torch.where(valid, pos, 0)
    pages = torch.gather(block_table.long(), 1, pos // block_size)
    rows = kv_cache[pages, pos % block_size].double()                               # [T, k, C + R]
    scores = torch.einsum("thd,tkd->thk", q.double(), rows) * softmax_scale
    scores = scores.masked_fill(~valid[:, None, :], float("-inf"))
    lse = torch.logsumexp(scores, dim=2)
    weights = torch.exp(scores - torch.where(lse.isinf(), 0.0, lse)[:, :, None])
    out = torch.einsum("thk,tkc->thc", weights, rows[..., :kv_lora_rank])
    return out, lse


def random_indices(key_lens, top_k, device, gen):
    """[T, k] int32: a random ascending subset of [0, key_len) per row (all of it when shorter), -1 after."""
    out = torch.full((len(key_lens), top_k), -1, dtype=torch.int32, device=device)
    for t, n in enumerate(key_lens):
        chosen = torch.randperm(n, generator=gen, device=device)[:top_k].sort().values
        out[t, :len(chosen)] = chosen.to(torch.int32)
    return out


def _check(key_lens, top_k, num_heads, kv_lora_rank, rope_dim, block_size, dtype, device, seed,
           num_splits=None, indices=None, non_contiguous=False, workspace=False, value_dim=None, config=None):
    gen = generator(seed, device)
    dim = kv_lora_rank + rope_dim
    kv_cache, block_table = paged_cache(key_lens, block_size, dim, dtype, device, gen)
    q = randn((len(key_lens), num_heads, dim), dtype, device, gen)
    if indices is None:
        indices = random_indices(key_lens, top_k, device, gen)
    if non_contiguous:
        q, kv_cache, block_table, indices = (strided(x, gen) for x in (q, kv_cache, block_table, indices))
    scale = dim ** -0.5
    kwargs = {} if config is None else {"config": config}
    if workspace:
        kwargs["workspace"] = tri.sparse_mla_decode_workspace(len(key_lens), num_heads, kv_lora_rank,
                                                              indices.shape[1], device)
    w_uv = None
    if value_dim:
        w_uv = strided(randn((num_heads, value_dim, kv_lora_rank), dtype, device, gen,
                             scale=kv_lora_rank ** -0.5), gen)
    out, lse = tri.sparse_mla_decode(q, kv_cache, block_table, indices, softmax_scale=scale,
                                     kv_lora_rank=kv_lora_rank, w_uv=w_uv, num_splits=num_splits, **kwargs)
    expected, expected_lse = oracle_sparse_decode(q, kv_cache, block_table, indices, scale, kv_lora_rank)
    if w_uv is not None:
        expected = torch.einsum("thc,hvc->thv", expected, w_uv.double())
    assert out.dtype == dtype and out.shape == expected.shape
    assert lse.dtype == torch.float32 and lse.shape == (len(key_lens), num_heads)
    assert not out.isnan().any() and not lse.isnan().any()
    assert_close(out, expected, dtype)
    assert_close(lse, expected_lse, dtype, LSE_TOLERANCE)
    return out, lse


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("num_heads", [2, 16, 20])
@pytest.mark.parametrize("num_splits", [None, 1, 3])
def test_selected_keys(dtype, num_heads, num_splits, device):
    # More keys than k, exactly k, fewer (a -1 tail), a padded row (all -1), one key.
    lens = [90, 24, 9, 0, 1]
    out, lse = _check(lens, 24, num_heads, 32, 16, 16, dtype, device, seed=num_heads, num_splits=num_splits)
    assert torch.all(out[3] == 0) and torch.all(lse[3] == float("-inf"))


def test_invalid_indices_are_inert(device):
    # -1 anywhere (not only in a tail), positions past the table, an all-invalid row.
    indices = torch.tensor([[3, -1, 40, -1, 7, 200],
                            [-1, -1, -1, -1, -1, -1],
                            [0, 1, 2, 3, 1000, -5]], dtype=torch.int32, device=device)
    out, lse = _check([64, 64, 64], 6, 4, 32, 16, 16, torch.float32, device, seed=2, indices=indices,
                      num_splits=2)
    assert torch.all(out[1] == 0) and torch.all(lse[1] == float("-inf"))


def test_real_mla_dims(device):
    _check([300, 40, 0], 48, 16, 512, 64, 64, torch.bfloat16, device, seed=3)


def test_non_contiguous_inputs_and_workspace(device):
    _check([50, 7, 0, 33], 16, 3, 32, 16, 16, torch.bfloat16, device, seed=4, non_contiguous=True, workspace=True)


@pytest.mark.parametrize("block_h", [16, 64])  # the latent in four chunks; from 64 heads a program, whole
@pytest.mark.parametrize("kv_lora_rank", [32, 96, 128])
def test_latent_chunks(block_h, kv_lora_rank, device):
    # A rank of 96 pads to 128 columns: the last chunk is a masked one.
    config = DecodeConfig(block_h=block_h, block_n=16, num_warps=4, num_stages=1)
    _check([90, 24, 0], 24, 5, kv_lora_rank, 16, 16, torch.bfloat16, device, seed=kv_lora_rank, num_splits=2,
           config=config)


def test_fp16(device):
    _check([40, 12], 16, 4, 32, 16, 16, torch.float16, device, seed=5)


@pytest.mark.parametrize("num_rows", [tri._FUSED_VALUE_MAX_ROWS, tri._FUSED_VALUE_MAX_ROWS + 1])  # fused; a GEMM
@pytest.mark.parametrize("num_splits", [1, 3])
def test_value_projection(num_rows, num_splits, device):
    lens = [(37 * i + 5) % 90 for i in range(num_rows)]
    lens[-1] = 0
    out, lse = _check(lens, 20, 3, 32, 16, 16, torch.float32, device, seed=num_rows + num_splits,
                      num_splits=num_splits, value_dim=40)
    assert out.shape == (num_rows, 3, 40)
    assert torch.all(out[-1] == 0) and torch.all(lse[-1] == float("-inf"))


def test_split_count_is_static(device):
    a = tri.sparse_mla_decode_num_splits(64, 16, 2048, device)
    assert a == tri.sparse_mla_decode_num_splits(64, 16, 2048, device) >= 1
    assert tri.sparse_mla_decode_num_splits(1, 16, 4, device) == 1


def test_op_config_without_the_gluon_kernels_is_the_tl_dot_kernels(device):
    """Where the Hopper kernels are not (the CPU, or a GPU without them), the op's kernel is the `tl.dot` one at
    every row count, the batch-invariant op's (slots None) too."""
    if gluon_decode.available(device):
        pytest.skip("a Hopper GPU takes the Gluon kernels (test_gluon_decode_gpu.py)")
    q = torch.zeros(8, 16, 576, dtype=torch.bfloat16, device=device)
    cache = torch.zeros(4, 64, 576, dtype=torch.bfloat16, device=device)
    for slots in (None, 1, 8 * 2048):
        config = tri.sparse_op_config(q, cache, 512, slots=slots)
        assert config == tri.sparse_decode_config(16, device) and not (config.narrow or config.wgmma)


def test_rejects_bad_inputs(device):
    q = torch.zeros(2, 4, 48, device=device)
    cache = torch.zeros(5, 16, 48, device=device)
    table = torch.zeros(2, 3, dtype=torch.int32, device=device)
    indices = torch.zeros(2, 8, dtype=torch.int32, device=device)
    kw = dict(softmax_scale=1.0, kv_lora_rank=32)
    with pytest.raises(ValueError, match="kv_cache"):
        tri.sparse_mla_decode(q, cache[..., :40], table, indices, **kw)
    with pytest.raises(ValueError, match="block_table"):
        tri.sparse_mla_decode(q, cache, table[:1], indices, **kw)
    with pytest.raises(ValueError, match="indices"):
        tri.sparse_mla_decode(q, cache, table, indices.long(), **kw)
    with pytest.raises(ValueError, match="indices"):
        tri.sparse_mla_decode(q, cache, table, indices[:1], **kw)
    with pytest.raises(ValueError, match="kv_lora_rank"):
        tri.sparse_mla_decode(q, cache, table, indices, softmax_scale=1.0, kv_lora_rank=48)
    with pytest.raises(ValueError, match="w_uv"):
        tri.sparse_mla_decode(q, cache, table, indices, w_uv=torch.zeros(4, 16, 31, device=device), **kw)
    with pytest.raises(ValueError, match="workspace"):
        bad = (torch.zeros(2, 4, 7, 32, device=device), torch.zeros(2, 4, 7, device=device))
        tri.sparse_mla_decode(q, cache, table, indices, num_splits=2, workspace=bad, **kw)


# --- the pipeline: indexer scores -> top-k -> sparse decode -------------------------------

def _pipeline_inputs(key_lens, num_heads, index_heads, block_size, dtype, device, seed, dim=48, index_dim=32):
    gen = generator(seed, device)
    kv_cache, block_table = paged_cache(key_lens, block_size, dim, dtype, device, gen)
    index_cache = randn((kv_cache.shape[0], block_size, index_dim), dtype, device, gen)
    return dict(
        q=randn((len(key_lens), num_heads, dim), dtype, device, gen),
        kv_cache=kv_cache, block_table=block_table, index_cache=index_cache,
        index_q=randn((len(key_lens), index_heads, index_dim), dtype, device, gen),
        head_weights=randn((len(key_lens), index_heads), torch.float32, device, gen),
        key_lens=torch.tensor(key_lens, dtype=torch.int32, device=device))


def _pipeline(x, top_k, kv_lora_rank, scale, scores=None, indices=None, workspace=None, topk_workspace=None):
    scores = dsa_indexer.index_scores(x["index_q"], x["head_weights"], x["index_cache"], x["block_table"],
                                      x["key_lens"], out=scores)
    indices = dsa_topk.top_k_indices(scores, x["key_lens"], k=top_k, out=indices, workspace=topk_workspace)
    out, lse = tri.sparse_mla_decode(x["q"], x["kv_cache"], x["block_table"], indices, softmax_scale=scale,
                                     kv_lora_rank=kv_lora_rank, workspace=workspace)
    return indices, out, lse


def test_context_within_k_equals_dense_decode(device):
    # Every visible key selected, in order: sparse attention reduces over the dense keys.
    x = _pipeline_inputs([1, 16, 17, 0, 40], 4, 8, 16, torch.float32, device, seed=6)
    indices, out, lse = _pipeline(x, 40, 32, 0.2)
    dense_out, dense_lse = ref.mla_decode(x["q"].double(), x["kv_cache"].double(), x["block_table"],
                                          x["key_lens"], softmax_scale=0.2, kv_lora_rank=32)
    assert_close(out, dense_out, torch.float32)
    assert_close(lse, dense_lse, torch.float32, LSE_TOLERANCE)
    assert torch.all(out[3] == 0) and torch.all(lse[3] == float("-inf"))


# --- GPU, real sizes ----------------------------------------------------------------------

@pytest.mark.gpu
@pytest.mark.parametrize("num_heads", [16, 64, 128])
def test_gpu_real_sizes(num_heads):
    device = torch.device("cuda")
    lens = [128 * 1024, 32 * 1024, 2048, 2047, 100, 1, 0, 5000]
    _check(lens, 2048, num_heads, 512, 64, 64, torch.bfloat16, device, seed=num_heads)


@pytest.mark.gpu
def test_gpu_many_rows_split_and_fused_paths():
    device = torch.device("cuda")
    gen = generator(9, device)
    lens = torch.randint(0, 8192, (64,), generator=gen, device=device).tolist()
    _check(lens, 2048, 16, 512, 64, 64, torch.bfloat16, device, seed=10)
    # W_UV merged in stage 2, then by a GEMM after it.
    _check(lens[:tri._FUSED_VALUE_MAX_ROWS], 2048, 128, 512, 64, 64, torch.bfloat16, device, seed=11, value_dim=128)
    _check(lens[:4], 2048, 128, 512, 64, 64, torch.bfloat16, device, seed=11, value_dim=128)


@pytest.mark.gpu
def test_gpu_graph_replay_equals_eager():
    device = torch.device("cuda")
    num_rows, top_k, context, block_size = 16, 2048, 16 * 1024, 64
    x = _pipeline_inputs([context] * num_rows, 16, 64, block_size, torch.bfloat16, device, seed=12,
                         dim=576, index_dim=128)
    x["key_lens"].fill_(3)
    scores = torch.empty(num_rows, x["block_table"].shape[1] * block_size, device=device)
    indices = torch.empty(num_rows, top_k, dtype=torch.int32, device=device)
    # The workspace's splits are those of the kernel the eager op takes at these shapes (on Hopper the
    # keys-as-rows kernel's), so graph and eager run the same splits.
    config = tri.sparse_op_config(x["q"], x["kv_cache"], 512, slots=num_rows * top_k)
    workspace = tri.sparse_mla_decode_workspace(num_rows, 16, 512, top_k, device, config)
    topk_workspace = dsa_topk.top_k_workspace(num_rows, scores.shape[1], device, k=top_k)

    def step():
        return _pipeline(x, top_k, 512, 0.07, scores=scores, indices=indices, workspace=workspace,
                         topk_workspace=topk_workspace)

    step()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        got_indices, out, lse = step()
    gen = generator(13, device)
    for new_lens in ([1, context, 0, 700, 2048, 2049, 9999, 3] * 2,
                     torch.randint(0, context + 1, (num_rows,), generator=gen, device=device).tolist()):
        x["key_lens"].copy_(torch.tensor(new_lens, dtype=torch.int32))
        x["block_table"].copy_(x["block_table"][torch.randperm(num_rows, device=device)])
        graph.replay()
        graph_indices, graph_out, graph_lse = got_indices.clone(), out.clone(), lse.clone()
        eager_indices, eager_out, eager_lse = _pipeline(x, top_k, 512, 0.07)
        assert torch.equal(graph_indices, eager_indices)
        eager_scores = dsa_indexer.index_scores(x["index_q"], x["head_weights"], x["index_cache"],
                                                x["block_table"], x["key_lens"])
        assert torch.equal(graph_indices, oracle_top_k(eager_scores, x["key_lens"], top_k))
        torch.testing.assert_close(graph_out, eager_out, atol=0, rtol=0)
        torch.testing.assert_close(graph_lse, eager_lse, atol=0, rtol=0)
        expected, expected_lse = oracle_sparse_decode(x["q"], x["kv_cache"], x["block_table"], eager_indices,
                                                      0.07, 512)
        assert_close(graph_out, expected, torch.bfloat16)
        assert_close(graph_lse, expected_lse, torch.bfloat16, LSE_TOLERANCE)
