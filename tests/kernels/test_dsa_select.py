"""The fused indexer + top-k op against the two ops it fuses (and the top-k oracle)."""

from __future__ import annotations

import pytest
import torch

from kernel_cases import generator, paged_cache, randn
from mla_func.kernels.triton import dsa_indexer, dsa_select, dsa_topk
from test_dsa_topk import oracle_top_k


def _inputs(key_lens, num_heads, head_dim, block_size, dtype, device, seed):
    gen = generator(seed, device)
    index_cache, block_table = paged_cache(key_lens, block_size, head_dim, dtype, device, gen)
    q = randn((len(key_lens), num_heads, head_dim), dtype, device, gen)
    head_weights = randn((len(key_lens), num_heads), torch.float32, device, gen, scale=num_heads ** -0.5)
    lens = torch.tensor(key_lens, dtype=torch.int32, device=device)
    return q, head_weights, index_cache, block_table, lens


def _check(inputs, k, **kwargs):
    q, head_weights, index_cache, block_table, lens = inputs
    indices, scores = dsa_select.index_top_k(q, head_weights, index_cache, block_table, lens, k=k, **kwargs)
    # The same tiles of the same kernel: the scores are the unfused op's bit for bit.
    assert torch.equal(scores, dsa_indexer.index_scores(q, head_weights, index_cache, block_table, lens))
    torch.testing.assert_close(indices, oracle_top_k(scores, lens, k), atol=0, rtol=0)
    return indices, scores


def _split(inputs) -> tuple[int, int]:
    q, _, index_cache, block_table, _ = inputs
    num_cols = block_table.shape[1] * index_cache.shape[1]
    plan = dsa_topk.select_plan(q.shape[0], num_cols, q.device)
    config = dsa_indexer.indexer_config(q.device)
    return plan.chunks, dsa_select.indexer_chunks_per_select_chunk(plan, q.shape[0], num_cols, q.device, config)


@pytest.mark.parametrize("k", [1, 9, 40])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_matches_scores_then_top_k(k, dtype, device):
    # Longer than k, shorter than k, a padded row, one key, a row ending mid-page.
    inputs = _inputs([256, 30, 0, 1, 201], 8, 32, 16, dtype, device, seed=k)
    if device.type == "cpu":
        chunks, split = _split(inputs)
        assert chunks > 1 and split > 1, "the case must give top-k several chunks, each of several indexer programs"
    _check(inputs, k)


def test_ties_go_to_lower_positions(device):
    # Zero head weights score every key 0: the k first visible positions win.
    inputs = _inputs([256, 100, 17], 4, 32, 16, torch.bfloat16, device, seed=5)
    q, head_weights, index_cache, block_table, lens = inputs
    indices, scores = _check((q, torch.zeros_like(head_weights), index_cache, block_table, lens), 24)
    assert torch.all(scores[:, :17] == 0)
    expected = torch.arange(24, dtype=torch.int32, device=device).expand(3, 24).clone()
    expected[2, 17:] = -1
    assert torch.equal(indices, expected)


def test_reused_workspace_and_outputs(device):
    # The first pass's slots are zeroed by every call: a second call into the same buffers agrees.
    inputs = _inputs([256, 130, 64], 4, 32, 16, torch.bfloat16, device, seed=6)
    q, _, index_cache, block_table, _ = inputs
    num_cols = block_table.shape[1] * index_cache.shape[1]
    workspace = dsa_topk.top_k_workspace(3, num_cols, device)
    out = torch.empty((3, 20), dtype=torch.int32, device=device)
    scores = torch.empty((3, num_cols), device=device)
    first, _ = _check(inputs, 20, workspace=workspace, out=out, scores=scores)
    first = first.clone()
    second, again = _check(inputs, 20, workspace=workspace, out=out, scores=scores)
    assert second.data_ptr() == out.data_ptr() and again.data_ptr() == scores.data_ptr()
    assert torch.equal(first, second)


def test_rejects_a_workspace_of_another_shape(device):
    inputs = _inputs([64, 10], 4, 32, 16, torch.float32, device, seed=7)
    with pytest.raises(ValueError, match="workspace"):
        dsa_select.index_top_k(*inputs, k=4, workspace=torch.zeros(2, 4, 99, 256, dtype=torch.int32, device=device))


@pytest.mark.gpu
@pytest.mark.parametrize("num_rows, context", [(64, 32 * 1024), (8, 128 * 1024), (3, 5000)])
def test_gpu_real_sizes(num_rows, context):
    device = torch.device("cuda")
    # A full row, a half one, a padded row, one of exactly k keys, one key; then rows of unequal lengths.
    lens = ([context, context // 2 + 7, 0, 2048, 1] + [context - 64 * i for i in range(num_rows)])[:num_rows]
    inputs = _inputs(lens, 64, 128, 64, torch.bfloat16, device, seed=num_rows)
    _, split = _split(inputs)
    q, head_weights, index_cache, block_table, key_lens = inputs
    indices, scores = _check(inputs, 2048)
    unfused = dsa_topk.top_k_indices(scores, key_lens, k=2048)
    assert torch.equal(indices, unfused), f"fused top-k (indexer programs per chunk {split}) differs"
