"""Triton radix-select top-k of indexer scores against a plain-torch oracle (a stable sort)."""

from __future__ import annotations

import pytest
import torch

from support.kernel_cases import generator, strided
from mla_func.kernels.triton import dsa_topk as tri
from mla_func.kernels.triton import dsa_topk_row as row_topk


def oracle_top_k(scores: torch.Tensor, key_lens: torch.Tensor, k: int) -> torch.Tensor:
    """[T, L] scores, [T] key_lens -> [T, k] int32: the k best visible positions, ascending, -1 after.

    A stable descending sort keeps equal scores in position order, so ties go to
    the lower position; hidden positions sort after every visible one of equal
    score (they all sit at higher positions) and are cut off by the count.
    """
    num_rows, num_cols = scores.shape
    out = torch.full((num_rows, k), -1, dtype=torch.int32, device=scores.device)
    positions = torch.arange(num_cols, device=scores.device)
    lens = key_lens.long().clamp(0, num_cols)
    # +0.0 makes -0.0 a plain zero for the sort as well (it compares equal already).
    visible = torch.where(positions[None, :] < lens[:, None], scores + 0.0, float("-inf"))
    order = torch.sort(visible, dim=1, descending=True, stable=True).indices[:, :k]
    for t in range(num_rows):
        n = min(int(lens[t]), k)
        out[t, :n] = order[t, :n].sort().values.to(torch.int32)
    return out


@pytest.fixture(params=tri.TOP_K_PATHS)
def path(request):
    """Every path: one program holding a row in registers, the radix passes a launch each, and
    the radix passes in one launch (a row one chunk in the interpreter, which runs programs in turn)."""
    return request.param


def _check(scores, key_lens, k, **kwargs):
    got = tri.top_k_indices(scores, key_lens, k=k, **kwargs)
    expected = oracle_top_k(scores, key_lens, k)
    assert got.dtype == torch.int32 and got.shape == (scores.shape[0], k)
    torch.testing.assert_close(got, expected, atol=0, rtol=0)
    return got


def _lens(values, device):
    return torch.tensor(values, dtype=torch.int32, device=device)


@pytest.mark.parametrize("k", [1, 7, 16, 33])
def test_random_scores(k, device, path):
    gen = generator(k, device)
    scores = torch.randn((6, 150), generator=gen, device=device)
    # Longer than k, exactly k, shorter than k, a padded row, all of L, one key.
    _check(scores, _lens([150, k, max(1, k - 3), 0, 97, 1], device), k, path=path)


def test_ties_go_to_lower_positions(device, path):
    gen = generator(1, device)
    # Few distinct values: the k-th score is shared by many positions, and the
    # refinement runs through all four bytes before ties are broken by position.
    ints = torch.randint(0, 4, (5, 200), generator=gen, device=device).float()
    lens = _lens([200, 150, 64, 9, 0], device)
    got = _check(ints, lens, 24, path=path)
    assert torch.all(got[:3] >= 0) and torch.all(got[3, 9:] == -1)


@pytest.mark.parametrize("num_chunks", [1, 3, 8])
def test_chunk_counts_agree(num_chunks, device):
    # Ties and selections spread over several chunks: each chunk's first slot and
    # first tie rank come from the chunks before it; chunks past a row's keys are empty.
    gen = generator(10 + num_chunks, device)
    ints = torch.randint(0, 3, (4, 260), generator=gen, device=device).float()
    ints[1] = torch.randn(260, generator=gen, device=device)
    default_chunks = num_chunks == tri.top_k_num_chunks(4, 260, device)
    workspace = tri.top_k_workspace(4, 260, device, k=50) if default_chunks else None
    got = tri.top_k_indices(ints, _lens([260, 255, 40, 0], device), k=50, num_chunks=num_chunks,
                            workspace=workspace)
    torch.testing.assert_close(got, oracle_top_k(ints, _lens([260, 255, 40, 0], device), 50), atol=0, rtol=0)


@pytest.mark.parametrize("seed", range(6))
def test_random_shapes_and_distributions(seed, device, path):
    # Random k, lengths, chunk counts and score distributions (continuous, few
    # values, zeros of both signs, a wide exponent range) against the oracle.
    gen = generator(100 + seed, device)
    num_rows = int(torch.randint(1, 6, (1,), generator=gen, device=device))
    num_cols = int(torch.randint(1, 300, (1,), generator=gen, device=device))
    k = int(torch.randint(1, 80, (1,), generator=gen, device=device))
    kind = seed % 3
    if kind == 0:
        scores = torch.randn((num_rows, num_cols), generator=gen, device=device)
    elif kind == 1:
        scores = torch.randint(-1, 3, (num_rows, num_cols), generator=gen, device=device).float() * -0.0
        scores += torch.randint(0, 2, (num_rows, num_cols), generator=gen, device=device).float()
    else:
        scores = torch.exp(torch.randn((num_rows, num_cols), generator=gen, device=device) * 20)
    lens = torch.randint(0, num_cols + 1, (num_rows,), generator=gen, device=device).to(torch.int32)
    chunks = int(torch.randint(1, 6, (1,), generator=gen, device=device))
    if path == "passes":
        got = tri.top_k_indices(scores, lens, k=k, num_chunks=chunks)
    else:
        got = tri.top_k_indices(scores, lens, k=k, path=path)
    torch.testing.assert_close(got, oracle_top_k(scores, lens, k), atol=0, rtol=0)


def test_all_equal_row_takes_the_first_positions(device, path):
    scores = torch.full((2, 90), 0.5, device=device)
    got = _check(scores, _lens([90, 40], device), 10, path=path)
    assert got[0].tolist() == list(range(10))


def test_negative_zero_ties_with_zero(device, path):
    # relu(q.k) = 0 times a negative head weight is -0.0: it must tie with 0.0.
    scores = torch.zeros((3, 70), device=device)
    scores[:, ::2] = -0.0
    scores[1, 50:] = 1.0
    scores[2, 5] = -1.0
    got = _check(scores, _lens([70, 70, 70], device), 12, path=path)
    assert got[0].tolist() == list(range(12))


def test_negative_and_infinite_visible_scores(device, path):
    gen = generator(2, device)
    scores = -torch.rand((3, 80), generator=gen, device=device) * 100
    scores[0, 10:] = float("-inf")       # visible -inf scores are still candidates, taken in order
    scores[1, ::3] = float("inf")
    scores[2, :40] = float("-inf")
    _check(scores, _lens([15, 80, 60], device), 12, path=path)


def test_context_shorter_than_k_lists_every_position(device, path):
    gen = generator(3, device)
    scores = torch.randn((3, 64), generator=gen, device=device)
    got = _check(scores, _lens([5, 0, 64], device), 80, path=path)
    assert got[0, :5].tolist() == list(range(5)) and torch.all(got[0, 5:] == -1)
    assert torch.all(got[1] == -1)
    assert got[2, :64].tolist() == list(range(64)) and torch.all(got[2, 64:] == -1)


def test_key_lens_past_the_row_are_clamped(device, path):
    gen = generator(4, device)
    scores = torch.randn((2, 40), generator=gen, device=device)
    got = tri.top_k_indices(scores, _lens([1000, -3], device), k=8, path=path)
    torch.testing.assert_close(got, oracle_top_k(scores, _lens([40, 0], device), 8), atol=0, rtol=0)


def test_strided_scores_and_preallocated_out(device, path):
    gen = generator(5, device)
    scores = strided(torch.randn((4, 100), generator=gen, device=device), gen)
    lens = strided(_lens([100, 3, 77, 0], device), gen)
    out = torch.full((4, 20), 99, dtype=torch.int32, device=device)
    got = _check(scores, lens, 20, out=out, path=path)
    assert got.data_ptr() == out.data_ptr()


def test_bits_of_close_scores(device, path):
    # Scores that differ only in the last mantissa bits force every radix pass.
    base = torch.full((1, 128), 1.0, device=device)
    base = base + torch.arange(128, device=device).flip(0)[None, :] * 2.0 ** -23
    base[0, ::2] = base[0, 1]
    _check(base, _lens([128], device), 31, path=path)


def test_rejects_bad_inputs(device):
    scores = torch.zeros(2, 10, device=device)
    lens = torch.zeros(2, dtype=torch.int32, device=device)
    with pytest.raises(ValueError, match="k"):
        tri.top_k_indices(scores, lens, k=0)
    with pytest.raises(ValueError, match="scores"):
        tri.top_k_indices(scores.half(), lens, k=4)
    with pytest.raises(ValueError, match="key_lens"):
        tri.top_k_indices(scores, lens[:1], k=4)
    with pytest.raises(ValueError, match="key_lens"):
        tri.top_k_indices(scores, lens.long(), k=4)
    with pytest.raises(ValueError, match="out"):
        tri.top_k_indices(scores, lens, k=4, out=torch.zeros(2, 5, dtype=torch.int32, device=device))
    with pytest.raises(ValueError, match="workspace"):
        tri.top_k_indices(scores, lens, k=4, num_chunks=1,
                          workspace=torch.zeros(2, 4, 1, 256, dtype=torch.int32, device=device))
    with pytest.raises(ValueError, match="num_chunks"):
        tri.top_k_indices(scores, lens, k=4, num_chunks=0)
    with pytest.raises(ValueError, match="num_chunks"):
        tri.top_k_indices(scores, lens, k=4, num_chunks=121)
    with pytest.raises(ValueError, match="block"):
        tri.top_k_indices(scores, lens, k=4, config=tri.TopKConfig(block=1 << 16, num_warps=4))


def test_chunk_count_is_static(device):
    a = tri.top_k_num_chunks(64, 128 * 1024, device)
    assert a == tri.top_k_num_chunks(64, 128 * 1024, device) >= 1
    assert tri.top_k_num_chunks(1, 10, device) == 1
    # Per pass: the chunk histograms, then the row's state; the synced path's chunks add
    # into the row's histogram of each pass, and trade their counts in a plane more.
    assert tri.top_k_workspace(3, 100, device, path="passes", k=8).shape == (
        3, 4, tri.top_k_num_chunks(3, 100, device, path="passes") + 1, 256)
    assert tri.top_k_workspace(3, 100, device, path="synced", k=8).shape == (3, 5, 1, 256)


@pytest.mark.gpu
@pytest.mark.parametrize("ties", [False, True])
@pytest.mark.parametrize("num_rows, num_cols, path", [
    (64, 128 * 1024, "passes"), (1, 128 * 1024, "passes"), (64, 32 * 1024, "passes"), (512, 4096, "passes"),
    (64, 128 * 1024, "synced"), (8, 128 * 1024 + 64, "synced"), (1, 128 * 1024, "synced"), (64, 32 * 1024, "synced"),
    (64, 32 * 1024, "row"), (1, 32 * 1024, "row"), (512, 4096, "row"), (64, 16 * 1024 - 3, "row"),
    (64, 128 * 1024, "filtered"), (8, 128 * 1024 + 64, "filtered"), (1, 128 * 1024, "filtered"),
    (64, 32 * 1024, "filtered"), (128, 16 * 1024 + 1, "filtered")])
def test_gpu_real_sizes(ties, num_rows, num_cols, path):
    # Decode rows at 128K and 32K, one row in the most chunks, prompt-like rows in one
    # chunk each; rows held in registers up to the longest that fits, and an odd length;
    # the passes in one launch over as many chunks as stay resident.
    device = torch.device("cuda")
    gen = generator(7 + ties, device)
    k = 2048
    if ties:
        # Sums of a few relu'd heads: many exact zeros and repeated values.
        scores = torch.randint(-2, 6, (num_rows, num_cols), generator=gen, device=device).clamp(min=0).float()
    else:
        scores = torch.randn((num_rows, num_cols), generator=gen, device=device)
    lens = torch.randint(1, num_cols + 1, (num_rows,), generator=gen, device=device).to(torch.int32)
    lens[:4] = torch.tensor([num_cols, 0, 1, k], dtype=torch.int32)[:num_rows]
    _check(scores, lens, k, path=path)


@pytest.mark.gpu
@pytest.mark.parametrize("num_cols", [32768, 32768 + 64, 36864])
def test_gpu_row_resident_whole_rows_reaching_a_candidate(num_cols):
    # Every key reaching both candidates of a round: the two counts fill their 32-bit word
    # (a sum that only a GPU's 32-bit accumulator overflows; the interpreter's is wider).
    device = torch.device("cuda")
    gen = generator(30, device)
    scores = torch.full((3, num_cols), 1e38, device=device)
    scores[1] = (torch.rand(num_cols, generator=gen, device=device) + 1) * 1e30
    scores[2] = float("inf")
    _check(scores, _lens([num_cols, num_cols, num_cols - 1], device), 2048, path="row")


def test_row_resident_rows_at_the_register_limit(device):
    # The longest row one program holds (32K keys and a 4K tail beside them), at V3.2's
    # k: a continuous row, one whose k-th score is shared far past k, and one of equal
    # huge scores, where every candidate of the first rounds counts the whole row (the
    # two counts of a round share one 32-bit word).
    gen = generator(20, device)
    num_cols = row_topk.ROW_MAX_COLS
    scores = torch.randn((3, num_cols), generator=gen, device=device)
    scores[1] = torch.randint(0, 40, (num_cols,), generator=gen, device=device).float()
    scores[2] = 1e38
    _check(scores, _lens([num_cols, num_cols - 5, num_cols], device), 2048, path="row")
    # A decode row at 32K context: the power of two and a block more.
    _check(scores[:2, :32768 + 67], _lens([32768 + 67, 32768 + 1], device), 2048, path="row")


def test_row_path_and_the_default_choice(device):
    scores = torch.zeros(2, row_topk.ROW_MAX_COLS + 1, device=device)
    lens = torch.zeros(2, dtype=torch.int32, device=device)
    with pytest.raises(ValueError, match=str(row_topk.ROW_MAX_COLS)):
        tri.top_k_indices(scores, lens, k=4, path="row")
    with pytest.raises(ValueError, match="num_chunks"):
        tri.top_k_indices(scores[:, :10], lens, k=4, path="row", num_chunks=2)
    # Short rows go to one program each, and rows that fit when there are at least 3/4 as
    # many as multiprocessors; longer rows in one launch on a GPU when few tiles fall to
    # each resident program, else one a program where they fit and are at least 3/8 as
    # many as multiprocessors, else a launch per pass.
    assert row_topk.row_top_k_fits(row_topk.ROW_MAX_COLS) and not row_topk.row_top_k_fits(row_topk.ROW_MAX_COLS + 1)
    assert tri.top_k_path(1, 8192, device) == "row"
    assert tri.top_k_path(1000, 16384 + 64, device) == "row"
    longest = row_topk.ROW_MAX_COLS
    long_rows = "synced" if device.type == "cuda" else "passes"
    assert tri.top_k_path(1, longest, device) == tri.top_k_path(1, longest + 1, device) == long_rows
    assert tri.top_k_path(10_000, longest, device) == "row"
    assert tri.top_k_path(100_000, longest + 1, device) == "passes"
    if device.type == "cuda":
        # Few rows: a 4K tile per 8-warp program; more rows: up to three 2K tiles per 4-warp one.
        assert tri.top_k_config(device, 8, 128 * 1024, "synced") == tri.TopKConfig(4096, 8)
        assert tri.top_k_config(device, 64, 32 * 1024 + 64, "synced") == tri.TopKConfig(2048, 4)
    got = tri.top_k_indices(scores, lens + 6, k=4)
    assert got.tolist() == [[0, 1, 2, 3]] * 2
    with pytest.raises(ValueError, match="path"):
        tri.top_k_indices(scores, lens, k=4, path="sorted")


def test_synced_rows_wait_only_for_resident_chunks(device):
    # The one-launch path needs a row's chunks resident together: the interpreter runs
    # programs one after another, so there a row is one chunk, and more is refused by name.
    scores = torch.randn(3, 300, device=device)
    lens = _lens([300, 200, 0], device)
    config = tri.top_k_config(device)
    most = tri.synced_max_chunks(3, device, config.num_warps, config.max_registers)
    assert most >= 1 and tri.top_k_num_chunks(3, 300, device, path="synced") <= most
    if device.type != "cuda":
        assert most == 1
        with pytest.raises(ValueError, match="num_chunks"):
            tri.top_k_indices(scores, lens, k=5, path="synced", num_chunks=2)
    _check(scores, lens, 5, path="synced")
    # A chunk of one tile keeps its keys in registers from the first pass to the emit; ties
    # broken by position there too.
    _check(scores, lens, 5, path="synced", config=tri.TopKConfig(block=512, num_warps=4))
    ints = torch.randint(0, 3, (3, 300), generator=generator(41, device), device=device).float()
    _check(ints, lens, 50, path="synced", config=tri.TopKConfig(block=512, num_warps=4))


@pytest.mark.gpu
def test_gpu_synced_histograms_count_every_bucket_key_once():
    # Rows of four values refine through all four passes. A program waits until its row's
    # histogram of a pass adds up to the bucket's size: a chunk's counts added twice (an
    # atomic taken by every thread that holds a bin) would end the wait early with a wrong
    # digit, and one missing would never end it. A row that needs no pass adds nothing.
    device = torch.device("cuda")
    gen = generator(40, device)
    num_rows, num_cols, k = 8, 64 * 1024, 2048
    scores = torch.randint(0, 4, (num_rows, num_cols), generator=gen, device=device).float()
    lens = _lens([num_cols] * (num_rows - 1) + [k], device)
    assert tri.top_k_num_chunks(num_rows, num_cols, device, path="synced") > 1
    workspace = tri.top_k_workspace(num_rows, num_cols, device, path="synced", k=k)
    got = tri.top_k_indices(scores, lens, k=k, path="synced", workspace=workspace)
    torch.testing.assert_close(got, oracle_top_k(scores, lens, k), atol=0, rtol=0)
    histograms = workspace[:, :4, 0].sum(-1)                                     # [rows, passes]
    # Pass p's bucket: the keys whose first p bytes are the k-th key's (scores >= 0 key as
    # their bits with the sign bit set).
    keys = scores[:-1].view(torch.int32).long() + (1 << 31)
    kth_key = keys.sort(dim=1, descending=True).values[:, k - 1:k]
    bucket = [((keys >> (32 - 8 * p)) == (kth_key >> (32 - 8 * p))).sum(1) for p in range(4)]
    assert histograms[:-1].tolist() == torch.stack(bucket, 1).tolist()
    assert histograms[-1].tolist() == [0] * 4
    # The chunks' final counts: keys above the k-th value and those equal to it, the row's.
    kth = scores[:-1].sort(dim=1, descending=True).values[:, k - 1:k]
    traded = workspace[:-1, 4, 0].sum(-1)
    assert traded.tolist() == ((scores[:-1] >= kth).sum(1)).tolist()
