"""CUDA graphs under data-parallel attention: every rank decides every rank's mode, and they agree.

The decision needs no CUDA: `graphs=True` is passed to `plan_rank_step` / `rank_modes` directly. A decode
step whose every busy rank may replay a graph is padded, on every rank (an idle one too), to the largest
sizes any rank needs, and every rank has one static key; any other step runs eagerly on every rank. The
padding changes no result: one process's padded step equals its exact step, and over gloo each rank's
steps with the agreed padding (and the exchange of the agreed rows) equal its requests run alone.
(Two GPUs, the engine replaying graphs: test_data_parallel_graphs_gpu.py.)
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

import mla_func as mf
from mla_func.core.mode import SEGMENT_KINDS
from mla_func.core.step import Step
from mla_func.parallel.data_parallel import plan_rank_step, prepare_rank_step, rank_graph_modes, rank_modes
from support.hand_plans import blocks
from support.mla_reference import make_reference, rel_err, save_reference
from support.parallel_jobs import AGREED_BUSY, agreed_plans, job_agreed_steps, runs_of_every_rank
from support.parallel_runs import TOL, WORLD, run_steps

LADDER = mf.PaddingPolicy(decode_seqs=(1, 2, 4, 8), prefill_tokens=(16, 32), prefill_seqs=(1, 2, 4),
                          block_table_widths=(4, 8, 16))
BLOCK_SIZE = 4
PER_SEQ = 20  # blocks a test sequence owns: 80 positions, above the widest rung (16 blocks)


@pytest.fixture(scope="module")
def model():
    return mf.load_model("tiny", dtype=torch.float64, device="cpu", seed=4)


@pytest.fixture
def state(model):
    return mf.init_state(model.config, num_blocks=256, block_size=BLOCK_SIZE, dtype=model.dtype)


def decode(contexts, first=0, *, q_len=1):
    """A decode step of sequences first, first + 1, ... with contexts[i] cached tokens each."""
    return mf.StepPlan(decode=tuple(mf.SeqPlan(tuple(range(7 + i, 7 + i + q_len)), n, blocks(first + i, PER_SEQ),
                                               q_len) for i, n in enumerate(contexts)), decode_q_len=q_len)


def prefill(lengths, first=0):
    return mf.StepPlan(prefill=tuple(mf.SeqPlan(tuple(range(3, 3 + n)), 0, blocks(first + i, PER_SEQ))
                                     for i, n in enumerate(lengths)))


def every_rank(model, state, plans, graph_kinds=("decode",)):
    """(batch, mode) of every rank, each decided as that rank decides it (graphs for decode steps only by
    default, as the engine's)."""
    return [plan_rank_step(model.config, state, plans, rank, backend="torch", padding=LADDER, graphs=True,
                           graph_kinds=graph_kinds) for rank in range(len(plans))]


# One sequence (3 cached tokens: 1 block), five (up to 30: 8 blocks), and an idle rank.
UNEVEN = (decode([3]), decode([20, 5, 6, 7, 30], first=1), mf.StepPlan())


def test_uneven_decode_plans_agree_on_one_padded_key(model, state):
    steps = every_rank(model, state, UNEVEN)
    modes = [mode for _, mode in steps]
    assert all(mode.use_graph and not mode.graph_fallback for mode in modes)
    assert len({mode.static_key for mode in modes}) == 1
    # The largest rung any rank needs: 5 sequences -> 8; 31 tokens in blocks of 4 -> 8 blocks -> 8.
    assert {(mode.padded_decode_seqs, mode.block_table_width) for mode in modes} == {(8, 8)}
    assert [mode.num_decode_seqs for mode in modes] == [1, 5, 0]
    # Every rank brings the padded rows to the exchange: its whole step.
    assert {mode.exchange_rows for mode in modes} == {8} == {mode.num_tokens for mode in modes}
    # The same tuple on every rank, from the plans alone.
    assert rank_modes(UNEVEN, cache_groups=state.groups, backend="torch", padding=LADDER, graphs=True) == tuple(modes)


def test_verify_steps_agree_with_the_query_length_in_the_exchanged_rows(model, state):
    modes = [mode for _, mode in every_rank(model, state, (decode([3, 4], q_len=3), mf.StepPlan(),
                                                           decode([9], first=2, q_len=3)))]
    assert all(mode.use_graph for mode in modes) and len({mode.static_key for mode in modes}) == 1
    assert {(mode.padded_decode_seqs, mode.decode_q_len, mode.exchange_rows) for mode in modes} == {(2, 3, 6)}


def test_the_agreed_batch_holds_a_rank_s_real_rows_first_then_padding(model, state):
    batch, mode = every_rank(model, state, UNEVEN)[0]
    own_batch, own_mode = mf.plan_step(model.config, state, UNEVEN[0], padding=LADDER, graphs=True)
    assert (own_mode.padded_decode_seqs, own_mode.block_table_width) == (1, 4)  # less than agreed
    assert mode.num_tokens == 8 and batch.input_ids.shape == (8,)
    assert torch.equal(batch.input_ids[:1], own_batch.input_ids)
    assert torch.equal(batch.positions[:1], own_batch.positions)
    assert torch.equal(batch.slot_mapping[:1], own_batch.slot_mapping)
    assert bool((batch.slot_mapping[1:] == -1).all())  # padding writes only the scratch block
    table, own_table = batch.decode.block_table, own_batch.decode.block_table
    assert table.shape == (8, 8) and torch.equal(table[:1, :4], own_table)
    assert bool((table[1:] == 0).all())                 # padding sequences read the scratch block
    assert torch.equal(batch.logits_indices[:1], own_batch.logits_indices)
    idle_batch, idle_mode = every_rank(model, state, UNEVEN)[2]
    assert idle_mode.num_logits == 0 and bool((idle_batch.slot_mapping == -1).all())


def test_a_mixed_step_on_one_rank_makes_every_rank_eager(model, state):
    mixed = dataclasses.replace(prefill([5], first=6), decode=decode([4], first=7).decode)
    modes = [mode for _, mode in every_rank(model, state, (decode([3]), mixed, mf.StepPlan()))]
    assert not any(mode.use_graph or mode.graph_fallback for mode in modes)
    # Each at its own sizes (the mixed step exact, as a kind without graphs; the idle rank one row),
    # exchanging the most rows of any: the mixed step's.
    assert [mode.num_tokens for mode in modes] == [1, 6, 1]
    assert {mode.exchange_rows for mode in modes} == {6}


def test_prefill_steps_run_eagerly_even_where_each_rank_alone_would_graph_them(model, state):
    plans = (prefill([5]), prefill([9], first=1))
    alone = [mf.plan_step(model.config, state, plan, padding=LADDER, graphs=True)[1] for plan in plans]
    assert all(mode.use_graph for mode in alone)
    modes = [mode for _, mode in every_rank(model, state, plans, graph_kinds=SEGMENT_KINDS)]
    assert not any(mode.use_graph or mode.graph_fallback for mode in modes)
    assert {mode.exchange_rows for mode in modes} == {max(mode.num_tokens for mode in modes)}


def test_other_query_lengths_make_every_rank_eager(model, state):
    modes = [mode for _, mode in every_rank(model, state, (decode([3]), decode([5], first=1, q_len=3)))]
    assert not any(mode.use_graph or mode.graph_fallback for mode in modes)


def test_logits_rows_that_differ_by_rank_make_every_rank_eager(model, state):
    """A decode row without logits makes that rank gather its logits rows: its key differs, so no rank graphs."""
    quiet = mf.StepPlan(decode=(mf.SeqPlan((7,), 4, blocks(1, PER_SEQ), 0),))
    modes = [mode for _, mode in every_rank(model, state, (decode([3]), quiet))]
    assert not any(mode.use_graph or mode.graph_fallback for mode in modes)


@pytest.mark.parametrize("over", ["seqs", "width"])
def test_a_rank_above_the_ladders_makes_every_rank_eager_and_only_it_warns(model, state, over):
    big = decode([3] * 9, first=1) if over == "seqs" else decode([70], first=1)  # 9 > 8 sequences; 18 > 16 blocks
    modes = [mode for _, mode in every_rank(model, state, (decode([3]), big, mf.StepPlan()))]
    assert [mode.use_graph for mode in modes] == [False] * 3
    assert [mode.graph_fallback for mode in modes] == [False, True, False]
    assert {mode.exchange_rows for mode in modes} == {max(mode.num_tokens for mode in modes)}
    assert modes[2].num_tokens == 1  # an idle rank of an eager step brings one row


def test_without_graphs_nothing_is_padded_to_another_rank_s_sizes(model, state):
    modes = [plan_rank_step(model.config, state, UNEVEN, rank, backend="torch")[1] for rank in range(3)]
    assert [(m.use_graph, m.padded_decode_seqs, m.num_tokens) for m in modes] == [(False, 1, 1), (False, 5, 5),
                                                                                  (False, 1, 1)]
    assert {m.exchange_rows for m in modes} == {5}


def test_warmup_modes_have_the_keys_agreed_decode_steps_get(model, state):
    """`rank_graph_modes` of a step's decode graph modes: what each agreed decode step's key is, so warm-up
    captures every key a real step meets, and `prepare_rank_step` decides with the step's settings."""
    step = Step(fn=lambda *a: a, params=model.params, config=model.config, backend="torch", graphs=True,
                padding=LADDER, block_size=BLOCK_SIZE, graph_kinds=("decode",))
    warm = rank_graph_modes(step.decode_graph_modes(state))
    keys = {mode.static_key for mode in warm}
    assert len(keys) == len(LADDER.decode_seqs) * len(LADDER.block_table_widths)
    assert all(mode.exchange_rows == mode.num_tokens for mode in warm)
    for plans in (UNEVEN, (decode([3, 4, 5]), decode([60], first=3)), (mf.StepPlan(), decode([9], first=4))):
        for rank in range(len(plans)):
            _, mode = prepare_rank_step(step, state, plans, rank)
            assert mode.use_graph and mode.static_key in keys


def test_padded_to_grows_a_mode_and_derives_its_logits_rows(state):
    plan = decode([3, 5])
    mode = mf.ForwardMode.decide(plan, cache_groups=state.groups, padding=LADDER, graphs=True)
    grown = mode.padded_to(decode_seqs=8, block_table_width=16)
    assert (grown.padded_decode_seqs, grown.block_table_width, grown.padded_num_logits) == (8, 16, 8)
    assert (grown.num_decode_seqs, grown.num_logits, grown.use_graph, grown.gather_logits) == (2, 2, True, False)
    assert mode.padded_to(decode_seqs=2, block_table_width=4) == mode
    with pytest.raises(ValueError, match="decode_seqs 1 < 2"):
        mode.padded_to(decode_seqs=1, block_table_width=4)
    with pytest.raises(ValueError, match="a decode step has no rows of prefill_tokens or prefill_seqs"):
        mode.padded_to(decode_seqs=2, block_table_width=4, prefill_tokens=16)


def test_agreed_padding_leaves_a_rank_s_logits_and_cache_unchanged(model):
    """One process runs rank 0's agreed step (padded to rank 1's sizes) and its exact step from the same
    cache: the same logits rows and cache entries (block 0, the scratch block, aside)."""
    contexts = [6, 11]
    start = mf.init_state(model.config, num_blocks=256, block_size=BLOCK_SIZE, dtype=model.dtype)
    _, start = mf.forward(model.params, start, *mf.plan_step(model.config, start, prefill(contexts)))
    plan = mf.StepPlan(decode=tuple(mf.SeqPlan((40 + i,), n, blocks(i, PER_SEQ)) for i, n in enumerate(contexts)))
    plans = (plan, decode([3, 4, 5, 6, 50], first=2))

    def run(batch, mode):
        state = mf.pytree.tree_map(torch.clone, start)
        logits, state = mf.forward(model.params, state, batch, mode)
        return logits[:mode.num_logits], state

    agreed_batch, agreed_mode = plan_rank_step(model.config, start, plans, 0, backend="torch", padding=LADDER,
                                               graphs=True)
    assert (agreed_mode.padded_decode_seqs, agreed_mode.block_table_width) == (8, 16)
    padded, padded_state = run(agreed_batch, agreed_mode)
    exact, exact_state = run(*mf.plan_step(model.config, start, plan))
    torch.testing.assert_close(padded, exact, rtol=1e-12, atol=1e-12)
    for got, want in zip(padded_state.leaves(), exact_state.leaves()):
        torch.testing.assert_close(got[1:], want[1:], rtol=1e-12, atol=1e-12)


@pytest.fixture(scope="module")
def v3_folder(tmp_path_factory):
    folder = tmp_path_factory.mktemp("dp-graphs") / "v3"
    save_reference(make_reference("v3-qlora-noaux", seed=21, vocab_size=98), folder)
    return folder


def test_agreed_steps_over_gloo_equal_each_rank_s_requests_alone(v3_folder, tmp_path):
    """Two ranks through prefill, decode (of other widths), then rank 1 idle beside rank 0's decode, mixed and
    verify steps, padded as graph steps agree (run eagerly): each rank's logits are its requests' run alone,
    and the ranks agreed on one key at every decode and verify step."""
    ranks = runs_of_every_rank(job_agreed_steps, {"v3": (str(v3_folder),)}, tmp_path)["v3"]
    whole = mf.load_model(v3_folder, dtype=torch.float32, device="cpu")
    plans = agreed_plans(whole, WORLD)
    assert all(r["graph"] == [False, True, True, False, True] for r in ranks)  # prefill and mixed: eager
    for step, graph in enumerate(ranks[0]["graph"]):
        if graph:
            assert ranks[0]["keys"][step] == ranks[1]["keys"][step], f"step {step}"
    for rank, got in enumerate(ranks):
        alone = run_steps(whole, [plan for plan in plans[rank] if plan.num_seqs])
        busy = [logits for logits in got["logits"] if logits is not None]
        assert len(busy) == len(alone) == (len(plans[rank]) if rank == 0 else AGREED_BUSY)
        for step, (g, want) in enumerate(zip(busy, alone)):
            assert g.shape == want.shape and rel_err(g, want) <= TOL, f"rank {rank}, step {step}"
