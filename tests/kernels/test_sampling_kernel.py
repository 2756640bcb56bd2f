"""Triton gumbel_max (the fused Gumbel-max draw) against the reference, token for token."""

from __future__ import annotations

import pytest
import torch

from support.kernel_cases import generator, strided
from mla_func.kernels import ops_for
from mla_func.kernels.reference import sampling as ref_sampling
from mla_func.kernels.triton import sampling

# Temperatures around every edge: greedy (0, below and at MIN_TEMPERATURE), tiny, ordinary, huge.
TEMPERATURES = [0.0, 1e-6, ref_sampling.MIN_TEMPERATURE, 3e-5, 0.05, 0.7, 1.0, 1.3, 5.0, 1e3, 1e6]


def _keys(num_rows: int, gen: torch.Generator, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    # Seeds and positions over the whole int64 range, the sign bit included, where a signed
    # shift or compare would differ from the unsigned hash.
    seeds = torch.randint(-(1 << 63), (1 << 63) - 1, (num_rows,), generator=gen, device=device)
    positions = torch.randint(0, 1 << 40, (num_rows,), generator=gen, device=device)
    seeds[0], positions[0] = (1 << 63) - 1, (1 << 62) + 5
    return seeds, positions


def _rows(num_rows: int, vocab: int, dtype: torch.dtype, seed: int, device: torch.device
          ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Fresh logits [N, V] with greedy and sampled rows mixed, and ties in the greedy rows' maxima."""
    gen = generator(seed, device)
    logits = (torch.randn((num_rows, vocab), generator=gen, device=device) * 4).to(dtype)
    picks = torch.randint(0, len(TEMPERATURES), (num_rows,), generator=gen, device=device)
    temperature = torch.tensor(TEMPERATURES, device=device)[picks]
    temperature[0] = 0.0
    if num_rows > 1:
        temperature[1] = 1.0
    for row in range(num_rows):
        # The row's maximum repeated at several places (a block boundary included): the first wins.
        if vocab > 2 and temperature[row] < ref_sampling.MIN_TEMPERATURE:
            ties = torch.randint(0, vocab, (3,), generator=gen, device=device).tolist() + [vocab - 1]
            logits[row, ties] = logits[row].max() + 1
    seeds, positions = _keys(num_rows, gen, device)
    return logits, temperature, seeds, positions


def _reference_scores(logits, temperature, seeds, positions):
    """What the reference takes the argmax of, row by row: raw logits (greedy) or logits / T + g."""
    logits = logits.float()
    greedy = temperature < ref_sampling.MIN_TEMPERATURE
    gumbel = -torch.log(-torch.log(ref_sampling.uniform_noise(seeds, positions, logits.shape[1])))
    sampled = logits / torch.where(greedy, 1.0, temperature)[:, None] + gumbel
    return torch.where(greedy[:, None], logits, sampled)


def _assert_same_tokens(logits, temperature, seeds, positions):
    got = sampling.gumbel_max(logits, temperature, seeds, positions)
    expected = ref_sampling.gumbel_max(logits, temperature, seeds, positions)
    assert got.dtype == torch.int64 and got.shape == expected.shape
    assert torch.equal(got, expected), (got != expected).nonzero().flatten().tolist()


def test_noise_bits_are_the_reference_noise(device):
    gen = generator(0, device)
    seeds, positions = _keys(9, gen, device)
    seeds[1], seeds[2], positions[2] = 0, -1, 0
    for vocab in (1, 63, 64, 65, 333):
        got = sampling.uniform_noise(seeds, positions, vocab)
        expected = ref_sampling.uniform_noise(seeds, positions, vocab)
        assert torch.equal(got.view(torch.int32), expected.view(torch.int32))


def test_scores_are_the_reference_scores(device):
    # Bit for bit: the division, both logs and the sum rounded as torch rounds them (on the CPU
    # interpreter the logs are numpy's, which may differ from torch's in a rare last bit).
    logits, temperature, seeds, positions = _rows(16, 257, torch.bfloat16, seed=3, device=device)
    got = sampling.scores(logits, temperature, seeds, positions)
    expected = _reference_scores(logits, temperature, seeds, positions)
    if device.type == "cuda":
        assert torch.equal(got, expected)
    else:
        torch.testing.assert_close(got, expected, atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("num_rows,vocab", [(1, 1), (3, 2), (5, 63), (7, 64), (9, 65), (13, 300), (4, 1000)])
def test_tokens_are_the_reference_tokens(dtype, num_rows, vocab, device):
    _assert_same_tokens(*_rows(num_rows, vocab, dtype, seed=num_rows * 1000 + vocab, device=device))


def test_ties_nan_and_minus_inf_as_torch_argmax(device):
    vocab = 150
    logits = torch.randn((6, vocab), device=device)
    logits[0] = float("-inf")                         # all -inf: index 0, greedy or sampled
    logits[1] = float("-inf")
    logits[2, [7, 100]] = float("nan")                # the first NaN wins, greedy or sampled
    logits[3, [70, 140]] = float("nan")
    logits[4, 64:] = float("-inf")                    # a sampled row whose later blocks are all -inf
    logits[5, [3, 65, 129]] = 50.0                    # a greedy tie across blocks
    temperature = torch.tensor([0.0, 1.0, 0.0, 0.8, 1.5, 0.0], device=device)
    seeds, positions = _keys(6, generator(1, device), device)
    got = sampling.gumbel_max(logits, temperature, seeds, positions)
    assert got[[0, 1, 2, 3, 5]].tolist() == [0, 0, 7, 70, 3]
    _assert_same_tokens(logits, temperature, seeds, positions)


def test_strided_inputs_and_no_rows(device):
    logits, temperature, seeds, positions = _rows(6, 97, torch.float32, seed=5, device=device)
    gen = generator(6, device)
    _assert_same_tokens(strided(logits, gen), strided(temperature, gen), strided(seeds, gen),
                        strided(positions, gen))
    empty = sampling.gumbel_max(logits[:0], temperature[:0], seeds[:0], positions[:0])
    assert empty.shape == (0,) and empty.dtype == torch.int64


def test_rejects_bad_arguments(device):
    logits, temperature, seeds, positions = _rows(3, 10, torch.float32, seed=7, device=device)
    with pytest.raises(ValueError, match=r"logits: expected shape \(N, V\)"):
        sampling.gumbel_max(logits[0], temperature, seeds, positions)
    with pytest.raises(ValueError, match="V = 0"):
        sampling.gumbel_max(logits[:, :0], temperature, seeds, positions)
    with pytest.raises(ValueError, match="logits: expected dtype"):
        sampling.gumbel_max(logits.double(), temperature, seeds, positions)
    with pytest.raises(ValueError, match=r"temperature: expected shape \(3,\)"):
        sampling.gumbel_max(logits, temperature[:2], seeds, positions)
    with pytest.raises(ValueError, match="temperature: expected dtype"):
        sampling.gumbel_max(logits, temperature.double(), seeds, positions)
    with pytest.raises(ValueError, match="seeds: expected dtype"):
        sampling.gumbel_max(logits, temperature, seeds.int(), positions)
    with pytest.raises(ValueError, match="positions: expected dtype"):
        sampling.gumbel_max(logits, temperature, seeds, positions.int())
    with pytest.raises(ValueError, match="vocab_size"):
        sampling.uniform_noise(seeds, positions, 0)


def test_tables_bind_the_kernel():
    assert ops_for("torch").sampling.gumbel_max is ref_sampling.gumbel_max
    # Row-local: the batch-invariant table keeps the kernel.
    for batch_invariant in (False, True):
        assert ops_for("triton", batch_invariant=batch_invariant).sampling.gumbel_max is sampling.gumbel_max


def test_sample_through_either_table_gives_the_same_tokens(device):
    from mla_func.serving.sampling import sample

    logits, temperature, seeds, positions = _rows(8, 130, torch.bfloat16, seed=9, device=device)
    top_k = torch.tensor([0, 0, 5, 0, 1, 0, 3, 0], device=device)
    top_p = torch.tensor([1.0, 0.5, 1.0, 1.0, 1.0, 0.9, 0.3, 1.0], device=device)
    for use_top_k_top_p in (False, True):
        k, p = (top_k, top_p) if use_top_k_top_p else (torch.zeros_like(top_k), torch.ones_like(top_p))
        args = (logits, temperature, k, p, seeds, positions)
        expected = sample(*args, use_top_k_top_p=use_top_k_top_p)
        got = sample(*args, use_top_k_top_p=use_top_k_top_p, ops=ops_for("triton"))
        assert torch.equal(got, expected)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("vocab", [4096, 102400, 129280])
@pytest.mark.parametrize("num_rows", [1, 7, 64, 256])
def test_tokens_are_the_reference_tokens_on_gpu(dtype, vocab, num_rows):
    device = torch.device("cuda")
    _assert_same_tokens(*_rows(num_rows, vocab, dtype, seed=vocab + num_rows, device=device))
    if dtype == torch.float32:
        # Every row sampled at the ordinary temperatures, where the noise decides most tokens.
        logits, _, seeds, positions = _rows(num_rows, vocab, dtype, seed=vocab - num_rows, device=device)
        _assert_same_tokens(logits, torch.full((num_rows,), 1.0, device=device), seeds, positions)
        noise = sampling.uniform_noise(seeds, positions, vocab)
        assert torch.equal(noise, ref_sampling.uniform_noise(seeds, positions, vocab))
        temperature = torch.full((num_rows,), 0.7, device=device)
        got = sampling.scores(logits, temperature, seeds, positions)
        assert torch.equal(got, _reference_scores(logits, temperature, seeds, positions))
