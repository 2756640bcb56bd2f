"""Block-scaled FP8 products in the batch-invariant Triton table: a row's bits depend on that row alone.

The default table's FP8 ops pick their path by the row count (one row: the one-row product; up to
16 rows the weight stream; more the block GEMM; few (token, expert) pairs: the per-pair MoE with float32
atomics), so a row's last bits follow its batch. The invariant table takes every row count through the
block GEMM and the tiled MoE with one configuration of K steps: each row gives the same bits alone, among
other rows, at another place and in batches of other sizes, and the op computes the reference's function.
"""

from __future__ import annotations

import pytest
import torch

from support.kernel_cases import assert_close, generator, randn
from mla_func.checkpoint.fp8 import block_quantize
from mla_func.kernels import ops_for
from mla_func.kernels.quantized import BlockFP8Weight

# Bitwise comparisons across batch compositions: the interpreter's dot must sum each row in one order.
pytestmark = pytest.mark.row_invariant_dots

ROWS = 23
# Alone (two places), a run crossing a 16-row tile, the last rows, and every row but the first.
SUBSETS = (slice(0, 1), slice(5, 6), slice(3, 19), slice(20, 23), slice(1, 23))


def _pair(shape, gen, device) -> BlockFP8Weight:
    """A block-quantized random weight [..., N, K] in 32 x 32 blocks (partial at the edges)."""
    full = torch.randn(shape, generator=gen, device=device) * shape[-1] ** -0.5
    pairs = [block_quantize(w, (32, 32)) for w in full.view(-1, *shape[-2:])]
    return BlockFP8Weight(torch.stack([v for v, _ in pairs]).view(shape),
                          torch.stack([s for _, s in pairs]).view(*shape[:-2], *pairs[0][1].shape), (32, 32))


def _rows_of(op, *rows: torch.Tensor) -> list[tuple[slice, torch.Tensor]]:
    """op over every subset of the rows: (the subset, its result rows)."""
    return [(sl, op(*(r[sl] for r in rows))) for sl in SUBSETS]


def _assert_invariant(op, *rows: torch.Tensor) -> torch.Tensor:
    full = op(*rows)
    for sl, got in _rows_of(op, *rows):
        assert torch.equal(got, full[sl]), sl
    order = torch.randperm(ROWS, generator=torch.Generator().manual_seed(0)).to(rows[0].device)
    assert torch.equal(op(*(r[order] for r in rows)), full[order]), "shuffled rows"
    return full


def _differs_somewhere(op, *rows: torch.Tensor) -> bool:
    full = op(*rows)
    return any(not torch.equal(got, full[sl]) for sl, got in _rows_of(op, *rows))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_fp8_linear_and_norm_linear_rows_are_batch_invariant(dtype, device):
    gen = generator(3, device)
    x = randn((ROWS, 72), dtype, device, gen)
    residual = randn((ROWS, 72), dtype, device, gen)
    norm = 1.0 + 0.1 * randn((72,), dtype, device, gen)
    w = _pair((40, 72), gen, device)
    table, default, ref = ops_for("triton", batch_invariant=True), ops_for("triton"), ops_for("torch")
    y = _assert_invariant(lambda a: table.dense.linear(a, w), x)
    assert_close(y, ref.dense.linear(x.double(), w), dtype)
    # float32 out: every bit of the accumulator kept.
    _assert_invariant(lambda a: table.dense.linear(a, w, out_dtype=torch.float32), x)
    normed = _assert_invariant(lambda a, r: torch.cat(table.dense.rms_norm_linear(a, norm, 1e-6, w, r), dim=1),
                               x, residual)
    want_y, want_sum = ref.dense.rms_norm_linear(x.double(), norm.double(), 1e-6, w, residual.double())
    assert_close(normed[:, :40], want_y, dtype)
    assert torch.equal(normed[:, 40:], (x.double() + residual.double()).to(dtype))
    if dtype == torch.float32:
        # What the invariant table replaces: the default table's rows follow the row count. (In the
        # interpreter, bf16 rows' products are exact in float32 and its paths happen to agree.)
        assert _differs_somewhere(lambda a: default.dense.linear(a, w, out_dtype=torch.float32), x)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_fp8_fused_moe_rows_are_batch_invariant(dtype, device):
    gen = generator(4, device)
    experts, top_k = 6, 3
    x = randn((ROWS, 64), dtype, device, gen)
    w13, w2 = _pair((experts, 2 * 48, 64), gen, device), _pair((experts, 64, 48), gen, device)
    weights, ids = torch.rand((ROWS, experts), generator=gen, device=device).topk(top_k, dim=1)
    weights = (weights / weights.sum(1, keepdim=True)).float()
    ids[2, 1] = -1                                    # a dropped slot
    table, ref = ops_for("triton", batch_invariant=True), ops_for("torch")
    out = _assert_invariant(lambda a, tw, ti: table.moe.fused_moe(a, w13, w2, tw, ti), x, weights, ids)
    assert_close(out, ref.moe.fused_moe(x.double(), w13, w2, weights, ids), dtype)
    _assert_invariant(lambda a, tw, ti: table.moe.fused_moe(a, w13, w2, tw, ti, out_dtype=torch.float32),
                      x, weights, ids)
