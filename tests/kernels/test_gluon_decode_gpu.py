"""The warpgroup-MMA decode (`kernels/gluon/mla_decode.py`, Hopper only), dense and sparse, against the
float64 reference and against its `tl.dot` twin, at the benchmark's shapes, with several queries a sequence,
in graphs."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from support.fp8_cache_cases import dequantized, fp8_cache_of
from support.kernel_cases import LSE_TOLERANCE, assert_close, captured, generator, paged_cache, randn, strided
from mla_func.kernels.gluon import mla_decode as gluon_decode
from mla_func.kernels.gluon import mla_decode_narrow as gluon_narrow
from mla_func.kernels.reference import attention as ref
from mla_func.kernels.reference import dsa as ref_dsa
from mla_func.kernels.triton import decode as tri
from mla_func.kernels.triton import dsa_decode as tri_dsa
from test_dsa_decode import random_indices

pytestmark = pytest.mark.gpu

C, R = 512, 64
SCALE = (C + R) ** -0.5


def _hopper() -> torch.device:
    device = torch.device("cuda")
    if not gluon_decode.available(device):
        pytest.skip("the warpgroup-MMA decode needs a Hopper GPU")
    return device


def _twin(num_heads: int, q_len: int, device: torch.device) -> tri.DecodeConfig:
    """The `tl.dot` kernel the GPU would take without the warpgroup MMA."""
    return tri.launch_config(num_heads, q_len, C, R, device, False, torch.bfloat16, wgmma=False)


def _case(seq_lens, num_heads, q_len, block_size, dtype, seed, non_contiguous=False):
    device = _hopper()
    gen = generator(seed, device)
    kv_cache, table = paged_cache(seq_lens, block_size, C + R, dtype, device, gen)
    q = randn((len(seq_lens) * q_len, num_heads, C + R), dtype, device, gen)
    lens = torch.tensor(seq_lens, dtype=torch.int32, device=device)
    if non_contiguous:
        q, kv_cache, table, lens = strided(q, gen), strided(kv_cache, gen), strided(table, gen), strided(lens, gen)
    return q, kv_cache, table, lens


def _run(q, kv_cache, table, lens, q_len, config=None, **kw):
    return tri.mla_decode(q, kv_cache, table, lens, softmax_scale=SCALE, kv_lora_rank=C, q_len=q_len,
                          config=config, **kw)


@pytest.mark.parametrize("num_heads,q_len", [(128, 1), (64, 1), (100, 1), (128, 2), (128, 3), (128, 4), (16, 4)])
@pytest.mark.parametrize("block_size", [16, 64])
@pytest.mark.parametrize("num_splits", [None, 1, 7])
def test_equals_reference_and_twin(num_heads, q_len, block_size, num_splits):
    lens = [q_len, 63, 64, 65, 1000, 4096, 0, 3000, 129]
    q, kv_cache, table, seq_lens = _case(lens, num_heads, q_len, block_size, torch.bfloat16,
                                         seed=num_heads + 10 * q_len + block_size)
    config = tri.launch_config(num_heads, q_len, C, R, q.device, False, q.dtype)
    assert config.wgmma, "the Hopper default for this decode is the warpgroup-MMA kernel"
    out = torch.full((len(lens) * q_len, num_heads, C), float("nan"), dtype=q.dtype, device=q.device)
    got, got_lse = _run(q, kv_cache, table, seq_lens, q_len, num_splits=num_splits)
    out.copy_(got)
    twin, twin_lse = _run(q, kv_cache, table, seq_lens, q_len, config=_twin(num_heads, q_len, q.device),
                          num_splits=num_splits)
    want, want_lse = ref.mla_decode(q.double(), kv_cache.double(), table, seq_lens, softmax_scale=SCALE,
                                    kv_lora_rank=C, q_len=q_len)
    assert not out.isnan().any()
    assert_close(out, want, torch.bfloat16)
    assert_close(got_lse, want_lse, torch.bfloat16, LSE_TOLERANCE)
    assert_close(out, twin, torch.bfloat16)
    assert_close(got_lse, twin_lse, torch.bfloat16, LSE_TOLERANCE)
    padded = (seq_lens == 0).repeat_interleave(q_len)
    assert torch.all(out[padded] == 0) and torch.all(got_lse[padded] == float("-inf"))


def test_fp16_strided_queries_and_value_projection():
    lens = [5, 700, 64, 2048]
    q, kv_cache, table, seq_lens = _case(lens, 128, 1, 64, torch.float16, seed=3)
    q, table, seq_lens = (strided(t, generator(6, q.device)) for t in (q, table, seq_lens))
    w_uv = randn((128, 128, C), torch.float16, q.device, generator(4, q.device), scale=C ** -0.5)
    got, got_lse = _run(q, kv_cache, table, seq_lens, 1, w_uv=w_uv)
    want, want_lse = ref.mla_decode(q.double(), kv_cache.double(), table, seq_lens, softmax_scale=SCALE,
                                    kv_lora_rank=C)
    want = torch.einsum("bhc,hvc->bhv", want.to(torch.float16).double(), w_uv.double())
    assert_close(got, want, torch.float16)
    assert_close(got_lse, want_lse, torch.float16, LSE_TOLERANCE)


def test_graph_replay_with_new_lengths_equals_eager():
    lens0 = [2048] * 8
    q, kv_cache, table, lens = _case(lens0, 128, 1, 64, torch.bfloat16, seed=21)
    config = tri.launch_config(128, 1, C, R, q.device, False, q.dtype)
    workspace = tri.mla_decode_workspace(8, 128, C, table.shape[1], 64, q.device, config=config)

    def step():
        return _run(q, kv_cache, table, lens, 1, workspace=workspace)

    graph, (out, lse) = captured(step)
    for new_lens in ([1, 2048, 0, 700, 64, 65, 1999, 3], lens0):
        lens.copy_(torch.tensor(new_lens, dtype=torch.int32))
        graph.replay()
        eager_out, eager_lse = step()
        torch.testing.assert_close(out, eager_out, atol=0, rtol=0)
        torch.testing.assert_close(lse, eager_lse, atol=0, rtol=0)
        want, _ = ref.mla_decode(q.double(), kv_cache.double(), table, lens, softmax_scale=SCALE, kv_lora_rank=C)
        assert_close(out, want, torch.bfloat16)


def test_refuses_what_it_cannot_take():
    q, kv_cache, table, lens = _case([70, 5], 16, 1, 64, torch.bfloat16, seed=5)
    wgmma = tri.DecodeConfig(block_h=64, block_n=64, num_warps=8, num_stages=2, wgmma=True)
    with pytest.raises(ValueError, match="warpgroup-MMA"):
        _run(q, kv_cache, table, lens, 1, config=wgmma)          # 16 rows a sequence: the twin's case
    assert not tri.launch_config(16, 1, C, R, q.device, False, q.dtype).wgmma
    assert not tri.launch_config(128, 1, C, R, q.device, False, torch.float32).wgmma


# --- over an FP8 latent cache: its tiles widened in shared memory, the keys the dequantized cache holds ------

@pytest.mark.parametrize("num_heads,q_len", [(128, 1), (64, 1), (100, 1), (128, 3)])
@pytest.mark.parametrize("block_size", [16, 64])
@pytest.mark.parametrize("num_splits", [None, 7])
def test_fp8_cache_equals_its_dequantized_rows_bit_for_bit(num_heads, q_len, block_size, num_splits):
    """Over an FP8 cache the kernel multiplies the rows `FP8LatentCache.rows` gives, so its outputs equal the
    same kernel's over those rows as a plain cache bit for bit; and the float64 reference's and the `tl.dot`
    twin's (which dequantizes in registers) over the FP8 cache within bf16's tolerance."""
    lens = [q_len, 63, 64, 65, 1000, 4096, 0, 3000, 129]
    q, kv_cache, table, seq_lens = _case(lens, num_heads, q_len, block_size, torch.bfloat16,
                                         seed=5 * num_heads + q_len + block_size)
    fp8 = fp8_cache_of(kv_cache, C)
    plain = dequantized(fp8)
    config = tri.launch_config(num_heads, q_len, C, R, q.device, True, q.dtype)
    assert config.wgmma, "the Hopper default for this decode over an FP8 cache is the warpgroup-MMA kernel"
    got, got_lse = _run(q, fp8, table, seq_lens, q_len, num_splits=num_splits)
    same, same_lse = _run(q, plain, table, seq_lens, q_len, num_splits=num_splits)
    assert not got.isnan().any()
    torch.testing.assert_close(got, same, atol=0, rtol=0)
    torch.testing.assert_close(got_lse, same_lse, atol=0, rtol=0)
    twin_config = tri.launch_config(num_heads, q_len, C, R, q.device, True, q.dtype, wgmma=False)
    twin, twin_lse = _run(q, fp8, table, seq_lens, q_len, config=twin_config, num_splits=num_splits)
    want, want_lse = ref.mla_decode(q.double(), plain.double(), table, seq_lens, softmax_scale=SCALE,
                                    kv_lora_rank=C, q_len=q_len)
    assert_close(got, want, torch.bfloat16)
    assert_close(got_lse, want_lse, torch.bfloat16, LSE_TOLERANCE)
    assert_close(got, twin, torch.bfloat16)
    assert_close(got_lse, twin_lse, torch.bfloat16, LSE_TOLERANCE)
    padded = (seq_lens == 0).repeat_interleave(q_len)
    assert torch.all(got[padded] == 0) and torch.all(got_lse[padded] == float("-inf"))


def test_fp8_cache_graph_replay_with_new_lengths_equals_eager():
    lens0 = [2048] * 8
    q, kv_cache, table, lens = _case(lens0, 128, 1, 64, torch.bfloat16, seed=22)
    fp8 = fp8_cache_of(kv_cache, C)
    config = tri.launch_config(128, 1, C, R, q.device, True, q.dtype)
    assert config.wgmma
    workspace = tri.mla_decode_workspace(8, 128, C, table.shape[1], 64, q.device, config=config)

    def step():
        return _run(q, fp8, table, lens, 1, workspace=workspace)

    graph, (out, lse) = captured(step)
    for new_lens in ([1, 2048, 0, 700, 64, 65, 1999, 3], lens0):
        lens.copy_(torch.tensor(new_lens, dtype=torch.int32))
        graph.replay()
        eager_out, eager_lse = step()
        torch.testing.assert_close(out, eager_out, atol=0, rtol=0)
        torch.testing.assert_close(lse, eager_lse, atol=0, rtol=0)
        want, _ = ref.mla_decode(q.double(), dequantized(fp8).double(), table, lens, softmax_scale=SCALE,
                                 kv_lora_rank=C)
        assert_close(out, want, torch.bfloat16)


# --- few heads over an FP8 cache: the keys-as-rows kernel (`gluon.mla_decode_narrow`) ----------------------

_NARROW = tri.DecodeConfig(block_h=16, block_n=64, num_warps=4, num_stages=1, narrow=True, programs_per_sm=2)


def _float32_rows(fp8) -> torch.Tensor:
    """The FP8 cache's rows dequantized in float32 (e4m3 value x scale, unrounded): what its values stand for."""
    return dequantized(dataclasses.replace(fp8, rope=fp8.rope.float()))


def _relative_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    return ((actual.double() - expected.double()).norm() / expected.double().norm()).item()


@pytest.mark.parametrize("num_heads", [16, 12, 1])
@pytest.mark.parametrize("block_size", [16, 64])
@pytest.mark.parametrize("num_splits", [None, 1, 7])
def test_narrow_fp8_cache_is_nearer_its_float32_rows_than_the_bf16_rows(num_heads, block_size, num_splits):
    """At up to 16 heads and one query the op takes the keys-as-rows kernel over an FP8 cache, which widens the
    latent into float16: its outputs equal the float64 reference's over the float32-dequantized rows and the
    `tl.dot` kernel's (which reads the bf16 rows `FP8LatentCache.rows` gives) within bf16's tolerance, and its
    float32 LSE (the scores, before the outputs' rounding to bf16) lies nearer the float32 rows' than the
    `tl.dot` kernel's does."""
    lens = [1, 63, 64, 65, 1000, 4096, 0, 3000, 129]
    q, kv_cache, table, seq_lens = _case(lens, num_heads, 1, block_size, torch.bfloat16,
                                         seed=7 * num_heads + block_size)
    fp8 = fp8_cache_of(kv_cache, C)
    config = tri.launch_config(num_heads, 1, C, R, q.device, True, q.dtype)
    assert config.narrow, "the Hopper default for few heads over an FP8 cache is the keys-as-rows kernel"
    assert not tri.launch_config(num_heads, 1, C, R, q.device, False, q.dtype).narrow   # a plain cache: chunks
    got, got_lse = _run(q, fp8, table, seq_lens, 1, num_splits=num_splits)
    assert not got.isnan().any()
    twin_config = tri.launch_config(num_heads, 1, C, R, q.device, True, q.dtype, wgmma=False)
    twin, twin_lse = _run(q, fp8, table, seq_lens, 1, config=twin_config, num_splits=num_splits)
    want, want_lse = ref.mla_decode(q.double(), _float32_rows(fp8).double(), table, seq_lens, softmax_scale=SCALE,
                                    kv_lora_rank=C)
    assert_close(got, want, torch.bfloat16)
    assert_close(got_lse, want_lse, torch.bfloat16, LSE_TOLERANCE)
    assert_close(got, twin, torch.bfloat16)
    assert_close(got_lse, twin_lse, torch.bfloat16, LSE_TOLERANCE)
    live = seq_lens > 0
    assert _relative_error(got_lse[live], want_lse[live]) < _relative_error(twin_lse[live], want_lse[live])
    padded = seq_lens == 0
    assert torch.all(got[padded] == 0) and torch.all(got_lse[padded] == float("-inf"))


def test_narrow_takes_queries_beyond_float16():
    """Queries whose magnitudes float16 cannot hold (up to about 2^18; the softmax scale brings their scores back
    to the usual range) give the float64 reference's answer: each head's Q_nope is divided by a power of two
    before the float16 product, and its scores multiplied back."""
    lens = [5000, 64, 3000, 129]
    q, kv_cache, table, seq_lens = _case(lens, 16, 1, 64, torch.bfloat16, seed=31)
    q = q * 65536
    fp8 = fp8_cache_of(kv_cache, C)
    assert q[..., :C].abs().max() > 65504
    got, got_lse = tri.mla_decode(q, fp8, table, seq_lens, softmax_scale=SCALE / 65536, kv_lora_rank=C,
                                  config=_NARROW)
    want, want_lse = ref.mla_decode(q.double(), _float32_rows(fp8).double(), table, seq_lens,
                                    softmax_scale=SCALE / 65536, kv_lora_rank=C)
    assert not got.isnan().any()
    assert_close(got, want, torch.bfloat16)
    assert_close(got_lse, want_lse, torch.bfloat16, LSE_TOLERANCE)


def test_narrow_clips_scales_float16_cannot_hold():
    """A latent group of magnitudes beyond float16's range (a scale above `SCALE_MAX`) reads as its values times
    SCALE_MAX: finite outputs, the reference's over the rows with the scales so clipped."""
    lens = [3000, 700]
    q, kv_cache, table, seq_lens = _case(lens, 16, 1, 64, torch.bfloat16, seed=37)
    kv_cache[1::3, :, 128:256] *= 2 ** 17
    fp8 = fp8_cache_of(kv_cache, C)
    assert fp8.scales.max() > gluon_narrow.SCALE_MAX
    scale = SCALE / 2 ** 17
    got, got_lse = tri.mla_decode(q, fp8, table, seq_lens, softmax_scale=scale, kv_lora_rank=C, config=_NARROW)
    clipped = dataclasses.replace(fp8, scales=fp8.scales.clamp(max=gluon_narrow.SCALE_MAX))
    want, want_lse = ref.mla_decode(q.double(), _float32_rows(clipped).double(), table, seq_lens,
                                    softmax_scale=scale, kv_lora_rank=C)
    assert got.isfinite().all()
    # The clipped group's outputs are averages of values up to 448 x SCALE_MAX: compared on their own scale.
    group = slice(128, 256)
    got, want = got.double(), want.clone()
    got[..., group] /= 2 ** 14
    want[..., group] /= 2 ** 14
    assert_close(got, want, torch.bfloat16)
    assert_close(got_lse, want_lse, torch.bfloat16, LSE_TOLERANCE)


def test_narrow_fp8_cache_with_value_projection_and_in_a_graph():
    """v2-lite's decode as the model calls it (16 heads, W_UV merged at small batches and projected at large),
    captured and replayed on new lengths: equal to eager, and to the reference."""
    lens0 = [2048] * 12
    q, kv_cache, table, lens = _case(lens0, 16, 1, 64, torch.bfloat16, seed=23)
    fp8 = fp8_cache_of(kv_cache, C)
    w_uv = randn((16, 128, C), torch.bfloat16, q.device, generator(24, q.device), scale=C ** -0.5)
    for rows in (4, 12):          # W_UV in the merge (<= 8 rows), then merged and projected
        q_rows, lens_rows, table_rows = q[:rows], lens[:rows], table[:rows]
        config = tri.launch_config(16, 1, C, R, q.device, True, q.dtype)
        workspace = tri.mla_decode_workspace(rows, 16, C, table.shape[1], 64, q.device, config=config)

        def step():
            return _run(q_rows, fp8, table_rows, lens_rows, 1, config=config, workspace=workspace, w_uv=w_uv)

        graph, (out, lse) = captured(step)
        for new_lens in ([1, 2048, 0, 700, 64, 65, 1999, 3, 5, 9, 100, 2000][:rows], lens0[:rows]):
            lens_rows.copy_(torch.tensor(new_lens, dtype=torch.int32))
            graph.replay()
            eager_out, eager_lse = step()
            torch.testing.assert_close(out, eager_out, atol=0, rtol=0)
            torch.testing.assert_close(lse, eager_lse, atol=0, rtol=0)
            want, _ = ref.mla_decode(q_rows.double(), dequantized(fp8).double(), table_rows, lens_rows,
                                     softmax_scale=SCALE, kv_lora_rank=C)
            want = torch.einsum("bhc,hvc->bhv", want.to(torch.bfloat16).double(), w_uv.double())
            assert_close(out, want, torch.bfloat16)


def test_narrow_refuses_what_it_cannot_take():
    q, kv_cache, table, lens = _case([70, 5], 32, 2, 64, torch.bfloat16, seed=25)
    fp8 = fp8_cache_of(kv_cache, C)
    with pytest.raises(ValueError, match="keys-as-rows"):
        _run(q, fp8, table, lens, 2, config=_NARROW)              # 32 heads x 2 queries
    with pytest.raises(ValueError, match="over an FP8 cache.*a plain cache"):
        _run(q[::2, :16], kv_cache, table, lens, 1, config=_NARROW)
    assert not tri.launch_config(16, 2, C, R, q.device, True, q.dtype).narrow
    assert not tri.launch_config(17, 1, C, R, q.device, True, q.dtype).narrow
    assert not tri.launch_config(16, 1, C, R, q.device, True, torch.float32).narrow
    # Few keys in all: the tl.dot kernel's shorter splits are faster there.
    assert not tri.launch_config(16, 1, C, R, q.device, True, q.dtype, table_keys=4096).narrow
    assert tri.launch_config(16, 1, C, R, q.device, True, q.dtype, table_keys=8192).narrow


def test_a_cache_cp_async_cannot_gather_takes_the_twin():
    """A cache whose columns are strided is read by the `tl.dot` twin, to the same answer."""
    lens = [5, 700, 64]
    q, kv_cache, table, seq_lens = _case(lens, 128, 1, 64, torch.bfloat16, seed=7, non_contiguous=True)
    assert not gluon_decode.copyable(kv_cache)
    got, got_lse = _run(q, kv_cache, table, seq_lens, 1)
    want, want_lse = ref.mla_decode(q.double(), kv_cache.double(), table, seq_lens, softmax_scale=SCALE,
                                    kv_lora_rank=C)
    assert_close(got, want, torch.bfloat16)
    assert_close(got_lse, want_lse, torch.bfloat16, LSE_TOLERANCE)
    wgmma = tri.launch_config(128, 1, C, R, q.device, False, q.dtype)
    with pytest.raises(ValueError, match="aligned contiguous"):
        _run(q, kv_cache, table, seq_lens, 1, config=wgmma)


# --- sparse (V3.2's top-k attention): the same kernel over the positions an index list selects ---------------

def _sparse_case(key_lens, top_k, num_heads, block_size, seed):
    device = _hopper()
    gen = generator(seed, device)
    kv_cache, table = paged_cache(key_lens, block_size, C + R, torch.bfloat16, device, gen)
    q = randn((len(key_lens), num_heads, C + R), torch.bfloat16, device, gen)
    indices = random_indices(key_lens, top_k, device, gen)
    indices[0, :3] = torch.tensor([-1, table.shape[1] * block_size, 5], dtype=torch.int32)   # none, past the table
    return q, kv_cache, table, indices


def _check_sparse(q, kv_cache, table, indices, config, num_splits):
    """The sparse op on `config` against the float64 reference and its `tl.dot` twin, within bf16's tolerance; a
    row with no key gives out 0 and LSE -inf (the cases hold one)."""
    num_heads = q.shape[1]
    kw = dict(softmax_scale=SCALE, kv_lora_rank=C, num_splits=num_splits)
    got, got_lse = tri_dsa.sparse_mla_decode(q, kv_cache, table, indices, config=config, **kw)
    twin_config = tri_dsa.sparse_launch_config(num_heads, C, R, q.device, False, q.dtype, wgmma=False)
    twin, twin_lse = tri_dsa.sparse_mla_decode(q, kv_cache, table, indices, config=twin_config, **kw)
    want, want_lse = ref_dsa.sparse_mla_decode(q.double(), kv_cache.double(), table, indices, softmax_scale=SCALE,
                                               kv_lora_rank=C)
    assert not got.isnan().any()
    assert_close(got, want, torch.bfloat16)
    assert_close(got_lse, want_lse, torch.bfloat16, LSE_TOLERANCE)
    assert_close(got, twin, torch.bfloat16)
    assert_close(got_lse, twin_lse, torch.bfloat16, LSE_TOLERANCE)
    empty = (indices < 0).all(dim=1)
    assert empty.any() and torch.all(got[empty] == 0) and torch.all(got_lse[empty] == float("-inf"))


@pytest.mark.parametrize("num_heads", [128, 64, 100])
@pytest.mark.parametrize("top_k,block_size", [(2048, 64), (100, 16)])
@pytest.mark.parametrize("num_splits", [None, 1, 5])
def test_sparse_equals_reference_and_twin(num_heads, top_k, block_size, num_splits):
    key_lens = [3000, 50, 4096, 0, 2100, 64]
    q, kv_cache, table, indices = _sparse_case(key_lens, top_k, num_heads, block_size, seed=num_heads + top_k)
    config = tri_dsa.sparse_launch_config(num_heads, C, R, q.device, False, q.dtype)
    assert config.wgmma
    _check_sparse(q, kv_cache, table, indices, config, num_splits)


def test_sparse_graph_replay_with_new_indices_equals_eager():
    key_lens = [4096] * 8
    q, kv_cache, table, indices = _sparse_case(key_lens, 2048, 128, 64, seed=31)
    config = tri_dsa.sparse_launch_config(128, C, R, q.device, False, q.dtype)
    workspace = tri_dsa.sparse_mla_decode_workspace(8, 128, C, 2048, q.device, config)

    def step():
        return tri_dsa.sparse_mla_decode(q, kv_cache, table, indices, softmax_scale=SCALE, kv_lora_rank=C,
                                         workspace=workspace)

    graph, (out, lse) = captured(step)
    gen = generator(32, q.device)
    for new_lens in ([100, 4096, 0, 700, 64, 65, 1999, 3], key_lens):
        indices.copy_(random_indices(new_lens, 2048, q.device, gen))
        graph.replay()
        eager_out, eager_lse = step()
        torch.testing.assert_close(out, eager_out, atol=0, rtol=0)
        torch.testing.assert_close(lse, eager_lse, atol=0, rtol=0)
        want, _ = ref_dsa.sparse_mla_decode(q.double(), kv_cache.double(), table, indices, softmax_scale=SCALE,
                                            kv_lora_rank=C)
        assert_close(out, want, torch.bfloat16)


def test_sparse_prefill_rows_of_one_sequence_equal_reference_and_twin():
    """V3.2's prefill as the model and `bench/dsa_kernels.py --wgmma` run it: a chunk's rows share one
    sequence's table, each row over top-k positions of its own causal prefix (some with fewer keys than k)."""
    device = _hopper()
    gen = generator(41, device)
    context, chunk, top_k = 3000, 160, 2048
    kv_cache, table = paged_cache([context], 64, C + R, torch.bfloat16, device, gen)
    positions = range(context - chunk, context)
    # The chunk's rows see more keys than top_k; eight rows stand for a prompt's first positions (fewer
    # than top_k, exactly top_k, one more).
    key_lens = [p + 1 for p in positions][:chunk - 8] + [1, 7, 100, 2047, 2048, 2049, 1000, 3]
    indices = random_indices(key_lens, top_k, device, gen)
    rows_table = table.expand(chunk, table.shape[1]).contiguous()
    q = randn((chunk, 128, C + R), torch.bfloat16, device, gen)
    kw = dict(softmax_scale=SCALE, kv_lora_rank=C)
    got, got_lse = tri_dsa.sparse_mla_decode(q, kv_cache, rows_table, indices, **kw)
    twin_config = tri_dsa.sparse_launch_config(128, C, R, device, False, q.dtype, wgmma=False)
    twin, twin_lse = tri_dsa.sparse_mla_decode(q, kv_cache, rows_table, indices, config=twin_config, **kw)
    want, want_lse = ref_dsa.sparse_mla_decode(q.double(), kv_cache.double(), rows_table, indices, **kw)
    assert tri_dsa.sparse_launch_config(128, C, R, device, False, q.dtype).wgmma
    assert_close(got, want, torch.bfloat16)
    assert_close(got_lse, want_lse, torch.bfloat16, LSE_TOLERANCE)
    assert_close(got, twin, torch.bfloat16)
    assert_close(got_lse, twin_lse, torch.bfloat16, LSE_TOLERANCE)


@pytest.mark.parametrize("num_heads", [128, 64])
@pytest.mark.parametrize("top_k,block_size", [(2048, 64), (100, 16)])
def test_sparse_fp8_cache_equals_its_dequantized_rows_bit_for_bit(num_heads, top_k, block_size):
    """V3.2's sparse decode over an FP8 cache (FlashMLA's cache semantics): bit for bit the kernel's answer over
    the dequantized rows, and the reference's and the twin's within bf16's tolerance."""
    key_lens = [3000, 50, 4096, 0, 2100, 64]
    q, kv_cache, table, indices = _sparse_case(key_lens, top_k, num_heads, block_size, seed=3 * num_heads + top_k)
    fp8 = fp8_cache_of(kv_cache, C)
    plain = dequantized(fp8)
    assert tri_dsa.sparse_launch_config(num_heads, C, R, q.device, True, q.dtype).wgmma
    kw = dict(softmax_scale=SCALE, kv_lora_rank=C)
    got, got_lse = tri_dsa.sparse_mla_decode(q, fp8, table, indices, **kw)
    same, same_lse = tri_dsa.sparse_mla_decode(q, plain, table, indices, **kw)
    torch.testing.assert_close(got, same, atol=0, rtol=0)
    torch.testing.assert_close(got_lse, same_lse, atol=0, rtol=0)
    twin_config = tri_dsa.sparse_launch_config(num_heads, C, R, q.device, True, q.dtype, wgmma=False)
    twin, twin_lse = tri_dsa.sparse_mla_decode(q, fp8, table, indices, config=twin_config, **kw)
    want, want_lse = ref_dsa.sparse_mla_decode(q.double(), plain.double(), table, indices, **kw)
    assert not got.isnan().any()
    assert_close(got, want, torch.bfloat16)
    assert_close(got_lse, want_lse, torch.bfloat16, LSE_TOLERANCE)
    assert_close(got, twin, torch.bfloat16)
    assert_close(got_lse, twin_lse, torch.bfloat16, LSE_TOLERANCE)


# --- sparse at up to 16 heads over a 16-bit cache: keys as the products' rows (`gluon.dsa_decode_narrow`) -------

_SPARSE_NARROW = tri.DecodeConfig(block_h=16, block_n=64, num_warps=4, num_stages=2, narrow=True, programs_per_sm=1)


def _sparse_narrow_config(num_heads: int, device: torch.device) -> tri.DecodeConfig:
    config = tri_dsa.sparse_launch_config(num_heads, C, R, device, False, torch.bfloat16)
    assert config.narrow, "the Hopper default for a sparse decode of <= 16 heads is the keys-as-rows kernel"
    return config


@pytest.mark.parametrize("num_heads", [16, 12, 1])
@pytest.mark.parametrize("top_k,block_size", [(2048, 64), (100, 16), (700, 64)])
@pytest.mark.parametrize("num_splits", [None, 1, 5])
def test_narrow_sparse_equals_reference_and_twin(num_heads, top_k, block_size, num_splits):
    key_lens = [3000, 50, 4096, 0, 2100, 64, 129, 5000]
    q, kv_cache, table, indices = _sparse_case(key_lens, top_k, num_heads, block_size,
                                               seed=7 * num_heads + top_k + block_size)
    _check_sparse(q, kv_cache, table, indices, _sparse_narrow_config(num_heads, q.device), num_splits)


def test_narrow_sparse_is_the_op_from_eight_rows_of_2048_slots():
    """The op takes the keys-as-rows kernel by itself where it was measured faster (8 rows x 2048 slots and
    more), with the splits of one program a multiprocessor, and keeps the `tl.dot` kernel below that, for FP8
    caches, fp32 queries and more than 16 heads."""
    device = _hopper()
    assert tri_dsa.sparse_launch_config(16, C, R, device, False, torch.bfloat16, slots=8 * 2048) == _SPARSE_NARROW
    assert tri_dsa.sparse_launch_config(16, C, R, device, False, torch.float16, slots=64 * 2048).narrow
    assert not tri_dsa.sparse_launch_config(16, C, R, device, False, torch.bfloat16, slots=4 * 2048).narrow
    assert not tri_dsa.sparse_launch_config(16, C, R, device, True, torch.bfloat16).narrow
    assert not tri_dsa.sparse_launch_config(16, C, R, device, False, torch.float32).narrow
    assert not tri_dsa.sparse_launch_config(32, C, R, device, False, torch.bfloat16).narrow
    assert tri_dsa.sparse_mla_decode_num_splits(64, 16, 2048, device, _SPARSE_NARROW) == 2
    key_lens = [9000] * 8
    q, kv_cache, table, indices = _sparse_case(key_lens, 2048, 16, 64, seed=51)
    got, got_lse = tri_dsa.sparse_mla_decode(q, kv_cache, table, indices, softmax_scale=SCALE, kv_lora_rank=C)
    forced, forced_lse = tri_dsa.sparse_mla_decode(q, kv_cache, table, indices, softmax_scale=SCALE, kv_lora_rank=C,
                                                   config=_SPARSE_NARROW)
    torch.testing.assert_close(got, forced, atol=0, rtol=0)
    torch.testing.assert_close(got_lse, forced_lse, atol=0, rtol=0)


def test_narrow_sparse_with_value_projection_and_in_a_graph():
    """V3.2's decode at 16 heads as the model calls it (W_UV merged at 2 rows, projected after the merge at 8),
    captured and replayed on new index lists: equal to eager, and to the reference."""
    key_lens = [4096] * 8
    q, kv_cache, table, indices = _sparse_case(key_lens, 2048, 16, 64, seed=53)
    w_uv = randn((16, 128, C), torch.bfloat16, q.device, generator(54, q.device), scale=C ** -0.5)
    gen = generator(55, q.device)
    for rows in (2, 8):
        q_rows, table_rows, indices_rows = q[:rows], table[:rows], indices[:rows]
        workspace = tri_dsa.sparse_mla_decode_workspace(rows, 16, C, 2048, q.device, _SPARSE_NARROW)

        def step():
            return tri_dsa.sparse_mla_decode(q_rows, kv_cache, table_rows, indices_rows, softmax_scale=SCALE,
                                             kv_lora_rank=C, w_uv=w_uv, workspace=workspace, config=_SPARSE_NARROW)

        graph, (out, lse) = captured(step)
        for new_lens in ([100, 4096, 0, 700, 64, 65, 1999, 3][:rows], key_lens[:rows]):
            indices_rows.copy_(random_indices(new_lens, 2048, q.device, gen))
            graph.replay()
            eager_out, eager_lse = step()
            torch.testing.assert_close(out, eager_out, atol=0, rtol=0)
            torch.testing.assert_close(lse, eager_lse, atol=0, rtol=0)
            want, _ = ref_dsa.sparse_mla_decode(q_rows.double(), kv_cache.double(), table_rows, indices_rows,
                                                softmax_scale=SCALE, kv_lora_rank=C)
            want = torch.einsum("bhc,hvc->bhv", want.to(torch.bfloat16).double(), w_uv.double())
            assert_close(out, want, torch.bfloat16)


def test_narrow_sparse_refuses_what_it_cannot_take():
    q, kv_cache, table, indices = _sparse_case([300, 70], 128, 32, 64, seed=57)
    kw = dict(softmax_scale=SCALE, kv_lora_rank=C, config=_SPARSE_NARROW)
    with pytest.raises(ValueError, match="keys-as-rows sparse kernel.*32 heads"):
        tri_dsa.sparse_mla_decode(q, kv_cache, table, indices, **kw)
    with pytest.raises(ValueError, match="keys-as-rows sparse kernel.*an FP8 cache"):
        tri_dsa.sparse_mla_decode(q[:, :16], fp8_cache_of(kv_cache, C), table, indices, **kw)
