"""DeepSeek-V4's group 0 holds only what later steps read: logits are unchanged whatever lies behind it.

The test config's layers (window 8, CSA 4:1, HCA 16:1) read group 0 back 15 tokens from a sequence's
next position (`V4DecoderLayer.lookback`: HCA's compressor pools the 16 tokens of its block), so with
blocks of 4 tokens a sequence keeps 4 or 5 group-0 blocks however long it grows. Prompts of about a
hundred tokens span a dozen windows, 25 CSA blocks and 6 HCA blocks.

By hand, chunked prefill then decode runs with the blocks behind the lookback either replaced by the
scratch block (as the scheduler leaves a table) or kept in the table but overwritten; the scratch
block, and those blocks, hold NaN or huge values; the logits are the reference's all the same, on
the torch and the Triton backends. Through the engine, whose bounded group 0 is recycled between
sequences all the time, greedy tokens are transformers' argmax with chunks across every boundary,
mixed and unmixed steps, preemption, and prefix hits whose first query's window starts in a cached
tail.
"""

from __future__ import annotations

import dataclasses
import random

import pytest
import torch

import mla_func as mf
from mla_func.models.v4.config import CSA, HCA, SLIDING
from mla_func.state.block_allocator import SCRATCH_BLOCK
from support.v4_reference import Seq, new_state, reference_logits, relative_error, save_reference, saved_model

LOOKBACK = 15
BLOCK_SIZE = 4


@pytest.fixture(scope="module")
def v4(tmp_path_factory):
    """(our model, transformers' model) of the test config, with the same random weights."""
    return saved_model(tmp_path_factory.mktemp("v4-bounded"), seed=31)


def _tokens(seed: int, n: int) -> list[int]:
    return random.Random(seed).choices(range(2, 97), k=n)


def test_each_layer_kind_declares_how_far_back_it_reads_group_0(v4):
    model, _ = v4
    kinds = {k.attention: k.lookback(model.config) for k in mf.layer_kinds(model.config)}
    # Window 8: 7 tokens back; CSA pools blocks of 4 with the previous block: 2 * 4 - 1; HCA its block of 16.
    assert kinds == {SLIDING: 7, CSA: 7, HCA: LOOKBACK}
    assert new_state(model).groups[0].lookback == LOOKBACK
    assert all(g.lookback is None for g in new_state(model).groups[1:])
    wider = dataclasses.replace(model.config.family_fields, sliding_window=40)
    config = dataclasses.replace(model.config, family_fields=wider)
    assert mf.init_state(config, num_blocks=4, block_size=4, device="meta").groups[0].lookback == 39


def _freed(plan: mf.SeqPlan, stale: bool, group: mf.CacheGroup) -> mf.SeqPlan:
    """The plan with its group-0 blocks wholly before start_pos - lookback (the model's own) given up: the
    scratch block in their place (as the scheduler leaves a table), or, `stale`, left in the table."""
    behind = group.first_live_block(plan.start_pos)
    if stale:
        return plan
    return dataclasses.replace(plan, block_table=(SCRATCH_BLOCK,) * behind + plan.block_table[behind:])


def _spoil(state, plan: mf.SeqPlan, value: float, stale: bool) -> None:
    """Fill the scratch block of every leaf with `value`, and, `stale`, the group-0 blocks the step may not
    read (wholly behind the lookback of its first position) that the table still names."""
    for leaf in state.leaves():
        leaf[SCRATCH_BLOCK] = value
    if stale:
        behind = state.groups[0].first_live_block(plan.start_pos)
        for layer in state.layers:
            for leaf in layer.paged():
                leaf[list(plan.block_table[:behind])] = value


def _run(model, tokens: list[int], chunk: int, decode: int, backend: str, spoil: float | None, stale: bool,
         backend_from: int = 0, block_size: int = BLOCK_SIZE):
    """Logits of every position: prefill of len(tokens) - decode tokens in chunks, then one token a step;
    steps from position `backend_from` on run on `backend`, those before on the torch reference."""
    state = new_state(model, num_seqs=1, block_size=block_size, max_tokens=len(tokens))
    seq = Seq(0, state.groups, max_tokens=len(tokens))
    prompt = len(tokens) - decode
    plans = [("prefill", seq.plan(tokens[s:min(s + chunk, prompt)], s)) for s in range(0, prompt, chunk)]
    plans += [("decode", seq.plan(tokens[p:p + 1], p)) for p in range(prompt, len(tokens))]
    rows = []
    for kind, plan in plans:
        if spoil is not None:
            plan = _freed(plan, stale, state.groups[0])
            _spoil(state, plan, spoil, stale)
        step = mf.StepPlan(prefill=(plan,)) if kind == "prefill" else mf.StepPlan(decode=(plan,))
        batch, mode = mf.plan_step(model.config, state, step,
                                   backend=backend if plan.start_pos >= backend_from else "torch")
        logits, state = mf.forward(model.params, state, batch, mode)
        rows.append(logits)
    return torch.cat(rows)


@pytest.fixture(scope="module")
def clean_run(v4):
    """100 tokens in chunks of 7 (each chunk boundary falls at another offset of the window, the CSA and the
    HCA blocks), then 4 decode steps, with every block in the tables and finite values everywhere."""
    model, hf = v4
    tokens = _tokens(100, 100)
    logits = _run(model, tokens, 7, 4, "torch", None, False)
    assert relative_error(logits, reference_logits(hf, tokens)) <= 1e-4
    return tokens, logits


@pytest.mark.parametrize("spoil,stale,block_size", [(float("nan"), False, 4), (3e38, True, 4), (float("nan"), True, 1)],
                         ids=["scratch-nan", "stale-huge", "stale-nan-blocks-of-1"])
def test_what_lies_behind_the_lookback_never_changes_a_logit(v4, clean_run, spoil, stale, block_size):
    """Blocks of one token free every token as soon as it falls behind: a lookback one short shows."""
    model, _ = v4
    tokens, clean = clean_run
    got = _run(model, tokens, 7, 4, "torch", spoil, stale, block_size=block_size)
    assert bool(torch.isfinite(got).all())
    assert torch.equal(got, clean)


def test_csa_s_overlapping_blocks_set_the_lookback_of_a_small_window(tmp_path):
    """Window 3, CSA 8:1 (its compressor and its indexer's pool the previous block too: 15 tokens back),
    HCA 4:1: group 0 is read back 15 tokens for CSA's sake, and no less will do (blocks of one token)."""
    hf = save_reference(tmp_path, seed=37, sliding_window=3, index_topk=2,
                        compress_rates={"compressed_sparse_attention": 8, "heavily_compressed_attention": 4})
    model = mf.load_model(tmp_path, device="cpu")
    assert {k.attention: k.lookback(model.config) for k in mf.layer_kinds(model.config)} == {
        SLIDING: 2, CSA: 15, HCA: 3}
    tokens = _tokens(60, 60)
    got = _run(model, tokens, 5, 3, "torch", float("nan"), True, block_size=1)
    assert bool(torch.isfinite(got).all())
    assert relative_error(got, reference_logits(hf, tokens)) <= 1e-4


def test_the_triton_kernels_read_nothing_behind_the_lookback(v4):
    """The Triton ops (Triton's interpreter without a GPU) from position 28 on: a chunk [28, 32) completes a
    CSA and an HCA entry with the first 3 blocks behind the lookback in the scratch block (a decode row
    takes the same per-row ops); the steps before run on the torch reference."""
    model, hf = v4
    tokens = _tokens(32, 32)
    got = _run(model, tokens, 14, 0, "triton", float("nan"), False, backend_from=28)
    assert bool(torch.isfinite(got).all())
    assert relative_error(got, reference_logits(hf, tokens)) <= 1e-4


def _engine(model, **kwargs):
    settings = dict(block_size=BLOCK_SIZE, num_blocks=200, max_num_seqs=4, max_num_batched_tokens=16,
                    long_prefill_token_threshold=8, graphs=False)
    return mf.Engine(model, **{**settings, **kwargs})


GREEDY = mf.SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)


class Recorder:
    """Wraps an engine's scheduler: the steps it made (and preempted), the group-0 blocks its rows held."""

    def __init__(self, engine):
        self.engine, self.preempted, self.most_held, self.placeholders = engine, [], 0, 0
        schedule = engine.scheduler.schedule

        def recording():
            step = schedule()
            if step is not None:
                self.preempted.extend(step.preempted)
                for row in step.rows:
                    held = [b for b in row.block_table if b != SCRATCH_BLOCK]
                    self.most_held = max(self.most_held, len(held))
                    self.placeholders += len(row.block_table) - len(held)
            return step

        engine.scheduler.schedule = recording


def _spoiled_engine(model, **kwargs):
    engine = _engine(model, **kwargs)
    for leaf in engine.state.leaves():
        leaf[SCRATCH_BLOCK] = float("nan")
    return engine, Recorder(engine)


def _assert_greedy(hf, prompts, completions):
    """Each generated token is transformers' argmax at its position (one full forward over the sequence:
    with the engine's own tokens fed back, that is greedy decoding)."""
    for prompt, completion in zip(prompts, completions):
        out = list(completion.raise_for_error().token_ids)
        ids = prompt + out
        want = reference_logits(hf, ids)[len(prompt) - 1:-1].argmax(-1).tolist()
        assert out == want


@pytest.fixture(scope="module")
def long_prompts():
    return [_tokens(100 + i, n) for i, n in enumerate((97, 61, 112))]


# Engine settings past `_engine`'s: mixed steps, unmixed ones, chunks of 5 tokens, and a cache whose compressed
# groups are too small for the three requests at once (preemption).
SCHEDULES = {"mixed": {}, "unmixed": {"enable_mixed": False}, "chunk5": {"long_prefill_token_threshold": 5},
             "preempting": {"num_blocks": 40}}


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_greedy_generate_over_many_windows_matches_transformers(v4, long_prompts, schedule):
    model, hf = v4
    settings = SCHEDULES[schedule]
    engine, seen = _spoiled_engine(model, **settings)
    groups = engine.state.groups
    # Group 0: what 4 sequences hold at once (4 or 5 blocks each) and a step of 16 tokens; groups 1 and 2 hold
    # the entries of the capacity's tokens, one block more a sequence.
    capacity = (engine.config.num_blocks - 1) * BLOCK_SIZE
    assert groups[0].num_blocks == min(engine.config.num_blocks, 1 + 4 * (4 + 2) + 4) == 29
    assert groups[1].num_blocks == 1 + capacity // 4 + 4 and groups[2].num_blocks == 1 + capacity // 16 + 4
    completions = engine.generate(long_prompts, GREEDY)
    _assert_greedy(hf, long_prompts, completions)
    # Rows saw their tables through placeholders, and no row held more than the lookback's blocks and its chunk's.
    assert seen.placeholders > 0 and seen.most_held <= -(-LOOKBACK // BLOCK_SIZE) + 1 + -(-8 // BLOCK_SIZE)
    assert bool(seen.preempted) == ("num_blocks" in settings)
    for allocator in engine.scheduler.blocks.allocators:
        assert allocator.num_free_blocks == allocator.num_usable_blocks


def test_prefix_hits_read_a_cached_tail_of_group_0(v4, long_prompts):
    """A hit of P tokens takes groups 1..'s blocks for [0, P) and group 0's for [P - 15, P) only; the next
    query's window (P - 7 .. P) starts inside that tail. Prompts sharing 70 tokens hit at 64 (a multiple
    of 16, the alignment), or less where a tail block was evicted; tokens are the same without hits."""
    model, hf = v4
    shared = long_prompts[2][:70]
    variants = [shared + _tokens(7, 9), shared + _tokens(8, 3), shared[:67] + _tokens(9, 20)]
    engine, _ = _spoiled_engine(model)
    hits: list[tuple[int, tuple[list[int], ...]]] = []
    match_prefix = engine.scheduler.blocks.match_prefix

    def recording(token_ids):
        tables, hashes, n = match_prefix(token_ids)
        hits.append((n, tuple(list(t) for t in tables)))
        return tables, hashes, n

    engine.scheduler.blocks.match_prefix = recording
    first = engine.generate([shared], GREEDY)
    again = engine.generate(variants, GREEDY)
    _assert_greedy(hf, variants, again)
    _assert_greedy(hf, [shared], first)
    landed = [(n, tables) for n, tables in hits if n]
    assert landed and all(n % 16 == 0 for n, _ in landed)
    for n, tables in landed:
        behind = (n - LOOKBACK) // BLOCK_SIZE
        assert tables[0][:behind] == [SCRATCH_BLOCK] * behind and SCRATCH_BLOCK not in tables[0][behind:]
        assert len(tables[0]) == n // BLOCK_SIZE and SCRATCH_BLOCK not in tables[1] + tables[2]
    assert 64 in [n for n, _ in landed]
    fresh = _engine(model, enable_prefix_caching=False).generate(variants, GREEDY)
    assert [c.token_ids for c in fresh] == [c.token_ids for c in again]


def test_scoring_a_prompt_longer_than_group_0_frees_behind_each_chunk(v4, long_prompts):
    """`Engine.score` runs a prompt in chunks; group 0's pool (29 blocks of 4) is shorter than the prompt."""
    model, hf = v4
    engine = _engine(model, num_blocks=400)
    prompt = long_prompts[2] + long_prompts[0]
    assert len(prompt) > (engine.state.groups[0].num_blocks - 1) * BLOCK_SIZE
    free = [a.num_free_blocks for a in engine.scheduler.blocks.allocators]
    got = engine.score(prompt)
    assert relative_error(got, reference_logits(hf, prompt)) <= 1e-4
    assert [a.num_free_blocks for a in engine.scheduler.blocks.allocators] == free
