"""Triton FP8 kernels (activation quantization, linear, fused MoE) against the FP8 reference.

On the CPU they run in Triton's interpreter at small sizes whose blocks are partial at the N and K
edges; the `gpu` tests run DeepSeek-V3's shapes in bf16.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from support.kernel_cases import TOLERANCE, assert_close, generator, randn, strided, w8a8_tolerance
from mla_func.checkpoint.fp8 import block_quantize
from mla_func.kernels.reference import fp8 as ref
from mla_func.kernels.triton import fp8_linear, fp8_moe, fp8_quant
from mla_func.kernels.hardware import hopper
from mla_func.kernels.triton.moe_pairs import PairConfig


def _weight(shape, gen, device):
    """Block-quantized random weights [..., N, K] (scaled so that products stay near 1)."""
    full = torch.randn(shape, generator=gen, device=device) * shape[-1] ** -0.5
    pairs = [block_quantize(w) for w in full.view(-1, *shape[-2:])]
    return (torch.stack([v for v, _ in pairs]).view(shape),
            torch.stack([s for _, s in pairs]).view(*shape[:-2], *pairs[0][1].shape))


def _expected_linear(x, values, scale_inv, w8a8):
    # x.double() quantizes to the same FP8 values as x, so the float64 oracle takes every path.
    return ref.fp8_linear(x.double(), values, scale_inv, w8a8=w8a8)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_quantize_activations_is_the_reference_bit_for_bit(dtype, device):
    gen = generator(0, device)
    x = (randn((5, 328), torch.float32, device, gen) * torch.logspace(-7, 3, 328, device=device)).to(dtype)
    x[1, :128] = 0.0
    values, scales = fp8_quant.quantize_activations(x)
    want_values, want_scales = ref.quantize_activations(x)
    assert torch.equal(values.view(torch.uint8), want_values.view(torch.uint8))
    assert torch.equal(scales, want_scales)
    rows, _ = fp8_quant.quantize_activations(strided(x, gen), scales_by_group=False)
    assert torch.equal(rows.view(torch.uint8), want_values.view(torch.uint8))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_quantize_activations_ue8m0_is_the_reference_bit_for_bit(dtype, device):
    gen = generator(1, device)
    x = (randn((5, 328), torch.float32, device, gen) * torch.logspace(-7, 3, 328, device=device)).to(dtype)
    x[1, :128] = 0.0                                                # the floor's group
    x[2, 128:256] = 0.0
    x[2, 130] = 448.0 * 2.0 ** -5                                   # largest magnitude / 448 exactly a power of two
    values, scales = fp8_quant.quantize_activations(x, scale_fmt="ue8m0")
    want_values, want_scales = ref.quantize_activations(x, scale_fmt="ue8m0")
    assert torch.equal(values.view(torch.uint8), want_values.view(torch.uint8))
    assert torch.equal(scales, want_scales)
    assert scales[2, 1] == 2.0 ** -5
    with pytest.raises(ValueError, match="scale_fmt"):
        fp8_quant.quantize_activations(x, scale_fmt="e8m0")


@pytest.mark.parametrize("num_tokens", [3, 24, 80])             # the stream (16 and 32 rows), the GEMM
def test_fp8_linear_w8a8_ue8m0(num_tokens, device):
    gen = generator(num_tokens + 7, device)
    x = randn((num_tokens, 200), torch.float32, device, gen)
    values, scale_inv = _weight((136, 200), gen, device)
    y = fp8_linear.fp8_linear(x, values, scale_inv, w8a8=True, scale_fmt="ue8m0")
    want = ref.fp8_linear(x.double(), values, scale_inv, w8a8=True, scale_fmt="ue8m0")
    assert_close(y, want, torch.float32, w8a8_tolerance(torch.float32, True, x.device))
    # Not the "fp32" scales' products: the activations were quantized otherwise.
    assert not torch.equal(y, fp8_linear.fp8_linear(x, values, scale_inv, w8a8=True))


@pytest.mark.parametrize("w8a8", [False, True])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
# The one-row product (1-4 rows without w8a8 over this small weight; with w8a8 the stream), the weight stream
# (padded to 16, to 32), the GEMM.
@pytest.mark.parametrize("num_tokens", [1, 3, 5, 24, 80])
def test_fp8_linear(num_tokens, dtype, w8a8, device):
    gen = generator(num_tokens, device)
    x = randn((num_tokens, 200), dtype, device, gen)
    values, scale_inv = _weight((136, 200), gen, device)
    y = fp8_linear.fp8_linear(x, values, scale_inv, w8a8=w8a8)
    assert y.dtype == dtype and y.shape == (num_tokens, 136)
    assert_close(y, _expected_linear(x, values, scale_inv, w8a8), dtype, w8a8_tolerance(dtype, w8a8, x.device))


@pytest.mark.parametrize("num_tokens", [2, 20])
def test_fp8_linear_strided_float32_out_and_split_k(num_tokens, device):
    gen = generator(10 + num_tokens, device)
    x = strided(randn((num_tokens, 320), torch.bfloat16, device, gen), gen)
    values, scale_inv = _weight((72, 320), gen, device)
    expected = _expected_linear(x, values, scale_inv, True)
    y = fp8_linear.fp8_linear(x, values, scale_inv, w8a8=True, out_dtype=torch.float32)
    assert y.dtype == torch.float32
    cpu = {torch.float32: dict(atol=1e-4, rtol=1e-4)}
    assert_close(y, expected, torch.float32, table=w8a8_tolerance(torch.float32, True, x.device) if x.is_cuda else cpu)
    # Splits of K (whole scale blocks) summed in split order: the stream's product, differently added; the bf16
    # rows as two FP8 parts and lifted to fp16 against the widened weight.
    for fp8_rows in (True, False):
        split = fp8_linear.StreamTiles(block_n=16, block_k=32, split_k=3, num_warps=4, num_stages=1, fp8_rows=fp8_rows)
        assert_close(fp8_linear.fp8_linear(x, values, scale_inv, stream=split),
                     _expected_linear(x, values, scale_inv, False), torch.bfloat16)


@pytest.mark.parametrize("w8a8", [False, True])
def test_fp8_linear_stream_over_scale_blocks_narrower_than_its_tiles(w8a8, device):
    # Scale blocks of 24 x 32: a 16-column stream tile spans two scale rows (columns 16..31: rows 0 and 1),
    # so it reads a scale a column rather than one a step; each step's scales are read a step ahead.
    gen = generator(30, device)
    x = randn((5, 100), torch.bfloat16, device, gen)
    full = torch.randn((40, 100), generator=gen, device=device) * 100 ** -0.5
    values, scale_inv = block_quantize(full, block=(24, 32))
    tiles = fp8_linear.StreamTiles(block_n=16, block_k=32, split_k=2, num_warps=4, num_stages=1)
    y = fp8_linear.fp8_linear(x, values, scale_inv, block=(24, 32), w8a8=w8a8, stream=tiles)
    expected = ref.fp8_linear(x.double(), values, scale_inv, block=(24, 32), w8a8=w8a8)
    assert_close(y, expected, torch.bfloat16, w8a8_tolerance(torch.bfloat16, w8a8, x.device))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("num_rows", [1, 2, 3, 4])
def test_fp8_linear_one_row_split_and_tiles_equal_the_stream_and_reference(num_rows, dtype, device):
    # Rows of 320 columns in scale blocks of 128 (the last partial), strided x: the default tiles; K
    # split in three; steps of two scale blocks (the second step half past K), whole and split in two;
    # the H200's steps of eight blocks (one step, most of it past K). Each row's product is the one it has
    # alone, and the weight stream forced on the same rows agrees.
    gen = generator(31 + num_rows, device)
    x = strided(randn((num_rows, 320), dtype, device, gen), gen)
    values, scale_inv = _weight((136, 320), gen, device)
    expected = _expected_linear(x, values, scale_inv, False)
    for tiles in (None, fp8_linear.RowTiles(block_n=16, block_k=32, split_k=3, num_warps=4),
                  fp8_linear.RowTiles(block_n=4, block_k=256, split_k=1, num_warps=2),
                  fp8_linear.RowTiles(block_n=4, block_k=256, split_k=2, num_warps=2),
                  fp8_linear.RowTiles(block_n=8, block_k=1024, split_k=1, num_warps=4)):
        y = fp8_linear.fp8_linear(x, values, scale_inv, row=tiles)
        assert y.dtype == dtype and y.shape == (num_rows, 136)
        assert_close(y, expected, dtype)
        for i in range(num_rows):
            assert torch.equal(y[i:i + 1], fp8_linear.fp8_linear(x[i:i + 1], values, scale_inv, row=tiles))
    stream = fp8_linear.stream_tiles(136, 320, 128, x.device)
    assert_close(fp8_linear.fp8_linear(x, values, scale_inv, stream=stream), expected, dtype)


def test_takes_rows_sends_few_rows_over_small_weights_to_the_one_row_kernel():
    assert fp8_linear.takes_rows(1, 18432, 7168)
    assert fp8_linear.takes_rows(2, 3072, 2048) and not fp8_linear.takes_rows(2, 7168, 7168)
    assert fp8_linear.takes_rows(4, 576, 7168) and not fp8_linear.takes_rows(3, 3072, 2048)
    assert not fp8_linear.takes_rows(5, 576, 2048)


def test_tma_weight_asks_for_rows_a_descriptor_can_cover():
    # TMA needs contiguous rows whose starts are 16-byte aligned; other weights stream by pointer loads.
    values = torch.zeros((64, 48), dtype=torch.float8_e4m3fn)
    assert fp8_linear.tma_weight(values)
    assert fp8_linear.tma_weight(values[:, :40])          # 40 columns, rows still 48 bytes apart
    assert not fp8_linear.tma_weight(values[:, 8:])       # starts 8 bytes into a row
    assert not fp8_linear.tma_weight(torch.zeros((64, 40), dtype=torch.float8_e4m3fn))   # rows 40 bytes apart
    assert not fp8_linear.tma_weight(values.t())
    assert not fp8_linear.stream_tiles(18432, 7168, 128, torch.device("cpu")).tma


def test_fp8_linear_rejects_bad_inputs(device):
    values, scale_inv = _weight((64, 128), generator(3, device), device)
    x = torch.randn(2, 128, device=device)
    with pytest.raises(ValueError, match="scale_inv"):
        fp8_linear.fp8_linear(x, values, scale_inv[:, :0])
    with pytest.raises(ValueError, match="power of two"):
        fp8_linear.fp8_linear(x, values, torch.ones(1, 8, device=device), block=(128, 16))
    with pytest.raises(ValueError, match="values"):
        fp8_linear.fp8_linear(torch.randn(2, 96, device=device), values, scale_inv)


def _moe_inputs(num_tokens, hidden, inter, num_experts, top_k, dtype, device, seed):
    gen = generator(seed, device)
    x = randn((num_tokens, hidden), dtype, device, gen)
    w13, s13 = _weight((num_experts, 2 * inter, hidden), gen, device)
    w2, s2 = _weight((num_experts, hidden, inter), gen, device)
    scores = torch.rand((num_tokens, num_experts), generator=gen, device=device)
    weights, ids = scores.topk(top_k, dim=1)
    if num_tokens > 1:
        ids[-1] = -1             # a padded row
    if num_tokens > 2:
        ids[1, 0] = -1           # a dropped slot in a real row
    return x, w13, s13, w2, s2, (weights / weights.sum(1, keepdim=True)).float(), ids


def _check_moe(inputs, dtype, w8a8, config=None, table=None, scale_fmt="fp32"):
    x, *weights, topk_weights, topk_ids = inputs
    out = fp8_moe.fp8_fused_moe(*inputs, w8a8=w8a8, config=config, scale_fmt=scale_fmt)
    # w8a8 quantizes the activation as rounded to x's dtype: the oracle runs in that dtype too.
    oracle_x = x if w8a8 else x.double()
    expected = ref.fp8_fused_moe(oracle_x, *weights, topk_weights, topk_ids, w8a8=w8a8, scale_fmt=scale_fmt)
    assert out.dtype == dtype and out.shape == x.shape
    assert_close(out, expected, dtype, **({"table": table} if table else {}))
    if x.shape[0] > 1:
        assert torch.all(out[-1] == 0)
    return out


@pytest.mark.parametrize("w8a8", [False, True])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("num_tokens", [4, 30])   # sorted inside gate/up, by `moe_align`
def test_fp8_fused_moe(num_tokens, dtype, w8a8, device):
    inputs = _moe_inputs(num_tokens, 160, 96, 6, 3, dtype, device, seed=num_tokens)
    _check_moe(inputs, dtype, w8a8)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_fp8_fused_moe_w8a8_ue8m0(dtype, device):
    inputs = _moe_inputs(12, 160, 96, 6, 3, dtype, device, seed=5)
    out = _check_moe(inputs, dtype, True, scale_fmt="ue8m0")
    assert not torch.equal(out, fp8_moe.fp8_fused_moe(*inputs, w8a8=True))


@pytest.mark.parametrize("limit", [None, 0.75])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_fp8_fused_moe_per_pair_path_equals_the_tiled_path_and_reference(dtype, limit, device):
    # 4 tokens x top-3: few pairs of 16-bit activations take the per-pair path by default; the gate
    # and up rows of a program lie in different row blocks (I = 96 in 128-row blocks).
    inputs = _moe_inputs(4, 160, 96, 6, 3, dtype, device, seed=11)
    chosen = fp8_moe.fp8_moe_config(12, 6, device)
    tiled = fp8_moe.fp8_moe_config(12, 6, device, w8a8=True)
    assert isinstance(chosen, PairConfig) and not isinstance(tiled, PairConfig)
    per_pair = fp8_moe.fp8_fused_moe(*inputs, limit=limit)
    by_tiles = fp8_moe.fp8_fused_moe(*inputs, limit=limit, config=tiled)
    assert_close(per_pair, by_tiles, dtype)
    assert torch.all(per_pair[-1] == 0)
    # Gate/up steps of two scale blocks (the second past D = 160 in part).
    wide_steps = PairConfig(block_i=16, block_k=256, block_d=32, num_warps=4, num_stages=1)
    assert_close(fp8_moe.fp8_fused_moe(*inputs, limit=limit, config=wide_steps), by_tiles, dtype)
    if limit is None:
        _check_moe(inputs, dtype, False)
    with pytest.raises(ValueError, match="per-pair path"):
        fp8_moe.fp8_fused_moe(*inputs, w8a8=True, config=chosen)


def test_fp8_fused_moe_lifted_rows_equal_the_widened_rows(device):
    # bf16 rows lifted to fp16 (`Fp8MoeConfig.lift`) against the FP8 tiles: rows of very different
    # magnitudes (each its own power of two, 2^-24 .. 2^34: out of fp16's range unlifted) against the
    # reference, and rows of order one against the tiles widened to bf16. (The interpreter's bf16
    # products lose such magnitudes themselves, so the widened path is compared at order one only.)
    x, *rest = _moe_inputs(30, 160, 96, 6, 3, torch.bfloat16, device, seed=17)
    widened = dataclasses.replace(fp8_moe.fp8_moe_config(90, 6, device), lift=False)
    lifted = dataclasses.replace(widened, lift=True)
    magnitude = torch.tensor([2.0 ** e for e in range(-24, 36, 2)], device=device)
    scaled = (x.float() * magnitude[:, None]).bfloat16()
    got = fp8_moe.fp8_fused_moe(scaled, *rest, config=lifted).double()
    expected = ref.fp8_fused_moe(scaled.double(), *rest)
    # Each row to its own scale (the SwiGLU is not homogeneous: entries that cancel are small in their row).
    row_err = (got - expected).norm(dim=1) / expected.norm(dim=1).clamp_min(1e-300)
    assert torch.all(row_err[:-1] < 1e-2), row_err
    assert torch.all(got[-1] == 0)
    out = _check_moe((x, *rest), torch.bfloat16, False, lifted)
    assert_close(out, fp8_moe.fp8_fused_moe(x, *rest, config=widened), torch.bfloat16)


def test_fp8_fused_moe_larger_tiles(device):
    # 64-row tiles (one an expert; the prefill tiles are 32 rows) on the same function.
    inputs = _moe_inputs(9, 160, 96, 4, 2, torch.bfloat16, device, seed=5)
    config = dataclasses.replace(fp8_moe.fp8_moe_config(18, 4, device, w8a8=True), block_m=64)  # the tiled path
    _check_moe(inputs, torch.bfloat16, False, config)


# --- on the GPU: DeepSeek-V3's shapes in bf16 -------------------------------------------------

# Hopper's FP8 tensor cores sum a K tile's products in fewer bits than float32 (about 14 bits of
# mantissa kept, which is why the scaled sum is promoted every K tile): a few elements of a
# million land past bf16's tolerance (H100, 7168 x 2048 at 1024 rows: 3 of 7.3M, by at most 0.039).
_GPU_W8A8_TOLERANCE = {torch.bfloat16: dict(atol=6e-2, rtol=3e-2)}

@pytest.mark.gpu
@pytest.mark.parametrize("w8a8", [False, True])
@pytest.mark.parametrize("num_tokens", [1, 7, 16, 64, 1024])
@pytest.mark.parametrize("n, k", [(7168, 7168), (18432, 7168), (576, 7168), (7168, 2048)])
def test_fp8_linear_gpu(n, k, num_tokens, w8a8):
    device = torch.device("cuda")
    gen = generator(n + num_tokens, device)
    x = randn((num_tokens, k), torch.bfloat16, device, gen)
    values, scale_inv = _weight((n, k), gen, device)
    y = fp8_linear.fp8_linear(x, values, scale_inv, w8a8=w8a8)
    expected = _expected_linear(x, values, scale_inv, w8a8)
    assert_close(y, expected, torch.bfloat16, table=_GPU_W8A8_TOLERANCE if w8a8 else TOLERANCE)
    assert float((y.double() - expected).norm() / expected.norm()) < 5e-3


@pytest.mark.gpu
@pytest.mark.parametrize("num_tokens", [7, 64])
@pytest.mark.parametrize("n, k", [(18432, 7168), (2048, 1408)])
def test_fp8_stream_gpu_both_row_forms(n, k, num_tokens):
    # The weight stream's bf16 rows as two FP8 parts and lifted to fp16, whichever the tile rule picks at
    # this size: both = the float64 reference within bf16's tolerance.
    device = torch.device("cuda")
    gen = generator(n + k + num_tokens, device)
    x = randn((num_tokens, k), torch.bfloat16, device, gen)
    values, scale_inv = _weight((n, k), gen, device)
    expected = _expected_linear(x, values, scale_inv, False)
    tiles = fp8_linear.stream_tiles(n, k, 128, device)
    for fp8_rows in (True, False):
        y = fp8_linear.fp8_linear(x, values, scale_inv, stream=dataclasses.replace(tiles, fp8_rows=fp8_rows))
        assert_close(y, expected, torch.bfloat16)
        assert float((y.double() - expected).norm() / expected.norm()) < 5e-3


@pytest.mark.gpu
@pytest.mark.parametrize("w8a8", [False, True])
@pytest.mark.parametrize("num_tokens", [3, 16, 64])
# [4100, 2064]: a partial column tile at N's edge and a partial K step at K's (2064 = 16 x 129).
@pytest.mark.parametrize("n, k", [(18432, 7168), (4100, 2064)])
def test_fp8_stream_gpu_tma_equals_pointer_loads(n, k, num_tokens, w8a8):
    # The FP8-row stream's weight tiles by TMA and by pointer loads: the same products in the same order, so the
    # same bits (tiles past N or K read as zeros either way), and both = the float64 reference.
    device = torch.device("cuda")
    if not hopper(device):
        # Elsewhere the tile rule never asks for TMA; there is no TMA path to compare.
        assert not fp8_linear.stream_tiles(18432, 7168, 128, device).tma
        pytest.skip("the stream takes TMA on Hopper only")
    # The tile rule asks for TMA over V3's large projections.
    assert fp8_linear.stream_tiles(18432, 7168, 128, device).tma
    tiles = fp8_linear.stream_tiles(n, k, 128, device)
    gen = generator(n + k + num_tokens, device)
    x = randn((num_tokens, k), torch.bfloat16, device, gen)
    values, scale_inv = _weight((n, k), gen, device)
    assert tiles.fp8_rows and fp8_linear.tma_weight(values)
    y = fp8_linear.fp8_linear(x, values, scale_inv, w8a8=w8a8, stream=dataclasses.replace(tiles, tma=True))
    y_pointers = fp8_linear.fp8_linear(x, values, scale_inv, w8a8=w8a8, stream=dataclasses.replace(tiles, tma=False))
    assert torch.equal(y, y_pointers)
    expected = _expected_linear(x, values, scale_inv, w8a8)
    assert_close(y, expected, torch.bfloat16, table=_GPU_W8A8_TOLERANCE if w8a8 else TOLERANCE)


@pytest.mark.gpu
@pytest.mark.parametrize("num_rows", [2, 3, 4])
@pytest.mark.parametrize("n, k", [(3072, 2048), (576, 7168), (4096, 512), (1536, 7168)])
def test_fp8_few_rows_gpu_on_the_one_row_kernel(n, k, num_rows):
    # 2-4 rows over small weights take the one-row kernel where `takes_rows` says (the others the stream): the
    # float64 reference within bf16's tolerance, and each row the bits it has alone.
    device = torch.device("cuda")
    gen = generator(n + k + num_rows, device)
    x = randn((num_rows, k), torch.bfloat16, device, gen)
    values, scale_inv = _weight((n, k), gen, device)
    y = fp8_linear.fp8_linear(x, values, scale_inv)
    assert_close(y, _expected_linear(x, values, scale_inv, False), torch.bfloat16)
    if fp8_linear.takes_rows(num_rows, n, k):
        for i in range(num_rows):
            assert torch.equal(y[i:i + 1], fp8_linear.fp8_linear(x[i:i + 1], values, scale_inv))


@pytest.mark.gpu
def test_fp8_stream_gpu_tma_graph_replays_equal_eager():
    # The weight's descriptor is built on the host at capture and kept in the graph: replays over new rows give
    # the eager op's bits.
    device = torch.device("cuda")
    if not hopper(device):
        # Elsewhere the tile rule never asks for TMA; there is no TMA path to compare.
        assert not fp8_linear.stream_tiles(18432, 7168, 128, device).tma
        pytest.skip("the stream takes TMA on Hopper only")
    gen = generator(16, device)
    values, scale_inv = _weight((18432, 7168), gen, device)
    x = randn((16, 7168), torch.bfloat16, device, gen)
    fp8_linear.fp8_linear(x, values, scale_inv)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y = fp8_linear.fp8_linear(x, values, scale_inv)
    for _ in range(2):
        new_x = randn((16, 7168), torch.bfloat16, device, gen)
        x.copy_(new_x)
        graph.replay()
        assert torch.equal(y, fp8_linear.fp8_linear(new_x, values, scale_inv))


@pytest.mark.gpu
def test_fp8_stream_gpu_weight_rows_not_16_byte_aligned():
    # A weight whose rows TMA cannot describe (K = 2056 bytes, not a multiple of 16) streams by pointer loads,
    # even where the tiles ask for TMA.
    device = torch.device("cuda")
    gen = generator(2056, device)
    x = randn((16, 2056), torch.bfloat16, device, gen)
    values, scale_inv = _weight((4096, 2056), gen, device)
    assert not fp8_linear.tma_weight(values)
    tiles = dataclasses.replace(fp8_linear.stream_tiles(4096, 2056, 128, device), tma=True)
    y = fp8_linear.fp8_linear(x, values, scale_inv, stream=tiles)
    assert_close(y, _expected_linear(x, values, scale_inv, False), torch.bfloat16)


@pytest.mark.gpu
@pytest.mark.parametrize("w8a8", [False, True])
@pytest.mark.parametrize("num_tokens", [1, 4, 64, 512])
def test_fp8_fused_moe_gpu(num_tokens, w8a8):
    # V3's expert shapes (D 7168, I 2048), 16 experts, top-8.
    inputs = _moe_inputs(num_tokens, 7168, 2048, 16, 8, torch.bfloat16, torch.device("cuda"), seed=num_tokens)
    _check_moe(inputs, torch.bfloat16, w8a8, table=_GPU_W8A8_TOLERANCE if w8a8 else None)


@pytest.mark.gpu
@pytest.mark.parametrize("limit", [None, 10.0])
@pytest.mark.parametrize("num_tokens", [1, 2, 4])
def test_fp8_fused_moe_per_pair_path_gpu(num_tokens, limit):
    # V2-Lite's expert shapes (D 2048, I 1408 = 11 blocks), 66 experts, top-8: the per-pair path against
    # the tiled path and the reference, up to its limit (4 tokens: 32 pairs).
    device = torch.device("cuda")
    inputs = _moe_inputs(num_tokens, 2048, 1408, 66, 8, torch.bfloat16, device, seed=num_tokens)
    assert isinstance(fp8_moe.fp8_moe_config(num_tokens * 8, 66, device), PairConfig)
    per_pair = fp8_moe.fp8_fused_moe(*inputs, limit=limit)
    tiled = fp8_moe.fp8_fused_moe(*inputs, limit=limit, config=fp8_moe.fp8_moe_config(num_tokens * 8, 66, device,
                                                                                        w8a8=True))
    assert_close(per_pair, tiled, torch.bfloat16)
    if limit is None:
        _check_moe(inputs, torch.bfloat16, False)
