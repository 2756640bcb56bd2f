"""The Triton hyper-connection weights (gates and Sinkhorn) against the torch reference op."""

from __future__ import annotations

import pytest
import torch

from support.kernel_cases import generator
from mla_func.kernels.reference.v4_hc import hc_mix_weights as reference
from mla_func.kernels.triton.v4_hc import hc_mix_weights


@pytest.mark.parametrize("hc_mult, iters, tokens", [(4, 20, 37), (3, 5, 5), (4, 1, 1), (2, 7, 0)])
def test_hc_weights_equal_the_reference(device, hc_mult, iters, tokens):
    gen = generator(hc_mult * 100 + iters, device)
    width = (2 + hc_mult) * hc_mult
    mixes = torch.randn((tokens, width), generator=gen, device=device) * 2
    base = torch.randn((width,), generator=gen, device=device) * 0.5
    scale = 1 + 0.2 * torch.randn((3,), generator=gen, device=device)
    got = hc_mix_weights(mixes, base, scale, hc_mult=hc_mult, iters=iters, hc_eps=1e-6)
    want = reference(mixes.double(), base.double(), scale.double(), hc_mult=hc_mult, iters=iters, hc_eps=1e-6)
    for g, w in zip(got, want):
        assert g.dtype == torch.float32 and g.shape == w.shape
        torch.testing.assert_close(g.double(), w.double(), rtol=1e-5, atol=1e-6)
    if tokens and iters > 1:
        # Nearly doubly stochastic after Sinkhorn: columns sum to 1, rows close to it.
        torch.testing.assert_close(got[2].sum(dim=-2), torch.ones(tokens, hc_mult, device=device), rtol=1e-4,
                                   atol=1e-4)


def test_strided_mixes_and_bad_shapes(device):
    gen = generator(1, device)
    mixes = torch.randn((6, 48), generator=gen, device=device)[:, ::2]
    base, scale = torch.randn((24,), generator=gen, device=device), torch.ones(3, device=device)
    got = hc_mix_weights(mixes, base, scale, hc_mult=4, iters=3, hc_eps=1e-6)
    want = reference(mixes, base, scale, hc_mult=4, iters=3, hc_eps=1e-6)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError, match="mixes"):
        hc_mix_weights(mixes[:, :20], base, scale, hc_mult=4, iters=3, hc_eps=1e-6)
