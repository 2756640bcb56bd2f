"""V4's grouped output projection (the inverse rope folded into the product) against the torch reference."""

from __future__ import annotations

import pytest
import torch

from kernel_cases import assert_close, generator, randn, strided
from mla_func.kernels.reference import v4_attention as ref
from mla_func.kernels.triton.v4_output import GroupedOutputConfig, grouped_output, grouped_output_config
from mla_func.kernels.triton.v4_rope import rope_tail


def _inputs(rows, heads, head_dim, half, groups, group_out, dtype, device, seed):
    gen = generator(seed, device)
    out = randn((rows, heads, head_dim), dtype, device, gen)
    o_a = randn((groups * group_out, heads // groups * head_dim), dtype, device, gen, scale=0.1)
    angles = torch.rand((50, half), generator=gen, device=device) * 6
    positions = torch.randint(0, 50, (rows,), generator=gen, device=device, dtype=torch.int32)
    return out, o_a, angles.cos(), angles.sin(), positions


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("rows, heads, head_dim, half, groups, group_out",
                         [(5, 4, 32, 4, 2, 16), (1, 4, 32, 4, 2, 16), (17, 8, 32, 8, 4, 24), (3, 2, 64, 16, 1, 40)])
def test_grouped_output_equals_the_reference(device, dtype, rows, heads, head_dim, half, groups, group_out):
    out, o_a, cos, sin, positions = _inputs(rows, heads, head_dim, half, groups, group_out, dtype, device,
                                            rows + heads + groups)
    got = grouped_output(out, o_a, cos, sin, positions, groups=groups)
    want = ref.grouped_output(out.double(), o_a.double(), cos.double(), sin.double(), positions, groups=groups)
    assert got.dtype == dtype and got.shape == (rows, groups, group_out)
    assert_close(got, want, dtype)
    # The tail is rounded to out's dtype before the product, as the two ops round it.
    two_ops = ref.grouped_output(out, o_a, cos, sin, positions, groups=groups)
    assert_close(got, two_ops, dtype)


@pytest.mark.parametrize("split_k", [1, 2, 4])
@pytest.mark.parametrize("block_k", [16, 32, 128])
def test_grouped_output_split_k_and_tiles(device, split_k, block_k):
    # Every K split sums to the same product; padded weight rows (group_out not a tile multiple) stay out.
    # Heads of 64 with 16 rotated: K steps inside a head's plain channels, ending on its tail, or two heads wide.
    out, o_a, cos, sin, positions = _inputs(6, 4, 64, 8, 2, 20, torch.bfloat16, device, 11)
    want = ref.grouped_output(out.double(), o_a.double(), cos.double(), sin.double(), positions, groups=2)
    config = GroupedOutputConfig(16, block_k, split_k, 1)
    got = grouped_output(out, o_a, cos, sin, positions, groups=2, config=config)
    assert_close(got, want, torch.bfloat16)
    on_gpu = device.type == "cuda"
    assert grouped_output_config(2, 20, 128, on_gpu).split_k > 1
    assert grouped_output_config(8, 1024, 4096, on_gpu).split_k == 1     # v4-mini's 128 tiles


def test_grouped_output_strided_int64_positions_and_fallbacks(device):
    gen = generator(5, device)
    out, o_a, cos, sin, positions = _inputs(4, 4, 32, 4, 2, 16, torch.bfloat16, device, 5)
    want = ref.grouped_output(out.double(), o_a.double(), cos.double(), sin.double(), positions, groups=2)
    got = grouped_output(strided(out, gen), o_a, cos, sin, positions.long(), groups=2)
    assert_close(got, want, torch.bfloat16)
    # float32 and more rows than the row tiles take go through rope_tail and the batched product.
    out32, o_a32 = out.float(), o_a.float()
    torch.testing.assert_close(grouped_output(out32, o_a32, cos, sin, positions, groups=2),
                               ref.grouped_output(out32, o_a32, cos, sin, positions, groups=2))
    many, _, _, _, many_pos = _inputs(70, 4, 32, 4, 2, 16, torch.bfloat16, device, 6)
    unrotated = rope_tail(many, cos, sin, positions=many_pos, inverse=True)
    assert torch.equal(grouped_output(many, o_a, cos, sin, many_pos, groups=2),
                       torch.einsum("tgi,goi->tgo", unrotated.view(70, 2, 64), o_a.view(2, 16, 64)))
    empty = grouped_output(out[:0], o_a, cos, sin, positions[:0], groups=2)
    assert empty.shape == (0, 2, 16)


def test_grouped_output_refuses_bad_shapes(device):
    out, o_a, cos, sin, positions = _inputs(4, 4, 32, 4, 2, 16, torch.bfloat16, device, 7)
    with pytest.raises(ValueError, match="groups"):
        grouped_output(out, o_a, cos, sin, positions, groups=3)
    with pytest.raises(ValueError, match="o_a"):
        grouped_output(out, o_a[:, :32], cos, sin, positions, groups=2)
    with pytest.raises(ValueError, match="o_a"):
        grouped_output(out, o_a.float(), cos, sin, positions, groups=2)
    with pytest.raises(ValueError, match="positions"):
        grouped_output(out, o_a, cos, sin, positions[:-1], groups=2)
    with pytest.raises(ValueError, match="cos, sin"):
        grouped_output(out, o_a, cos[:, None], sin[:, None], positions, groups=2)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("rows", [1, 17, 64])
def test_grouped_output_real_size_on_the_gpu(rows):
    # v4-mini's layer: 64 heads of 512 (64 rotated), 8 groups of rank 1024.
    device = torch.device("cuda")
    out, o_a, cos, sin, positions = _inputs(rows, 64, 512, 32, 8, 1024, torch.bfloat16, device, rows)
    got = grouped_output(out, o_a, cos, sin, positions, groups=8)
    want = ref.grouped_output(out.double(), o_a.double(), cos.double(), sin.double(), positions, groups=8)
    assert_close(got, want, torch.bfloat16)
    assert_close(got, ref.grouped_output(out, o_a, cos, sin, positions, groups=8), torch.bfloat16)
