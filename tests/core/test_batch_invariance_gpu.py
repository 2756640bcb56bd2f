"""Batch invariance where users run it: bf16, Triton backend, CUDA graphs on, through the engine.

16 probe requests (8 seeded sampled, 8 greedy, 48 tokens) give the same tokens, and
the same logits bit for bit on their first 16 steps, alone, among 16 and among 64
other requests of random lengths, with mixed batches and prefix caching on, with
chunk thresholds 64 / 512 / unlimited, after preemptions, and with graphs off: on
DeepSeek-V2/V3's shapes ("tiny", "v2-lite") and DeepSeek-V4's ("v4-mini": 64 heads of 512
over a window of 128, CSA with its indexer's top-512, HCA, hyper-connections, hash and
score routing).
"""

from __future__ import annotations

import pytest
import torch

import mla_func as mf
from support.logits_probes import ProbeRun, first_difference, other_requests, probe_requests, run_probes

pytestmark = pytest.mark.gpu

PROBE_TOKENS = 48
LOGIT_STEPS = 16


# Each case's preset and load_model options: v2-lite with block-scaled FP8 weights too (the invariant
# table's FP8 products); v4-mini's rope tables for the engines' max_model_len, not its 1M positions.
LOAD = {"tiny": ("tiny", {}), "v2-lite": ("v2-lite", {}), "v2-lite-fp8": ("v2-lite", dict(quantization="fp8")),
        "v4-mini": ("v4-mini", dict(max_model_len=1024))}


@pytest.fixture(scope="module", params=list(LOAD))
def model(request):
    preset, options = LOAD[request.param]
    model = mf.load_model(preset, dtype=torch.bfloat16, device="cuda", seed=3, **options)
    yield model
    del model
    torch.cuda.empty_cache()


def engine(model, **kwargs):
    settings = dict(block_size=16, max_num_seqs=96, max_num_batched_tokens=2048, max_model_len=1024,
                    batch_invariant=True, num_blocks=2048)
    return mf.Engine(model, **{**settings, **kwargs})


SCENARIOS = {
    "the 16 probes together": dict(others=0),
    "among 16": dict(others=16),
    "among 64": dict(others=64),
    "among 64, chunks of 64": dict(others=64, long_prefill_token_threshold=64),
    "among 64, unlimited chunks": dict(others=64, long_prefill_token_threshold=None),
    "among 64, preempted": dict(others=64, num_blocks=160),
    "alone, graphs off": dict(others=0, graphs=False),
}


def test_probes_do_not_depend_on_their_batch_mates(model):
    vocab = model.config.vocab_size
    probes = probe_requests(vocab, 0, count=16, max_tokens=PROBE_TOKENS, max_len=300)
    alone_engine = engine(model)
    assert alone_engine.step.graphs, "the promise is about graph steps: this test needs them"
    # Each probe alone: one generate call per probe on one engine.
    singles = [run_probes(alone_engine, ([prompt], [params]), ([], []), seed=0)
               for prompt, params in zip(*probes)]
    alone = ProbeRun([r.tokens[0] for r in singles], [r.logits[0] for r in singles], 0)
    del alone_engine
    failures = []
    for name, scenario in SCENARIOS.items():
        settings = dict(scenario)
        others = other_requests(vocab, 1, count=settings.pop("others"), probes=probes[0], max_tokens=64, max_len=400)
        eng = engine(model, **settings)
        run = run_probes(eng, probes, others, seed=2)
        if settings.get("num_blocks"):
            assert run.preemptions > 0, f"{name}: the cache was meant to force preemption"
        for probe in range(16):
            if run.tokens[probe] != alone.tokens[probe]:
                failures.append(f"{name}: probe {probe} tokens differ")
            step = first_difference(run.logits[probe][:LOGIT_STEPS], alone.logits[probe][:LOGIT_STEPS])
            if step is not None:
                failures.append(f"{name}: probe {probe} logits differ at step {step}")
        del eng
        torch.cuda.empty_cache()
    assert not failures, "\n".join(failures)


def test_invariant_ops_rows_at_real_sizes():
    """Each op of the batch-invariant Triton table, at V2-Lite sizes in bf16: a row's bits are the
    same alone, at another place among other rows, and in batches of every size (which pick
    other tiles), and close to the default table's."""
    ops, plain = mf.kernels.ops_for("triton", batch_invariant=True), mf.kernels.ops_for("triton")
    torch.manual_seed(0)
    dev, bf16 = "cuda", torch.bfloat16
    x = torch.randn(700, 2048, device=dev, dtype=bf16)
    w = torch.randn(3648, 2048, device=dev, dtype=bf16) * 0.02
    full = ops.dense.linear(x, w)
    for start, rows in ((0, 1), (5, 1), (3, 4), (0, 16), (9, 17), (100, 300), (0, 700)):
        assert torch.equal(ops.dense.linear(x[start:start + rows], w), full[start:start + rows]), (start, rows)
    torch.testing.assert_close(full.float(), plain.dense.linear(x, w).float(), rtol=2e-2, atol=2e-2)
    qn = torch.randn(300, 16, 128, device=dev, dtype=bf16)
    qp = torch.randn(300, 16, 64, device=dev, dtype=bf16)
    w_uk = torch.randn(16, 128, 512, device=dev, dtype=bf16) * 0.05
    absorbed = ops.mla.absorb_query(qn, qp, w_uk)
    for start, rows in ((0, 1), (7, 1), (2, 33), (0, 300)):
        assert torch.equal(ops.mla.absorb_query(qn[start:start + rows], qp[start:start + rows], w_uk),
                           absorbed[start:start + rows])
    gate = torch.randn(64, 2048, device=dev, dtype=torch.float32) * 0.02
    w13 = torch.randn(66, 2 * 1408, 2048, device=dev, dtype=bf16) * 0.02
    w2 = torch.randn(66, 2048, 1408, device=dev, dtype=bf16) * 0.02
    valid = torch.ones(700, dtype=torch.bool, device=dev)
    route = dict(top_k=6, scoring_func="softmax", topk_method="greedy", n_group=None, topk_group=None,
                 norm_topk_prob=False, routed_scaling_factor=1.0, num_shared=2)
    xs = x * 0.1
    weights, ids = ops.moe.route(xs, gate, None, valid, **route)
    moe = ops.moe.fused_moe(xs, w13, w2, weights, ids)
    for start, rows in ((0, 1), (3, 2), (10, 17), (0, 700)):
        sl = slice(start, start + rows)
        w_sub, id_sub = ops.moe.route(xs[sl], gate, None, valid[sl], **route)
        assert torch.equal(w_sub, weights[sl]) and torch.equal(id_sub, ids[sl]), (start, rows)
        assert torch.equal(ops.moe.fused_moe(xs[sl], w13, w2, weights[sl], ids[sl]), moe[sl]), (start, rows)
    kv = torch.randn(1024, 64, 576, device=dev, dtype=bf16)
    table = torch.randint(1, 1024, (64, 80), device=dev, dtype=torch.int32)
    lens = torch.randint(1, 80 * 64, (64,), device=dev, dtype=torch.int32)
    q = torch.randn(64, 16, 576, device=dev, dtype=bf16)
    w_uv = torch.randn(16, 128, 512, device=dev, dtype=bf16) * 0.05
    args = dict(softmax_scale=0.07, kv_lora_rank=512, w_uv=w_uv)
    out, lse = ops.mla.mla_decode(q, kv, table, lens, **args)
    for sl in (slice(0, 1), slice(5, 6), slice(3, 20)):
        sub, sub_lse = ops.mla.mla_decode(q[sl], kv, table[sl], lens[sl], **args)
        assert torch.equal(sub, out[sl]) and torch.equal(sub_lse, lse[sl])
    wide = torch.cat([table, table], dim=1)
    assert torch.equal(ops.mla.mla_decode(q, kv, wide, lens, **args)[0], out)
    expected, _ = plain.mla.mla_decode(q, kv, table, lens, **args)
    torch.testing.assert_close(out.float(), expected.float(), rtol=2e-2, atol=2e-2)


def test_invariant_sparse_decode_rows_at_real_sizes():
    """DeepSeek-V3.2's sparse MLA in the invariant table: top-k 2048 of a 32K context, 16 heads."""
    ops, plain = mf.kernels.ops_for("triton", batch_invariant=True), mf.kernels.ops_for("triton")
    torch.manual_seed(1)
    dev, bf16 = "cuda", torch.bfloat16
    kv = torch.randn(1024, 64, 576, device=dev, dtype=bf16)
    table = torch.randint(1, 1024, (64, 512), device=dev, dtype=torch.int32)
    indices = torch.sort(torch.randint(0, 512 * 64, (64, 2048), device=dev, dtype=torch.int32), dim=1).values
    indices[3, 100:] = -1
    q = torch.randn(64, 16, 576, device=dev, dtype=bf16)
    w_uv = torch.randn(16, 128, 512, device=dev, dtype=bf16) * 0.05
    args = dict(softmax_scale=0.07, kv_lora_rank=512, w_uv=w_uv)
    out, lse = ops.dsa.sparse_mla_decode(q, kv, table, indices, **args)
    for sl in (slice(0, 1), slice(3, 4), slice(5, 30)):
        sub, sub_lse = ops.dsa.sparse_mla_decode(q[sl], kv, table[sl], indices[sl], **args)
        assert torch.equal(sub, out[sl]) and torch.equal(sub_lse, lse[sl])
    expected, _ = plain.dsa.sparse_mla_decode(q, kv, table, indices, **args)
    torch.testing.assert_close(out.float(), expected.float(), rtol=2e-2, atol=2e-2)


def _same_rows(op, rows, cases):
    """op(*rows) (each [T, ...]) -> its results; op of rows[start:start + count] for each (start, count)
    gives their rows' bits."""
    full = op(*rows)
    full = full if isinstance(full, tuple) else (full,)
    for start, count in cases:
        sub = op(*(r[start:start + count] for r in rows))
        for got, want in zip(sub if isinstance(sub, tuple) else (sub,), full):
            assert torch.equal(got, want[start:start + count]), (op, start, count)
    return full


def check_v4_ops(dev, *, rows=300, heads=64, head_dim=512, window=128, hidden=4096, hc=4, inter=2048, experts=9,
                 top_k=7, index_heads=64, index_dim=128, index_topk=512, block=16, context=4096):
    """Each V4 op of the batch-invariant Triton table on `rows` rows at V4's sizes (v4-mini's by default),
    in bf16: a row's bits are the same alone, at another place, among few rows (which the default table
    gives other tiles) and many, and where the batch's tables are wider; close to the default table's."""
    ops, plain = mf.kernels.ops_for("triton", batch_invariant=True), mf.kernels.ops_for("triton")
    torch.manual_seed(2)
    bf16 = torch.bfloat16
    cases = ((0, 1), (5, 1), (2, 3), (7, 40), (0, rows))

    def close(got, want):
        torch.testing.assert_close(got.float(), want.float(), rtol=2e-2, atol=2e-2)

    width = context // block
    lens = torch.randint(1, context, (rows,), device=dev, dtype=torch.int32)
    table = torch.randint(1, 4 * width, (rows, width), device=dev, dtype=torch.int32)
    window_cache = torch.randn(4 * width, block, head_dim, device=dev, dtype=bf16)
    q = torch.randn(rows, heads, head_dim, device=dev, dtype=bf16) * head_dim ** -0.25
    sinks = torch.randn(heads, device=dev)
    scale = dict(softmax_scale=head_dim ** -0.5, sliding_window=window)
    # CSA: entries of 4 tokens, 4 a block of 16, the indexer's ascending top-k with a -1 tail.
    csa_cache = torch.randn(4 * width, block // 4, head_dim, device=dev, dtype=bf16)
    csa_table = torch.randint(1, 4 * width, (rows, width), device=dev, dtype=torch.int32)
    counts = lens // 4
    # The indexer's choice: the top-k of random scores among a row's complete entries, ascending, -1 after.
    num_entries = width * (block // 4)
    indices = plain.dsa.top_k_indices(torch.rand(rows, num_entries, device=dev), counts,
                                      k=min(index_topk, num_entries))
    # HCA: entries of 128 tokens, one a block.
    hca_cache = torch.randn(4 * width, 1, head_dim, device=dev, dtype=bf16)
    hca_table = torch.randint(1, 4 * width, (rows, context // 128 + 1), device=dev, dtype=torch.int32)
    for entries in (None, "csa", "hca"):
        extra = {} if entries is None else dict(
            entry_cache=csa_cache if entries == "csa" else hca_cache, compress_rate=4 if entries == "csa" else 128)

        def attend(qs, t, n, et=None, idx=None, widen=0):
            kw = dict(extra)
            if et is not None:
                kw["entry_table"] = torch.cat([et, et[:, :widen]], dim=1)
            if idx is not None:
                kw["entry_indices"] = torch.cat([idx, torch.full_like(idx[:, :widen], -1)], dim=1)
            return ops.v4.window_entry_attention(qs, window_cache, torch.cat([t, t[:, :widen]], dim=1), n, sinks,
                                                 **scale, **kw)

        rows_in = [q, table, lens] + ([] if entries is None else [csa_table if entries == "csa" else hca_table])
        rows_in += [indices] if entries == "csa" else []
        out, lse = _same_rows(attend, rows_in, cases)
        wide = attend(*rows_in, widen=3)
        assert torch.equal(wide[0], out) and torch.equal(wide[1], lse), entries
        kw = dict(extra)
        if entries is not None:
            kw["entry_table"] = rows_in[3]
        if entries == "csa":
            kw["entry_indices"] = indices
        want, want_lse = plain.v4.window_entry_attention(q, window_cache, table, lens, sinks, **scale, **kw)
        close(out, want)
        close(lse, want_lse)

    width_fn = (2 + hc) * hc
    streams = torch.randn(rows, hc, hidden, device=dev, dtype=bf16)
    fn = torch.randn(width_fn, hc * hidden, device=dev) * (hc * hidden) ** -0.5
    base, hc_scale = torch.randn(width_fn, device=dev), torch.rand(3, device=dev)
    norm = 1 + 0.1 * torch.randn(hidden, device=dev, dtype=bf16)
    post, comb = torch.rand(rows, hc, device=dev) * 2, torch.rand(rows, hc, hc, device=dev)
    out = torch.randn(rows, hidden, device=dev, dtype=bf16)
    site = dict(iters=20, hc_eps=1e-6, norm_eps=1e-6)
    got = _same_rows(lambda s: ops.v4.hc_site(s, fn, base, hc_scale, norm, **site), [streams], cases)
    for g, w in zip(got, plain.v4.hc_site(streams, fn, base, hc_scale, norm, **site)):
        close(g, w)
    got = _same_rows(lambda p, c, o, s: ops.v4.hc_write_back_site(p, c, o, s, fn, base, hc_scale, norm, **site),
                     [post, comb, out, streams], cases)
    for g, w in zip(got, plain.v4.hc_write_back_site(post, comb, out, streams, fn, base, hc_scale, norm, **site)):
        close(g, w)
    written = _same_rows(ops.v4.hc_write_back, [post, comb, out, streams], cases)[0]
    close(written, plain.v4.hc_write_back(post, comb, out, streams))
    head_fn = torch.randn(hc, hc * hidden, device=dev) * (hc * hidden) ** -0.5
    head = dict(hc_eps=1e-6, norm_eps=1e-6)
    got = _same_rows(lambda s: ops.v4.hc_head(s, head_fn, base[:hc], hc_scale[:1], **head), [streams], cases)[0]
    close(got, plain.v4.hc_head(streams, head_fn, base[:hc], hc_scale[:1], **head))

    x = torch.randn(rows, hidden, device=dev, dtype=bf16) * 0.5
    w13 = torch.randn(experts, 2 * inter, hidden, device=dev, dtype=bf16) * hidden ** -0.5
    w2 = torch.randn(experts, hidden, inter, device=dev, dtype=bf16) * inter ** -0.5
    ids = torch.stack([torch.randperm(experts - 1, device=dev)[:top_k - 1] for _ in range(rows)])
    ids = torch.cat([ids, torch.full_like(ids[:, :1], experts - 1)], dim=1)          # routed, then the shared one
    weights = torch.rand(rows, top_k, device=dev)
    got = _same_rows(lambda xs, w, i: ops.v4.clamped_experts(xs, w13, w2, w, i, limit=10.0), [x, weights, ids], cases)
    close(got[0], plain.v4.clamped_experts(x, w13, w2, weights, ids, limit=10.0))

    q_index = torch.randn(rows, index_heads, index_dim, device=dev, dtype=bf16)
    head_weights = torch.randn(rows, index_heads, device=dev)
    index_cache = torch.randn(4 * width, block // 4, index_dim, device=dev, dtype=bf16)
    weight_scale = index_heads ** -0.5 * index_dim ** -0.5

    def index(qs, w, t, n, widen=0):
        return ops.dsa.index_scores(qs, w, index_cache, torch.cat([t, t[:, :widen]], dim=1), n,
                                    weight_scale=weight_scale)

    got = _same_rows(index, [q_index, head_weights, csa_table, counts], cases)[0]
    assert torch.equal(index(q_index, head_weights, csa_table, counts, widen=20)[:, :got.shape[1]], got)
    close(got, plain.dsa.index_scores(q_index, head_weights, index_cache, csa_table, counts,
                                      weight_scale=weight_scale))


def test_invariant_v4_ops_rows_at_real_sizes():
    """DeepSeek-V4's ops of the batch-invariant Triton table at v4-mini's sizes (see `check_v4_ops`)."""
    check_v4_ops("cuda")
