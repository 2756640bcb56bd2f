"""The Triton few-row linear layer (a GEMV for decode), alone and after an RMSNorm, against the reference."""

from __future__ import annotations

import pytest
import torch

from support.kernel_cases import TOLERANCE, generator, randn, strided
from mla_func.kernels.reference.linear import linear as ref_linear
from mla_func.kernels.reference.linear import rms_norm_linear as ref_rms_norm_linear
from mla_func.kernels.reference.linear import logits_of
from mla_func.kernels.triton.linear import LINEAR_MAX_ROWS, linear, logits, rms_norm_linear
from mla_func.kernels.triton.linear_rows import (ROWS_MAX_ROWS, WIDE_ROWS_MAX_ROWS, RowsConfig, rows_config,
                                                 rows_linear, takes_rows)
from mla_func.kernels.triton.linear_widened import WIDENED_MAX_ROWS


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("num_rows", [1, 2, 3, LINEAR_MAX_ROWS, LINEAR_MAX_ROWS + 1])  # GEMV, then cuBLAS
@pytest.mark.parametrize("n_out, k_in", [(40, 200), (16, 64), (5, 7)])   # ragged column and K tiles included
def test_linear_matches_reference(dtype, num_rows, n_out, k_in, device):
    gen = generator(num_rows * 131 + n_out + k_in, device)
    x = randn((num_rows, k_in), dtype, device, gen)
    weight = randn((n_out, k_in), dtype, device, gen, scale=k_in ** -0.5)
    got = linear(x, weight)
    assert got.shape == (num_rows, n_out) and got.dtype == dtype
    torch.testing.assert_close(got.double(), ref_linear(x.double(), weight.double()), **TOLERANCE[dtype])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("num_rows", [2, 7, ROWS_MAX_ROWS, ROWS_MAX_ROWS + 1])  # tensor-core tiles, then cuBLAS
@pytest.mark.parametrize("n_out, k_in", [(40, 200), (300, 72), (5, 7)])
def test_linear_rows_match_reference(dtype, num_rows, n_out, k_in, device):
    # (40, 200): K split over programs (few column tiles), ragged K; (300, 72): one split, ragged columns.
    gen = generator(num_rows * 7 + n_out + k_in, device)
    x = randn((num_rows, k_in), dtype, device, gen)
    weight = randn((n_out, k_in), dtype, device, gen, scale=k_in ** -0.5)
    want = ref_linear(x.double(), weight.double())
    got = linear(strided(x, gen), strided(weight, gen))
    assert got.shape == (num_rows, n_out) and got.dtype == dtype
    torch.testing.assert_close(got.double(), want, **TOLERANCE[dtype])
    if num_rows <= ROWS_MAX_ROWS:   # the tiles themselves, where `linear` gives few rows of a small weight to the GEMV
        torch.testing.assert_close(rows_linear(strided(x, gen), weight).double(), want, **TOLERANCE[dtype])


def test_linear_takes_tiles_by_rows_weight_and_dtype():
    assert not takes_rows(1, 4096, 4096, torch.bfloat16)                 # one row: the GEMV
    assert not takes_rows(4, 1024, 4096, torch.bfloat16)                 # few rows of a small weight: the GEMV
    assert takes_rows(2, 2048, 4096, torch.bfloat16) and takes_rows(5, 8, 8, torch.float16)
    assert not takes_rows(ROWS_MAX_ROWS + 1, 2048, 4096, torch.bfloat16)  # cuBLAS
    assert not takes_rows(8, 2048, 4096, torch.float32)
    # More rows only of wide weights (an LM head), and at most WIDE_ROWS_MAX_ROWS.
    assert takes_rows(ROWS_MAX_ROWS + 1, 8192, 1024, torch.bfloat16)
    assert takes_rows(WIDE_ROWS_MAX_ROWS, 129280, 4096, torch.bfloat16)
    assert not takes_rows(WIDE_ROWS_MAX_ROWS + 1, 129280, 4096, torch.bfloat16)
    assert not takes_rows(WIDE_ROWS_MAX_ROWS, 8192, 1024, torch.float32)


@pytest.mark.parametrize("num_rows", [ROWS_MAX_ROWS + 1, 37, WIDE_ROWS_MAX_ROWS, WIDE_ROWS_MAX_ROWS + 1])
def test_linear_wide_weight_rows_match_reference(num_rows, device):
    # A weight of 8192 outputs: its rows take the tiles up to WIDE_ROWS_MAX_ROWS, then cuBLAS.
    gen = generator(num_rows, device)
    x = randn((num_rows, 24), torch.bfloat16, device, gen)
    weight = randn((8192, 24), torch.bfloat16, device, gen, scale=24 ** -0.5)
    want = ref_linear(x.double(), weight.double())
    got = linear(strided(x, gen), strided(weight, gen))
    assert got.shape == (num_rows, 8192) and got.dtype == torch.bfloat16
    torch.testing.assert_close(got.double(), want, **TOLERANCE[torch.bfloat16])
    if num_rows <= WIDE_ROWS_MAX_ROWS:
        torch.testing.assert_close(rows_linear(x, weight).double(), want, **TOLERANCE[torch.bfloat16])


def test_linear_rows_splits_sum_in_order(device):
    # Every split count gives the float32 sum rounded once; the rule splits few column tiles only.
    on_gpu = device.type == "cuda"
    assert rows_config(40, 200, on_gpu).split_k > 1 and rows_config(5000, 200, on_gpu).split_k == 1
    assert rows_config(8192, 1024, on_gpu, WIDE_ROWS_MAX_ROWS).split_k == 1
    gen = generator(11, device)
    x = randn((5, 256), torch.bfloat16, device, gen)
    weight = randn((24, 256), torch.bfloat16, device, gen, scale=0.0625)
    want = ref_linear(x.double(), weight.double())
    for split_k in (1, 2, 8):
        got = rows_linear(x, weight, RowsConfig(block_n=16, block_k=32, split_k=split_k, num_stages=1))
        torch.testing.assert_close(got.double(), want, **TOLERANCE[torch.bfloat16])
        assert torch.equal(got, rows_linear(x, weight, RowsConfig(16, 32, split_k, 1)))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("num_rows, n_out", [(1, 300), (5, 300), (5, 40), (20, 300), (20, 8192), (70, 300)])
def test_logits_are_the_product_widened(dtype, num_rows, n_out, device):
    # The LM head: the row tiles store float32 themselves (also after a K split), every other path
    # widens linear's output; either way the bits of `linear` widened, and float32 at least.
    gen = generator(num_rows + n_out, device)
    x = randn((num_rows, 64), dtype, device, gen)
    weight = randn((n_out, 64), dtype, device, gen, scale=0.125)
    got = logits(x, weight)
    assert got.dtype == torch.float32 and got.shape == (num_rows, n_out)
    assert torch.equal(got, linear(x, weight).float())
    torch.testing.assert_close(got.double(), ref_linear(x.double(), weight.double()), **TOLERANCE[dtype])
    assert torch.equal(logits_of(ref_linear)(x, weight), ref_linear(x, weight).float())
    assert logits_of(ref_linear)(x.double(), weight.double()).dtype == torch.float64
    if dtype != torch.float32 and takes_rows(num_rows, n_out, 64, dtype):
        assert torch.equal(rows_linear(x, weight, out_dtype=torch.float32), rows_linear(x, weight).float())


@pytest.mark.parametrize("num_rows", [2, LINEAR_MAX_ROWS + 3])
def test_linear_widened_output_and_strided_inputs(num_rows, device):
    # Router logits: bf16 inputs, float32 products and output.
    gen = generator(7 + num_rows, device)
    x = randn((num_rows, 96), torch.bfloat16, device, gen)
    weight = randn((24, 96), torch.bfloat16, device, gen, scale=0.1)
    got = linear(strided(x, gen), strided(weight, gen), out_dtype=torch.float32)
    assert got.dtype == torch.float32
    want = ref_linear(x, weight, out_dtype=torch.float32)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("num_rows", [1, 3, 5, 16, 37, WIDENED_MAX_ROWS, WIDENED_MAX_ROWS + 1])
@pytest.mark.parametrize("x_dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("n_out, k_in", [(64, 200), (5, 7)])
def test_linear_float32_weight_on_wider_or_narrower_rows(num_rows, x_dtype, n_out, k_in, device):
    # A float32 router (or indexer head) weight on the model's activations: both widened,
    # every product and sum in float32, whichever kernel the row count takes.
    gen = generator(num_rows * 17 + n_out + k_in, device)
    x = randn((num_rows, k_in), x_dtype, device, gen)
    weight = randn((n_out, k_in), torch.float32, device, gen, scale=k_in ** -0.5)
    got = linear(strided(x, gen), weight, out_dtype=torch.float32)
    assert got.shape == (num_rows, n_out) and got.dtype == torch.float32
    want = ref_linear(x.double(), weight.double())
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5)


def test_linear_rejects_bad_inputs(device):
    gen = generator(3, device)
    x = randn((2, 8), torch.float32, device, gen)
    with pytest.raises(ValueError, match="weight"):
        linear(x, randn((4, 9), torch.float32, device, gen))
    with pytest.raises(ValueError, match="weight"):
        linear(x, randn((4, 8), torch.float64, device, gen))
    assert linear(x[:0], randn((4, 8), torch.float32, device, gen)).shape == (0, 4)


@pytest.mark.parametrize("num_rows", [1, 3, LINEAR_MAX_ROWS, LINEAR_MAX_ROWS + 1])  # fused GEMV, then composed
@pytest.mark.parametrize("case", ["bf16", "float32 onto bf16 residual", "no residual", "float32"])
def test_rms_norm_linear_matches_reference(num_rows, case, device):
    # k_in 200: more than one interpreted K tile and a ragged one.
    gen = generator(num_rows * 17 + len(case), device)
    dtype = torch.float32 if case == "float32" else torch.bfloat16
    x_dtype = torch.float32 if case == "float32 onto bf16 residual" else dtype
    x = randn((num_rows, 200), x_dtype, device, gen, scale=2.0)
    residual = None if case == "no residual" else strided(randn((num_rows, 200), dtype, device, gen), gen)
    norm_weight = randn((200,), dtype, device, gen)
    weight = randn((40, 200), dtype, device, gen, scale=200 ** -0.5)
    got = rms_norm_linear(strided(x, gen), norm_weight, 1e-6, weight, residual)
    want = ref_rms_norm_linear(x, norm_weight, 1e-6, weight, residual)
    if residual is not None:
        (got, got_sum), (want, want_sum) = got, want
        assert got_sum.dtype == dtype and torch.equal(got_sum, want_sum)
    assert got.shape == (num_rows, 40) and got.dtype == dtype
    # Same roundings as the reference; the float32 sums' order may move a bf16 rounding by an ulp.
    torch.testing.assert_close(got, want, **TOLERANCE[dtype])


def test_rms_norm_linear_rejects_bad_inputs(device):
    gen = generator(5, device)
    x = randn((2, 8), torch.bfloat16, device, gen)
    weight = randn((4, 8), torch.bfloat16, device, gen)
    with pytest.raises(ValueError, match="norm_weight"):
        rms_norm_linear(x, torch.ones(7, dtype=torch.bfloat16, device=device), 1e-6, weight)
    with pytest.raises(ValueError, match="weight"):
        rms_norm_linear(x, torch.ones(8, dtype=torch.float32, device=device), 1e-6, weight)  # normalised to fp32
    with pytest.raises(ValueError, match="residual"):
        rms_norm_linear(x, torch.ones(8, dtype=torch.bfloat16, device=device), 1e-6, weight, x[:1])
