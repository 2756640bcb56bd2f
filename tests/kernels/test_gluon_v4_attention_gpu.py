"""The warpgroup-MMA stage 1 of V4's window + entry attention (`gluon.v4_attention`) on Hopper, against the
float64 reference (`reference.v4_paged.window_entry_attention`) and its tl.dot twin (`triton.v4_attention`).

The op takes it where `triton.v4_attention.wgmma_parts` says (one split, the sink folded in; two programs a
row at batch 64 of the benchmark's shapes, one at batch 128); `_wgmma` below runs the kernel at other split
counts and either number of programs a row, merged by the op's own stage 2, so every way it can be launched
is checked.

Cases: the benchmark's shapes (64 heads of 512, window 128, block size 64, CSA top-512 of context / 4, HCA
context / 128; batch 64 at 8K and 64K context, full and ragged lengths) through the op; small ragged rows
(padded rows, windows shorter than the sliding window, no complete entry yet, -1 tails, more complete
entries than the table holds, CSA picks past the table), splits of 1 to 5 tiles; batch 128 through the op
and a graph; stage-1 partials against the twin's, split by
split; 128 and 100 heads (two head groups, a partial one); fp16 and strided queries; NaN past a row's keys
and in the workspace; graph replay with new lengths; FP8 caches (V4's 448 values, 4 scales and 64 RoPE values
a key), whose outputs equal the kernel's over their dequantized rows bit for bit.
"""

from __future__ import annotations

import pytest
import torch

from mla_func.kernels.gluon import mla_decode as gluon_decode
from mla_func.kernels.gluon import v4_attention as gluon_v4
from mla_func.kernels.latent_cache import FP8LatentCache
from mla_func.kernels.reference.v4_paged import window_entry_attention as reference
from mla_func.kernels.triton import v4_attention as tri
from mla_func.kernels.triton._common import LOG2E
from mla_func.kernels.triton.decode_merge import split_partials
from support.fp8_cache_cases import dequantized, fp8_cache_of
from support.kernel_cases import LSE_TOLERANCE, assert_close, captured, generator, randn, strided

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

D = 512
WINDOW = 128
# (num_splits, d_split) the kernel is launched with besides the op's own choice (None: the op): two programs a
# row (`gluon_v4.D_SPLIT`, each the scores and half the columns) or one (the scores once).
VARIANTS = [None, (1, 2), (3, 2), (2, 2), (1, 1), (2, 1), (3, 1)]


def _hopper() -> torch.device:
    device = torch.device("cuda")
    if not gluon_v4.available(device):
        pytest.skip("the warpgroup-MMA kernel needs a Hopper GPU")
    return device


def _wgmma(args, kwargs, *, num_splits: int, d_split: int, workspace=None):
    """The kernel at `num_splits` splits (one: the sink folded in) and `d_split` programs a row, merged by the
    op's stage 2: (out [n, H, D], lse [n, H])."""
    q, window_cache, block_table, key_lens, sinks = args
    num_rows, num_heads, _ = q.shape
    out = torch.empty((num_rows, num_heads, D), dtype=q.dtype, device=q.device)
    lse = torch.empty((num_rows, num_heads), dtype=torch.float32, device=q.device)
    partial_out, partial_lse = split_partials(out, lse, num_splits, direct=num_splits == 1, workspace=workspace)
    entry_cache, indices = kwargs.get("entry_cache"), kwargs.get("entry_indices")
    has_entries = entry_cache is not None
    fp8_leaves = None
    if isinstance(window_cache, FP8LatentCache):
        fp8_entries = entry_cache if has_entries else window_cache
        fp8_leaves = (window_cache.scales, fp8_entries.scales, window_cache.rope, fp8_entries.rope)
        window_cache, entry_cache = window_cache.values, fp8_entries.values
    gluon_v4.window_entry_split(
        q, window_cache, block_table, key_lens, entry_cache if has_entries else window_cache,
        kwargs["entry_table"] if has_entries else block_table,
        indices if indices is not None else block_table, sinks, partial_out, partial_lse,
        softmax_scale_log2=kwargs["softmax_scale"] * LOG2E, sliding_window=kwargs["sliding_window"],
        compress_rate=kwargs.get("compress_rate", 0), has_entries=has_entries, has_indices=indices is not None,
        fold_sink=num_splits == 1, d_split=d_split, use_pdl=False, fp8_leaves=fp8_leaves)
    if num_splits > 1:
        tri.merge_with_sink(partial_out, partial_lse, sinks, out, lse, use_pdl=False)
    return out, lse


# --- reference in float64, a few rows at a time over only the pages they use -------------------------------

def _compact(cache: torch.Tensor, table: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    pages = torch.unique(table.long())
    return cache[pages].double(), torch.searchsorted(pages, table.long()).to(torch.int32)


def _reference(args, kwargs, chunk: int = 8):
    q, window_cache, block_table, key_lens, sinks = args
    outs, lses = [], []
    for r0 in range(0, q.shape[0], chunk):
        rows = slice(r0, r0 + chunk)
        wc, bt = _compact(window_cache, block_table[rows])
        kw = dict(softmax_scale=kwargs["softmax_scale"], sliding_window=kwargs["sliding_window"])
        if kwargs.get("entry_cache") is not None:
            ec, et = _compact(kwargs["entry_cache"], kwargs["entry_table"][rows])
            kw.update(entry_cache=ec, entry_table=et, compress_rate=kwargs["compress_rate"])
            if kwargs.get("entry_indices") is not None:
                kw["entry_indices"] = kwargs["entry_indices"][rows]
        o, lse = reference(q[rows].double(), wc, bt, key_lens[rows], sinks.double(), **kw)
        outs.append(o)
        lses.append(lse)
    return torch.cat(outs), torch.cat(lses)


def _compare(args, kwargs, dtype=torch.bfloat16, *, variant, twin: bool = True, want=None, workspace=None):
    """The kernel (`variant`: (num_splits, d_split); None: the op, which must take the kernel) against the
    float64 reference (`want`: computed already) and, with `twin`, the tl.dot twin at its own splits."""
    if variant is None:
        q = args[0]
        assert tri.wgmma_parts(q.shape[0], q.shape[1], D, q.dtype, q.device) > 0, "the op keeps the twin here"
        out, lse = tri.window_entry_attention(*args, **kwargs)
    else:
        out, lse = _wgmma(args, kwargs, num_splits=variant[0], d_split=variant[1], workspace=workspace)
    want, want_lse = want if want is not None else _reference(args, kwargs)
    assert out.dtype == args[0].dtype and lse.dtype == torch.float32
    assert torch.isfinite(out).all() and not torch.isnan(lse).any()
    assert_close(out, want, dtype)
    assert_close(lse, want_lse, dtype, LSE_TOLERANCE)
    if twin:
        t_out, t_lse = tri.window_entry_attention(*args, **kwargs, num_splits=2)
        assert_close(out, t_out, dtype)
        assert_close(lse, t_lse, dtype, LSE_TOLERANCE)
    return out, lse


# --- the benchmark's shapes -------------------------------------------------------------------------------

# The last bench case and its reference (the parameters that vary fastest reuse them; one case at a time,
# as a 64K CSA case holds a 1 GiB entries cache).
_LAST_CASE: dict = {}


def _bench_case_with_reference(num_rows: int, context: int, kind: str, ragged: bool):
    key = (num_rows, context, kind, ragged)
    if key not in _LAST_CASE:
        _LAST_CASE.clear()
        torch.cuda.empty_cache()
        args, kwargs = _bench_case(num_rows, context, kind, ragged)
        _LAST_CASE[key] = (args, kwargs, _reference(args, kwargs))
    return _LAST_CASE[key]


def _bench_case(num_rows: int, context: int, kind: str, ragged: bool):
    """bench/v4_kernels.py's inputs: block size 64, the window's pages live and earlier table entries block 0
    (outside every window), an entry table of every entry, CSA's top-512 of random scores; ragged: lengths
    from a padded row through windows shorter than the sliding window and rows without a complete entry."""
    device = _hopper()
    gen = generator(1000 + num_rows + context // 1024 + (kind == "csa"), device)
    bs, rate = 64, 4 if kind == "csa" else 128
    live, width = -(-WINDOW // bs) + 1, context // bs
    window_cache = randn((num_rows * live + 1, bs, D), torch.bfloat16, device, gen)
    block_table = torch.zeros(num_rows, width, dtype=torch.int32, device=device)
    block_table[:, width - live:] = _tables(num_rows, live, window_cache.shape[0], gen, device)
    num_entries, entry_page = context // rate, max(1, bs // rate)
    entry_width = -(-num_entries // entry_page)
    entry_cache = randn((num_rows * entry_width + 1, entry_page, D), torch.bfloat16, device, gen)
    entry_table = _tables(num_rows, entry_width, entry_cache.shape[0], gen, device)
    indices = None
    if kind == "csa":
        scores = torch.rand(num_rows, num_entries, device=device, generator=gen)
        indices = scores.topk(512, dim=1).indices.sort(dim=1).values.to(torch.int32)
    key_lens = torch.full((num_rows,), context, dtype=torch.int32, device=device)
    if ragged:
        lens = torch.randint(0, context + 1, (num_rows,), device=device, generator=gen)
        special = [0, 1, 3, 4, 127, 128, 129, 511, 512, 513, context - 1, context]
        lens[:len(special)] = torch.tensor(special, device=device)
        key_lens = lens.to(torch.int32)
    q = randn((num_rows, 64, D), torch.bfloat16, device, gen)
    sinks = randn((64,), torch.float32, device, gen)
    args = (q, window_cache, block_table, key_lens, sinks)
    kwargs = dict(softmax_scale=D ** -0.5, sliding_window=WINDOW, entry_cache=entry_cache, entry_table=entry_table,
                  entry_indices=indices, compress_rate=rate)
    return args, kwargs


@pytest.mark.parametrize("variant", VARIANTS, ids=str)
@pytest.mark.parametrize("ragged", [False, True])
@pytest.mark.parametrize("context", [8 * 1024, 64 * 1024])
@pytest.mark.parametrize("kind", ["csa", "hca"])
def test_bench_shapes_equal_reference_and_twin(kind, context, ragged, variant):
    _hopper()
    args, kwargs, want = _bench_case_with_reference(64, context, kind, ragged)
    _compare(args, kwargs, want=want, variant=variant)


@pytest.mark.parametrize("num_rows", [1, 16, 64, 128, 200])
def test_the_op_keeps_the_twin_outside_one_half_full_wave(num_rows):
    """Two programs a row where they make one wave at least half full, else one where the rows do, else the
    twin."""
    device = _hopper()
    slots = torch.cuda.get_device_properties(device).multi_processor_count
    parts = tri.wgmma_parts(num_rows, 64, D, torch.bfloat16, device)
    assert parts == (2 if slots // 2 < 2 * num_rows <= slots else 1 if slots // 2 < num_rows <= slots else 0)
    assert tri.wgmma_parts(num_rows, 128, D, torch.bfloat16, device) == \
        (2 if slots // 2 < 4 * num_rows <= slots else 1 if slots // 2 < 2 * num_rows <= slots else 0)
    assert tri.wgmma_parts(64, 64, D, torch.float32, device) == 0     # 32-bit queries: the twin
    assert tri.wgmma_parts(64, 32, D, torch.bfloat16, device) == 0    # fewer heads than a program's


@pytest.mark.parametrize("d_split", [1, 2])
@pytest.mark.parametrize("kind", ["csa", "hca"])
@pytest.mark.parametrize("ragged", [False, True])
def test_stage_one_partials_equal_the_twins(kind, ragged, d_split):
    """Split by split (whole 64-key runs: the same slots a split as the twin's): normalised partial and LSE."""
    _hopper()
    args, kwargs = _bench_case(64, 64 * 1024, kind, ragged)
    splits = 3
    num_rows = args[0].shape[0]

    def nan_workspace():
        return (torch.full((num_rows, 64, splits, D), float("nan"), device="cuda"),
                torch.full((num_rows, 64, splits), float("nan"), device="cuda"))

    got_out, got_lse = nan_workspace()
    _wgmma(args, kwargs, num_splits=splits, d_split=d_split, workspace=(got_out, got_lse))
    want_out, want_lse = nan_workspace()
    tri.window_entry_attention(*args, **kwargs, num_splits=splits, workspace=(want_out, want_lse))
    assert not want_lse.isnan().any()
    torch.testing.assert_close(got_lse, want_lse, atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(got_out, want_out, atol=3e-2, rtol=3e-2)
    empty = want_lse == float("-inf")
    assert torch.equal(got_lse == float("-inf"), empty)
    assert torch.all(got_out[empty] == 0)


# --- small ragged rows ------------------------------------------------------------------------------------

def _tables(num_rows: int, width: int, num_blocks: int, gen: torch.Generator, device) -> torch.Tensor:
    pages = torch.randperm(num_blocks - 1, generator=gen, device=device)[: num_rows * width] + 1
    return pages.view(num_rows, width).to(torch.int32)


def _small_case(key_lens, heads, seed, *, rate=4, topk=None, entries=True, window=WINDOW, bs=16, bs_g=4,
                entry_width=None, dtype=torch.bfloat16):
    """test_v4_attention's rows at D = 512: distinct random pages, every table entry a real page (a read
    past a row's keys reads finite data and shows in the comparison). entry_width caps the entry table
    (rows with more complete entries than it holds)."""
    device = _hopper()
    gen = generator(seed, device)
    n = len(key_lens)
    width = max(-(-k // bs) for k in key_lens + [1]) + 1
    width_g = entry_width or max(-(-(k // rate) // bs_g) for k in key_lens + [1]) + 1
    window_cache = randn((1 + n * width + 2, bs, D), dtype, device, gen)
    block_table = _tables(n, width, window_cache.shape[0], gen, device)
    lens = torch.tensor(key_lens, dtype=torch.int32, device=device)
    q = randn((n, heads, D), dtype, device, gen, scale=D ** -0.25)
    sinks = randn((heads,), torch.float32, device, gen)
    kwargs: dict = dict(softmax_scale=D ** -0.5, sliding_window=window)
    if entries:
        entry_cache = randn((1 + n * width_g + 2, bs_g, D), dtype, device, gen)
        kwargs.update(entry_cache=entry_cache, entry_table=_tables(n, width_g, entry_cache.shape[0], gen, device),
                      compress_rate=rate)
        if topk is not None:
            rows = []
            for k in key_lens:
                count = min(k // rate, width_g * bs_g)
                picks = sorted(torch.randperm(max(count, 1), generator=gen, device=device)[:min(topk, count)]
                               .tolist())
                rows.append(picks + [-1] * (topk - len(picks)))
            kwargs["entry_indices"] = torch.tensor(rows, dtype=torch.int32, device=device)
    return (q, window_cache, block_table, lens, sinks), kwargs


# 0: padded; 1, 3: window not full, no entry; 4: the first entry; 127 / 128 / 129: around a full window;
# 1000, 3000: the window slid, more entries than a small top-k; 700: a split boundary inside the entries.
KEY_LENS = [0, 1, 3, 4, 13, 127, 128, 129, 700, 1000, 3000, 64]


SMALL_VARIANTS = [(1, 2), (2, 2), (3, 2), (5, 2)]


@pytest.mark.parametrize("variant", SMALL_VARIANTS, ids=str)
@pytest.mark.parametrize("heads", [64, 128, 100])
@pytest.mark.parametrize("topk", [64, 512])
def test_small_csa_rows(topk, heads, variant):
    args, kwargs = _small_case(KEY_LENS, heads, seed=heads + topk, topk=topk)
    out, lse = _compare(args, kwargs, variant=variant)
    # The padded row attends to the sink alone: out 0, lse = the sink.
    assert bool((out[0] == 0).all())
    torch.testing.assert_close(lse[0], args[4].float())


@pytest.mark.parametrize("variant", SMALL_VARIANTS, ids=str)
@pytest.mark.parametrize("heads", [64, 100])
def test_small_hca_rows_and_entries_past_the_table(heads, variant):
    """rate 16: 3000 keys complete 187 entries, the table holds 10 x 4 = 40 of them (n_e = min(count,
    capacity), as the reference reads only entries the table holds)."""
    args, kwargs = _small_case(KEY_LENS, heads, seed=7 + heads, rate=16, entry_width=10)
    _compare(args, kwargs, variant=variant)


def test_csa_picks_past_the_table_are_no_keys():
    """Index-list picks at or past the table's capacity (but complete) are no keys, as in the reference and
    the twin."""
    args, kwargs = _small_case([3000, 1000, 129, 0], 64, seed=11, topk=64, entry_width=20)
    idx = kwargs["entry_indices"]
    capacity = kwargs["entry_table"].shape[1] * kwargs["entry_cache"].shape[1]
    idx[0, -8:] = torch.arange(capacity, capacity + 8, dtype=torch.int32, device=idx.device)   # past, < count
    idx[0] = idx[0].sort().values
    for splits in (1, 3):
        _compare(args, kwargs, variant=(splits, 2))


def test_rows_of_a_few_tiles_leave_the_second_warpgroup_idle_or_short():
    """The warpgroups take a split's 32-key tiles in turn: rows (and splits) of 1 to 5 tiles, so the second
    warpgroup has none, one or two, and the first one more or as many; its state merges into the first's."""
    lens = [1, 31, 32, 33, 64, 65, 96, 97, 160]
    args, kwargs = _small_case(lens, 64, seed=61, entries=False, window=300)
    for splits in (1, 2, 3):
        _compare(args, kwargs, variant=(splits, 2))
        _compare(args, kwargs, variant=(splits, 1))


@pytest.mark.parametrize("window", [8, 128, 300])
def test_sliding_window_only(window):
    args, kwargs = _small_case(KEY_LENS, 64, seed=window, entries=False, window=window)
    _compare(args, kwargs, variant=(2, 2))
    _compare(args, kwargs, variant=(1, 2))


def test_fp16_strided_queries_and_page_size_64():
    args, kwargs = _small_case(KEY_LENS, 64, seed=21, topk=128, bs=64, bs_g=16, dtype=torch.float16)
    q = strided(args[0], generator(22, args[0].device))
    assert not gluon_decode.copyable(q)
    _compare((q, *args[1:]), kwargs, torch.float16, variant=(3, 2))
    _compare((q, *args[1:]), kwargs, torch.float16, variant=(1, 2))


def test_garbage_past_a_rows_keys_is_never_read():
    """Window positions past a row's length and entries past its complete ones hold NaN: the result stays
    finite and equal to the reference (which masks them)."""
    lens = [6, 130, 700]
    args, kwargs = _small_case(lens, 64, seed=31, rate=4)
    window_cache, block_table = args[1], args[2]
    entry_cache, entry_table = kwargs["entry_cache"], kwargs["entry_table"]
    bs, bs_g = window_cache.shape[1], entry_cache.shape[1]
    for row, key_len in enumerate(lens):
        for pos in range(key_len, block_table.shape[1] * bs):
            window_cache[block_table[row, pos // bs], pos % bs] = float("nan")
        for e in range(key_len // 4, entry_table.shape[1] * bs_g):
            entry_cache[entry_table[row, e // bs_g], e % bs_g] = float("nan")
    for splits in (1, 2, 3):
        out, lse = _wgmma(args, kwargs, num_splits=splits, d_split=2)
        assert torch.isfinite(out).all() and torch.isfinite(lse).all()


def test_nan_workspace_is_written_before_read():
    """A NaN-filled workspace: every partial is written before the merge reads it."""
    args, kwargs = _small_case(KEY_LENS, 64, seed=41, topk=64)
    splits = 4
    workspace = (torch.full((len(KEY_LENS), 64, splits, D), float("nan"), device="cuda"),
                 torch.full((len(KEY_LENS), 64, splits), float("nan"), device="cuda"))
    _compare(args, kwargs, workspace=workspace, variant=(splits, 2))


def test_graph_replay_with_new_lengths_equals_eager():
    """The op as a model calls it at 64 rows (the kernel, one split), captured, replayed on new lengths."""
    lens0 = [3000] * 64
    args, kwargs = _small_case(lens0, 64, seed=51, topk=128)
    q, window_cache, block_table, key_lens, sinks = args
    assert tri.wgmma_parts(64, 64, D, q.dtype, q.device) > 0

    def step():
        return tri.window_entry_attention(*args, **kwargs)

    graph, (out, lse) = captured(step)
    for new_lens in ([1, 3000, 0, 700, 64, 129, 1999, 3] * 8, lens0):
        key_lens.copy_(torch.tensor(new_lens, dtype=torch.int32))
        graph.replay()
        eager_out, eager_lse = step()
        torch.testing.assert_close(out, eager_out, atol=0, rtol=0)
        torch.testing.assert_close(lse, eager_lse, atol=0, rtol=0)
        want, _ = _reference(args, kwargs)
        assert_close(out, want, torch.bfloat16)


@pytest.mark.parametrize("kind", ["csa", "hca"])
def test_one_program_a_row_at_batch_128_through_the_op_and_a_graph(kind):
    """At 128 rows the op takes one program a row (each tile's scores computed once): ragged rows equal the
    reference and the twin; captured, replayed on other lengths, equal to eager."""
    args, kwargs = _bench_case(128, 8 * 1024, kind, True)
    q, key_lens = args[0], args[3]
    slots = torch.cuda.get_device_properties(q.device).multi_processor_count
    if not slots // 2 < 128 <= slots:
        pytest.skip(f"128 rows do not make one wave of {slots} multiprocessors at least half full")
    assert tri.wgmma_parts(128, 64, D, q.dtype, q.device) == 1
    _compare(args, kwargs, variant=None)

    def step():
        return tri.window_entry_attention(*args, **kwargs)

    graph, (out, lse) = captured(step)
    key_lens.copy_(torch.randint(0, 8 * 1024 + 1, (128,), device=q.device, dtype=torch.int32))
    graph.replay()
    eager_out, eager_lse = step()
    torch.testing.assert_close(out, eager_out, atol=0, rtol=0)
    torch.testing.assert_close(lse, eager_lse, atol=0, rtol=0)
    want_out, want_lse = _reference(args, kwargs)
    assert_close(out, want_out, torch.bfloat16)
    assert_close(lse, want_lse, torch.bfloat16, LSE_TOLERANCE)


# --- FP8 caches: e4m3 tiles widened in shared memory to the dequantized rows --------------------------------

def _fp8_and_dequantized(args, kwargs):
    """(FP8 args, kwargs) holding both caches as `FP8LatentCache`s (C = 448), and (args, kwargs) holding their
    dequantized rows as 16-bit caches."""
    q, window_cache, *rest = args
    fp8_window = fp8_cache_of(window_cache, gluon_v4.FP8_KV_C)
    fp8_kwargs, plain_kwargs = dict(kwargs), dict(kwargs)
    if kwargs.get("entry_cache") is not None:
        fp8_kwargs["entry_cache"] = fp8_cache_of(kwargs["entry_cache"], gluon_v4.FP8_KV_C)
        plain_kwargs["entry_cache"] = dequantized(fp8_kwargs["entry_cache"])
    return (q, fp8_window, *rest), fp8_kwargs, (q, dequantized(fp8_window), *rest), plain_kwargs


@pytest.mark.parametrize("variant", VARIANTS, ids=str)
@pytest.mark.parametrize("ragged", [False, True])
@pytest.mark.parametrize("kind", ["csa", "hca"])
def test_fp8_caches_equal_their_dequantized_rows_bit_for_bit(kind, ragged, variant):
    """At the benchmark's shapes (batch 64 x 8K) the kernel over FP8 caches gives its own outputs over the
    dequantized rows as 16-bit caches, bit for bit (the op, which takes it, and other launches); the float64
    reference's (the op) and the tl.dot twin's over the FP8 caches within bf16's tolerance."""
    args, kwargs = _bench_case(64, 8 * 1024, kind, ragged)
    fp8_args, fp8_kwargs, plain_args, plain_kwargs = _fp8_and_dequantized(args, kwargs)
    if variant is None:
        assert tri.wgmma_parts(64, 64, D, args[0].dtype, args[0].device) > 0, "the op keeps the twin here"
        got, got_lse = tri.window_entry_attention(*fp8_args, **fp8_kwargs)
        same, same_lse = tri.window_entry_attention(*plain_args, **plain_kwargs)
        want, want_lse = _reference(plain_args, plain_kwargs)
        assert_close(got, want, torch.bfloat16)
        assert_close(got_lse, want_lse, torch.bfloat16, LSE_TOLERANCE)
    else:
        got, got_lse = _wgmma(fp8_args, fp8_kwargs, num_splits=variant[0], d_split=variant[1])
        same, same_lse = _wgmma(plain_args, plain_kwargs, num_splits=variant[0], d_split=variant[1])
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got, same, atol=0, rtol=0)
    torch.testing.assert_close(got_lse, same_lse, atol=0, rtol=0)
    twin, twin_lse = tri.window_entry_attention(*fp8_args, **fp8_kwargs, num_splits=2)
    assert_close(got, twin, torch.bfloat16)
    assert_close(got_lse, twin_lse, torch.bfloat16, LSE_TOLERANCE)


def test_fp8_caches_at_64k_and_in_a_graph():
    """HCA at batch 64 x 64K over FP8 caches through the op: bit for bit its answer over the dequantized rows;
    captured, replayed on new lengths, equal to eager."""
    args, kwargs = _bench_case(64, 64 * 1024, "hca", ragged=True)
    fp8_args, fp8_kwargs, plain_args, plain_kwargs = _fp8_and_dequantized(args, kwargs)
    key_lens = args[3]
    assert tri.wgmma_parts(64, 64, D, args[0].dtype, args[0].device) > 0

    def step():
        return tri.window_entry_attention(*fp8_args, **fp8_kwargs)

    graph, (out, lse) = captured(step)
    for new_lens in (key_lens.flip(0).clone(), key_lens.clone()):
        key_lens.copy_(new_lens)
        graph.replay()
        eager_out, eager_lse = step()
        torch.testing.assert_close(out, eager_out, atol=0, rtol=0)
        torch.testing.assert_close(lse, eager_lse, atol=0, rtol=0)
        same, same_lse = tri.window_entry_attention(*plain_args, **plain_kwargs)
        torch.testing.assert_close(out, same, atol=0, rtol=0)
        torch.testing.assert_close(lse, same_lse, atol=0, rtol=0)
