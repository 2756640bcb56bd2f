"""The Triton V4 attention (window + compressed entries + sink) against the torch reference op.

Rows cover every phase a row can be in: padded (no key), a window not yet full,
no complete entry yet, exactly the first compressed entry, fewer complete entries
than the top-k (a -1 tail), more than it, and a window that has slid. The reference
runs in float64 on the same (rounded) inputs. FP8 key caches (`FP8LatentCache`, both caches) are
compared with the reference over their dequantized rows, which is what the reference reads from them.
"""

from __future__ import annotations

import pytest
import torch

from support.fp8_cache_cases import dequantized, fp8_cache_of
from support.kernel_cases import LSE_TOLERANCE, assert_close, generator, randn, strided
from mla_func.kernels.latent_cache import FP8LatentCache
from mla_func.kernels.reference.v4_paged import window_entry_attention as reference
from mla_func.kernels.triton.v4_attention import window_entry_attention

WINDOW = 8


def _tables(num_rows: int, width: int, num_blocks: int, gen: torch.Generator, device) -> torch.Tensor:
    """Distinct random pages per row (block 0 never handed out)."""
    pages = torch.randperm(num_blocks - 1, generator=gen, device=device)[: num_rows * width] + 1
    return pages.view(num_rows, width).to(torch.int32)


def _case(key_lens: list[int], heads: int, dim: int, dtype, device, seed: int, *, rate: int = 4,
          topk: int | None = None, entries: bool = True, window: int = WINDOW):
    gen = generator(seed, device)
    n = len(key_lens)
    bs, bs_g = 4, 2
    width = max(-(-k // bs) for k in key_lens + [1]) + 1
    width_g = max(-(-(k // rate) // bs_g) for k in key_lens + [1]) + 1
    window_cache = randn((1 + n * width + 2, bs, dim), dtype, device, gen)
    block_table = _tables(n, width, window_cache.shape[0], gen, device)
    lens = torch.tensor(key_lens, dtype=torch.int32, device=device)
    q = randn((n, heads, dim), dtype, device, gen, scale=dim ** -0.25)
    sinks = randn((heads,), torch.float32, device, gen)
    kwargs: dict = dict(softmax_scale=dim ** -0.5, sliding_window=window)
    if entries:
        entry_cache = randn((1 + n * width_g + 2, bs_g, dim), dtype, device, gen)
        kwargs.update(entry_cache=entry_cache, entry_table=_tables(n, width_g, entry_cache.shape[0], gen, device),
                      compress_rate=rate)
        if topk is not None:
            # The indexer's contract: ascending picks among the complete entries, -1 filling the tail.
            rows = []
            for k in key_lens:
                count = k // rate
                picks = sorted(torch.randperm(max(count, 1), generator=gen, device=device)[:min(topk, count)].tolist())
                rows.append(picks + [-1] * (topk - len(picks)))
            kwargs["entry_indices"] = torch.tensor(rows, dtype=torch.int32, device=device)
    return (q, window_cache, block_table, lens, sinks), kwargs


def _double(args, kwargs):
    def wide(x):
        return x.double() if isinstance(x, torch.Tensor) and x.is_floating_point() else x
    return [wide(a) for a in args], {k: wide(v) for k, v in kwargs.items()}


def _as_fp8(args, kwargs, rope_dim: int):
    """The case with both key caches in FP8 (the trailing rope_dim values kept in the cache's dtype)."""
    window = args[1]
    fp8_args = (args[0], fp8_cache_of(window, window.shape[2] - rope_dim), *args[2:])
    fp8_kwargs = dict(kwargs)
    if "entry_cache" in kwargs:
        fp8_kwargs["entry_cache"] = fp8_cache_of(kwargs["entry_cache"], window.shape[2] - rope_dim)
    return fp8_args, fp8_kwargs


def _dense(args, kwargs):
    """FP8 key caches replaced by their dequantized rows (tensors pass as they are)."""
    def rows(x):
        return dequantized(x) if isinstance(x, FP8LatentCache) else x
    return [rows(a) for a in args], {k: rows(v) for k, v in kwargs.items()}


def _check(args, kwargs, dtype, **extra):
    out, lse = window_entry_attention(*args, **kwargs, **extra)
    wide_args, wide_kwargs = _double(*_dense(args, kwargs))
    want_out, want_lse = reference(*wide_args, **wide_kwargs)
    assert out.dtype == args[0].dtype and lse.dtype == torch.float32
    assert torch.isfinite(out).all() and not torch.isnan(lse).any()
    assert_close(out, want_out, dtype)
    assert_close(lse, want_lse, dtype, LSE_TOLERANCE)
    return out, lse


# 0: padded; 3: window not full, no entry; 4: the first entry; 13: window full, 3 entries;
# 23 and 41: the window slid, more entries than the top-k.
KEY_LENS = [0, 3, 4, 13, 23, 41]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("splits", [None, 1, 3])
def test_csa_rows_over_window_and_top_k_entries(device, dtype, splits):
    args, kwargs = _case(KEY_LENS, 4, 32, dtype, device, seed=1, topk=5)
    out, lse = _check(args, kwargs, dtype, num_splits=splits)
    # The padded row attends to the sink alone: out 0, lse = the sink.
    assert bool((out[0] == 0).all())
    torch.testing.assert_close(lse[0], args[4].float())


@pytest.mark.parametrize("splits", [None, 2])
def test_hca_rows_over_every_complete_entry(device, splits):
    args, kwargs = _case([0, 5, 16, 33, 70], 20, 48, torch.float32, device, seed=2, rate=16)
    _check(args, kwargs, torch.float32, num_splits=splits)


def test_sliding_window_layer_without_entries(device):
    args, kwargs = _case([0, 1, 7, 8, 19], 4, 16, torch.bfloat16, device, seed=3, entries=False)
    _check(args, kwargs, torch.bfloat16, num_splits=2)


def test_strided_queries_and_a_workspace(device):
    lens = [0, 13, 41]
    args, kwargs = _case(lens, 4, 32, torch.float32, device, seed=4, topk=12)
    q = strided(args[0], generator(5, device))
    # The split count is forced: the device's own choice for 20 keys is one split on a GPU (the
    # workspace would go unused); the NaN-filled workspace shows every partial is written before read.
    splits = 3
    workspace = (torch.full((len(lens), 4, splits, 32), float("nan"), device=device),
                 torch.full((len(lens), 4, splits), float("nan"), device=device))
    _check((q, *args[1:]), kwargs, torch.float32, workspace=workspace, num_splits=splits)


def test_picks_past_a_narrow_entry_table_are_no_key(device):
    """An entry table narrower than a row's complete entries: picks past its capacity are masked, as the
    reference masks them, and nothing past the table is read."""
    args, kwargs = _case([41, 33], 4, 32, torch.float32, device, seed=7, topk=8)
    kwargs["entry_table"] = kwargs["entry_table"][:, :3].contiguous()          # capacity 6 of 10 and 8 entries
    kwargs["entry_indices"] = torch.tensor([[0, 2, 5, 6, 7, 9, -1, -1], [1, 4, 6, 7, -1, -1, -1, -1]],
                                           dtype=torch.int32, device=device)
    for splits in (1, 2):
        _check(args, kwargs, torch.float32, num_splits=splits)
    hca = dict(kwargs, entry_indices=None)
    _check(args, hca, torch.float32, num_splits=2)


def test_garbage_past_a_rows_keys_is_never_read(device):
    """Keys past a row's window and entries past its complete ones hold NaN: the result stays finite."""
    args, kwargs = _case([6, 13], 4, 32, torch.float32, device, seed=6)
    window_cache, block_table = args[1], args[2]
    entry_cache, entry_table = kwargs["entry_cache"], kwargs["entry_table"]
    for row, key_len in enumerate([6, 13]):
        for pos in range(key_len, block_table.shape[1] * 4):
            window_cache[block_table[row, pos // 4], pos % 4] = float("nan")
        for e in range(key_len // 4, entry_table.shape[1] * 2):
            entry_cache[entry_table[row, e // 2], e % 2] = float("nan")
    out, lse = window_entry_attention(*args, **kwargs, num_splits=2)
    assert torch.isfinite(out).all() and torch.isfinite(lse).all()


def test_mismatched_arguments_are_named(device):
    args, kwargs = _case([5], 4, 32, torch.float32, device, seed=7, topk=2)
    with pytest.raises(ValueError, match="entry_indices"):
        window_entry_attention(*args, **{**kwargs, "entry_indices": kwargs["entry_indices"].long()})
    with pytest.raises(ValueError, match="compress_rate"):
        window_entry_attention(*args, **{**kwargs, "compress_rate": 0})
    with pytest.raises(ValueError, match="sinks"):
        window_entry_attention(*args[:4], args[4][:2], **kwargs)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("kind", ["csa", "hca", "window"])
def test_fp8_key_caches(device, dtype, kind):
    """Both caches in FP8: 24 values (one partial scale group) and 8 rope values a key."""
    topk = 5 if kind == "csa" else None
    args, kwargs = _case(KEY_LENS, 4, 32, dtype, device, seed=11, topk=topk, entries=kind != "window")
    _check(*_as_fp8(args, kwargs, rope_dim=8), dtype, num_splits=2)


def test_fp8_keys_past_one_scale_group(device):
    """200 values a key (two scale groups, the second partial) and 16 rope values, one split and three."""
    args, kwargs = _case([0, 9, 23], 2, 216, torch.float32, device, seed=12, topk=4)
    fp8_args, fp8_kwargs = _as_fp8(args, kwargs, rope_dim=16)
    assert fp8_args[1].scales.shape[2] == 2
    for splits in (1, 3):
        _check(fp8_args, fp8_kwargs, torch.float32, num_splits=splits)


def test_reference_reads_fp8_caches_as_their_rows(device):
    """The reference over FP8 caches equals it over their dequantized rows, bit for bit."""
    args, kwargs = _as_fp8(*_case(KEY_LENS, 4, 32, torch.bfloat16, device, seed=13, topk=5), rope_dim=8)
    got = reference(*args, **kwargs)
    want = reference(*_dense(args, kwargs)[0], **_dense(args, kwargs)[1])
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


def test_fp8_and_tensor_caches_do_not_mix(device):
    args, kwargs = _case([5, 9], 4, 32, torch.float32, device, seed=14, topk=2)
    fp8_args, fp8_kwargs = _as_fp8(args, kwargs, rope_dim=8)
    with pytest.raises(ValueError, match="entry_cache: expected an FP8LatentCache"):
        window_entry_attention(*fp8_args, **kwargs)
    with pytest.raises(ValueError, match="entry_cache: expected a tensor"):
        window_entry_attention(*args, **fp8_kwargs)
    with pytest.raises(ValueError, match="window_cache"):
        window_entry_attention(fp8_args[0].to(torch.bfloat16), *fp8_args[1:], **fp8_kwargs)


@pytest.mark.gpu
@pytest.mark.parametrize("heads", [16, 64, 128])
@pytest.mark.parametrize("num_rows", [1, 3, 64])  # 1 and 3 rows: 64+ heads take the few-row tiles
@pytest.mark.parametrize("kind", ["csa", "hca"])
@pytest.mark.parametrize("kv_cache_dtype", ["auto", "fp8"])
def test_real_sizes_on_the_gpu(heads, num_rows, kind, kv_cache_dtype):
    """v4-mini's shapes (head_dim 512, window 128, CSA top-512 of context / 4, HCA context / 128), bf16,
    rows from a padded one to 9K tokens (one 9K row when alone); with FP8 caches, 448 FP8 values and 64
    bf16 rope values a key."""
    device = torch.device("cuda")
    gen = generator(8, device)
    lens = torch.randint(0, 9000, (num_rows,), generator=gen, device=device)
    if num_rows > 1:
        short = [0, 1, 127, 4][:num_rows - 1]  # the last row keeps a random length
        lens[:len(short)] = torch.tensor(short, device=device)
    else:
        lens[0] = 8999  # a lone padded row would leave nothing to compare
    args, kwargs = _case(lens.tolist(), heads, 512, torch.bfloat16, device, seed=9, rate=4 if kind == "csa" else 128,
                         topk=512 if kind == "csa" else None, window=128)
    if kv_cache_dtype == "fp8":
        args, kwargs = _as_fp8(args, kwargs, rope_dim=64)
    out, _ = _check(args, kwargs, torch.bfloat16)
    # Outputs average hundreds of keys (|out| ~ 0.05): judged over the whole output too, far below what
    # reading one wrong key per row would give.
    want, _ = reference(*_double(*_dense(args, kwargs))[0], **_double(*_dense(args, kwargs))[1])
    assert float((out.double() - want).norm() / want.norm()) <= 1e-2
