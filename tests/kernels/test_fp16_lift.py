"""`fp16_lift.lift_to_fp16`: bf16 lines written in fp16 times a power of two, exactly."""

from __future__ import annotations

import pytest
import torch
import triton
import triton.language as tl

from support.kernel_cases import generator
from mla_func.kernels.triton.fp16_lift import lift_to_fp16


@triton.jit
def _lift_kernel(x_ptr, x16_ptr, unscale_ptr, A: tl.constexpr, B: tl.constexpr, AXIS: tl.constexpr):
    offs = tl.arange(0, A)[:, None] * B + tl.arange(0, B)[None, :]
    x16, unscale = lift_to_fp16(tl.load(x_ptr + offs), AXIS)
    tl.store(x16_ptr + offs, x16)
    if AXIS == 1:
        tl.store(unscale_ptr + tl.arange(0, A), unscale)
    else:
        tl.store(unscale_ptr + tl.arange(0, B), unscale)


def _lift(x: torch.Tensor, axis: int) -> tuple[torch.Tensor, torch.Tensor]:
    a, b = x.shape
    x16 = torch.empty(a, b, dtype=torch.float16, device=x.device)
    unscale = torch.empty(a if axis == 1 else b, dtype=torch.float32, device=x.device)
    _lift_kernel[(1,)](x, x16, unscale, A=a, B=b, AXIS=axis)
    return x16, unscale


@pytest.mark.parametrize("axis", [0, 1])
def test_lift_is_exact_and_puts_each_line_largest_in_fp16_top_binade(axis, device):
    gen = generator(7, device)
    # Lines of very different magnitudes (2^-60 .. 2^60), each spanning 2^20 inside, one line of zeros,
    # one whose largest is bf16's largest.
    lines = torch.randn(16, 32, generator=gen, device=device) * torch.exp2(
        torch.randint(-10, 10, (16, 32), generator=gen, device=device).float())
    lines *= torch.exp2(torch.linspace(-60, 60, 16, device=device))[:, None]
    lines[3] = 0.0
    lines[5, 0] = torch.finfo(torch.bfloat16).max
    x = (lines if axis == 1 else lines.T.contiguous()).to(torch.bfloat16)
    x16, unscale = _lift(x, axis)
    back = x16.float() * (unscale[:, None] if axis == 1 else unscale[None, :])
    line_max = x.float().abs().amax(dim=axis)
    limit = (line_max[:, None] if axis == 1 else line_max[None, :]).expand_as(back)
    # Exact down to 2^-31 of the line's largest (the bf16-max line has values far below that: they round).
    exact = x.float().abs() >= limit * 2.0 ** -31
    assert bool((~exact).any()) and bool(exact.sum() > 400)
    assert torch.equal(back[exact], x.float()[exact])
    assert bool(((back - x.float()).abs() <= limit * 2.0 ** -39).all())
    largest = x16.float().abs().amax(dim=axis)
    busy = line_max > 0
    assert bool(((largest[busy] >= 2.0 ** 14) & (largest[busy] < 2.0 ** 15)).all())
    assert bool((unscale[~busy] == 1.0).all())
    # Every unscale is a power of two (its float32 mantissa bits are zero).
    assert bool(((unscale.view(torch.int32) & 0x7FFFFF) == 0).all())


def test_lift_passes_infinities_and_nan_through(device):
    x = torch.ones(16, 16, dtype=torch.bfloat16, device=device)
    x[2, 3] = float("inf")
    x[4, 1] = float("nan")
    x16, _ = _lift(x, 1)
    assert bool(torch.isinf(x16[2, 3])) and bool(torch.isnan(x16[4, 1]))
    assert bool(torch.isfinite(x16[0]).all())
