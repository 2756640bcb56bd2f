"""The FP8 leaf pair (`kernels.quantized`) and the ops that take it: reference math, w8a8, other tables."""

from __future__ import annotations

import pytest
import torch

from mla_func.checkpoint.fp8 import block_quantize
from mla_func.kernels.quantized import BlockFP8Weight, cat_rows, slice_block, split_heads, stack_experts
from mla_func.kernels.reference import linear as ref_linear
from mla_func.kernels.reference import moe as ref_moe
from mla_func.kernels.reference import w8a8
from mla_func.kernels.reference.fp8 import quantize_activations
from mla_func.kernels.registry import ops_for
from mla_func.pytree import tree_leaves

BLOCK = (128, 128)
# w8a8 against the dequantized-weight product: e4m3 rounds each activation by up to 2^-4 of its
# magnitude; over K random products the output's error is a few percent of its largest entry.
W8A8_TOL = 0.05
# The MoE quantizes twice (its input, then each expert's silu(gate) * up): twice the bound.
W8A8_MOE_TOL = 0.1


def _pair(n: int, k: int, seed: int, experts: int | None = None) -> tuple[BlockFP8Weight, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    if experts is None:
        w = torch.randn(n, k, generator=g) * k ** -0.5
        values, scales = block_quantize(w, BLOCK)
        pair = BlockFP8Weight(values, scales, BLOCK)
    else:
        pair = stack_experts([_pair(n, k, seed + e)[0] for e in range(experts)])  # type: ignore[assignment]
    return pair, pair.dequantize(torch.float32)


def _rel(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got - want).abs().max() / want.abs().max())


def test_the_pair_is_two_leaves_and_dequantizes_per_block():
    pair, dense = _pair(200, 300, seed=1)
    assert [t.dtype for t in tree_leaves(pair)] == [torch.float8_e4m3fn, torch.float32]
    assert pair.scale_inv.shape == (2, 3) and pair.nbytes == 200 * 300 + 6 * 4
    assert torch.equal(dense[130:, 260:], pair.values[130:, 260:].float() * pair.scale_inv[1, 2])


def test_a_malformed_pair_is_refused_naming_the_shapes():
    pair, _ = _pair(200, 300, seed=1)
    with pytest.raises(ValueError, match=r"scale_inv has shape \[2, 2\]"):
        BlockFP8Weight(pair.values, pair.scale_inv[:, :2], BLOCK)


@pytest.mark.parametrize("rows", [(160, 96), (128, 136, 16), (40,)])
def test_joined_and_cut_pairs_keep_every_value(rows):
    parts = [_pair(n, 150, seed=i) for i, n in enumerate(rows)]
    joined = cat_rows([p for p, _ in parts])
    assert isinstance(joined, BlockFP8Weight)
    assert torch.equal(joined.dequantize(torch.float32), torch.cat([d for _, d in parts]))
    start, stop = rows[0] // 2, min(rows[0] // 2 + 70, sum(rows))
    cut = slice_block(joined, -2, start, stop)
    assert torch.equal(cut.dequantize(torch.float32), torch.cat([d for _, d in parts])[start:stop])
    cols = slice_block(joined, -1, 67, 140)
    assert torch.equal(cols.dequantize(torch.float32), torch.cat([d for _, d in parts])[:, 67:140])


def test_the_activation_scale_format_travels_with_the_pair_and_mixed_ones_are_refused():
    """`activation_scale_fmt` is tree metadata that every joining, cutting and stacking keeps; pieces of one matrix
    or of one expert stack that disagree are refused by name, as is a format that does not exist."""
    pair, _ = _pair(200, 300, seed=3)
    assert pair.activation_scale_fmt == "fp32"
    rounded = BlockFP8Weight(pair.values, pair.scale_inv, BLOCK, "ue8m0")
    second, _ = _pair(72, 300, seed=4)
    second = BlockFP8Weight(second.values, second.scale_inv, BLOCK, "ue8m0")
    joined = cat_rows([rounded, second])
    stacked = stack_experts([rounded, rounded])
    pieces = [joined, slice_block(joined, -2, 100, 230), slice_block(joined, -1, 67, 140), stacked, stacked[1],
              rounded.to("cpu"), *split_heads(rounded, 2, (40, 60))]
    assert [p.activation_scale_fmt for p in pieces] == ["ue8m0"] * len(pieces)
    with pytest.raises(ValueError, match=r"cat_rows: .*\['fp32', 'ue8m0'\]"):
        cat_rows([pair, second])
    with pytest.raises(ValueError, match="stack_experts"):
        stack_experts([pair, rounded])
    with pytest.raises(ValueError, match="scale_fmt.*'e8m0'"):
        BlockFP8Weight(pair.values, pair.scale_inv, BLOCK, "e8m0")


def test_reference_linear_is_the_dequantized_product():
    pair, dense = _pair(200, 300, seed=2)
    x = torch.randn(5, 300)
    assert torch.equal(ref_linear.linear(x, pair), torch.nn.functional.linear(x, dense))
    assert torch.equal(ops_for("torch", batch_invariant=True).dense.linear(x, pair),
                       ops_for("torch", batch_invariant=True).dense.linear(x, dense))


def test_w8a8_linear_is_within_its_stated_tolerance_of_the_dequantized_product():
    pair, dense = _pair(300, 700, seed=3)
    x = torch.randn(9, 700)
    want = torch.nn.functional.linear(x, dense)
    got = w8a8.linear(x, pair)
    assert 0 < _rel(got, want) <= W8A8_TOL
    # the activations' quantization alone: their dequantized values reproduce the product
    xq, scales = quantize_activations(x, 128)
    assert xq.dtype == torch.float8_e4m3fn and scales.shape == (9, 6)
    x_back = xq.float() * scales.repeat_interleave(128, dim=1)[:, :700]
    assert torch.allclose(got, torch.nn.functional.linear(x_back, dense), rtol=1e-4, atol=1e-5)


def test_fused_moe_takes_stacked_pairs_and_w8a8_stays_within_tolerance():
    w13, w13_dense = _pair(2 * 136, 160, seed=4, experts=3)
    w2, w2_dense = _pair(160, 136, seed=9, experts=3)
    x = torch.randn(7, 160)
    topk_ids = torch.tensor([[0, 2], [1, -1], [2, 1], [0, 1], [-1, -1], [2, 0], [1, 2]])
    topk_weights = torch.rand(7, 2)
    want = ref_moe.fused_moe(x, w13_dense, w2_dense, topk_weights, topk_ids)
    assert torch.equal(ref_moe.fused_moe(x, w13, w2, topk_weights, topk_ids), want)
    assert torch.equal(ops_for("torch", batch_invariant=True).moe.fused_moe(x, w13, w2, topk_weights, topk_ids),
                       ops_for("torch", batch_invariant=True).moe.fused_moe(x, w13_dense, w2_dense, topk_weights,
                                                                           topk_ids))
    assert 0 < _rel(w8a8.fused_moe(x, w13, w2, topk_weights, topk_ids), want) <= W8A8_MOE_TOL
