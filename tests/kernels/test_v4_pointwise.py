"""The Triton partial rope and unweighted RMS norm of DeepSeek-V4 against the torch reference ops."""

from __future__ import annotations

import pytest
import torch

from support.kernel_cases import assert_close, generator, randn, strided
from mla_func.kernels.reference import v4_attention as ref
from mla_func.kernels.triton.v4_norm import unit_rms
from mla_func.kernels.triton.v4_rope import rope_tail


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("inverse", [False, True])
@pytest.mark.parametrize("shape, half", [((5, 6, 32), 4), ((7, 48), 8), ((3, 2, 16), 8), ((2, 70, 16), 4)])
def test_rope_tail_equals_the_reference(device, dtype, inverse, shape, half):
    gen = generator(len(shape) * 10 + half, device)
    x = randn(shape, dtype, device, gen)
    angles = torch.rand((shape[0], *([1] * (len(shape) - 2)), half), generator=gen, device=device) * 6
    got = rope_tail(x, angles.cos(), angles.sin(), inverse=inverse)
    want = ref.rope_tail(x.double(), angles.cos().double(), angles.sin().double(), inverse=inverse)
    assert got.dtype == dtype and got.shape == x.shape
    assert_close(got, want, dtype)
    nope = shape[-1] - 2 * half
    assert torch.equal(got[..., :nope], x[..., :nope])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(5, 6, 32), (7, 48)])
def test_rope_tail_reads_tables_at_positions(device, dtype, shape):
    # The tables' rows at each token's position, read in the op, rotate as the gathered angles do.
    gen = generator(shape[-1] + len(shape), device)
    x = randn(shape, dtype, device, gen)
    angles = torch.rand((40, 8), generator=gen, device=device) * 6
    positions = torch.randint(0, 40, (shape[0],), generator=gen, device=device)
    gathered = angles[positions].view(shape[0], *([1] * (len(shape) - 2)), 8)
    for inverse in (False, True):
        got = rope_tail(x, angles.cos(), angles.sin(), positions=positions.to(torch.int32), inverse=inverse)
        want = ref.rope_tail(x.double(), angles.cos().double(), angles.sin().double(), positions=positions,
                             inverse=inverse)
        assert_close(got, want, dtype)
        assert torch.equal(got, rope_tail(x, gathered.cos(), gathered.sin(), inverse=inverse))
    with pytest.raises(ValueError, match="positions"):
        rope_tail(x, angles.cos(), angles.sin(), positions=positions[:-1])
    with pytest.raises(ValueError, match="positions"):
        rope_tail(x, angles.cos(), angles.sin(), positions=positions.float())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rope_tail_after_unit_rms_equals_the_two_ops(device, dtype):
    # V4's queries: normalised per head, then rotated, in one launch.
    gen = generator(17, device)
    x = randn((3, 5, 48), dtype, device, gen, scale=4.0)
    angles = torch.rand((9, 8), generator=gen, device=device) * 6
    positions = torch.tensor([8, 0, 4], device=device)
    got = rope_tail(x, angles.cos(), angles.sin(), positions=positions, unit_rms_eps=1e-6)
    two_ops = rope_tail(unit_rms(x, 1e-6), angles.cos(), angles.sin(), positions=positions)
    want = ref.rope_tail(x.double(), angles.cos().double(), angles.sin().double(), positions=positions,
                         unit_rms_eps=1e-6)
    assert_close(got, want, dtype)
    assert_close(got, two_ops, dtype)   # the same roundings; only the sum of squares' order differs


def test_rope_tail_of_strided_input_and_bad_angles(device):
    gen = generator(3, device)
    x = strided(randn((4, 3, 16), torch.float32, device, gen), gen)
    angles = torch.rand((4, 1, 4), generator=gen, device=device)
    torch.testing.assert_close(rope_tail(x, angles.cos(), angles.sin()), ref.rope_tail(x, angles.cos(), angles.sin()))
    with pytest.raises(ValueError, match="cos, sin"):
        rope_tail(x, angles.cos().expand(4, 3, 4), angles.sin().expand(4, 3, 4))
    # No tokens (an empty segment): an empty result of x's shape.
    assert rope_tail(x[:0], angles.cos()[:0], angles.sin()[:0]).shape == (0, 3, 16)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(4, 3, 32), (3, 4 * 1100), (0, 8)])
def test_unit_rms_equals_the_reference(device, dtype, shape):
    gen = generator(shape[-1], device)
    x = randn(shape, dtype, device, gen, scale=3.0)
    got = unit_rms(x, 1e-6)
    want = ref.unit_rms(x.double(), 1e-6)
    assert got.dtype == dtype and got.shape == x.shape
    assert_close(got, want, dtype)
