"""The engine on a DeepSeek-V4 checkpoint: greedy tokens = the argmax of transformers' full forward.

Every generated token must be the argmax of transformers' logits (full forward over
prompt + generated tokens, teacher forcing) at its position, whatever the
scheduling: mixed batches on and off, small prefill chunks, preemption under a tight
cache, and prefix-cache hits (cut to a multiple of every cache group's block).
"""

from __future__ import annotations

import random

import pytest
import torch

import mla_func as mf
from support.v4_reference import reference_logits, save_reference

GREEDY = mf.SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    folder = tmp_path_factory.mktemp("v4-engine")
    hf = save_reference(folder, seed=21)
    return hf, mf.load_model(folder, device="cpu")


@pytest.fixture(scope="module")
def prompts():
    rng = random.Random(1)
    return [[rng.randrange(2, 97) for _ in range(n)] for n in (5, 14, 23, 38)]


def _engine(model, **kwargs):
    settings = dict(block_size=4, num_blocks=120, max_num_seqs=4, max_num_batched_tokens=16,
                    long_prefill_token_threshold=8)
    return mf.Engine(model, **{**settings, **kwargs})


def _tokens(completions):
    return [list(c.raise_for_error().token_ids) for c in completions]


@pytest.fixture(scope="module")
def expected(reference, prompts):
    """Greedy decoding by transformers' full forward, one token at a time (teacher forcing is then exact)."""
    hf, _ = reference
    out = []
    for prompt in prompts:
        ids = list(prompt)
        for _ in range(GREEDY.max_tokens):
            ids.append(int(reference_logits(hf, ids)[-1].argmax()))
        out.append(ids[len(prompt):])
    return out


@pytest.mark.parametrize("settings", [
    dict(),
    dict(enable_mixed=False),
    dict(long_prefill_token_threshold=3),
    dict(num_blocks=24),
], ids=["mixed", "unmixed", "chunk3", "preempting"])
def test_greedy_generate_equals_the_full_forward_argmax(reference, prompts, expected, settings):
    _, model = reference
    engine = _engine(model, **settings)
    assert len(engine.state.groups) == 3 and len(engine.scheduler.config.cache_groups) == 3
    preempted: list = []
    schedule = engine.scheduler.schedule

    def recording_schedule():
        step = schedule()
        preempted.extend(() if step is None else step.preempted)
        return step

    engine.scheduler.schedule = recording_schedule
    assert _tokens(engine.generate(prompts, GREEDY)) == expected
    assert bool(preempted) == ("num_blocks" in settings)


def test_prefix_hits_restore_every_layer_state(reference, prompts):
    _, model = reference
    shared = prompts[3] + prompts[1]                  # 52 tokens: hits are cut to 48 (a multiple of 16)
    variants = [shared + [5], shared + [6, 7], shared[:40]]
    engine = _engine(model)
    hits: list[int] = []
    match_prefix = engine.scheduler.blocks.match_prefix

    def recording_match(token_ids):
        found = match_prefix(token_ids)
        hits.append(found[2])
        return found

    engine.scheduler.blocks.match_prefix = recording_match
    first = _tokens(engine.generate(variants, GREEDY))
    assert engine.scheduler.blocks.prefix_alignment == 16
    assert engine.scheduler.allocator.num_cached_blocks > 0
    again = _tokens(engine.generate(variants, GREEDY))
    assert 48 in hits and all(h % 16 == 0 for h in hits)
    fresh = _tokens(_engine(model, enable_prefix_caching=False).generate(variants, GREEDY))
    assert first == again == fresh


def test_generate_command_runs_a_v4_checkpoint(reference, tmp_path, capsys):
    from mla_func.cli.commands import main

    hf, _ = reference
    folder = tmp_path / "ckpt"
    hf.save_pretrained(folder)
    code = main(["generate", "3 14 15 92 65", "--model", str(folder), "--max-tokens", "6", "--temperature", "0",
                 "--ignore-eos"])
    assert code == 0
    printed = capsys.readouterr().out.split()
    ids = [3, 14, 15, 92, 65]
    for _ in range(6):
        ids.append(int(reference_logits(hf, ids)[-1].argmax()))
    assert [int(t) for t in printed[:6]] == ids[5:]


def test_an_engine_longer_than_the_loaded_rope_tables_extends_every_layers(reference, tmp_path):
    hf, _ = reference
    hf.save_pretrained(tmp_path)
    short = mf.load_model(tmp_path, device="cpu", max_model_len=24)
    assert short.max_positions == 24 and short.params.layers[1].attn.rope_cos.shape[0] == 24
    engine = _engine(short, max_model_len=80)
    assert {layer.attn.rope_cos.shape[0] for layer in engine.model.params.layers} == {80}
    prompt = list(range(2, 42))
    ids = list(prompt)
    for _ in range(6):
        ids.append(int(reference_logits(hf, ids)[-1].argmax()))
    got = _tokens(engine.generate([prompt], mf.SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)))
    assert got == [ids[len(prompt):]]


def test_score_returns_every_position_of_a_v4_prompt(reference, prompts):
    hf, model = reference
    engine = _engine(model)
    free = [a.num_free_blocks for a in engine.scheduler.blocks.allocators]
    got = engine.score(prompts[3])
    assert float((got - reference_logits(hf, prompts[3])).abs().max()) <= 1e-4 * float(got.abs().max())
    assert [a.num_free_blocks for a in engine.scheduler.blocks.allocators] == free


def test_transformers_cached_generate_agrees_with_its_full_forward(reference, prompts, expected):
    """The oracle's two paths agree on this tie-free config (16 indexer heads), so either is the reference."""
    hf, _ = reference
    for prompt, want in zip(prompts[2:], expected[2:]):
        ids = torch.tensor([prompt])
        with torch.no_grad():
            out = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=GREEDY.max_tokens,
                              do_sample=False, eos_token_id=None, pad_token_id=0)
        assert out[0, len(prompt):].tolist() == want
