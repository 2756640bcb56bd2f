"""DeepSeek-V4 mixed batches and state: each sequence as if alone, batch-mates independent, padding inert.

Sequences meet a mixed step in different phases of their layers' state: mid-window
and mid-CSA-block (13 tokens cached), past the window and mid-HCA-block (22), a fresh
prompt (0) and a prompt mid-chunk (6 cached).
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import mla_func as mf
from mla_func.core.rows import row_metadata, rows_needed
from mla_func.kernels import ops_for
from mla_func.models.v4.attention import v4_attention
from mla_func.pytree import tree_leaves
from support.v4_reference import Seq, new_state, save_reference

HISTORY = {0: 13, 1: 22, 2: 0, 3: 6}


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    folder = tmp_path_factory.mktemp("v4-batch")
    save_reference(folder, seed=11)
    return mf.load_model(folder, device="cpu")


def _tokens(seed: int, n: int) -> list[int]:
    return torch.randint(2, 97, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _with_history(model, state, seqs: list[int]):
    """Each listed sequence's cached history, prefilled alone."""
    for i in seqs:
        if HISTORY[i]:
            seq = Seq(i, state.groups)
            batch, mode = mf.plan_step(model.config, state, mf.StepPlan(prefill=(seq.plan(_tokens(i, HISTORY[i]), 0, 1),)))
            _, state = mf.forward(model.params, state, batch, mode)
    return state


def _mixed_plan(groups, fresh: dict[int, list[int]]) -> mf.StepPlan:
    seq = {i: Seq(i, groups) for i in HISTORY}
    return mf.StepPlan(
        prefill=(seq[2].plan(fresh[2], 0), seq[3].plan(fresh[3], HISTORY[3])),
        decode=(seq[0].plan(fresh[0], HISTORY[0], 1), seq[1].plan(fresh[1], HISTORY[1], 1)),
    )


def _fresh(seed: int) -> dict[int, list[int]]:
    return {0: _tokens(100 + seed, 1), 1: _tokens(200 + seed, 1), 2: _tokens(300 + seed, 9), 3: _tokens(400 + seed, 7)}


def _rows_by_seq(logits: torch.Tensor, fresh: dict[int, list[int]]) -> dict[int, torch.Tensor]:
    n2, n3 = len(fresh[2]), len(fresh[3])
    return {2: logits[:n2], 3: logits[n2:n2 + n3], 0: logits[n2 + n3:n2 + n3 + 1], 1: logits[n2 + n3 + 1:]}


def _mixed(model, fresh, padding=None, copy=False):
    # A fifth sequence's blocks stay unused: nothing may ever write them.
    state = _with_history(model, new_state(model, num_seqs=5), list(HISTORY))
    batch, mode = mf.plan_step(model.config, state, _mixed_plan(state.groups, fresh), padding=padding)
    assert mode.kind is mf.SegmentKind.MIXED
    logits, new = mf.forward(model.params, state, batch, mode, copy=copy)
    return logits[: mode.num_logits], new, state


def test_a_mixed_step_gives_each_sequence_what_it_gets_alone(model):
    fresh = _fresh(0)
    mixed, _, _ = _mixed(model, fresh)
    got = _rows_by_seq(mixed, fresh)
    for i in HISTORY:
        state = _with_history(model, new_state(model), [i])
        seq = Seq(i, state.groups)
        plan = (mf.StepPlan(decode=(seq.plan(fresh[i], HISTORY[i], 1),)) if i in (0, 1)
                else mf.StepPlan(prefill=(seq.plan(fresh[i], HISTORY[i]),)))
        batch, mode = mf.plan_step(model.config, state, plan)
        alone, _ = mf.forward(model.params, state, batch, mode)
        torch.testing.assert_close(got[i], alone, rtol=1e-5, atol=1e-5)


def test_batch_mates_do_not_change_a_sequence(model):
    first, second = _fresh(1), _fresh(1)
    second[1] = _tokens(7, 1)
    second[2] = _tokens(8, 9)
    a = _rows_by_seq(_mixed(model, first)[0], first)
    b = _rows_by_seq(_mixed(model, second)[0], second)
    for i in (0, 3):
        torch.testing.assert_close(a[i], b[i], rtol=1e-5, atol=1e-5)
    assert not torch.allclose(a[2], b[2])


def test_a_donated_state_raises_and_copy_keeps_it(model):
    fresh = _fresh(2)
    copied_logits, _, kept = _mixed(model, fresh, copy=True)
    assert not kept.is_donated
    state = _with_history(model, new_state(model), list(HISTORY))
    batch, mode = mf.plan_step(model.config, state, _mixed_plan(state.groups, fresh))
    logits, new = mf.forward(model.params, state, batch, mode)
    torch.testing.assert_close(logits[: mode.num_logits], copied_logits, rtol=0, atol=0)
    with pytest.raises(mf.DonatedStateError):
        mf.forward(model.params, state, batch, mode)
    # Every kind of leaf is in the state: window keys, compressor inputs, entries, indexer inputs and keys.
    kinds = {name for layer in new.layers for name in ("compressor_inputs", "entries", "index_inputs", "index_keys")
             if getattr(layer, name) is not None}
    assert kinds == {"compressor_inputs", "entries", "index_inputs", "index_keys"}
    assert len(new.groups) == 3 and [g.tokens_per_entry for g in new.groups] == [1, 4, 16]


@settings(max_examples=6, deadline=None)
@given(prefill_tokens=st.integers(0, 6), prefill_seqs=st.integers(0, 2), decode_seqs=st.integers(0, 3),
       width=st.integers(0, 3))
def test_padded_rows_change_no_real_cache_entry(model, prefill_tokens, prefill_seqs, decode_seqs, width):
    fresh = _fresh(3)
    exact_logits, exact_state, _ = _mixed(model, fresh)
    plan = _mixed_plan(new_state(model).groups, fresh)
    rungs = dict(prefill_tokens=plan.num_prefill_tokens + prefill_tokens, prefill_seqs=2 + prefill_seqs,
                 decode_seqs=2 + decode_seqs, block_table_widths=-(-max(s.seq_len for s in (*plan.prefill, *plan.decode))
                                                                     // 4) + width)
    padding = mf.PaddingPolicy(**{name: (value,) for name, value in rungs.items()})
    padded_logits, padded_state, _ = _mixed(model, fresh, padding=padding)
    torch.testing.assert_close(padded_logits, exact_logits, rtol=1e-5, atol=1e-5)
    assert len(tree_leaves(padded_state)) == 14
    first_unused = [table[0] for table in Seq(4, exact_state.groups).tables()]
    for exact_layer, padded_layer in zip(exact_state.layers, padded_state.layers):
        pairs = [(0, e, p) for e, p in zip(exact_layer.paged(), padded_layer.paged())]
        pairs += [(exact_layer.entry_group, e, p) for e, p in zip(exact_layer.paged_entries(),
                                                                  padded_layer.paged_entries())]
        for group, exact, padded in pairs:
            # Block 0 of every group is the scratch block padded rows write into; every other block is real.
            # Real rows' values may round differently at another padded size, never by more than that.
            torch.testing.assert_close(padded[1:], exact[1:], rtol=1e-5, atol=1e-5)
            assert not bool(padded[first_unused[group]:].any()), "a row wrote into blocks no sequence holds"


def test_the_step_rows_hold_each_segments_rows_in_every_group_and_the_batch_carries_none(model):
    """One per-row view, built from the batch by the forward (never a field of the batch, so graph
    replays copy none of it), sliced per segment by V4's attention."""
    state = new_state(model)
    batch, mode = mf.plan_step(model.config, state, _mixed_plan(state.groups, _fresh(4)))
    assert "rows" not in {f.name for f in dataclasses.fields(batch)}
    assert rows_needed(model.config, mode)
    rows = row_metadata(batch, mode)
    assert [tuple(t.shape) for t in rows.group_tables] == [(18, w) for w in mode.group_widths]
    segments = rows.segments(mode)
    assert [(r.start, r.stop) for r in segments] == [(0, 16), (16, 18)]
    decode_rows = segments[1]
    assert decode_rows.key_lens.tolist() == [HISTORY[0] + 1, HISTORY[1] + 1]
    # HCA entries (group 2, 16 tokens each): none complete at 14 tokens, so only the scratch block; one at 23.
    assert decode_rows.group_tables[1].tolist() == [[0, 0], [Seq(1, state.groups).tables()[2][0], 0]]
    with pytest.raises(ValueError, match="cache groups past group 0"):
        row_metadata(dataclasses.replace(batch, groups=batch.groups[:1]), mode)


def test_v4_attention_refuses_a_step_without_its_rows(model):
    state = new_state(model)
    batch, mode = mf.plan_step(model.config, state, _mixed_plan(state.groups, _fresh(4)))
    x = torch.zeros(mode.num_tokens, model.config.hidden_size)
    ops = ops_for("torch")
    with pytest.raises(ValueError, match="LayerContext.rows"):
        v4_attention(model.params.layers[0].attn, x, state.layers[0], batch, mode, "sliding", model.config, ops,
                     inplace=False, rows=None)


def _step(model, state, prefill=(), decode=()):
    batch, mode = mf.plan_step(model.config, state, mf.StepPlan(prefill=tuple(prefill), decode=tuple(decode)))
    logits, state = mf.forward(model.params, state, batch, mode)
    return logits[: mode.num_logits], state


@settings(max_examples=8, deadline=None)
@given(phases=st.lists(st.tuples(st.integers(0, 40), st.integers(1, 9), st.booleans()), min_size=2, max_size=4))
def test_any_mix_of_layer_state_phases_equals_each_sequence_alone(model, phases):
    """Histories of any length (mid-window, mid-block, past blocks) written in one batched prefill, then one step
    where each sequence decodes one token or prefills a chunk: every row = the sequence run alone."""
    state = new_state(model)
    seqs = [Seq(i, state.groups) for i in range(len(phases))]
    tokens = [_tokens(50 + i, history + new) for i, (history, new, _) in enumerate(phases)]
    decodes = [i for i, (history, _, decode) in enumerate(phases) if decode and history]
    prefills = [i for i in range(len(phases)) if i not in decodes]

    def plans(i):
        history, new, _ = phases[i]
        fed = tokens[i][history:history + (1 if i in decodes else new)]
        return seqs[i].plan(fed, history, 1 if i in decodes else len(fed))

    histories = [seqs[i].plan(tokens[i][:phases[i][0]], 0, 1) for i in range(len(phases)) if phases[i][0]]
    if histories:
        _, state = _step(model, state, prefill=histories)
    mixed, _ = _step(model, state, prefill=[plans(i) for i in prefills], decode=[plans(i) for i in decodes])
    offset = 0
    for i in (*prefills, *decodes):
        alone_state = new_state(model)
        if phases[i][0]:
            _, alone_state = _step(model, alone_state, prefill=[seqs[i].plan(tokens[i][:phases[i][0]], 0, 1)])
        alone, _ = _step(model, alone_state, decode=[plans(i)]) if i in decodes else \
            _step(model, alone_state, prefill=[plans(i)])
        torch.testing.assert_close(mixed[offset:offset + alone.shape[0]], alone, rtol=1e-5, atol=1e-5)
        offset += alone.shape[0]
    assert offset == mixed.shape[0]


def test_decode_rows_of_several_query_tokens_equal_a_prefill_chunk(model):
    """Verify-style decode (decode_q_len 3): each query token sees its own window and entries, as in a chunk."""
    state = new_state(model)
    seqs = [Seq(i, state.groups) for i in range(2)]
    tokens = [_tokens(60 + i, n) for i, n in enumerate((18, 31))]
    _, state = _step(model, state, prefill=[seqs[i].plan(tokens[i][:-3], 0, 1) for i in range(2)])
    batch, mode = mf.plan_step(model.config, state, mf.StepPlan(
        decode=tuple(seqs[i].plan(tokens[i][-3:], len(tokens[i]) - 3, 3) for i in range(2)), decode_q_len=3))
    verified, _ = mf.forward(model.params, state, batch, mode, copy=True)
    chunked, _ = _step(model, state, prefill=[seqs[i].plan(tokens[i][-3:], len(tokens[i]) - 3, 3) for i in range(2)])
    assert mode.kind is mf.SegmentKind.DECODE and verified.shape == chunked.shape == (6, 97)
    torch.testing.assert_close(verified, chunked, rtol=1e-5, atol=1e-5)
