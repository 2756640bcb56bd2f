"""The DSA reference ops against plain per-row loops written from the contracts (kernels/contracts.py)."""

from __future__ import annotations

import math

import pytest
import torch

from mla_func.kernels import ops_for
from mla_func.kernels.reference import attention as ref_attention

DSA = ops_for("torch").dsa
BS = 4


def paged(num_blocks, dim, dtype=torch.float32, seed=0):
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(num_blocks, BS, dim, generator=generator).to(dtype)


def tables(num_rows, width, num_blocks, seed):
    """Each row a random table of distinct blocks 1.. (rows may share a sequence's table or not)."""
    generator = torch.Generator().manual_seed(seed)
    return torch.stack([torch.randperm(num_blocks - 1, generator=generator)[:width] + 1
                        for _ in range(num_rows)]).to(torch.int32)


def key_at(cache, table_row, j):
    return cache[int(table_row[j // BS]), j % BS]


def test_write_index_key_skips_padding_and_respects_inplace():
    cache = paged(6, 8)
    keys = torch.randn(3, 8)
    slots = torch.tensor([5, -1, 13])
    before = cache.clone()
    out = DSA.write_index_key(cache, slots, keys, inplace=False)
    assert torch.equal(cache, before)                      # out of place: the input untouched
    assert torch.equal(out[1, 1], keys[0]) and torch.equal(out[3, 1], keys[2])
    changed = (out != before).any(-1).nonzero().tolist()
    assert sorted(map(tuple, changed)) in ([(1, 1), (3, 1)], [(0, 0), (1, 1), (3, 1)])  # -1 touches only scratch
    same = DSA.write_index_key(cache, slots, keys, inplace=True)
    assert same is cache and torch.equal(cache[1:], out[1:])


@pytest.mark.parametrize("seed", [0, 1])
def test_index_scores_match_a_loop(seed):
    num_rows, heads, dim, width, num_blocks = 9, 5, 8, 4, 12
    generator = torch.Generator().manual_seed(seed)
    q = torch.randn(num_rows, heads, dim, generator=generator)
    weights = torch.randn(num_rows, heads, generator=generator)
    cache = paged(num_blocks, dim, seed=seed)
    table = tables(num_rows, width, num_blocks, seed)
    key_lens = torch.tensor([0, 1, 3, 4, 5, 9, 16, 2, 0], dtype=torch.int32)   # 0: padded rows
    got = DSA.index_scores(q, weights, cache, table, key_lens)
    assert got.shape == (num_rows, width * BS) and got.dtype == torch.float32
    for t in range(num_rows):
        for j in range(width * BS):
            if j >= key_lens[t]:
                assert got[t, j] == -math.inf
                continue
            key = key_at(cache, table[t], j)
            want = sum(float(weights[t, h]) * max(0.0, float(q[t, h] @ key)) for h in range(heads))
            assert got[t, j].item() == pytest.approx(want, rel=1e-5, abs=1e-5)


def loop_top_k(scores, key_lens, k):
    out = []
    for t in range(scores.shape[0]):
        visible = range(min(int(key_lens[t]), scores.shape[1]))
        best = sorted(visible, key=lambda j: (-float(scores[t, j]), j))[:k]
        out.append(sorted(best) + [-1] * (k - len(best)))
    return torch.tensor(out, dtype=torch.int32)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_top_k_breaks_ties_toward_lower_positions(seed):
    generator = torch.Generator().manual_seed(seed)
    # Scores from {0, 1, 2}: most of the k-th values are tied (as ReLU zeros are with few heads).
    scores = torch.randint(0, 3, (7, 24), generator=generator).float()
    key_lens = torch.tensor([24, 20, 9, 5, 1, 0, 13], dtype=torch.int32)
    scores[key_lens[:, None] <= torch.arange(24)] = -math.inf   # what index_scores gives past key_lens
    got = DSA.top_k_indices(scores, key_lens, k=8)
    assert got.dtype == torch.int32
    assert torch.equal(got, loop_top_k(scores, key_lens, 8))


def test_top_k_with_short_contexts_lists_every_key_in_order():
    scores = torch.randn(3, 6)
    key_lens = torch.tensor([6, 2, 0], dtype=torch.int32)
    got = DSA.top_k_indices(scores, key_lens, k=10)      # k beyond the table's 6 positions
    assert got.tolist() == [[0, 1, 2, 3, 4, 5] + [-1] * 4, [0, 1] + [-1] * 8, [-1] * 10]
    # Scores past key_lens are ignored even when finite (the contract reads only j < key_lens).
    assert DSA.top_k_indices(torch.tensor([[0.0, 5.0, 9.0]]), torch.tensor([2], dtype=torch.int32), k=1).tolist() == [[1]]


def loop_sparse_mla(q, cache, table, indices, scale, rank):
    num_rows, heads, _ = q.shape
    out = torch.zeros(num_rows, heads, rank, dtype=torch.float64)
    lse = torch.full((num_rows, heads), -math.inf, dtype=torch.float64)
    for t in range(num_rows):
        picked = [j for j in indices[t].tolist() if j >= 0]
        if not picked:
            continue
        keys = torch.stack([key_at(cache, table[t], j) for j in picked]).double()   # [n, C + R]
        logits = q[t].double() @ keys.T * scale                                      # [H, n]
        lse[t] = torch.logsumexp(logits, -1)
        out[t] = torch.softmax(logits, -1) @ keys[:, :rank]
    return out, lse


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_sparse_mla_decode_matches_a_loop(dtype):
    num_rows, heads, rank, rope, width, num_blocks, k = 6, 3, 16, 4, 5, 14, 6
    generator = torch.Generator().manual_seed(3)
    q = torch.randn(num_rows, heads, rank + rope, generator=generator).to(dtype)
    cache = paged(num_blocks, rank + rope, dtype, seed=3)
    table = tables(num_rows, width, num_blocks, 3)
    indices = torch.tensor([[0, 3, 7, 8, 15, 19], [1, 2, -1, -1, -1, -1], [-1] * 6,
                            [4, 5, 6, 7, 8, 9], [0, 1, 2, 3, 4, 5], [18, -1, -1, -1, -1, -1]], dtype=torch.int32)
    w_uv = torch.randn(heads, 12, rank, generator=generator).to(dtype)
    out, lse = DSA.sparse_mla_decode(q, cache, table, indices, softmax_scale=0.3, kv_lora_rank=rank)
    want_out, want_lse = loop_sparse_mla(q, cache, table, indices, 0.3, rank)
    assert out.dtype == dtype and lse.dtype == torch.float32
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(out.double(), want_out, rtol=tol, atol=tol)
    torch.testing.assert_close(lse.double(), want_lse, rtol=tol, atol=tol)
    assert torch.equal(out[2], torch.zeros_like(out[2])) and torch.isneginf(lse[2]).all()   # no index: 0, -inf
    projected, lse2 = DSA.sparse_mla_decode(q, cache, table, indices, softmax_scale=0.3, kv_lora_rank=rank, w_uv=w_uv)
    assert projected.shape == (num_rows, heads, 12) and torch.equal(lse2, lse)
    want = torch.einsum("thc,hvc->thv", out.float(), w_uv.float())
    torch.testing.assert_close(projected.float(), want, rtol=tol, atol=tol)


def test_sparse_over_every_key_equals_dense_decode():
    """Indices listing all of a short context equal the dense absorbed decode over it."""
    heads, rank, rope, width, num_blocks = 4, 16, 8, 3, 8
    generator = torch.Generator().manual_seed(4)
    q = torch.randn(2, heads, rank + rope, generator=generator)
    cache = paged(num_blocks, rank + rope, seed=4)
    table = tables(2, width, num_blocks, 4)
    seq_lens = torch.tensor([7, 11], dtype=torch.int32)
    indices = torch.tensor([list(range(7)) + [-1] * 5, list(range(11)) + [-1]], dtype=torch.int32)
    sparse, sparse_lse = DSA.sparse_mla_decode(q, cache, table, indices, softmax_scale=0.2, kv_lora_rank=rank)
    dense, dense_lse = ref_attention.mla_decode(q, cache, table, seq_lens, softmax_scale=0.2, kv_lora_rank=rank)
    torch.testing.assert_close(sparse, dense, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(sparse_lse, dense_lse, rtol=1e-6, atol=1e-6)


def test_index_scores_in_row_chunks_equal_one_pass(monkeypatch):
    from mla_func.kernels.reference import dsa as ref_dsa

    generator = torch.Generator().manual_seed(5)
    q, weights = torch.randn(11, 3, 8, generator=generator), torch.randn(11, 3, generator=generator)
    cache, table = paged(10, 8, seed=5), tables(11, 4, 10, 5)
    key_lens = torch.randint(0, 17, (11,), generator=generator, dtype=torch.int32)
    whole = ref_dsa.index_scores(q, weights, cache, table, key_lens)
    monkeypatch.setattr(ref_dsa, "_SCORE_ELEMENTS", 16 * 11 * 3)   # 3 rows a chunk: 4 chunks
    torch.testing.assert_close(ref_dsa.index_scores(q, weights, cache, table, key_lens), whole, rtol=0, atol=0)
