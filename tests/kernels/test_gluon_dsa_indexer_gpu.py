"""The indexer's scores on Hopper's warpgroup MMA (`gluon.dsa_indexer`) against the float64 oracle and the `tl.dot`
twin (`triton.dsa_indexer` with `wgmma=False`).

Cases: ragged rows (padded rows, lengths inside and at the end of a tile, rows longer than a program's run, so
runs start and end inside rows), pages of whole tiles (64, 128 keys) and pages shorter than a tile (8, 16, 32:
several copies a tile, tables whose last pages end inside a tile), FP8 caches (bf16 and fp16 queries), strided
queries and weights, fp16, the programs' run lengths at other programs-a-multiprocessor and stage counts, a
graph replayed on new tables and lengths, a row's scores alone and among other rows (the batch-invariant table
takes the kernel), V3.2's benchmark shape (64 rows x 32K keys). Every score equals the oracle's within 1e-5 and
the twin's bit for bit; the op is spied to have taken the kernel.
"""

from __future__ import annotations

import pytest
import torch

from mla_func.kernels.gluon import dsa_indexer as gluon_indexer
from mla_func.kernels.index_cache import FP8IndexCache
from mla_func.kernels.triton import dsa_indexer as tri
from mla_func.kernels.triton import v4_invariant
from mla_func.kernels.triton._common import sm_count
from support.kernel_cases import captured, generator, randn, strided
from test_dsa_indexer import index_inputs, oracle_index_scores
from test_fp8_index_cache import dequantized, fp8_keys

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

HEADS, DIM = 64, 128
TWIN = tri.IndexerConfig(block_n=64, num_warps=4, num_stages=4, locate_tiles=16, wgmma=False)


def _hopper() -> torch.device:
    device = torch.device("cuda")
    if not gluon_indexer.available(device):
        pytest.skip("the warpgroup-MMA kernel needs a Hopper GPU and its Triton release")
    return device


@pytest.fixture
def spied(monkeypatch):
    """Counts the op's calls of the kernel."""
    calls = []
    real = gluon_indexer.index_scores_wgmma

    def spy(*args, **kwargs):
        calls.append(args[0].shape[0])
        return real(*args, **kwargs)

    monkeypatch.setattr(gluon_indexer, "index_scores_wgmma", spy)
    return calls


def _inputs(key_lens, block_size, dtype, device, seed, non_contiguous=False):
    # The cache stays contiguous (TMA reads it as rows); non_contiguous strides the rest.
    gen = generator(seed, device)
    q, weights, cache, table, lens = index_inputs(key_lens, HEADS, DIM, block_size, dtype, device, gen)
    if non_contiguous:
        q, weights, table, lens = strided(q, gen), strided(weights, gen), strided(table, gen), strided(lens, gen)
    return q, weights, cache, table, lens


def _assert_scores(got, q, weights, cache, table, lens, weight_scale=1.0):
    keys = dequantized(cache) if isinstance(cache, FP8IndexCache) else cache
    expected = oracle_index_scores(q, weights * weight_scale, keys, table, lens)
    hidden = torch.isinf(expected)
    assert torch.equal(torch.isinf(got), hidden) and torch.all(got[hidden] < 0)
    scale = expected[~hidden].abs().max().item() if (~hidden).any() else 1.0
    torch.testing.assert_close(got[~hidden].double(), expected[~hidden], atol=1e-5 * scale, rtol=1e-5)
    twin = tri.index_scores(q, weights, cache, table, lens, weight_scale=weight_scale, config=TWIN)
    # Both take each 64-key tile through one m64n64k16 product series and sum the heads the same way.
    assert torch.equal(got, twin)


@pytest.mark.parametrize("block_size", [64, 128, 8, 16, 32])
def test_ragged_rows_every_page_size(block_size, spied):
    device = _hopper()
    lens = [1, 64, 65, 0, 127, 700, 33, 1000, 5]
    q, weights, cache, table, lens_t = _inputs(lens, block_size, torch.bfloat16, device, seed=block_size)
    got = tri.index_scores(q, weights, cache, table, lens_t, weight_scale=0.3)
    assert spied == [len(lens)]
    _assert_scores(got, q, weights, cache, table, lens_t, weight_scale=0.3)


@pytest.mark.parametrize("block_size", [64, 16])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_fp8_keys(block_size, dtype, spied):
    # V3.2's FP8 indexer cache (e4m3 values, a float32 scale a key): the bytes by TMA, widened to q's dtype in
    # registers, each key's logits times its scale.
    device = _hopper()
    lens = [1, 64, 65, 0, 700, 33, 1000]
    gen = generator(block_size + 1, device)
    cache, table = fp8_keys(lens, block_size, DIM, device, gen)
    q = randn((len(lens), HEADS, DIM), dtype, device, gen)
    weights = randn((len(lens), HEADS), torch.float32, device, gen, scale=HEADS ** -0.5)
    lens_t = torch.tensor(lens, dtype=torch.int32, device=device)
    got = tri.index_scores(q, weights, cache, table, lens_t, weight_scale=0.3)
    assert spied == [len(lens)]
    _assert_scores(got, q, weights, cache, table, lens_t, weight_scale=0.3)


@pytest.mark.parametrize("block_size", [16, 48])
def test_tables_ending_inside_a_tile(block_size, spied):
    # 16-key pages with a table of 5 (80 keys: the last tile half past the table); 48-key pages are no tile's
    # multiple nor divisor, so the twin takes them.
    device = _hopper()
    q, weights, cache, table, lens = _inputs([80, 3], block_size, torch.bfloat16, device, seed=7)
    table = table[:, : -(-80 // block_size)]
    out = torch.full((2, table.shape[1] * block_size), 7.0, device=device)
    got = tri.index_scores(q, weights, cache, table, lens, out=out)
    assert got.data_ptr() == out.data_ptr()
    assert spied == ([2] if block_size == 16 else [])
    _assert_scores(got, q, weights, cache, table, lens)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_strided_inputs_and_dtypes(dtype, spied):
    device = _hopper()
    q, weights, cache, table, lens = _inputs([300, 0, 129, 64], 64, dtype, device, seed=3, non_contiguous=True)
    got = tri.index_scores(q, weights, cache, table, lens)
    assert spied == [4]
    _assert_scores(got, q, weights, cache, table, lens)


@pytest.mark.parametrize("stages,programs_per_sm", [(2, 4), (3, 3), (5, 1), (2, 1)])
def test_runs_across_rows(stages, programs_per_sm):
    # Few programs: each run covers several rows and starts and ends inside them.
    device = _hopper()
    lens = [4000, 0, 4096, 17, 2500, 4096, 64, 3000]
    q, weights, cache, table, lens_t = _inputs(lens, 64, torch.bfloat16, device, seed=stages * 10 + programs_per_sm)
    out = torch.full((len(lens), table.shape[1] * 64), float("nan"), device=device)
    got = gluon_indexer.index_scores_wgmma(q, weights, cache, table, lens_t, out, weight_scale=1.0, sm_count=3,
                                           use_pdl=False, stages=stages, programs_per_sm=programs_per_sm)
    _assert_scores(got, q, weights, cache, table, lens_t)


def test_refusals():
    device = _hopper()
    q, _, cache, _, _ = _inputs([64], 64, torch.bfloat16, device, seed=1)
    assert gluon_indexer.applies(q, cache)
    assert not gluon_indexer.applies(q.float(), cache.float())
    assert not gluon_indexer.applies(q[:, :32], cache)
    wide = torch.zeros(4, 64, 2 * DIM, dtype=torch.bfloat16, device=device)
    assert not gluon_indexer.applies(q, wide[..., :DIM])                            # rows TMA cannot read
    assert not gluon_indexer.applies(q, torch.zeros(4, 48, DIM, dtype=torch.bfloat16, device=device))
    assert not gluon_indexer.applies(q, cache.half())                                  # not q's dtype
    assert gluon_indexer.applies(q, torch.zeros(4, 16, DIM, dtype=torch.bfloat16, device=device))


def test_graph_replays_new_tables_and_lengths(spied):
    device = _hopper()
    lens = [2000, 64, 1500, 0]
    q, weights, cache, table, lens_t = _inputs(lens, 64, torch.bfloat16, device, seed=11)
    out = torch.empty((len(lens), table.shape[1] * 64), device=device)
    graph, got = captured(lambda: tri.index_scores(q, weights, cache, table, lens_t, out=out))
    gen = generator(12, device)
    table.copy_(table[torch.randperm(len(lens), generator=gen, device=device)])
    lens_t.copy_(torch.tensor([7, 2048, 0, 1999], dtype=torch.int32, device=device))
    q.copy_(randn(q.shape, q.dtype, device, gen))
    graph.replay()
    torch.cuda.synchronize()
    assert spied and set(spied) == {len(lens)}
    _assert_scores(got, q, weights, cache, table, lens_t)


def test_batch_invariant_rows():
    # The batch-invariant table takes the kernel: a row's scores alone equal its scores among 63 other rows.
    device = _hopper()
    lens = [3000 - 37 * i for i in range(64)]
    q, weights, cache, table, lens_t = _inputs(lens, 64, torch.bfloat16, device, seed=5)
    batch = v4_invariant.invariant_index_scores(q, weights, cache, table, lens_t, weight_scale=0.25)
    for t in (0, 17, 63):
        alone = v4_invariant.invariant_index_scores(q[t:t + 1], weights[t:t + 1], cache, table[t:t + 1],
                                                    lens_t[t:t + 1], weight_scale=0.25)
        assert torch.equal(alone[0], batch[t])


def test_benchmark_shape(spied):
    # V3.2's decode at batch 64 x 32K: 132 x 4 programs of 63 tiles, every run across a row boundary somewhere.
    device = _hopper()
    rows, context = 64, 32768
    gen = generator(2, device)
    cache = randn((rows * context // 64 + 1, 64, DIM), torch.bfloat16, device, gen)
    table = (torch.randperm(rows * context // 64, generator=gen, device=device) + 1).to(torch.int32).view(rows, -1)
    q = randn((rows, HEADS, DIM), torch.bfloat16, device, gen)
    weights = randn((rows, HEADS), torch.float32, device, gen, scale=HEADS ** -0.5)
    lens = torch.full((rows,), context, dtype=torch.int32, device=device)
    lens[::5] = torch.randint(1, context, (13,), generator=gen, device=device).to(torch.int32)
    got = tri.index_scores(q, weights, cache, table, lens)
    assert spied == [rows] and sm_count(device) > 0
    twin = tri.index_scores(q, weights, cache, table, lens, config=TWIN)
    assert torch.equal(got, twin)
    # The oracle over a few rows (float64 over 32K keys a row).
    for t in (0, 5, 63):
        _assert_scores(got[t:t + 1], q[t:t + 1], weights[t:t + 1], cache, table[t:t + 1], lens[t:t + 1])
