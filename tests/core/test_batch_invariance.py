"""Batch invariance on CPU (torch backend, and the Triton kernels in the interpreter); DeepSeek-V4's in
tests/core/test_v4_batch_invariance.py.

A batch-invariant step gives each row bits that depend on its own sequence only:
the same logits and cache entries whatever else shares the step, however a
prompt is cut into chunks, whether a token is a prefill or a decode row, and
whichever padding rung the step took. Tests compare with `torch.equal`.
"""

from __future__ import annotations

import random

import pytest
import torch

import mla_func as mf
from support.hand_plans import Seq, blocks, decode_plan, prefill_in_chunks, prefill_plan, run
from support import invariant_runs
from support.invariant_runs import padded_mixed_logits, probes_alone
from support.logits_probes import first_difference, other_requests, probe_requests, run_probes
from mla_func.kernels import ops_for
from mla_func.kernels.reference import attention as ref_attention
from mla_func.kernels.reference import invariant as ref_invariant
from support.mla_reference import make_reference, save_reference

# Bitwise comparisons across batch compositions: the interpreter's dot must sum each row in one order.
pytestmark = pytest.mark.row_invariant_dots

BLOCK = 4


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    hf = make_reference("v3-qlora-noaux", seed=5)
    return mf.load_model(save_reference(hf, tmp_path_factory.mktemp("invariance")), device="cpu")


def fresh(model):
    return mf.init_state(model, num_blocks=400, block_size=BLOCK)


def tokens(n, seed):
    rng = random.Random(seed)
    return [rng.randrange(97) for _ in range(n)]


# ---- ops ------------------------------------------------------------------------------------


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_products_do_not_depend_on_the_row_count(backend):
    ops = ops_for(backend, batch_invariant=True)
    torch.manual_seed(0)
    x, w = torch.randn(40, 96), torch.randn(72, 96)
    full = ops.dense.linear(x, w)
    for rows in (1, 3, 16, 17, 33):
        assert torch.equal(ops.dense.linear(x[:rows], w), full[:rows]), rows
        if backend == "torch":
            # A row moved to another place in its tile. (Triton's CPU interpreter multiplies a
            # tile with numpy, whose result for a row can depend on its place in the tile; on
            # the GPU a tensor-core product does not: tests/core/test_batch_invariance_gpu.py.)
            assert torch.equal(ops.dense.linear(x[7:7 + rows], w), full[7:7 + rows]), rows
    torch.testing.assert_close(full, x @ w.t(), rtol=1e-5, atol=1e-5)
    qn, qp, w_uk = torch.randn(40, 3, 16), torch.randn(40, 3, 8), torch.randn(3, 16, 32)
    absorbed = ops.mla.absorb_query(qn, qp, w_uk)
    torch.testing.assert_close(absorbed, ref_attention.absorb_query(qn, qp, w_uk), rtol=1e-5, atol=1e-5)
    for rows in (1, 5, 20):
        assert torch.equal(ops.mla.absorb_query(qn[:rows], qp[:rows], w_uk), absorbed[:rows])


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_decode_rows_depend_on_their_own_keys_only(backend):
    ops = ops_for(backend, batch_invariant=True)
    torch.manual_seed(1)
    heads, rank, rope, bs = 4, 32, 16, 4
    kv = torch.randn(64, bs, rank + rope)
    lens = torch.tensor([1, 5, 16, 33, 47, 60, 0], dtype=torch.int32)
    table = torch.randint(1, 64, (7, 15), dtype=torch.int32)
    q, w_uv = torch.randn(7, heads, rank + rope), torch.randn(heads, 8, rank)
    args = dict(softmax_scale=0.3, kv_lora_rank=rank)
    out, lse = ops.mla.mla_decode(q, kv, table, lens, w_uv=w_uv, **args)
    expected, expected_lse = ref_attention.mla_decode(q, kv, table, lens, w_uv=w_uv, **args)
    torch.testing.assert_close(out, expected, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(lse, expected_lse, rtol=1e-5, atol=1e-5)
    assert torch.equal(out[6], torch.zeros_like(out[6])) and torch.isinf(lse[6]).all()
    # Alone, among other rows, and with a wider (padded) table: the same bits.
    for rows in (slice(3, 4), slice(1, 5), slice(0, 7)):
        sub, sub_lse = ops.mla.mla_decode(q[rows], kv, table[rows], lens[rows], w_uv=w_uv, **args)
        assert torch.equal(sub, out[rows]) and torch.equal(sub_lse, lse[rows])
    wide = torch.cat([table, torch.zeros_like(table)], dim=1)
    assert torch.equal(ops.mla.mla_decode(q, kv, wide, lens, w_uv=w_uv, **args)[0], out)
    with pytest.raises(ValueError, match="q_len"):
        ops.mla.mla_decode(q, kv, table, lens, q_len=7, **args)


def test_moe_and_routing_rows_do_not_depend_on_the_token_count():
    ops = ops_for("torch", batch_invariant=True)
    torch.manual_seed(2)
    x = torch.randn(37, 24)
    gate, w13, w2 = torch.randn(8, 24), torch.randn(9, 2 * 12, 24), torch.randn(9, 24, 12)
    valid = torch.ones(37, dtype=torch.bool)
    route = dict(top_k=2, scoring_func="softmax", topk_method="greedy", n_group=None, topk_group=None,
                 norm_topk_prob=False, routed_scaling_factor=1.0, num_shared=1)
    weights, ids = ops.moe.route(x, gate, None, valid, **route)
    out = ops.moe.fused_moe(x, w13, w2, weights, ids)
    for rows in (1, 2, 16, 20):
        w_sub, id_sub = ops.moe.route(x[:rows], gate, None, valid[:rows], **route)
        assert torch.equal(w_sub, weights[:rows]) and torch.equal(id_sub, ids[:rows])
        assert torch.equal(ops.moe.fused_moe(x[:rows], w13, w2, weights[:rows], ids[:rows]), out[:rows])
    plain = ops_for("torch")
    torch.testing.assert_close(out, plain.moe.fused_moe(x, w13, w2, weights, ids), rtol=1e-5, atol=1e-5)


def test_a_mode_and_an_op_table_must_agree(model):
    state = fresh(model)
    batch, mode = mf.plan_step(model.config, state, mf.StepPlan(prefill=(prefill_plan(Seq(blocks(0, 4)), [1, 2]),)),
                               batch_invariant=True)
    assert mode.batch_invariant and mode.static_key != dataclasses_replace(mode).static_key
    with pytest.raises(ValueError, match="batch-invariant"):
        mf.forward(model.params, state, batch, mode, ops=ops_for("torch"))


def dataclasses_replace(mode):
    import dataclasses
    return dataclasses.replace(mode, batch_invariant=False)


# ---- the model --------------------------------------------------------------------------------


def test_chunking_and_step_kind_do_not_change_a_bit(model):
    prompt = tokens(31, 0)
    whole, _ = prefill_in_chunks(model, fresh(model), Seq(blocks(0, 10)), prompt, 31, batch_invariant=True)
    for chunk in (1, 3, 7):
        chunked, _ = prefill_in_chunks(model, fresh(model), Seq(blocks(0, 10)), prompt, chunk, batch_invariant=True)
        assert torch.equal(chunked, whole), chunk
    # The last token as a decode row gives the bits it got as a prefill row.
    seq = Seq(blocks(0, 10))
    _, state = prefill_in_chunks(model, fresh(model), seq, prompt[:-1], 30, batch_invariant=True)
    decoded, _ = run(model, state, mf.StepPlan(decode=(decode_plan(seq, prompt[-1]),)), batch_invariant=True)
    assert torch.equal(decoded[0], whole[-1])


def test_batch_mates_and_padding_do_not_change_a_bit(model):
    prompt = tokens(23, 1)
    alone, _ = prefill_in_chunks(model, fresh(model), Seq(blocks(0, 10)), prompt, 23, batch_invariant=True)
    # The same prompt in a mixed step beside another prefill and three decode rows, padded to a ladder.
    state = fresh(model)
    others = [Seq(blocks(i, 10)) for i in range(1, 5)]
    for i, other in enumerate(others):
        _, state = prefill_in_chunks(model, state, other, tokens(9 + 5 * i, 10 + i), 64, batch_invariant=True)
    plan = mf.StepPlan(prefill=(prefill_plan(Seq(blocks(0, 10)), prompt), prefill_plan(others[0], [5, 6, 7])),
                       decode=tuple(decode_plan(s, 11) for s in others[1:]))
    logits = padded_mixed_logits(model, state, plan, table_width=16)
    assert torch.equal(logits[: len(prompt)], alone)


# ---- the engine -------------------------------------------------------------------------------


def cpu_engine(model, **kwargs):
    return invariant_runs.cpu_engine(model, BLOCK, **kwargs)


@pytest.mark.parametrize("settings", [
    dict(others=6),
    dict(others=12, long_prefill_token_threshold=5),
    dict(others=12, long_prefill_token_threshold=None, max_num_batched_tokens=512),
    dict(others=12, enable_mixed=False),
    dict(others=12, num_blocks=40),
], ids=["among 6", "among 12, chunks of 5", "among 12, unlimited chunks", "among 12, mixed off", "preempted"])
def test_engine_requests_do_not_depend_on_their_batch_mates(model, settings):
    settings = dict(settings)
    vocab = model.config.vocab_size
    probes = probe_requests(vocab, 0, count=4, max_tokens=12, max_len=40)
    alone = probes_alone(cpu_engine(model), probes)
    others = other_requests(vocab, 1, count=settings.pop("others"), probes=probes[0], max_tokens=12, max_len=40)
    crowd = run_probes(cpu_engine(model, **settings), probes, others, seed=3)
    if settings.get("num_blocks"):
        assert crowd.preemptions > 0
    assert crowd.tokens == alone.tokens
    for probe in range(4):
        assert first_difference(crowd.logits[probe], alone.logits[probe]) is None, probe


def test_reference_tiles_cover_every_row():
    x = torch.randn(ref_invariant.ROW_TILE * 2 + 3, 5)
    w = torch.randn(4, 5)
    torch.testing.assert_close(ref_invariant.linear(x, w), x @ w.t())
    assert ref_invariant.linear(x[:0], w).shape == (0, 4)


def test_sparse_attention_model_is_invariant_too(tmp_path):
    """DeepSeek-V3.2 (indexer, top-k, sparse MLA) in batch-invariant steps: chunking, the step
    kind and a batch-mate change no bit."""
    from support.dsa_reference import make_v32

    make_v32("v32", seed=2).save_pretrained(tmp_path)
    v32 = mf.load_model(tmp_path, device="cpu")
    prompt = tokens(29, 4)
    whole, _ = prefill_in_chunks(v32, fresh(v32), Seq(blocks(0, 10)), prompt, 29, batch_invariant=True)
    chunked, _ = prefill_in_chunks(v32, fresh(v32), Seq(blocks(0, 10)), prompt, 3, batch_invariant=True)
    assert torch.equal(chunked, whole)
    seq, other = Seq(blocks(0, 10)), Seq(blocks(1, 10))
    state = fresh(v32)
    _, state = prefill_in_chunks(v32, state, seq, prompt[:-1], 28, batch_invariant=True)
    _, state = prefill_in_chunks(v32, state, other, tokens(17, 5), 17, batch_invariant=True)
    plan = mf.StepPlan(decode=(decode_plan(other, 3), decode_plan(seq, prompt[-1])))
    decoded, _ = run(v32, state, plan, batch_invariant=True)
    assert torch.equal(decoded[1], whole[-1])
