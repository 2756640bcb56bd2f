"""Batch invariance where users run it: bf16, Triton backend, CUDA graphs on, through the engine.

16 probe requests (8 seeded sampled, 8 greedy, 48 tokens) give the same tokens, and
the same logits bit for bit on their first 16 steps, alone, among 16 and among 64
other requests of random lengths, with mixed batches and prefix caching on, with
chunk thresholds 64 / 512 / unlimited, after preemptions, and with graphs off.
"""

from __future__ import annotations

import pytest
import torch

import mla_func as mf
from support.logits_probes import ProbeRun, first_difference, other_requests, probe_requests, run_probes

pytestmark = pytest.mark.gpu

PROBE_TOKENS = 48
LOGIT_STEPS = 16


@pytest.fixture(scope="module", params=["tiny", "v2-lite"])
def model(request):
    model = mf.load_model(request.param, dtype=torch.bfloat16, device="cuda", seed=3)
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
