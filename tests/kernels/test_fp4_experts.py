"""DeepSeek-V4's FP4 routed experts read packed by the Triton kernel (`kernels.triton.fp4_experts`), and FP8
experts through the FP8 MoE with the clamp, against the torch reference on the dequantized weights.

On the CPU the kernels run in Triton's interpreter at small sizes; the `gpu` tests run V4-Flash's expert
shapes (D 4096, I 2048, top 6) in bf16.
"""

from __future__ import annotations

import dataclasses
import random

import pytest
import torch
import triton
import triton.language as tl

import mla_func as mf
from mla_func.checkpoint.fp8 import block_quantize
from mla_func.kernels import ops_for
from mla_func.kernels.fp4_weight import SCALE_DTYPE, BlockFP4Weight, e2m1_table
from mla_func.kernels.gluon import fp4_experts as wgmma_fp4
from mla_func.kernels.hardware import e4m3_pairs_to_fp16
from mla_func.kernels.quantized import BlockFP8Weight
from mla_func.kernels.reference.v4_moe import clamped_experts as reference
from mla_func.kernels.triton import fp4_experts
from mla_func.kernels.triton.e2m1_widen import E2M1_UNDO, e2m1_to_fp16
from mla_func.kernels.triton.fp16_lift import lift_rows
from mla_func.kernels.triton.fp4_experts import Fp4MoeConfig, fp4_clamped_experts, fp4_moe_config
from mla_func.kernels.triton.fp4_pairs import FP4_PAIR_MAX_PAIRS
from mla_func.kernels.triton.moe_pairs import PairConfig
from support.kernel_cases import assert_close, generator, randn
from support.v4_official import write_v4_official
from support.v4_reference import save_reference


# The widened tiles on the warpgroup MMA (Gluon; their Triton twin where `gluon.fp4_experts.applies` does not).
WGMMA = Fp4MoeConfig(16, 64, 128, 4, 2, widened=True, wgmma=True)


def random_fp4(shape, gen, device, exponents=(-6, -3)) -> BlockFP4Weight:
    """A random FP4 weight [..., N, K]: every byte (two e2m1 codes) uniform, one e8m0 scale per 32 values of a
    row, a power of two drawn from 2^exponents[0] .. 2^exponents[1]."""
    *lead, n, k = shape
    packed = torch.randint(0, 256, (*lead, n, k // 2), generator=gen, device=device, dtype=torch.uint8)
    biased = 127 + torch.randint(exponents[0], exponents[1] + 1, (*lead, n, k // 32), generator=gen, device=device)
    return BlockFP4Weight(packed, biased.to(torch.uint8).view(SCALE_DTYPE), (1, 32))


def _routing(tokens, experts, top_k, gen, device):
    ids = torch.stack([torch.randperm(experts, generator=gen, device=device)[:top_k] for _ in range(tokens)])
    weights = torch.rand((tokens, top_k), generator=gen, device=device)
    ids[0] = -1                              # a padded row takes no expert
    weights[0] = 0
    if tokens > 2 and top_k > 1:
        ids[1, 0] = -1                       # a dropped slot of a real row
    return weights, ids


@pytest.mark.parametrize("tokens, top_k", [(3, 2), (100, 2), (5, 1)])
def test_fp4_experts_equal_the_reference(device, tokens, top_k, monkeypatch):
    gen = generator(tokens * 10 + top_k, device)
    experts, hidden, inter = 6, 96, 64
    x = randn((tokens, hidden), torch.bfloat16, device, gen)
    w13, w2 = random_fp4((experts, 2 * inter, hidden), gen, device), random_fp4((experts, hidden, inter), gen, device)
    weights, ids = _routing(tokens, experts, top_k, gen, device)
    limit = 1.0                              # inside the pre-activations' spread: the clamp matters
    want = reference(x.double(), w13, w2, weights.double(), ids, limit=limit)
    unclamped = reference(x.double(), w13, w2, weights.double(), ids, limit=1e9)
    assert not torch.allclose(want, unclamped, rtol=1e-3, atol=1e-3), "the clamp should change the result"

    def no_dense_copy(self, dtype):
        raise AssertionError("the FP4 kernel dequantized a weight instead of reading it packed")

    monkeypatch.setattr(BlockFP4Weight, "dequantize", no_dense_copy)
    got = fp4_clamped_experts(x, w13, w2, weights, ids, limit=limit)
    table = ops_for("triton").v4.clamped_experts(x, w13, w2, weights, ids, limit=limit)
    assert got.dtype == torch.bfloat16 and got.shape == x.shape
    assert bool((got[0] == 0).all())
    assert_close(got, want, torch.bfloat16)
    if tokens * top_k > FP4_PAIR_MAX_PAIRS:
        assert torch.equal(table, got)
    else:
        # The per-pair path sums a token's k terms with float32 atomics, in an order that may vary.
        assert isinstance(fp4_moe_config(tokens * top_k, experts, device), PairConfig)
        assert_close(table, got, torch.bfloat16)


def _ragged_case(tokens, experts, top_k, gen, device):
    """bf16 rows [tokens, 96] and FP4 experts of D 96, I 160 (neither a multiple of the kernels' steps), routed:
    (x, w13, w2, weights, ids)."""
    hidden, inter = 96, 160
    x = randn((tokens, hidden), torch.bfloat16, device, gen)
    w13, w2 = random_fp4((experts, 2 * inter, hidden), gen, device), random_fp4((experts, hidden, inter), gen, device)
    return (x, w13, w2, *_routing(tokens, experts, top_k, gen, device))


@pytest.mark.parametrize("config", [Fp4MoeConfig(16, 32, 64, 4, 1), Fp4MoeConfig(32, 64, 128, 4, 1),
                                    Fp4MoeConfig(16, 32, 64, 4, 1, scales_on_acc=True),
                                    Fp4MoeConfig(32, 64, 128, 4, 1, scales_on_acc=True),
                                    Fp4MoeConfig(16, 32, 64, 4, 1, widened=True),
                                    Fp4MoeConfig(16, 64, 128, 4, 1, widened=True)])
def test_wider_k_steps_read_several_scales_a_step(config, device):
    """K steps of 2 and 4 scale groups (the GPU's are 128 deep), the last one partial (D 96, I 160); the
    scales applied to the tiles or to each group's product, or the tiles widened to fp16 first."""
    x, w13, w2, weights, ids = _ragged_case(9, 3, 2, generator(config.block_k, device), device)
    got = fp4_clamped_experts(x, w13, w2, weights, ids, limit=1.0, config=config)
    assert_close(got, reference(x.double(), w13, w2, weights.double(), ids, limit=1.0), torch.bfloat16)


def _far_below_the_top(w: BlockFP4Weight) -> BlockFP4Weight:
    """w with every even scale group of each row made all zeros under a scale of 2^2: each K step's largest
    scale then carries nothing, and the values lie 2^20 .. 2^22 below it."""
    packed, biased = w.packed.clone(), w.scale.view(torch.uint8).clone()
    biased[..., 0::2] = 127 + 2
    packed.view(*packed.shape[:-1], -1, 16)[..., 0::2, :] = 0
    return BlockFP4Weight(packed, biased.view(SCALE_DTYPE), w.block)


def test_widened_tiles_are_exact_far_below_a_steps_largest_scale(device):
    """The widened tiles take a row's scales in a K step relative to the largest (`fp4_widened`): exact while
    they lie within 2^23 of it. Every value here sits 2^20 .. 2^22 below its step's largest scale (a group of
    zeros), where a flush to zero would leave almost nothing: the widened path equals the per-pair one (each
    value times its scale in float32) up to the order of the sums, and the reference as the tiled paths do."""
    gen = generator(23, device)
    x, w13, w2, weights, ids = _ragged_case(9, 3, 2, gen, device)
    w13 = _far_below_the_top(random_fp4(w13.shape, gen, device, exponents=(-20, -18)))
    w2 = _far_below_the_top(random_fp4(w2.shape, gen, device, exponents=(-20, -18)))
    x = x * 2.0 ** 20                                   # back to magnitudes the SwiGLU's bf16 rounding keeps
    want = reference(x.double(), w13, w2, weights.double(), ids, limit=1e4)
    widened = fp4_clamped_experts(x, w13, w2, weights, ids, limit=1e4, config=Fp4MoeConfig(16, 32, 64, 4, 1, widened=True))
    per_pair = fp4_clamped_experts(x, w13, w2, weights, ids, limit=1e4, config=PairConfig(16, 64, 32, 4, 1))
    assert float(want.norm()) > 0
    assert float((widened.double() - want).norm() / want.norm()) <= 1e-2
    assert float((widened.double() - per_pair.double()).norm() / want.norm()) <= 1e-3


def test_rows_lift_in_the_warpgroup_tiles_k_order(device):
    """`lift_rows(x, K_ORDER_BITS)`: each run of 128 columns in the order the warpgroup-MMA tiles read K (bit i
    of the source column is bit K_ORDER_BITS[i] of the position), the same lift as in x's order."""
    gen = generator(7, device)
    rows_scale = 2.0 ** torch.arange(-6, 9, 3, device=device)[:, None]          # rows of other magnitudes
    x = (randn((5, 384), torch.bfloat16, device, gen) * rows_scale).to(torch.bfloat16)
    plain, unlift = lift_rows(x)
    ordered, ordered_unlift = lift_rows(x, wgmma_fp4.K_ORDER_BITS)
    j = torch.arange(128)
    source = sum(((j >> b) & 1) << i for i, b in enumerate(wgmma_fp4.K_ORDER_BITS))
    assert sorted(source.tolist()) == list(range(128)) and not torch.equal(source, j)
    columns = torch.cat([run * 128 + source for run in range(3)]).to(device)
    assert torch.equal(ordered, plain[:, columns]) and torch.equal(ordered_unlift, unlift)
    assert torch.equal(ordered.float() * unlift[:, None], x[:, columns].float())
    with pytest.raises(ValueError, match="order_bits"):
        lift_rows(x[:, :96], wgmma_fp4.K_ORDER_BITS)
    with pytest.raises(ValueError, match="order_bits"):
        lift_rows(x, (0, 1, 1))


def test_warpgroup_tiles_refuse_other_tiles_and_take_their_twin_where_they_do_not_apply(device, monkeypatch):
    """`wgmma` names the widened tiles of 16 rows; where `gluon.fp4_experts.applies` says no (here: D 96, I 160,
    and on the CPU any shape) the Triton twin runs, bit for bit."""
    x, w13, w2, weights, ids = _ragged_case(9, 3, 2, generator(5, device), device)
    with pytest.raises(ValueError, match="block_m"):
        fp4_clamped_experts(x, w13, w2, weights, ids, limit=1.0, config=dataclasses.replace(WGMMA, block_m=32))
    with pytest.raises(ValueError, match="widened"):
        fp4_clamped_experts(x, w13, w2, weights, ids, limit=1.0, config=dataclasses.replace(WGMMA, widened=False))
    assert not wgmma_fp4.applies(x, w13, w2)

    def not_here(*args):
        raise AssertionError("the Gluon kernels ran where they do not apply")

    monkeypatch.setattr(wgmma_fp4, "wgmma_fp4_gate_up", not_here)
    twin = dataclasses.replace(WGMMA, block_n=32, block_k=64, num_stages=1)
    got = fp4_clamped_experts(x, w13, w2, weights, ids, limit=1.0, config=twin)
    assert torch.equal(got, fp4_clamped_experts(x, w13, w2, weights, ids, limit=1.0,
                                                config=dataclasses.replace(twin, wgmma=False)))


@pytest.mark.parametrize("config", [PairConfig(16, 64, 32, 4, 1), PairConfig(64, 32, 16, 4, 1),
                                    PairConfig(32, 128, 64, 4, 1)])
def test_the_per_pair_path_equals_the_reference_and_the_tiled_path(config, device):
    """The per-pair path on CUDA cores: columns of a program inside one scale group of w2 (16), one whole
    group (32) and two (64), K steps of one to four groups, the last partial (D 96, I 160: the last program's
    columns partly past I); against the reference and the tiled path."""
    x, w13, w2, weights, ids = _ragged_case(7, 5, 3, generator(config.block_i, device), device)
    got = fp4_clamped_experts(x, w13, w2, weights, ids, limit=1.0, config=config)
    assert bool((got[0] == 0).all())
    assert_close(got, reference(x.double(), w13, w2, weights.double(), ids, limit=1.0), torch.bfloat16)
    tiled = fp4_clamped_experts(x, w13, w2, weights, ids, limit=1.0, config=Fp4MoeConfig(16, 32, 64, 4, 1))
    assert_close(got, tiled, torch.bfloat16)


@triton.jit
def _widen_kernel(packed_ptr, low_ptr, high_ptr, BLOCK: tl.constexpr, ASM: tl.constexpr):
    offs = tl.arange(0, BLOCK)[:, None] * BLOCK + tl.arange(0, BLOCK)[None, :]
    low, high = e2m1_to_fp16(tl.load(packed_ptr + offs), ASM)
    tl.store(low_ptr + offs, low)
    tl.store(high_ptr + offs, high)


def test_e2m1_codes_widen_to_their_values_over_64(device):
    """Every byte (two codes) through the per-pair path's widening (the inline PTX on NVIDIA GPUs from 8.9, Triton's
    operations elsewhere): the low nibble's value and the high nibble's, each times 2^-6, exactly."""
    packed = torch.arange(256, dtype=torch.uint8, device=device).reshape(16, 16)
    low, high = (torch.empty((16, 16), dtype=torch.float16, device=device) for _ in range(2))
    _widen_kernel[(1,)](packed, low, high, BLOCK=16, ASM=e4m3_pairs_to_fp16(device))
    table = e2m1_table(device)
    assert torch.equal(low.float() * E2M1_UNDO, table[(packed & 15).long()])
    assert torch.equal(high.float() * E2M1_UNDO, table[(packed >> 4).long()])


def test_other_activation_dtypes_take_the_dequantized_weights(device):
    """float32 activations: no bf16 `dot_scaled` would keep them, so the table dequantizes (exactly) instead."""
    gen = generator(7, device)
    experts, hidden, inter = 4, 64, 32
    x = randn((6, hidden), torch.float32, device, gen)
    w13, w2 = random_fp4((experts, 2 * inter, hidden), gen, device), random_fp4((experts, hidden, inter), gen, device)
    weights, ids = _routing(6, experts, 2, gen, device)
    got = ops_for("triton").v4.clamped_experts(x, w13, w2, weights, ids, limit=1.0)
    assert got.dtype == torch.float32
    assert_close(got, reference(x.double(), w13, w2, weights.double(), ids, limit=1.0), torch.float32)


def test_the_kernel_refuses_other_blocks_by_name(device):
    gen = generator(8, device)
    x = randn((2, 64), torch.bfloat16, device, gen)
    w13 = random_fp4((2, 64, 64), gen, device)
    coarse = BlockFP4Weight(w13.packed, w13.scale[..., ::2].contiguous(), (1, 64))
    weights, ids = _routing(2, 2, 1, gen, device)
    with pytest.raises(ValueError, match="w13"):
        fp4_clamped_experts(x, coarse, random_fp4((2, 64, 32), gen, device), weights, ids, limit=1.0)
    with pytest.raises(ValueError, match="x"):
        fp4_clamped_experts(x.float(), w13, random_fp4((2, 64, 32), gen, device), weights, ids, limit=1.0)


def _fp8(shape, gen, device) -> BlockFP8Weight:
    full = torch.randn(shape, generator=gen, device=device) * shape[-1] ** -0.5
    pairs = [block_quantize(w) for w in full.view(-1, *shape[-2:])]
    return BlockFP8Weight(torch.stack([v for v, _ in pairs]).view(shape),
                          torch.stack([s for _, s in pairs]).view(*shape[:-2], *pairs[0][1].shape), (128, 128))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_fp8_experts_are_clamped_in_the_fp8_kernel(device, dtype, monkeypatch):
    """V4's FP8 experts (its shared expert; every expert of an `expert_dtype: fp8` checkpoint)."""
    gen = generator(9, device)
    experts, hidden, inter = 4, 160, 96
    x = randn((7, hidden), dtype, device, gen)
    w13, w2 = _fp8((experts, 2 * inter, hidden), gen, device), _fp8((experts, hidden, inter), gen, device)
    weights, ids = _routing(7, experts, 2, gen, device)
    limit = 0.5
    want = reference(x.double(), w13, w2, weights.double(), ids, limit=limit)
    assert not torch.allclose(want, reference(x.double(), w13, w2, weights.double(), ids, limit=1e9), atol=1e-3)

    def no_dense_copy(self, dtype):
        raise AssertionError("the FP8 kernel dequantized a weight instead of reading it")

    monkeypatch.setattr(BlockFP8Weight, "dequantize", no_dense_copy)
    got = ops_for("triton").v4.clamped_experts(x, w13, w2, weights, ids, limit=limit)
    assert got.dtype == dtype
    assert_close(got, want, dtype)


@pytest.mark.slow
def test_a_released_fp4_checkpoint_runs_its_experts_packed_on_triton(tmp_path, monkeypatch, device):
    """A tiny V4 checkpoint in DeepSeek's released layout (FP4 routed experts, FP8 linears) in bf16 on the
    Triton table: every layer's routed experts go through the packed FP4 kernel, and the prompt logits are
    those of the same table with the experts dequantized first. (Against a float32 run the two are equally
    far, 2-10% on this random toy, whose routing flips with bf16 rounding.)"""
    save_reference(tmp_path / "float", seed=random.randrange(1000), hidden_size=128, moe_intermediate_size=64)
    write_v4_official(tmp_path / "float", tmp_path / "official", tmp_path / "dequantized", "fp4")
    model = mf.load_model(tmp_path / "official", dtype=torch.bfloat16, device=device)
    prompt = [random.randrange(2, 97) for _ in range(17)]
    calls = []

    def counted(*args, **kwargs):
        calls.append(1)
        return fp4_clamped_experts(*args, **kwargs)

    monkeypatch.setattr(fp4_experts, "fp4_clamped_experts", counted)
    # The tiled path both times, so the two differ only in how a tile is widened (the per-pair path sums in
    # another order, and this toy's routing flips with the last bits: its own tests compare it).
    monkeypatch.setattr(fp4_experts, "FP4_PAIR_MAX_PAIRS", 0)
    packed = mf.Engine(model, backend="triton", graphs=False, max_model_len=64).score(prompt).float()
    assert len(calls) == model.config.num_hidden_layers
    monkeypatch.setattr(fp4_experts, "fp4_pair", lambda x, w: None)     # every FP4 stack dequantized instead
    dense = mf.Engine(model, backend="triton", graphs=False, max_model_len=64).score(prompt).float()
    assert len(calls) == model.config.num_hidden_layers
    assert float((packed - dense).norm() / dense.norm()) <= 1e-3


# --- on the GPU: V4-Flash's expert shapes ------------------------------------------------------------------

@pytest.mark.gpu
@pytest.mark.parametrize("tokens", [1, 16, 24, 40, 300])
def test_fp4_experts_real_sizes_on_the_gpu(tokens):
    """V4-Flash's routed experts (D 4096, I 2048, top 6, swiglu_limit 10; 16 of its 256 experts, which the
    float64 oracle can hold), bf16 activations, scales around 2^-8 as a trained checkpoint's are."""
    device = torch.device("cuda")
    gen = generator(tokens, device)
    experts, hidden, inter, top_k = 16, 4096, 2048, 6
    x = randn((tokens, hidden), torch.bfloat16, device, gen)
    w13 = random_fp4((experts, 2 * inter, hidden), gen, device, exponents=(-9, -7))
    w2 = random_fp4((experts, hidden, inter), gen, device, exponents=(-9, -7))
    ids = torch.stack([torch.randperm(experts, generator=gen, device=device)[:top_k] for _ in range(tokens)])
    weights = torch.rand((tokens, top_k), generator=gen, device=device)
    got = fp4_clamped_experts(x, w13, w2, weights, ids, limit=10.0)
    want = reference(x.double(), w13, w2, weights.double(), ids, limit=10.0)
    table = ops_for("triton").v4.clamped_experts(x, w13, w2, weights, ids, limit=10.0)
    # The kernel rounds the pre-activations and the SwiGLU to bf16 (0.4% each) before 2048-term sums:
    # judged over the whole output, not element by element near 0.
    assert float((got.double() - want).norm() / want.norm()) <= 1e-2
    # The table takes the same kernel: the same bits on the tiled path, and on the per-pair path (up to
    # FP4_PAIR_MAX_PAIRS pairs: float32 atomics in an order that varies from run to run) the same up to a
    # last bf16 bit here and there.
    if tokens * top_k > FP4_PAIR_MAX_PAIRS:
        assert table.equal(got)
    assert float((table.double() - got.double()).norm() / want.norm()) <= 1e-3
    # Each tiled form at this size: the same products, sums in another order (the warpgroup-MMA tiles, their
    # Triton twin, `dot_scaled`'s).
    for config in (WGMMA, dataclasses.replace(WGMMA, wgmma=False), Fp4MoeConfig(32, 64, 128, 4, 4)):
        other = fp4_clamped_experts(x, w13, w2, weights, ids, limit=10.0, config=config)
        assert float((other.double() - want).norm() / want.norm()) <= 1e-2
        assert float((other.double() - got.double()).norm() / want.norm()) <= 1e-3


def _spy(monkeypatch, name):
    """Count the calls of `gluon.fp4_experts.<name>` (the kernels the warpgroup tiles launch)."""
    calls = []
    real = getattr(wgmma_fp4, name)

    def counted(*args, **kwargs):
        calls.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(wgmma_fp4, name, counted)
    return calls


@pytest.mark.gpu
def test_warpgroup_tiles_are_exact_far_below_a_steps_largest_scale_on_the_gpu(monkeypatch):
    """The Gluon kernels' scales relative to a row's largest in a K step, as the twin's: every value 2^20 ..
    2^22 below its step's largest scale (D 256, I 384: two and three K steps), against the per-pair path and
    the reference, and against the Triton twin up to the order of the sums."""
    device = torch.device("cuda")
    gen = generator(29, device)
    tokens, experts, hidden, inter, top_k = 40, 4, 256, 384, 2
    x = randn((tokens, hidden), torch.bfloat16, device, gen) * 2.0 ** 20
    w13 = _far_below_the_top(random_fp4((experts, 2 * inter, hidden), gen, device, exponents=(-20, -18)))
    w2 = _far_below_the_top(random_fp4((experts, hidden, inter), gen, device, exponents=(-20, -18)))
    weights, ids = _routing(tokens, experts, top_k, gen, device)
    assert wgmma_fp4.applies(x, w13, w2)
    calls = _spy(monkeypatch, "wgmma_fp4_down")
    got = fp4_clamped_experts(x, w13, w2, weights, ids, limit=1e4, config=WGMMA)
    assert len(calls) == 1
    want = reference(x.double(), w13, w2, weights.double(), ids, limit=1e4)
    per_pair = fp4_clamped_experts(x, w13, w2, weights, ids, limit=1e4, config=PairConfig(16, 64, 32, 4, 1))
    twin = fp4_clamped_experts(x, w13, w2, weights, ids, limit=1e4, config=dataclasses.replace(WGMMA, wgmma=False))
    assert float(want.norm()) > 0 and bool((got[0] == 0).all())
    assert float((got.double() - want).norm() / want.norm()) <= 1e-2
    assert float((got.double() - per_pair.double()).norm() / want.norm()) <= 1e-3
    assert float((got.double() - twin.double()).norm() / want.norm()) <= 1e-3


@pytest.mark.gpu
@pytest.mark.parametrize("tokens, experts", [(24, 16), (64, 256)])
def test_warpgroup_tiles_in_a_cuda_graph_equal_their_eager_run(tokens, experts, monkeypatch):
    """The default path at V4-Flash's shapes where it takes the warpgroup tiles (24 tokens over 16 experts: 9 rows
    an expert; 64 over 256), captured once and replayed on new routing: the same bits as an eager run, and
    the Triton twin's values up to the order of the sums."""
    device = torch.device("cuda")
    gen = generator(tokens + experts, device)
    hidden, inter, top_k = 4096, 2048, 6
    x = randn((tokens, hidden), torch.bfloat16, device, gen)
    w13 = random_fp4((experts, 2 * inter, hidden), gen, device, exponents=(-9, -7))
    w2 = random_fp4((experts, hidden, inter), gen, device, exponents=(-9, -7))
    assert wgmma_fp4.applies(x, w13, w2) and fp4_moe_config(tokens * top_k, experts, device, warpgroup=True) == WGMMA
    calls = _spy(monkeypatch, "wgmma_fp4_gate_up")
    weights, ids = _routing(tokens, experts, top_k, gen, device)
    static_weights, static_ids = weights.clone(), ids.clone()
    fp4_clamped_experts(x, w13, w2, static_weights, static_ids, limit=10.0)      # compiled before the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = fp4_clamped_experts(x, w13, w2, static_weights, static_ids, limit=10.0)
    for _ in range(2):
        weights, ids = _routing(tokens, experts, top_k, gen, device)
        static_weights.copy_(weights)
        static_ids.copy_(ids)
        graph.replay()
        eager = fp4_clamped_experts(x, w13, w2, weights, ids, limit=10.0)
        assert torch.equal(captured, eager)
        twin = fp4_clamped_experts(x, w13, w2, weights, ids, limit=10.0, config=dataclasses.replace(WGMMA, wgmma=False))
        assert float((eager.double() - twin.double()).norm() / twin.double().norm()) <= 1e-3
    assert len(calls) == 4
