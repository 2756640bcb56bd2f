"""The Triton clamped-SwiGLU experts against the torch reference op."""

from __future__ import annotations

import pytest
import torch

from support.kernel_cases import assert_close, generator, randn
from mla_func.kernels.reference.v4_moe import clamped_experts as reference
from mla_func.kernels.triton.v4_experts import clamped_experts


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tokens, top_k", [(3, 2), (40, 2), (5, 1)])
def test_clamped_experts_equal_the_reference(device, dtype, tokens, top_k):
    gen = generator(tokens * 10 + top_k, device)
    experts, hidden, inter = 6, 32, 16
    x = randn((tokens, hidden), dtype, device, gen)
    w13 = randn((experts, 2 * inter, hidden), dtype, device, gen, scale=0.6)
    w2 = randn((experts, hidden, inter), dtype, device, gen, scale=0.3)
    ids = torch.stack([torch.randperm(experts, generator=gen, device=device)[:top_k] for _ in range(tokens)])
    weights = torch.rand((tokens, top_k), generator=gen, device=device).to(dtype)
    ids[0] = -1                              # a padded row takes no expert
    weights[0] = 0
    limit = 1.5                              # well inside the pre-activations' spread: the clamp matters
    got = clamped_experts(x, w13, w2, weights, ids, limit=limit)
    want = reference(x.double(), w13.double(), w2.double(), weights.double(), ids, limit=limit)
    assert got.dtype == dtype
    assert bool((got[0] == 0).all())
    assert_close(got, want, dtype)
    unclamped = reference(x.double(), w13.double(), w2.double(), weights.double(), ids, limit=1e9)
    assert not torch.allclose(want, unclamped, rtol=1e-3, atol=1e-3), "the clamp should change the result"


@pytest.mark.gpu
@pytest.mark.parametrize("tokens", [1, 64, 300])
def test_real_sizes_on_the_gpu(tokens):
    """v4-mini's experts: D 4096, I 2048, 8 routed, top 6, swiglu_limit 10, bf16."""
    device = torch.device("cuda")
    gen = generator(tokens, device)
    experts, hidden, inter, top_k = 8, 4096, 2048, 6
    x = randn((tokens, hidden), torch.bfloat16, device, gen)
    w13 = randn((experts, 2 * inter, hidden), torch.bfloat16, device, gen, scale=hidden ** -0.5 * 8)
    w2 = randn((experts, hidden, inter), torch.bfloat16, device, gen, scale=inter ** -0.5)
    ids = torch.stack([torch.randperm(experts, generator=gen, device=device)[:top_k] for _ in range(tokens)])
    weights = torch.rand((tokens, top_k), generator=gen, device=device).to(torch.bfloat16)
    got = clamped_experts(x, w13, w2, weights, ids, limit=10.0)
    want = reference(x.double(), w13.double(), w2.double(), weights.double(), ids, limit=10.0)
    # The kernel rounds the pre-activations and the SwiGLU to bf16 (0.4% each) before 2048-term sums:
    # judged over the whole output, not element by element near 0.
    assert float((got.double() - want).norm() / want.norm()) <= 1e-2
