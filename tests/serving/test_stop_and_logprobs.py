"""Stop strings and logprobs: text cut exactly at a stop string split over tokens, blocks freed,
streams that never show text past a stop, logprobs equal to the model's own log-softmax."""

from __future__ import annotations

import dataclasses
import random

import pytest
import torch

import mla_func as mf
from mla_func.cli.commands import build_parser, main, sampling_params
from mla_func.serving.penalties import adjust_logits
from mla_func.serving.requests import CheckedRequest, Limits, RequestError, check_params, check_request
from mla_func.serving.sampling import SamplingParams
from support.hand_plans import logits_of
from support.mtp_checkpoints import mtp_checkpoint
from support.stop_strings import spanning_stop


@pytest.fixture(scope="module")
def demo():
    return mf.load_model("demo", device="cpu")


def engine(model, **kwargs):
    settings = dict(block_size=4, num_blocks=128, max_num_seqs=4, max_num_batched_tokens=64, graphs=False)
    return mf.Engine(model, **{**settings, **kwargs})


def greedy(max_tokens=24, **kwargs):
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, **kwargs)


def prompt(model, rng):
    words = ["Return", "the", "number", "of", "a", "list", "value", "string", "def", "class"]
    return " ".join(rng.choice(words) for _ in range(rng.randrange(2, 7)))


def test_stop_string_split_across_tokens_cuts_exactly(demo):
    rng = random.Random(1234)
    e = engine(demo)
    for _ in range(4):
        text = prompt(demo, rng)
        full = e.generate([text], greedy())[0].raise_for_error()
        stop, before, ids = spanning_stop(demo, full.token_ids, rng)
        other = "\x00never"  # a stop string that never occurs leaves the result unchanged
        got = e.generate([text], greedy(stop=[other, stop]))[0].raise_for_error()
        assert got.finish_reason == "stop"
        assert got.text == before and stop not in got.text
        assert got.token_ids == ids
        assert e.scheduler.allocator.num_free_blocks == e.scheduler.allocator.num_usable_blocks
        assert not e.scheduler.has_unfinished()


def test_stop_string_finishes_in_a_batch_and_frees_blocks(demo):
    rng = random.Random(99)
    e = engine(demo, max_num_seqs=3)
    texts = [prompt(demo, rng) for _ in range(5)]
    fulls = e.generate(texts, greedy(max_tokens=20))
    stops = [spanning_stop(demo, c.token_ids, rng) for c in fulls]
    params = [greedy(max_tokens=20, stop=(s,)) if i % 2 == 0 else greedy(max_tokens=20)
              for i, (s, _, _) in enumerate(stops)]
    got = e.generate(texts, params)
    for i, (c, full, (stop, before, ids)) in enumerate(zip(got, fulls, stops)):
        if i % 2 == 0:
            assert (c.finish_reason, c.text, c.token_ids) == ("stop", before, ids)
        else:
            assert (c.finish_reason, c.token_ids) == ("length", full.token_ids)
    assert e.scheduler.allocator.num_free_blocks == e.scheduler.allocator.num_usable_blocks
    e.scheduler.check_invariants()


def test_stream_never_shows_text_past_the_stop(demo):
    rng = random.Random(7)
    e = engine(demo)
    text = prompt(demo, rng)
    full = e.generate([text], greedy(max_tokens=30))[0]
    stop, before, ids = spanning_stop(demo, full.token_ids, rng)
    shown, tokens, last = "", [], None
    for event in e.generate_stream([text], greedy(max_tokens=30, stop=[stop])):
        assert event.text is not None
        shown += event.text
        tokens.append(event.token_id)
        # At every event, what was shown is a prefix of the text before the stop string.
        assert before.startswith(shown), (shown, before)
        last = event.completion
    assert last is not None and last.finish_reason == "stop"
    assert shown == before == last.text and tuple(tokens) == ids
    assert e.scheduler.allocator.num_free_blocks == e.scheduler.allocator.num_usable_blocks


def test_stream_holds_back_only_a_possible_stop_start(demo):
    """A stop string that never completes: the stream's texts join to the whole completion's."""
    e = engine(demo)
    shown, last = "", None
    for event in e.generate_stream(["Return the number of"], greedy(max_tokens=12, stop=["the\x00"])):
        shown += event.text
        last = event.completion
    assert last is not None and last.finish_reason == "length"
    assert shown == last.text == demo.tokenizer.decode(list(last.token_ids))


def test_stop_refused_without_tokenizer():
    e = engine(mf.load_model("tiny", device="cpu"))
    c = e.generate([[1, 2, 3]], SamplingParams(max_tokens=2, stop=["x"]))[0]
    assert c.finish_reason == "error" and "SamplingParams.stop" in str(c.error) and "tokenizer" in str(c.error)


@pytest.mark.parametrize("stop", ["abc", [""], ["a"] * 17, ["a", 3], ("a", None)])
def test_bad_stop_refused_by_name(stop):
    with pytest.raises(ValueError, match=r"SamplingParams\.stop"):
        SamplingParams(stop=stop)


def test_stop_list_normalised():
    assert SamplingParams(stop=["a", "bc"]).stop == ("a", "bc")
    assert check_params(0, {"stop": ["x"]}).stop == ("x",)
    with pytest.raises(RequestError, match=r"SamplingParams\.stop"):
        check_params(0, {"stop": [""]})


def test_cli_stop_option(capsys):

    args = build_parser().parse_args(["generate", "--stop", "a b", "--stop", "\n", "hi"])
    assert sampling_params(args).stop == ("a b", "\n")
    assert sampling_params(build_parser().parse_args(["generate", "hi"])).stop == ()
    assert main(["generate", "--device", "cpu", "--stop", "", "hi"]) == 2
    assert "--stop" in capsys.readouterr().err


def same_logprobs(a, b):
    return len(a) == len(b) and all(
        abs(x.logprob - y.logprob) < 1e-4 and list(x.top) == list(y.top)
        and all(abs(x.top[t] - y.top[t]) < 1e-4 for t in x.top) for x, y in zip(a, b))


def reference_logprobs(e, completion):
    """[n, V] float32 log-softmax of the logits that predicted each generated token, by `Engine.score`."""
    ids = list(completion.prompt_token_ids) + list(completion.token_ids)
    logits = e.score(ids[:-1])[len(completion.prompt_token_ids) - 1 :]
    return torch.log_softmax(logits.float(), dim=-1)


@pytest.mark.parametrize("temperature", [0.0, 0.7])
def test_logprobs_equal_the_models_log_softmax(demo, temperature):
    rng = random.Random(int(temperature * 10) + 5)
    e = engine(demo)
    texts = [prompt(demo, rng) for _ in range(3)]
    counts = [0, 3, 20]
    params = [SamplingParams(temperature=temperature, max_tokens=12, ignore_eos=True, seed=rng.randrange(1 << 30),
                             logprobs=n) for n in counts]
    # A batch-mate without logprobs: its completion has none, and it does not change the others'.
    got = e.generate([*texts, texts[0]], [*params, SamplingParams(max_tokens=5)])
    assert got[-1].logprobs is None
    for c, n in zip(got, counts):
        c.raise_for_error()
        assert c.logprobs is not None and len(c.logprobs) == len(c.token_ids)
        ref = reference_logprobs(e, c)
        for t, (token, lp) in enumerate(zip(c.token_ids, c.logprobs)):
            assert abs(lp.logprob - ref[t, token].item()) < 1e-4
            assert len(lp.top) == n
            values = list(lp.top.values())
            assert values == sorted(values, reverse=True)
            best = ref[t].topk(n)
            assert torch.allclose(torch.tensor(values), best.values, atol=1e-4)
            for token_id, value in lp.top.items():
                assert abs(value - ref[t, token_id].item()) < 1e-4
            if temperature == 0.0 and n:
                assert next(iter(lp.top)) == token  # greedy draws the most likely token
    assert e.scheduler.allocator.num_free_blocks == e.scheduler.allocator.num_usable_blocks


def test_logprobs_after_penalties_before_temperature(demo):
    """The logprobs are of the penalised rows the token is drawn from; temperature does not change them."""
    e = engine(demo)
    base = dict(max_tokens=8, ignore_eos=True, repetition_penalty=1.5, logprobs=2)
    got = e.generate(["Return the number of"], SamplingParams(temperature=0.0, **base))[0]
    hot = e.generate(["Return the number of"], SamplingParams(temperature=2.0, seed=1, **base))[0]
    # The first token's row is the same whatever the temperature (up to the last bits: the second run
    # reads the first's prompt from the prefix cache).
    assert list(hot.logprobs[0].top) == list(got.logprobs[0].top)
    assert all(abs(hot.logprobs[0].top[t] - v) < 1e-4 for t, v in got.logprobs[0].top.items())
    request = CheckedRequest(0, got.prompt_token_ids, SamplingParams(**base), ())
    ids = list(got.prompt_token_ids) + list(got.token_ids)
    logits = e.score(ids[:-1])[len(got.prompt_token_ids) - 1 :]
    penalised = False
    for t, lp in enumerate(got.logprobs):
        row = adjust_logits(logits[t : t + 1], [request], [list(got.token_ids[:t])])
        expected = torch.log_softmax(row.float(), -1)[0]
        assert abs(lp.logprob - expected[got.token_ids[t]].item()) < 1e-4
        penalised |= not torch.allclose(expected, torch.log_softmax(logits[t].float(), -1), atol=1e-3)
    assert penalised  # the penalty did change some row, so the check above tells the two apart


def test_logprobs_with_stop(demo):
    rng = random.Random(3)
    e = engine(demo)
    full = e.generate(["Return the number of"], greedy(logprobs=1))[0]
    stop, before, ids = spanning_stop(demo, full.token_ids, rng)
    got = e.generate(["Return the number of"], greedy(logprobs=1, stop=[stop]))[0]
    assert got.token_ids == ids and same_logprobs(got.logprobs, full.logprobs[: len(ids)])


@pytest.mark.parametrize("logprobs", [-1, 21, 1.0, True, "3"])
def test_bad_logprobs_refused_by_name(logprobs):
    with pytest.raises(ValueError, match=r"SamplingParams\.logprobs"):
        SamplingParams(logprobs=logprobs)
    with pytest.raises(RequestError, match=r"SamplingParams\.logprobs"):
        check_params(0, {"logprobs": logprobs})


def test_prompt_logprobs_equal_the_log_softmax_of_the_prompts_own_logits(demo):
    """Each prompt token's logprob from the logits at the position before it (a prefill of the prompt
    alone, through the model's forward), its top alternatives in order; the sampled tokens unchanged."""
    e = engine(demo)
    text = "Return the number of a list"
    ids = list(demo.tokenizer.encode(text).ids)
    got = e.generate([text], greedy(max_tokens=6, prompt_logprobs=3, n=2))
    plain = e.generate([text], greedy(max_tokens=6))[0]
    assert all(c.token_ids == plain.token_ids and c.prompt_token_ids == tuple(ids) for c in got)
    assert plain.prompt_logprobs is None
    want = torch.log_softmax(logits_of(demo, ids).float(), dim=-1)  # [T, V]
    first = got[0].prompt_logprobs
    assert len(first) == len(ids) and first[0] is None and got[1].prompt_logprobs == first
    for position in range(1, len(ids)):
        row = want[position - 1]
        entry = first[position]
        assert entry.logprob == pytest.approx(float(row[ids[position]]), abs=1e-4)
        best = row.topk(3)
        assert list(entry.top) == best.indices.tolist()
        assert list(entry.top.values()) == pytest.approx(best.values.tolist(), abs=1e-4)
    assert e.scheduler.allocator.num_free_blocks == e.scheduler.allocator.num_usable_blocks


def test_prompt_logprobs_refused_when_the_cache_has_no_room_for_the_scoring_pass(demo):
    """The scoring pass borrows free blocks: with a running request holding most of them it is refused by
    name, nothing of it is queued, and the running request goes on as alone."""
    e = engine(demo, num_blocks=12)  # 11 usable blocks of 4 tokens
    busy = list(range(3, 33))
    alone = engine(demo, num_blocks=12).generate([busy], greedy(max_tokens=4))[0].token_ids
    [request_id] = e.add_request(busy, greedy(max_tokens=4))
    events = e.iterate()  # its prefill: 8 of the 11 blocks now held
    with pytest.raises(RequestError, match=r"SamplingParams\.prompt_logprobs: .*free cache blocks"):
        e.add_request(list(range(3, 23)), greedy(max_tokens=2, prompt_logprobs=0))
    while e.has_unfinished():
        events += e.iterate()
    assert [ev.token_id for ev in events if ev.request_id == request_id] == list(alone)


@pytest.mark.parametrize("value", [-1, 21, 1.5, True])
def test_bad_prompt_logprobs_refused_by_name(value):
    with pytest.raises(ValueError, match=r"SamplingParams\.prompt_logprobs"):
        SamplingParams(prompt_logprobs=value)


def test_logprobs_without_tokenizer_and_refused_with_drafts():
    model = mf.load_model("tiny", device="cpu")
    c = engine(model).generate([[1, 2, 3]], SamplingParams(max_tokens=3, logprobs=2, ignore_eos=True))[0]
    assert c.raise_for_error().logprobs is not None and len(c.logprobs) == 3
    limits = Limits(model.config.vocab_size, (), 64, 4, 16, None, speculative_tokens=2)
    with pytest.raises(RequestError, match=r"SamplingParams\.logprobs .*speculative"):
        check_request(0, [1, 2], SamplingParams(logprobs=1), limits)


def test_stop_inside_accepted_drafts(tmp_path, demo):
    """With speculative decoding a verify row gives several tokens: the stop cuts among them, and the
    request's blocks and pending drafts are freed. The demo's tokenizer reads the tiny vocabulary (ids
    2..7 are one character each)."""
    _, path = mtp_checkpoint(tmp_path / "v3", seed=11, vocab_size=8, echo=True)
    model = dataclasses.replace(mf.load_model(path, mtp=True, dtype=torch.float64, device="cpu"),
                                tokenizer=demo.tokenizer)
    rng = random.Random(5)
    drafts = engine(model, speculative_tokens=2, max_num_batched_tokens=24)
    plain = engine(model)
    for _ in range(3):
        prompt_ids = [rng.randrange(2, 8) for _ in range(rng.randrange(2, 9))]
        full = plain.generate([prompt_ids], greedy(max_tokens=20))[0]
        stop, before, ids = spanning_stop(model, full.token_ids, rng)
        for e in (plain, drafts):
            got = e.generate([prompt_ids], greedy(max_tokens=20, stop=[stop]))[0]
            assert (got.finish_reason, got.text, got.token_ids) == ("stop", before, ids)
            assert e.scheduler.allocator.num_free_blocks == e.scheduler.allocator.num_usable_blocks
    assert drafts.speculative_stats.accepted > 0 and not drafts._speculative.drafts
    refused = drafts.generate([[2, 3]], greedy(logprobs=1))[0]
    assert refused.finish_reason == "error" and "SamplingParams.logprobs" in str(refused.error)
