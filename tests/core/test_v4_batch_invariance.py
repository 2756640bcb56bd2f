"""DeepSeek-V4 in the batch-invariant mode on CPU: the torch backend in float32 (and the Triton table in
the interpreter).

A V4 request's logits rows depend on its own sequence only: the same bits alone or among
other requests of random lengths, whatever padding rung a step took, whether a token is a
prefill or a decode row, and wherever its prompt was cut into chunks -- inside the
sliding window (8 tokens), inside a CSA block (4) or an HCA block (16) whose compressor
pools tokens of several chunks -- in mixed steps and after a preemption. Compared with
`torch.equal`. The model is a small random transformers DeepSeek-V4 (`support.v4_reference`,
CSA, HCA and sliding layers, hash-routed and score-routed MoE), whose full forward is the
oracle for the function the invariant table computes.
"""

from __future__ import annotations

import pytest
import torch

import mla_func as mf
from support import invariant_runs
from support.invariant_runs import padded_mixed_logits, probes_alone
from support.logits_probes import first_difference, other_requests, probe_requests, run_probes
from support.v4_reference import Seq, make_reference, new_state, reference_logits, relative_error, save_reference

# Bitwise comparisons across batch compositions: the interpreter's dot must sum each row in one order.
pytestmark = pytest.mark.row_invariant_dots

BLOCK = 4
MAX_TOKENS = 96
REFERENCE_SEED = 13


@pytest.fixture(autouse=True)
def one_thread():
    # One thread, as `mla-func` runs on the CPU: a product of a few rows costs microseconds, where
    # waking a second thread on a busy machine can cost milliseconds (tests/conftest.py puts it back).
    torch.set_num_threads(1)


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    folder = tmp_path_factory.mktemp("v4-invariance")
    save_reference(folder, seed=REFERENCE_SEED)
    return mf.load_model(folder, device="cpu")


def tokens(n: int, seed: int) -> list[int]:
    return torch.randint(2, 97, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def fresh(model, num_seqs: int = 6):
    return new_state(model, num_seqs=num_seqs, block_size=BLOCK, max_tokens=MAX_TOKENS)


def step(model, state, plan: mf.StepPlan, **kwargs):
    """One batch-invariant step: (its real logits rows, the new state)."""
    batch, mode = mf.plan_step(model.config, state, plan, batch_invariant=True, **kwargs)
    logits, state = mf.forward(model.params, state, batch, mode)
    return logits[: mode.num_logits], state


def prefill_in_chunks(model, state, seq: Seq, prompt: list[int], chunk: int, start: int = 0, **kwargs):
    """prompt[start:] prefilled `chunk` tokens a step (every token's logits) -> ([n, V], state)."""
    rows = []
    for at in range(start, len(prompt), chunk):
        logits, state = step(model, state, mf.StepPlan(prefill=(seq.plan(prompt[at:at + chunk], at),)), **kwargs)
        rows.append(logits)
    return torch.cat(rows), state


# ---- steps by hand -------------------------------------------------------------------------------


def test_chunk_boundaries_and_the_step_kind_change_no_bit(model):
    prompt = tokens(37, 0)
    seq = Seq(0, fresh(model).groups, max_tokens=MAX_TOKENS)
    whole, _ = prefill_in_chunks(model, fresh(model), seq, prompt, len(prompt))
    # Chunks ending inside the window, inside CSA blocks (4) and HCA blocks (16), and on their boundaries.
    for chunk in (1, 3, 5, 7, 13, 16):
        chunked, _ = prefill_in_chunks(model, fresh(model), seq, prompt, chunk)
        assert torch.equal(chunked, whole), chunk
    # The last tokens as decode rows, one a step, give the bits they got as prefill rows.
    _, state = prefill_in_chunks(model, fresh(model), seq, prompt[:33], 33)
    for at in range(33, len(prompt)):
        decoded, state = step(model, state, mf.StepPlan(decode=(seq.plan(prompt[at:at + 1], at, 1),)))
        assert torch.equal(decoded[0], whole[at]), at


def test_batch_mates_and_padding_change_no_bit(model):
    prompt = tokens(23, 1)
    seq = Seq(0, fresh(model).groups, max_tokens=MAX_TOKENS)
    alone, _ = prefill_in_chunks(model, fresh(model), seq, prompt, len(prompt))
    # The same prompt in a mixed step beside another prefill (mid-prompt) and three decode rows of
    # sequences in other phases (mid-window, past the window, mid-HCA-block), padded to ladders.
    state = fresh(model)
    others = [Seq(i, state.groups, max_tokens=MAX_TOKENS) for i in range(1, 5)]
    histories = [tokens(n, 10 + i) for i, n in enumerate((6, 13, 22, 41))]
    for other, history in zip(others, histories):
        _, state = prefill_in_chunks(model, state, other, history, 64)
    plan = mf.StepPlan(prefill=(seq.plan(prompt, 0), others[0].plan(tokens(5, 20), len(histories[0]))),
                       decode=tuple(s.plan([11], len(h), 1) for s, h in zip(others[1:], histories[1:])))
    logits = padded_mixed_logits(model, state, plan, table_width=32)
    assert torch.equal(logits[: len(prompt)], alone)


# ---- the engine ----------------------------------------------------------------------------------


def cpu_engine(model, **kwargs):
    return invariant_runs.cpu_engine(model, BLOCK, **kwargs)


@pytest.fixture(scope="module")
def probes(model):
    return probe_requests(model.config.vocab_size, 0, count=4, max_tokens=12, max_len=40)


@pytest.fixture(scope="module")
def alone(model, probes):
    torch.set_num_threads(1)  # as the tests that compare with it run (`one_thread`)
    return probes_alone(cpu_engine(model), probes)


@pytest.mark.parametrize("settings", [
    dict(others=6),
    dict(others=12, long_prefill_token_threshold=3),
    dict(others=12, long_prefill_token_threshold=5),
    dict(others=12, long_prefill_token_threshold=13),
    dict(others=12, long_prefill_token_threshold=None, max_num_batched_tokens=512),
    dict(others=12, enable_mixed=False),
    dict(others=12, num_blocks=40),
], ids=["among 6", "among 12, chunks of 3", "among 12, chunks of 5", "among 12, chunks of 13",
        "among 12, unlimited chunks", "among 12, mixed off", "preempted"])
def test_engine_requests_do_not_depend_on_their_batch_mates(model, probes, alone, settings):
    settings = dict(settings)
    others = other_requests(model.config.vocab_size, 1, count=settings.pop("others"), probes=probes[0],
                            max_tokens=12, max_len=40)
    crowd = run_probes(cpu_engine(model, **settings), probes, others, seed=3)
    if settings.get("num_blocks"):
        assert crowd.preemptions > 0, "the cache was meant to force preemption"
    assert crowd.tokens == alone.tokens
    for probe in range(len(probes[0])):
        assert first_difference(crowd.logits[probe], alone.logits[probe]) is None, probe


def test_invariant_logits_are_transformers_and_the_default_tables(model, probes, alone):
    """The invariant table computes the model's function: each probe's logits at every generated
    position match transformers' full forward over its prompt and tokens, and the default table's."""
    hf = make_reference(seed=REFERENCE_SEED)
    default = run_probes(cpu_engine(model, batch_invariant=False), probes, ([], []), seed=0)
    for probe, prompt in enumerate(probes[0]):
        got = torch.stack(alone.logits[probe])
        ids = list(prompt) + list(alone.tokens[probe])
        want = reference_logits(hf, ids)[len(prompt) - 1:len(ids) - 1]
        assert relative_error(got, want) <= 1e-5, probe
        steps = min(len(got), len(default.logits[probe]))
        assert relative_error(got[:steps], torch.stack(default.logits[probe][:steps])) <= 1e-5, probe


# ---- the Triton table ----------------------------------------------------------------------------


@pytest.mark.slow
def test_triton_table_rows_do_not_depend_on_batch_mates(model):
    """The invariant Triton table (the interpreter here): a prompt alone, cut into chunks, and in a
    padded mixed step beside batch-mates give the same bits, close to the torch table's."""
    prompt = tokens(19, 2)
    seq = Seq(0, fresh(model).groups, max_tokens=MAX_TOKENS)
    whole, _ = prefill_in_chunks(model, fresh(model), seq, prompt, len(prompt), backend="triton")
    chunked, _ = prefill_in_chunks(model, fresh(model), seq, prompt, 7, backend="triton")
    assert torch.equal(chunked, whole)
    state = fresh(model)
    other, history = Seq(1, state.groups, max_tokens=MAX_TOKENS), tokens(18, 21)
    _, state = prefill_in_chunks(model, state, other, history, 18, backend="triton")
    padding = mf.PaddingPolicy(decode_seqs=(2,), prefill_tokens=(32,), prefill_seqs=(2,))
    plan = mf.StepPlan(prefill=(seq.plan(prompt, 0),), decode=(other.plan([7], len(history), 1),))
    mixed, _ = step(model, state, plan, backend="triton", padding=padding)
    assert torch.equal(mixed[: len(prompt)], whole)
    torch_rows, _ = prefill_in_chunks(model, fresh(model), seq, prompt, len(prompt))
    assert relative_error(whole, torch_rows) <= 1e-5
