"""The Triton RoPE kernel against the reference."""

from __future__ import annotations

import pytest
import torch

from mla_func.kernels.reference.rope import partial_rope as ref_partial_rope
from mla_func.kernels.reference.rope import rope as ref_rope
from mla_func.kernels.triton.rope import partial_rope, rope


@pytest.mark.parametrize("interleaved", [True, False])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("num_heads, rope_dim", [(3, 16), (16, 64)])
def test_rope_matches_reference(device, interleaved, dtype, num_heads, rope_dim):
    gen = torch.Generator(device="cpu").manual_seed(num_heads * 7 + rope_dim)
    tokens = 5
    # q_pe as the model has it: a strided slice of the full query.
    q = torch.randn(tokens, num_heads, 24 + rope_dim, generator=gen).to(device=device, dtype=dtype)
    q_pe = q[..., 24:]
    latent = torch.randn(tokens, 40 + rope_dim, generator=gen).to(device=device, dtype=dtype)
    k_pe = latent[:, 40:]
    assert not q_pe.is_contiguous() and not k_pe.is_contiguous()
    angles = torch.rand(100, rope_dim // 2, generator=gen) * 6.0
    cos, sin = (0.9 * angles.cos()).to(device), (0.9 * angles.sin()).to(device)
    positions = torch.tensor([0, 7, 99, 7, 31], device=device)
    q_out, k_out = rope(q_pe, k_pe, positions, cos, sin, interleaved=interleaved)
    q_ref, k_ref = ref_rope(q_pe, k_pe, positions, cos, sin, interleaved=interleaved)
    tol = dict(rtol=0, atol=1e-6) if dtype == torch.float32 else dict(rtol=1e-2, atol=1e-2)
    torch.testing.assert_close(q_out, q_ref, **tol)
    torch.testing.assert_close(k_out, k_ref, **tol)


def test_rope_refuses_odd_shapes(device):
    q = torch.zeros(2, 4, 12, device=device)
    k = torch.zeros(2, 12, device=device)
    table = torch.zeros(8, 6, device=device)
    with pytest.raises(ValueError, match="power of two"):
        rope(q, k, torch.zeros(2, dtype=torch.long, device=device), table, table, interleaved=True)
    with pytest.raises(ValueError, match="k_pe"):
        rope(torch.zeros(2, 4, 16, device=device), k, torch.zeros(2, dtype=torch.long, device=device),
             torch.zeros(8, 8, device=device), torch.zeros(8, 8, device=device), interleaved=True)


@pytest.mark.parametrize("interleaved", [True, False])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("num_heads, dim, rotary_dim", [(3, 24, 8), (16, 128, 64), (4, 32, 32)])
def test_partial_rope_matches_reference(device, interleaved, dtype, num_heads, dim, rotary_dim):
    # The indexer's query and key: the leading rotary_dim dims rotated, the rest copied.
    gen = torch.Generator(device="cpu").manual_seed(num_heads * 5 + dim + rotary_dim)
    tokens = 6
    q = torch.randn(tokens, num_heads, dim + 8, generator=gen).to(device=device, dtype=dtype)[..., 8:]
    k = torch.randn(tokens, dim + 5, generator=gen).to(device=device, dtype=dtype)[:, 5:]
    angles = torch.rand(50, rotary_dim // 2, generator=gen) * 6.0
    cos, sin = angles.cos().to(device), angles.sin().to(device)
    positions = torch.tensor([3, 0, 49, 3, 17, 8], device=device)
    q_out, k_out = partial_rope(q, k, positions, cos, sin, rotary_dim=rotary_dim, interleaved=interleaved)
    q_ref, k_ref = ref_partial_rope(q, k, positions, cos, sin, rotary_dim=rotary_dim, interleaved=interleaved)
    assert q_out.shape == q.shape and k_out.shape == k.shape and q_out.is_contiguous()
    tol = dict(rtol=0, atol=1e-6) if dtype == torch.float32 else dict(rtol=1e-2, atol=1e-2)
    torch.testing.assert_close(q_out, q_ref, **tol)
    torch.testing.assert_close(k_out, k_ref, **tol)
    # The dims past rotary_dim are copies, bit for bit.
    assert torch.equal(q_out[..., rotary_dim:], q[..., rotary_dim:])
    assert torch.equal(k_out[:, rotary_dim:], k[:, rotary_dim:])


def test_partial_rope_refuses_bad_rotary_dims(device):
    q, k = torch.zeros(2, 4, 16, device=device), torch.zeros(2, 16, device=device)
    positions = torch.zeros(2, dtype=torch.long, device=device)
    table = torch.zeros(8, 12, device=device)
    with pytest.raises(ValueError, match="rotary_dim"):
        partial_rope(q, k, positions, table, table, rotary_dim=24, interleaved=False)
    with pytest.raises(ValueError, match="rotary_dim"):
        partial_rope(q, k, positions, table[:, :3], table[:, :3], rotary_dim=6, interleaved=False)
