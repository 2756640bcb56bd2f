"""The Triton V4 attention (window + compressed entries + sink) against the torch reference op.

Rows cover every phase a row can be in: padded (no key), a window not yet full,
no complete entry yet, exactly the first compressed entry, fewer complete entries
than the top-k (a -1 tail), more than it, and a window that has slid. The reference
runs in float64 on the same (rounded) inputs.
"""

from __future__ import annotations

import pytest
import torch

from support.kernel_cases import LSE_TOLERANCE, assert_close, generator, randn, strided
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


def _check(args, kwargs, dtype, **extra):
    out, lse = window_entry_attention(*args, **kwargs, **extra)
    want_out, want_lse = reference(*_double(args, kwargs)[0], **_double(args, kwargs)[1])
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


@pytest.mark.gpu
@pytest.mark.parametrize("heads", [16, 64, 128])
@pytest.mark.parametrize("num_rows", [1, 3, 64])  # 1 and 3 rows: 64+ heads take the few-row tiles
@pytest.mark.parametrize("kind", ["csa", "hca"])
def test_real_sizes_on_the_gpu(heads, num_rows, kind):
    """v4-mini's shapes (head_dim 512, window 128, CSA top-512 of context / 4, HCA context / 128), bf16,
    rows from a padded one to 9K tokens (one 9K row when alone)."""
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
    out, _ = _check(args, kwargs, torch.bfloat16)
    # Outputs average hundreds of keys (|out| ~ 0.05): judged over the whole output too, far below what
    # reading one wrong key per row would give.
    want, _ = reference(*_double(args, kwargs)[0], **_double(args, kwargs)[1])
    assert float((out.double() - want).norm() / want.norm()) <= 1e-2
