"""DeepSeek-V4's ops in the batch-invariant tables: a row's bits depend on that row's inputs only.

Each op the invariant tables replace (`reference.v4_invariant`, `triton.v4_invariant`,
the experts of `triton.invariant`), on the torch backend and on the Triton kernels
(the interpreter without a GPU): every row gives the same bits alone, among other
rows, at another place among them, in batches of other sizes, and where the batch's
tables are wider (other padding); and the op computes the reference op's function
(`reference.table`, float64 on the same inputs).
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from support.kernel_cases import LSE_TOLERANCE, TOLERANCE, generator, randn
from mla_func.kernels import ops_for

# Bitwise comparisons across batch compositions: the interpreter's dot must sum each row in one order.
pytestmark = pytest.mark.row_invariant_dots

ROWS = 23
# Alone (two places), a run crossing a 16-row tile, the last rows, and every row but the first.
SUBSETS = (slice(0, 1), slice(5, 6), slice(3, 19), slice(20, 23), slice(1, 23))
BACKENDS = ["torch", "triton"]


def _tuple(result) -> tuple[torch.Tensor, ...]:
    return result if isinstance(result, tuple) else (result,)


def assert_rows_invariant(op, *rows: torch.Tensor, seed: int) -> tuple[torch.Tensor, ...]:
    """op(*rows) (every tensor [ROWS, ...], a row's inputs) against op of subsets of the rows and of the
    rows shuffled: each result row the same bits. Returns op(*rows)."""
    full = _tuple(op(*rows))
    for sl in SUBSETS:
        for got, want in zip(_tuple(op(*(r[sl] for r in rows))), full):
            assert torch.equal(got, want[sl]), sl
    order = torch.randperm(ROWS, generator=torch.Generator().manual_seed(seed)).to(rows[0].device)
    for got, want in zip(_tuple(op(*(r[order] for r in rows))), full):
        assert torch.equal(got, want[order]), "shuffled rows"
    return full


def _double(args):
    return [a.double() if isinstance(a, torch.Tensor) and a.is_floating_point() else a for a in args]


def _reference(name: str, *args, **kwargs):
    """The reference table's `v4` or `dsa` op `name` in float64 on the same inputs."""
    ref = ops_for("torch")
    op = getattr(ref.v4, name) if any(f.name == name for f in dataclasses.fields(ref.v4)) else getattr(ref.dsa, name)
    return op(*_double(args), **{k: v.double() if isinstance(v, torch.Tensor) and v.is_floating_point() else v
                                 for k, v in kwargs.items()})


# ---- attention ------------------------------------------------------------------------------------


def _attention_case(device, seed: int, *, kind: str):
    """ROWS rows of 4 heads of 16 over a window of 8 and entries of 4 tokens: padded rows, rows without
    an entry yet, and rows with more complete entries than CSA's top-k (5)."""
    gen = generator(seed, device)
    heads, dim, bs, width, rate = 4, 16, 4, 12, 4
    lens = torch.randint(1, width * bs, (ROWS,), generator=gen, device=device).to(torch.int32)
    lens[[2, 9]] = 0
    lens[4] = 3
    window = randn((80, bs, dim), torch.float32, device, gen)
    table = torch.randint(1, 80, (ROWS, width), generator=gen, device=device).to(torch.int32)
    q = randn((ROWS, heads, dim), torch.float32, device, gen, scale=0.5)
    sinks = randn((heads,), torch.float32, device, gen)
    static = dict(softmax_scale=dim ** -0.5, sliding_window=8)
    rows = [q, table, lens]
    if kind != "window":
        static.update(entry_cache=randn((40, 2, dim), torch.float32, device, gen), compress_rate=rate)
        rows.append(torch.randint(1, 40, (ROWS, 6), generator=gen, device=device).to(torch.int32))
    if kind == "csa":
        indices = torch.full((ROWS, 5), -1, dtype=torch.int32, device=device)
        for i, count in enumerate((lens // rate).tolist()):
            picks = torch.randperm(count, generator=gen, device=device)[:5] if count else indices[i, :0]
            indices[i, :len(picks)] = picks.sort().values
        rows.append(indices)
    return rows, sinks, window, static


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("kind", ["window", "hca", "csa"])
def test_attention_rows_do_not_depend_on_the_batch(backend, kind, device):
    ops = ops_for(backend, batch_invariant=True)
    rows, sinks, window, static = _attention_case(device, 1, kind=kind)

    def attend(q, table, lens, *entry_rows, widen: int = 0):
        # `widen` appends columns to the tables (and -1 slots to the top-k list), as a batch whose
        # longest row needs more would.
        def wider(t, fill):
            return torch.cat([t, torch.full((t.shape[0], widen), fill, dtype=t.dtype, device=t.device)], dim=1)

        entries = {}
        if entry_rows:
            entries["entry_table"] = wider(entry_rows[0], 1)
            if len(entry_rows) > 1:
                entries["entry_indices"] = wider(entry_rows[1], -1)
        return ops.v4.window_entry_attention(q, window, wider(table, 1), lens, sinks, **static, **entries)

    out, lse = assert_rows_invariant(attend, *rows, seed=2)
    for widen in (3, 70):
        wide_out, wide_lse = attend(*rows, widen=widen)
        assert torch.equal(wide_out, out) and torch.equal(wide_lse, lse), widen
    entry_kwargs = {}
    if kind != "window":
        entry_kwargs["entry_table"] = rows[3]
    if kind == "csa":
        entry_kwargs["entry_indices"] = rows[4]
    want, want_lse = _reference("window_entry_attention", rows[0], window, rows[1], rows[2], sinks, **static,
                                **entry_kwargs)
    torch.testing.assert_close(out.double(), want, **TOLERANCE[torch.float32])
    torch.testing.assert_close(lse.double(), want_lse.double(), **LSE_TOLERANCE[torch.float32])


# ---- the compressor ---------------------------------------------------------------------------------


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("overlap", [False, True])
def test_compressed_entries_do_not_depend_on_the_batch(backend, overlap, device):
    ops = ops_for(backend, batch_invariant=True)
    gen = generator(3, device)
    rate, dim, bs, width = 4, 16, 4, 12
    c = 2 if overlap else 1
    inputs = randn((80, bs, 2 * c * dim), torch.float32, device, gen)
    lens = (torch.randint(1, width * bs // rate, (ROWS,), generator=gen, device=device) * rate).to(torch.int32)
    lens[[1, 7, 12]] += 1      # rows completing no entry
    table = torch.randint(1, 80, (ROWS, width), generator=gen, device=device).to(torch.int32)
    slots = torch.where(lens % rate == 0, torch.arange(ROWS, device=device) + 2, -1).to(torch.int64)
    bias, norm = randn((rate, c * dim), torch.float32, device, gen), randn((dim,), torch.float32, device, gen)
    cos, sin = randn((200, 4), torch.float32, device, gen), randn((200, 4), torch.float32, device, gen)
    static = dict(rate=rate, overlap=overlap, eps=1e-6)

    def written(slot, key_lens, block_table, widen: int = 0):
        block_table = torch.cat([block_table, block_table[:, :widen]], dim=1)
        entries = torch.zeros((ROWS + 4, 1, dim), device=device)
        entries = ops.v4.compress_entries(inputs, entries, slot, key_lens, block_table, bias, norm, cos, sin,
                                          num_seqs=slot.shape[0], inplace=True, **static)
        # Each row's own entry (or zeros for a row that writes none).
        return torch.where((slot >= 0)[:, None], entries[slot.clamp(min=0), 0], 0.0)

    rows = assert_rows_invariant(written, slots, lens, table, seed=4)[0]
    assert torch.equal(written(slots, lens, table, widen=5), rows)
    want = _reference("compress_entries", inputs, torch.zeros((ROWS + 4, 1, dim), device=device), slots, lens, table,
                      bias, norm, cos, sin, num_seqs=ROWS, inplace=True, **static)
    torch.testing.assert_close(rows[slots >= 0].double(), want[slots[slots >= 0], 0], **TOLERANCE[torch.float32])


# ---- hyper-connections ------------------------------------------------------------------------------


def _hc_case(device, seed: int, n: int = 3, dim: int = 48):
    gen = generator(seed, device)
    width = (2 + n) * n
    return dict(
        streams=randn((ROWS, n, dim), torch.float32, device, gen),
        post=torch.rand((ROWS, n), generator=gen, device=device) * 2,
        comb=torch.rand((ROWS, n, n), generator=gen, device=device),
        out=randn((ROWS, dim), torch.float32, device, gen),
        fn=randn((width, n * dim), torch.float32, device, gen, scale=0.1),
        base=randn((width,), torch.float32, device, gen),
        scale=randn((3,), torch.float32, device, gen),
        norm=randn((dim,), torch.float32, device, gen),
        head_fn=randn((n, n * dim), torch.float32, device, gen, scale=0.1),
        head_base=randn((n,), torch.float32, device, gen),
        head_scale=randn((1,), torch.float32, device, gen),
    )


@pytest.mark.parametrize("backend", BACKENDS)
def test_hyper_connection_rows_do_not_depend_on_the_batch(backend, device):
    ops = ops_for(backend, batch_invariant=True)
    c = _hc_case(device, 5)
    site = dict(iters=5, hc_eps=1e-6, norm_eps=1e-5)
    tol = TOLERANCE[torch.float32]

    x, post, comb = assert_rows_invariant(
        lambda s: ops.v4.hc_site(s, c["fn"], c["base"], c["scale"], c["norm"], **site), c["streams"], seed=6)
    for got, want in zip((x, post, comb), _reference("hc_site", c["streams"], c["fn"], c["base"], c["scale"],
                                                     c["norm"], **site)):
        torch.testing.assert_close(got.double(), want.double(), **tol)

    written = assert_rows_invariant(ops.v4.hc_write_back, c["post"], c["comb"], c["out"], c["streams"], seed=7)[0]
    torch.testing.assert_close(written.double(), _reference("hc_write_back", c["post"], c["comb"], c["out"],
                                                            c["streams"]), **tol)

    fused = assert_rows_invariant(
        lambda p, cb, o, s: ops.v4.hc_write_back_site(p, cb, o, s, c["fn"], c["base"], c["scale"], c["norm"], **site),
        c["post"], c["comb"], c["out"], c["streams"], seed=8)
    for got, want in zip(fused, _reference("hc_write_back_site", c["post"], c["comb"], c["out"], c["streams"], c["fn"],
                                           c["base"], c["scale"], c["norm"], **site)):
        torch.testing.assert_close(got.double(), want.double(), **tol)

    head = assert_rows_invariant(
        lambda s: ops.v4.hc_head(s, c["head_fn"], c["head_base"], c["head_scale"], hc_eps=1e-6, norm_eps=1e-5),
        c["streams"], seed=9)[0]
    torch.testing.assert_close(head.double(), _reference("hc_head", c["streams"], c["head_fn"], c["head_base"],
                                                         c["head_scale"], hc_eps=1e-6, norm_eps=1e-5), **tol)


# ---- experts and the indexer ------------------------------------------------------------------------


@pytest.mark.parametrize("backend", BACKENDS)
def test_expert_rows_do_not_depend_on_the_batch(backend, device):
    ops = ops_for(backend, batch_invariant=True)
    gen = generator(10, device)
    x = randn((ROWS, 64), torch.float32, device, gen)
    w13, w2 = randn((5, 64, 64), torch.float32, device, gen, scale=0.1), randn((5, 64, 32), torch.float32, device, gen,
                                                                                 scale=0.1)
    ids = torch.randint(0, 5, (ROWS, 3), generator=gen, device=device)
    ids[6] = -1                                  # a padded row takes no expert
    weights = torch.rand((ROWS, 3), generator=gen, device=device)
    out = assert_rows_invariant(lambda xs, w, i: ops.v4.clamped_experts(xs, w13, w2, w, i, limit=1.5), x, weights, ids,
                                seed=11)[0]
    assert torch.equal(out[6], torch.zeros_like(out[6]))
    torch.testing.assert_close(out.double(), _reference("clamped_experts", x, w13, w2, weights, ids, limit=1.5),
                               **TOLERANCE[torch.float32])


@pytest.mark.parametrize("backend", BACKENDS)
def test_index_scores_do_not_depend_on_the_batch(backend, device):
    ops = ops_for(backend, batch_invariant=True)
    gen = generator(12, device)
    q = randn((ROWS, 16, 8), torch.float32, device, gen)
    weights = randn((ROWS, 16), torch.float32, device, gen)
    cache = randn((40, 2, 8), torch.float32, device, gen)
    table = torch.randint(1, 40, (ROWS, 6), generator=gen, device=device).to(torch.int32)
    lens = torch.randint(0, 13, (ROWS,), generator=gen, device=device).to(torch.int32)

    def scores(qs, w, t, n, widen: int = 0):
        return ops.dsa.index_scores(qs, w, cache, torch.cat([t, t[:, :widen]], dim=1), n, weight_scale=0.3)

    got = assert_rows_invariant(scores, q, weights, table, lens, seed=13)[0]
    # A wider table (a batch with a longer row) scores more columns: the row's own ones keep their bits,
    # and so does the top-k chosen from them.
    wide = scores(q, weights, table, lens, widen=50)
    assert torch.equal(wide[:, :got.shape[1]], got)
    k = 4
    assert torch.equal(ops.dsa.top_k_indices(wide, lens, k=k), ops.dsa.top_k_indices(got, lens, k=k))
    want = _reference("index_scores", q, weights, cache, table, lens, weight_scale=0.3)
    torch.testing.assert_close(got.double(), want, **TOLERANCE[torch.float32])
