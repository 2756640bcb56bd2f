"""Triton indexer key write and indexer scores against plain-torch oracles."""

from __future__ import annotations

import pytest
import torch

from support.kernel_cases import generator, paged_cache, randn, strided
from mla_func.kernels.triton import dsa_indexer as tri


def oracle_index_scores(q, head_weights, index_cache, block_table, key_lens) -> torch.Tensor:
    """scores[t, j] = sum_h w[t, h] * relu(q[t, h] . key_j) in float64; -inf for j >= key_lens[t].

    One row at a time, so real sizes (128K keys of 128 dims) fit in memory.
    """
    num_rows = q.shape[0]
    block_size, dim = index_cache.shape[1:]
    num_cols = block_table.shape[1] * block_size
    out = torch.empty((num_rows, num_cols), dtype=torch.float64, device=q.device)
    positions = torch.arange(num_cols, device=q.device)
    for t in range(num_rows):
        keys = index_cache[block_table[t].long()].reshape(num_cols, dim).double()
        logits = torch.relu(q[t].double() @ keys.T)                                     # [Hi, L]
        scores = (head_weights[t].double()[:, None] * logits).sum(0)
        out[t] = torch.where(positions < key_lens[t].long(), scores, float("-inf"))
    return out


def index_inputs(key_lens, num_heads, head_dim, block_size, dtype, device, gen):
    """(q [T, H, D], head_weights [T, H] float32, a paged cache [nb, bs, D], its block table, key_lens [T] int32)."""
    index_cache, block_table = paged_cache(key_lens, block_size, head_dim, dtype, device, gen)
    q = randn((len(key_lens), num_heads, head_dim), dtype, device, gen)
    head_weights = randn((len(key_lens), num_heads), torch.float32, device, gen, scale=num_heads ** -0.5)
    lens = torch.tensor(key_lens, dtype=torch.int32, device=device)
    return q, head_weights, index_cache, block_table, lens


def _check(key_lens, num_heads, head_dim, block_size, dtype, device, seed, non_contiguous=False, out=False,
           config=None, weight_scale=None):
    gen = generator(seed, device)
    q, head_weights, index_cache, block_table, lens = index_inputs(key_lens, num_heads, head_dim, block_size, dtype,
                                                                   device, gen)
    if non_contiguous:
        q, index_cache, block_table = strided(q, gen), strided(index_cache, gen), strided(block_table, gen)
        head_weights, lens = strided(head_weights, gen), strided(lens, gen)
    kwargs = {} if config is None else {"config": config}
    if weight_scale is not None:
        kwargs["weight_scale"] = weight_scale
    if out:
        kwargs["out"] = torch.full((len(key_lens), block_table.shape[1] * block_size), 7.0, device=device)
    got = tri.index_scores(q, head_weights, index_cache, block_table, lens, **kwargs)
    # The scale is applied to the weights as torch's float32 product rounds it.
    scaled = head_weights if weight_scale is None else head_weights * weight_scale
    expected = oracle_index_scores(q, scaled, index_cache, block_table, lens)
    assert got.dtype == torch.float32 and got.shape == expected.shape
    hidden = torch.isinf(expected)
    assert torch.equal(torch.isinf(got), hidden) and torch.all(got[hidden] < 0)
    # Products of bf16 inputs are exact in float32; only the float32 sums round.
    scale = expected[~hidden].abs().max().item() if (~hidden).any() else 1.0
    torch.testing.assert_close(got[~hidden].double(), expected[~hidden], atol=1e-5 * scale, rtol=1e-5)
    if out:
        assert got.data_ptr() == kwargs["out"].data_ptr()
    return got


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("num_heads", [1, 4, 16, 24])
def test_scores_around_block_boundaries(dtype, num_heads, device):
    block_size = 16
    lens = [1, block_size, block_size + 1, 0, 3 * block_size - 1, 70]
    _check(lens, num_heads, 32, block_size, dtype, device, seed=num_heads)


@pytest.mark.parametrize("head_dim", [16, 128, 48])
def test_head_dims(head_dim, device):
    _check([33, 5, 0], 4, head_dim, 16, torch.bfloat16, device, seed=head_dim)


def test_large_pages_and_many_chunks(device):
    # Chunks of one row (each 16 keys here) cover visible and hidden positions alike.
    _check([200, 64, 129, 0], 2, 32, 64, torch.float32, device, seed=3)


@pytest.mark.parametrize("block_size", [16, 64, 8])
def test_pages_located_ahead(block_size, device):
    # Pages of several tiles looked up at once: tiles within a page, across pages (8 keys a
    # page, 16 a tile), a chunk's last group of tiles ragged.
    config = tri.IndexerConfig(block_n=16, num_warps=4, num_stages=1, locate_tiles=4)
    _check([200, 64, 129, 0, 17], 4, 32, block_size, torch.float32, device, seed=block_size, config=config)


def test_non_contiguous_inputs_and_out(device):
    _check([40, 0, 17], 3, 32, 16, torch.bfloat16, device, seed=4, non_contiguous=True, out=True)


def test_weight_scale(device):
    # V3.2's score factor Hi^-0.5 * Di^-0.5 (not a power of two), applied to the weights.
    _check([40, 0, 17], 16, 128, 16, torch.bfloat16, device, seed=8, weight_scale=(16 * 128) ** -0.5)


def test_all_rows_padded(device):
    got = _check([0, 0], 4, 32, 16, torch.float32, device, seed=5)
    assert torch.all(got == float("-inf"))


def test_zero_scores_from_relu(device):
    # Every head's product is negative: relu leaves exact zeros (the commonest tie).
    gen = generator(6, device)
    index_cache, block_table = paged_cache([30], 16, 32, torch.float32, device, gen)
    index_cache = index_cache.abs()
    q = -randn((1, 4, 32), torch.float32, device, gen).abs()
    weights = randn((1, 4), torch.float32, device, gen)
    lens = torch.tensor([30], dtype=torch.int32, device=device)
    got = tri.index_scores(q, weights, index_cache, block_table, lens)
    assert torch.all(got[0, :30] == 0) and torch.all(got[0, 30:] == float("-inf"))


def test_chunk_count_is_static(device):
    a = tri.index_scores_num_chunks(64, 128 * 1024, device)
    assert a == tri.index_scores_num_chunks(64, 128 * 1024, device) >= 1
    assert tri.index_scores_num_chunks(3, 16, device) == 1


def test_rejects_bad_inputs(device):
    q = torch.zeros(2, 4, 32, device=device)
    w = torch.zeros(2, 4, device=device)
    cache = torch.zeros(5, 16, 32, device=device)
    table = torch.zeros(2, 3, dtype=torch.int32, device=device)
    lens = torch.zeros(2, dtype=torch.int32, device=device)
    with pytest.raises(ValueError, match="head_weights"):
        tri.index_scores(q, w[:, :3], cache, table, lens)
    with pytest.raises(ValueError, match="head_weights"):
        tri.index_scores(q, w.double(), cache, table, lens)
    with pytest.raises(ValueError, match="index_cache"):
        tri.index_scores(q, w, cache[..., :16], table, lens)
    with pytest.raises(ValueError, match="index_cache"):
        tri.index_scores(q, w, cache.bfloat16(), table, lens)
    with pytest.raises(ValueError, match="block_table"):
        tri.index_scores(q, w, cache, table.long(), lens)
    with pytest.raises(ValueError, match="key_lens"):
        tri.index_scores(q, w, cache, table, lens[:1])
    with pytest.raises(ValueError, match="out"):
        tri.index_scores(q, w, cache, table, lens, out=torch.zeros(2, 47, device=device))


# --- write_index_key ----------------------------------------------------------------------

@pytest.mark.parametrize("inplace", [True, False])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_write_index_key(inplace, dtype, device):
    gen = generator(8, device)
    index_cache = randn((6, 4, 32), dtype, device, gen)
    before = index_cache.clone()
    slots = torch.tensor([5, -1, 0, 23, -1, 9], dtype=torch.int64, device=device)
    keys = strided(randn((6, 32), torch.float32, device, gen), gen)
    got = tri.write_index_key(index_cache, slots, keys, inplace=inplace)
    expected = before.clone().view(-1, 32)
    for row, slot in enumerate(slots.tolist()):
        if slot >= 0:
            expected[slot] = keys[row].to(dtype)
    assert torch.equal(got.view(-1, 32), expected)
    assert (got.data_ptr() == index_cache.data_ptr()) == inplace
    if not inplace:
        assert torch.equal(index_cache, before)


def test_write_index_key_rejects_bad_inputs(device):
    cache = torch.zeros(3, 4, 32, device=device)
    slots = torch.zeros(2, dtype=torch.int64, device=device)
    keys = torch.zeros(2, 32, device=device)
    with pytest.raises(ValueError, match="index_key"):
        tri.write_index_key(cache, slots, keys[:, :16], inplace=True)
    with pytest.raises(ValueError, match="index_key"):
        tri.write_index_key(cache, slots[:1], keys, inplace=True)
    with pytest.raises(ValueError, match="slot_mapping"):
        tri.write_index_key(cache, slots.float(), keys, inplace=True)
    with pytest.raises(ValueError, match="index_cache"):
        tri.write_index_key(cache.to(torch.int32), slots, keys, inplace=True)


# --- GPU, real sizes ----------------------------------------------------------------------

@pytest.mark.gpu
@pytest.mark.parametrize("locate_tiles", [0, 16])
@pytest.mark.parametrize("num_heads", [16, 64])
def test_gpu_real_sizes(num_heads, locate_tiles):
    device = torch.device("cuda")
    context = 128 * 1024
    lens = [context, 1, 0, 64, 65, 2048, 100_000, 32 * 1024]
    config = tri.IndexerConfig(64, 4, 5, locate_tiles)
    _check(lens, num_heads, 128, 64, torch.bfloat16, device, seed=num_heads, config=config)
