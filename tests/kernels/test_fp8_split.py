"""`fp8_split.split_rows`: bf16 rows written exactly as the sum of two scaled e4m3 parts."""

from __future__ import annotations

import pytest
import torch

from support.kernel_cases import generator, randn, strided
from mla_func.kernels.triton.fp8_split import split_rows


def _joined(parts, unscales, group, k_in):
    return sum(parts[p].double() * unscales[p].double().repeat_interleave(group, 1)[:, :k_in] for p in range(2))


@pytest.mark.parametrize("k_in", [128, 300])   # whole groups; a partial last group
def test_split_rows_is_exact(k_in, device):
    gen = generator(k_in, device)
    # Within a group magnitudes over ten binades (exact: within 2^12 of the group's largest), groups of a row
    # and rows apart by up to eighteen decades; a zero group, a row of zeros, strided.
    magnitude = 2.0 ** (-10 * torch.rand((6, k_in), generator=gen, device=device))
    sign = torch.where(randn((6, k_in), torch.float32, device, gen) < 0, -1.0, 1.0)
    decades = 3.0 * (torch.arange(k_in, device=device) // 128) - 6.0 * (torch.arange(6, device=device)[:, None] % 3)
    x = (sign * magnitude * 10.0 ** decades).to(torch.bfloat16)
    x[2, :128] = 0.0
    x[4] = 0.0
    x = strided(x, gen)
    parts, unscales = split_rows(x, 128)
    assert parts.dtype == torch.float8_e4m3fn and parts.shape == (2, 6, k_in)
    assert unscales.shape == (2, 6, -(-k_in // 128)) and unscales.stride(1) == 1
    # Powers of two, so that undoing them is exact.
    assert torch.all(torch.frexp(unscales)[0] == 0.5)
    assert torch.equal(_joined(parts, unscales, 128, k_in), x.double())
    assert torch.all(parts[:, 4].float() == 0)


def test_split_rows_keeps_small_values_within_their_groups_bound(device):
    # Values 2^-20 below their group's largest: rounded, by at most 2^-18 of the largest (the module's bound).
    x = torch.full((1, 128), 2.0 ** -20, device=device)
    x[0, 0] = 1.0
    x[0, 1:64] *= torch.linspace(1, 1.9, 63, device=device)
    x = x.to(torch.bfloat16)
    parts, unscales = split_rows(x, 128)
    err = (_joined(parts, unscales, 128, 128) - x.double()).abs().max()
    assert 0 < err <= 2.0 ** -18


def test_split_rows_marks_a_group_with_nan_or_inf(device):
    x = torch.ones((3, 256), device=device, dtype=torch.bfloat16)
    x[0, 5] = float("inf")
    x[1, 200] = float("nan")
    parts, unscales = split_rows(x, 128)
    joined = _joined(parts, unscales, 128, 256)
    assert torch.isnan(joined[0, :128]).all() and torch.equal(joined[0, 128:], x[0, 128:].double())
    assert torch.isnan(joined[1, 128:]).all() and torch.equal(joined[1, :128], x[1, :128].double())
    assert torch.equal(joined[2], x[2].double())


def test_split_rows_rejects_what_it_cannot_split(device):
    with pytest.raises(ValueError, match="bfloat16"):
        split_rows(torch.ones((2, 128), device=device), 128)
    with pytest.raises(ValueError, match="power of two"):
        split_rows(torch.ones((2, 128), device=device, dtype=torch.bfloat16), 96)
