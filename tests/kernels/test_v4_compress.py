"""The Triton compressor update (a completed block pooled into an entry) against the torch reference op.

Rows: padded (key_len 0), rows that complete nothing (slot -1), the first entry (for
overlapping windows, block -1 does not exist: only series Cb pools), later entries.
FP8 entries caches (keys as `FP8LatentCache`, CSA's indexer keys as `FP8IndexCache`) take the
entries the tensor path pools, quantized by the cache's own write op.
"""

from __future__ import annotations

import pytest
import torch

from support.fp8_cache_cases import dequantized, fp8_cache_of, same_bits
from support.kernel_cases import assert_close, generator, randn
from mla_func.kernels.index_cache import FP8IndexCache
from mla_func.kernels.reference.dsa import quantize_index_keys
from mla_func.kernels.reference.v4_paged import compress_entries as reference
from mla_func.kernels.triton.cache import write_kv
from mla_func.kernels.triton.dsa_indexer import write_index_key
from mla_func.kernels.triton.v4_compress import compress_entries


def _case(key_lens: list[int], rate: int, overlap: bool, width: int, rope_pairs: int, dtype, device, seed: int,
          norm_dtype=None):
    gen = generator(seed, device)
    n, c, bs, bs_g = len(key_lens), 2 if overlap else 1, 4, 2
    table_width = max(-(-k // bs) for k in key_lens + [1]) + 1
    inputs = randn((1 + n * table_width + 1, bs, 2 * c * width), dtype, device, gen)
    pages = torch.randperm(inputs.shape[0] - 1, generator=gen, device=device)[: n * table_width] + 1
    block_table = pages.view(n, table_width).to(torch.int32)
    entries = randn((2 + n, bs_g, width), dtype, device, gen)
    # Each completing row gets its own slot past block 0 (the reference's scratch block).
    free = (torch.randperm((entries.shape[0] - 1) * bs_g, generator=gen, device=device) + bs_g)[:n]
    slots = [int(s) if k > 0 and k % rate == 0 else -1 for k, s in zip(key_lens, free.tolist())]
    positions = max(key_lens) + 1
    angles = torch.rand((positions, rope_pairs), generator=gen, device=device) * 6
    args = (inputs, entries, torch.tensor(slots, dtype=torch.int64, device=device),
            torch.tensor(key_lens, dtype=torch.int32, device=device), block_table,
            torch.randn((rate, c * width), generator=gen, device=device),
            (1 + 0.2 * torch.randn((width,), generator=gen, device=device)).to(norm_dtype or dtype),
            angles.cos(), angles.sin())
    kwargs = dict(rate=rate, overlap=overlap, eps=1e-6, num_seqs=n)
    return args, kwargs


def _check(args, kwargs, dtype):
    got = compress_entries(*args, **kwargs, inplace=False)
    wide = [a.double() if a.is_floating_point() and a.dtype == dtype else a for a in args]
    want = reference(*wide, **kwargs, inplace=False)
    # Block 0 is the reference's scratch block (its padded writes land there); every other entry must agree,
    # those no row completes untouched.
    assert_close(got[1:], want[1:], dtype)
    written = args[2][args[2] >= 0]
    untouched = torch.ones(args[1][1:].numel() // args[1].shape[2], dtype=torch.bool, device=args[1].device)
    untouched[written - args[1].shape[1]] = False
    assert torch.equal(got[1:].flatten(0, 1)[untouched], args[1][1:].flatten(0, 1)[untouched])
    assert not torch.equal(got, args[1]), "some row completes an entry"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_csa_overlapping_windows(device, dtype):
    # 4: the first entry (only series Cb); 8, 20: later ones; 0 padded; 5, 11 complete nothing.
    args, kwargs = _case([0, 4, 5, 8, 11, 20], rate=4, overlap=True, width=32, rope_pairs=4, dtype=dtype,
                         device=device, seed=1)
    _check(args, kwargs, dtype)


def test_hca_blocks_of_sixteen(device):
    args, kwargs = _case([16, 0, 17, 48, 33], rate=16, overlap=False, width=24, rope_pairs=3,
                         dtype=torch.float32, device=device, seed=2)
    _check(args, kwargs, torch.float32)


def test_bf16_cache_with_a_float32_norm_weight(device):
    args, kwargs = _case([8, 12, 3], rate=4, overlap=True, width=16, rope_pairs=2, dtype=torch.bfloat16,
                         device=device, seed=3, norm_dtype=torch.float32)
    _check(args, kwargs, torch.bfloat16)


def test_inplace_writes_into_the_same_cache(device):
    args, kwargs = _case([4, 8], rate=4, overlap=False, width=16, rope_pairs=2, dtype=torch.float32,
                         device=device, seed=4)
    entries = args[1].clone()
    got = compress_entries(args[0], entries, *args[2:], **kwargs, inplace=True)
    assert got is entries
    torch.testing.assert_close(got, compress_entries(*args, **kwargs, inplace=False))


def test_a_bad_bias_shape_is_named(device):
    args, kwargs = _case([4], rate=4, overlap=True, width=16, rope_pairs=2, dtype=torch.float32,
                         device=device, seed=5)
    with pytest.raises(ValueError, match="position_bias"):
        compress_entries(*args[:5], args[5][:2], *args[6:], **kwargs, inplace=False)


def _fp8_entries(dense: torch.Tensor, kind: str, rope_dim: int) -> FP8IndexCache:
    if kind == "keys":
        return fp8_cache_of(dense, dense.shape[2] - rope_dim)
    values, scales = quantize_index_keys(dense.flatten(0, 1))
    return FP8IndexCache(values=values.view(*dense.shape), scales=scales.view(*dense.shape[:2], 1))


def _rows(cache) -> torch.Tensor:
    """Every entry of an FP8 entries cache, dequantized: [nbg * bsg, Dc] float32."""
    if isinstance(cache, FP8IndexCache):
        return (cache.values.float() * cache.scales).flatten(0, 1)
    return dequantized(cache).float().flatten(0, 1)


@pytest.mark.parametrize("kind", ["keys", "index_keys"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fp8_entries_take_the_pooled_rows_quantized(device, kind, dtype):
    args, kwargs = _case([0, 4, 5, 8, 11, 20], rate=4, overlap=True, width=32, rope_pairs=4, dtype=dtype,
                         device=device, seed=7)
    fp8 = _fp8_entries(args[1], kind, rope_dim=8)
    before = [t.clone() for t in fp8.tensors()]
    got = compress_entries(args[0], fp8, *args[2:], **kwargs, inplace=False)
    assert type(got) is type(fp8) and all(same_bits(a, b) for a, b in zip(fp8.tensors(), before))
    # Exactly the tensor path's entries, written by the cache's own write op.
    slots = args[2]
    pooled = compress_entries(*args, **kwargs, inplace=False).flatten(0, 1)[slots.clamp(min=0)]
    write = write_index_key if kind == "index_keys" else write_kv
    want = write(fp8, slots, pooled, inplace=False)
    assert all(same_bits(a, b) for a, b in zip(got.tensors(), want.tensors()))
    # Near the reference's entries (past block 0, where the reference's padded writes land): the pooled rows
    # agree to the dtype's rounding, so their e4m3 values agree or sit one step (an eighth of the binade) apart.
    scratch = args[1].shape[1]
    ref_cache = reference(args[0], fp8, *args[2:], **kwargs, inplace=False)
    ref, new = _rows(ref_cache)[scratch:], _rows(got)[scratch:]
    torch.testing.assert_close(new, ref, rtol=0.125, atol=1e-3)
    assert (new != _rows(fp8)[scratch:]).any(), "some row completes an entry"
    # Most written e4m3 values are the reference's bits.
    written = slots[slots >= 0]
    codes = [c.values.view(torch.uint8).flatten(0, 1)[written] for c in (got, ref_cache)]
    assert (codes[0] == codes[1]).float().mean() >= 0.9


def test_fp8_entries_in_place(device):
    args, kwargs = _case([4, 8], rate=4, overlap=False, width=16, rope_pairs=2, dtype=torch.float32,
                         device=device, seed=8)
    fp8 = _fp8_entries(args[1], "keys", rope_dim=4)
    want = compress_entries(args[0], fp8, *args[2:], **kwargs, inplace=False)
    got = compress_entries(args[0], fp8, *args[2:], **kwargs, inplace=True)
    assert got is fp8 and all(same_bits(a, b) for a, b in zip(got.tensors(), want.tensors()))


@pytest.mark.gpu
@pytest.mark.parametrize("rate, overlap, width", [(4, True, 512), (4, True, 128), (128, False, 512)])
def test_real_sizes_on_the_gpu(rate, overlap, width):
    """v4-mini's compressors: CSA (512 wide) and its indexer's (128), HCA's 128-token blocks, bf16."""
    device = torch.device("cuda")
    lens = [rate * k for k in (1, 2, 3, 50)] + [0, 5, rate * 64 + 1, rate * 64]
    args, kwargs = _case(lens, rate=rate, overlap=overlap, width=width, rope_pairs=32, dtype=torch.bfloat16,
                         device=device, seed=6)
    _check(args, kwargs, torch.bfloat16)
