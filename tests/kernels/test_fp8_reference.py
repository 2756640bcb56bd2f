"""The block-scaled FP8 reference: activation quantization, dequantized products, and w8a8 against them."""

from __future__ import annotations

import pytest
import torch

from support.kernel_cases import generator, randn
from mla_func.checkpoint.fp8 import block_dequantize, block_quantize
from mla_func.kernels.reference import fp8 as ref
from mla_func.kernels.reference import moe as ref_moe

# Quantizing the activations rounds each to e4m3's 3 fraction bits: a relative error of at most
# 2^-4 an element (about 2^-4 / sqrt(3) RMS), which over random-sign sums stays near that in the
# output's norm (the relative Frobenius error of w8a8 against dequantized-weight math). The MoE
# quantizes twice (x, then the activation), about sqrt(2) times that.
W8A8_RELATIVE_ERROR = 0.04
W8A8_MOE_RELATIVE_ERROR = 0.06


def _weight(n: int, k: int, gen: torch.Generator, block=(128, 128)) -> tuple[torch.Tensor, torch.Tensor]:
    return block_quantize(torch.randn((n, k), generator=gen) * k ** -0.5, block)


def _experts(e: int, n: int, k: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    pairs = [_weight(n, k, gen) for _ in range(e)]
    return torch.stack([v for v, _ in pairs]), torch.stack([s for _, s in pairs])


def _relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm())


@pytest.mark.parametrize("shape", [(3, 200), (5, 128), (2, 64)])
def test_quantize_activations(shape):
    gen = generator(0, torch.device("cpu"))
    x = randn(shape, torch.float32, "cpu", gen) * torch.logspace(-6, 3, shape[1])
    x[0, :128] = 0.0   # an all-zero group
    values, scales = ref.quantize_activations(x)
    groups = -(-shape[1] // 128)
    assert values.dtype == torch.float8_e4m3fn and values.shape == x.shape
    assert scales.dtype == torch.float32 and scales.shape == (shape[0], groups)
    assert torch.all(values[0, :128].float() == 0) and scales[0, 0] == ref.AMAX_FLOOR / ref.FP8_MAX
    back = values.float() * scales.repeat_interleave(128, dim=1)[:, :shape[1]]
    # Normal values keep 3 fraction bits (relative error <= 2^-4); subnormals are 2^-9 * scale apart.
    bound = torch.maximum(x.abs() * 2 ** -4, scales.repeat_interleave(128, dim=1)[:, :shape[1]] * 2 ** -10)
    assert torch.all((back - x).abs() <= bound * (1 + 1e-6))
    # Each group's largest magnitude maps onto 448.
    assert torch.all(values[1:].float().abs().amax(dim=1) == ref.FP8_MAX)


@pytest.mark.parametrize("shape", [(3, 200), (4, 128)])
def test_quantize_activations_ue8m0(shape):
    """DeepSeek's "ue8m0" scales: the power of two at or above max(|x|, 1e-4) times 1/448 (in float32)."""
    gen = generator(2, torch.device("cpu"))
    x = randn(shape, torch.float32, "cpu", gen) * torch.logspace(-6, 3, shape[1])
    x[0, :128] = 0.0                              # all zeros: the floor's scale
    x[1, :128] = 5e-5                             # below the floor: the floor's scale too
    values, scales = ref.quantize_activations(x, scale_fmt="ue8m0")
    groups = -(-shape[1] // 128)
    assert scales.shape == (shape[0], groups)
    mantissa, _ = torch.frexp(scales)
    assert torch.all(mantissa == 0.5)             # every scale a power of two
    amax = torch.nn.functional.pad(x.abs(), (0, groups * 128 - shape[1])).view(shape[0], groups, 128).amax(-1)
    floor = amax.clamp(min=1e-4) * torch.tensor(1 / 448, dtype=torch.float32)
    assert torch.all(scales >= floor) and torch.all(scales / 2 < floor)
    assert scales[0, 0] == scales[1, 0] == 2.0 ** -22
    back = values.float() * scales.repeat_interleave(128, dim=1)[:, :shape[1]]
    bound = torch.maximum(x.abs() * 2 ** -4, scales.repeat_interleave(128, dim=1)[:, :shape[1]] * 2 ** -10)
    assert torch.all((back - x).abs() <= bound * (1 + 1e-6))
    # A group's largest value lands in [224, 448] (224 once rounded), where "fp32" scales put it on 448.
    top = values[2:].float().abs().amax(dim=1)
    assert torch.all((top >= 224) & (top <= 448))
    with pytest.raises(ValueError, match="scale_fmt"):
        ref.quantize_activations(x, scale_fmt="ue4m3")


@pytest.mark.parametrize("block", [(128, 128), (64, 32)])
def test_dequantize_weight_is_the_checkpoint_format(block):
    values, scale_inv = _weight(200, 328, generator(1, torch.device("cpu")), block)
    for dtype in (torch.float32, torch.bfloat16):
        assert torch.equal(ref.dequantize_weight(values, scale_inv, block, dtype),
                           block_dequantize(values, scale_inv, dtype, block))
    with pytest.raises(ValueError, match="scale_inv"):
        ref.dequantize_weight(values, scale_inv[:-1], block)


@pytest.mark.parametrize("num_tokens, n, k", [(1, 136, 200), (7, 200, 328), (16, 256, 256)])
def test_fp8_linear_dequantized_and_w8a8(num_tokens, n, k):
    gen = generator(num_tokens, torch.device("cpu"))
    x = randn((num_tokens, k), torch.float32, "cpu", gen)
    values, scale_inv = _weight(n, k, gen)
    w = block_dequantize(values, scale_inv, torch.float64)
    dequantized = ref.fp8_linear(x.double(), values, scale_inv)
    torch.testing.assert_close(dequantized, x.double() @ w.T, rtol=1e-12, atol=1e-12)
    w8a8 = ref.fp8_linear(x.double(), values, scale_inv, w8a8=True)
    # w8a8 is exactly the product of the dequantized activations with the dequantized weight, both
    # taken exactly (the dequantized-weight product rounds w to float32 first).
    x_fp8, x_scales = ref.quantize_activations(x)
    x_back = x_fp8.double() * x_scales.double().repeat_interleave(128, dim=1)[:, :k]
    w_exact = values.double() * scale_inv.double().repeat_interleave(128, 0)[:n].repeat_interleave(128, 1)[:, :k]
    torch.testing.assert_close(w8a8, x_back @ w_exact.T, rtol=1e-12, atol=1e-12)
    assert _relative(w8a8, dequantized) < W8A8_RELATIVE_ERROR
    # float32 accumulation and a bf16 output round as stated.
    torch.testing.assert_close(ref.fp8_linear(x, values, scale_inv, w8a8=True), w8a8.float(), rtol=1e-5, atol=1e-5)
    out = ref.fp8_linear(x.bfloat16(), values, scale_inv, out_dtype=torch.float32)
    assert out.dtype == torch.float32 and out.shape == (num_tokens, n)


def _routing(num_tokens: int, num_experts: int, top_k: int, gen: torch.Generator):
    scores = torch.rand((num_tokens, num_experts), generator=gen)
    weights, ids = scores.topk(top_k, dim=1)
    ids[-1, 0] = -1   # a dropped slot
    return (weights / weights.sum(1, keepdim=True)).float(), ids


def test_fp8_fused_moe_is_the_moe_of_dequantized_experts():
    gen = generator(3, torch.device("cpu"))
    num_tokens, hidden, inter, num_experts = 6, 160, 96, 5
    x = randn((num_tokens, hidden), torch.float32, "cpu", gen)
    w13, s13 = _experts(num_experts, 2 * inter, hidden, gen)
    w2, s2 = _experts(num_experts, hidden, inter, gen)
    weights, ids = _routing(num_tokens, num_experts, 2, gen)
    got = ref.fp8_fused_moe(x.double(), w13, s13, w2, s2, weights, ids)
    expected = ref_moe.fused_moe(x.double(), ref.dequantize_weight(w13, s13, dtype=torch.float64),
                                 ref.dequantize_weight(w2, s2, dtype=torch.float64), weights.double(), ids)
    torch.testing.assert_close(got, expected, rtol=1e-10, atol=1e-10)
    w8a8 = ref.fp8_fused_moe(x.double(), w13, s13, w2, s2, weights, ids, w8a8=True)
    assert _relative(w8a8, got) < W8A8_MOE_RELATIVE_ERROR
    bf16 = ref.fp8_fused_moe(x.bfloat16(), w13, s13, w2, s2, weights, ids, w8a8=True)
    assert bf16.dtype == torch.bfloat16 and _relative(bf16, w8a8) < W8A8_MOE_RELATIVE_ERROR


def test_fp8_weight_checks_name_the_bad_value():
    values, scale_inv = _weight(64, 128, generator(4, torch.device("cpu")))
    x = torch.randn(2, 128)
    with pytest.raises(ValueError, match="float8_e4m3fn"):
        ref.fp8_linear(x, values.float(), scale_inv)
    with pytest.raises(ValueError, match="scale_inv"):
        ref.fp8_linear(x, values, scale_inv.double())
    with pytest.raises(ValueError, match="values"):
        ref.fp8_linear(torch.randn(2, 96), values, scale_inv)
