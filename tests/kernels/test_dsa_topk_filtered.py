"""The filtered top-k (`dsa_topk_filtered`): both of its outcomes, a candidate list that holds the row's
top-k and the fallback over the whole row, against the stable-sort oracle."""

from __future__ import annotations

import math

import pytest
import torch

from support.kernel_cases import generator
from mla_func.kernels.triton import dsa_topk as tri
from mla_func.kernels.triton import dsa_topk_filtered as filtered
from test_dsa_topk import oracle_top_k


def _run(scores, key_lens, k, cap, sample, num_chunks):
    """(indices, per row the candidate list's length) of the filtered path at the given sizes."""
    num_rows, num_cols = scores.shape
    block = 32 if scores.device.type == "cpu" else 1024
    chunk_len = math.ceil(math.ceil(num_cols / num_chunks) / block) * block
    num_chunks = math.ceil(num_cols / chunk_len)
    width = filtered.filtered_workspace_width(num_chunks, filtered.filtered_region(chunk_len, cap), 4, 256)
    workspace = torch.full((num_rows, width), -7, dtype=torch.int32, device=scores.device)
    out = torch.full((num_rows, k), 99, dtype=torch.int32, device=scores.device)
    filtered.filtered_top_k(scores, key_lens, k, out, workspace, num_chunks, chunk_len, block=block, num_warps=4,
                            cap=cap, sample=sample, segment=8, stages=2, select_warps=4, fallback_block=block, passes=4,
                            bins=256, radix_bits=8, first_sparse_pass=2, sparse_share=16, fill_block=64, use_pdl=False)
    return out, workspace[:, 1:1 + num_chunks].sum(dim=1)


@pytest.mark.parametrize("num_chunks", [1, 3, 7])
def test_candidate_list_holds_the_top_k(num_chunks, device):
    # Continuous scores far longer than the cap: the sampled threshold keeps between k
    # and cap keys, so the selection runs on the list, over chunks whose candidates
    # follow each other in position order.
    gen = generator(40 + num_chunks, device)
    scores = torch.randn((3, 2000), generator=gen, device=device)
    lens = torch.tensor([2000, 1500, 1999], dtype=torch.int32, device=device)
    got, listed = _run(scores, lens, 8, cap=256, sample=256, num_chunks=num_chunks)
    assert torch.all((listed >= 8) & (listed <= 256)), listed
    torch.testing.assert_close(got, oracle_top_k(scores, lens, 8), atol=0, rtol=0)


def test_list_with_ties_at_the_kth_key_takes_the_first_positions(device):
    # The k-th score shared by positions on both sides of chunk borders: the list keeps
    # them in position order, and the search takes the first ones.
    gen = generator(50, device)
    scores = torch.randn((2, 1200), generator=gen, device=device)
    scores[:, 100:1100:50] = 3.0
    lens = torch.tensor([1200, 1200], dtype=torch.int32, device=device)
    got, listed = _run(scores, lens, 12, cap=256, sample=256, num_chunks=5)
    assert torch.all((listed >= 12) & (listed <= 256)), listed
    torch.testing.assert_close(got, oracle_top_k(scores, lens, 12), atol=0, rtol=0)


def test_fallback_when_the_list_overflows_or_falls_short(device):
    # An all-equal row puts every key at the threshold (a list past the cap). A row whose
    # only large scores are the sampled ones, fewer than k, puts the threshold above the
    # k-th key (a list shorter than k). Both rows fall back to the radix select over the
    # whole row.
    sample = 32
    scores = torch.full((2, 900), 0.25, device=device)
    scores[1] = -1.0
    i = torch.arange(sample, device=device)
    sampled = (i // 8) * 900 // (sample // 8) + i % 8
    scores[1, sampled] = torch.linspace(1, 2, sample, device=device)
    lens = torch.tensor([900, 900], dtype=torch.int32, device=device)
    got, listed = _run(scores, lens, 40, cap=128, sample=sample, num_chunks=4)
    assert listed[0] > 128 and listed[1] < 40, listed
    torch.testing.assert_close(got, oracle_top_k(scores, lens, 40), atol=0, rtol=0)


def test_short_rows_list_every_key(device):
    # Rows of at most cap keys keep them all (threshold 0); rows shorter than k list them
    # all, then -1; a padded row lists none.
    gen = generator(51, device)
    scores = torch.randn((4, 100), generator=gen, device=device)
    lens = torch.tensor([100, 5, 0, 64], dtype=torch.int32, device=device)
    got, listed = _run(scores, lens, 16, cap=128, sample=64, num_chunks=3)
    assert listed.tolist() == [100, 5, 0, 64]
    torch.testing.assert_close(got, oracle_top_k(scores, lens, 16), atol=0, rtol=0)


def test_rejects_bad_sizes(device):
    scores = torch.zeros(1, 64, device=device)
    lens = torch.ones(1, dtype=torch.int32, device=device)
    with pytest.raises(ValueError, match="cap"):
        _run(scores, lens, 8, cap=96, sample=32, num_chunks=1)
    with pytest.raises(ValueError, match="sample"):
        _run(scores, lens, 8, cap=64, sample=24, num_chunks=1)
    with pytest.raises(ValueError, match="sample"):
        _run(scores, lens, 8, cap=64, sample=128, num_chunks=1)
    with pytest.raises(ValueError, match="k"):
        tri.top_k_workspace(2, 64, device, path="filtered", k=0)


@pytest.mark.gpu
@pytest.mark.parametrize("num_rows, num_cols, k", [(64, 32 * 1024 + 64, 2048), (8, 128 * 1024 + 64, 2048),
                                                   (64, 16 * 1024, 512)])
def test_gpu_default_sizes_take_the_list(num_rows, num_cols, k):
    # At V3.2's and V4's sizes, on continuous scores, the default cap and sample keep
    # every row's list between k and the cap: the fast outcome, not the fallback.
    device = torch.device("cuda")
    gen = generator(60, device)
    scores = torch.randn((num_rows, num_cols), generator=gen, device=device)
    lens = torch.full((num_rows,), num_cols, dtype=torch.int32, device=device)
    workspace = tri.top_k_workspace(num_rows, num_cols, device, path="filtered", k=k)
    got = tri.top_k_indices(scores, lens, k=k, workspace=workspace, path="filtered")
    torch.testing.assert_close(got, oracle_top_k(scores, lens, k), atol=0, rtol=0)
    chunks = tri.top_k_num_chunks(num_rows, num_cols, device, path="filtered")
    listed = workspace.view(num_rows, -1)[:, 1:1 + chunks].sum(dim=1)
    cap = tri.filter_sizes(k, device)[0]
    assert torch.all((listed >= k) & (listed <= cap)), listed
