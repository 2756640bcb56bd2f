"""DeepSeek-V4 on the Triton op table on a GPU, at `v4-mini`'s real shapes (64 heads of 512, window 128,
CSA 4:1 with top-512, HCA 128:1).

* triton = torch in bf16, both judged against a float64 run of the same weights;
* graph = eager for decode and mixed steps at every captured key, one below a key, and above the
  largest (eager fallback), bit for bit;
* no host sync inside a step (`set_sync_debug_mode("error")`), and a donated state raises.

The first two also over FP8 caches (`kv_cache_dtype="fp8"`: FP8 window keys, entries and indexer keys).
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

import mla_func as mf
from support.graph_checks import compare, run_without_host_sync

pytestmark = pytest.mark.gpu

BLOCK_SIZE = 16
MAX_TOKENS = 400
LADDER = mf.PaddingPolicy(decode_seqs=(1, 2, 4, 8), prefill_tokens=(64, 512), prefill_seqs=(1, 2, 4),
                          block_table_widths=(32,))


@pytest.fixture(scope="module")
def mini():
    return mf.load_model("v4-mini", dtype=torch.bfloat16, device="cuda", seed=0, max_model_len=1024)


def _tokens(seed: int, n: int, vocab: int) -> list[int]:
    return torch.randint(2, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _state(model: mf.Model, num_seqs: int, kv_cache_dtype: str = "auto"):
    per_seq = -(-MAX_TOKENS // BLOCK_SIZE) + 1
    return mf.init_state(model, num_blocks=1 + num_seqs * per_seq, block_size=BLOCK_SIZE,
                         kv_cache_dtype=kv_cache_dtype)


def _seq(state, index: int, tokens: list[int], start: int, num_logits: int = 1) -> mf.SeqPlan:
    """Sequence `index`'s disjoint blocks in every cache group."""
    tables = []
    for group in state.groups:
        n = group.blocks_for(MAX_TOKENS) + 1
        tables.append(tuple(range(1 + index * n, 1 + (index + 1) * n)))
    return mf.SeqPlan(tuple(tokens), start, tables[0], num_logits, group_block_tables=tuple(tables[1:]))


def _with_context(model: mf.Model, contexts: list[int], kv_cache_dtype: str = "auto"):
    """A state where sequence i holds contexts[i] tokens (prefilled eagerly on the torch table)."""
    state = _state(model, max(8, len(contexts)) + 2, kv_cache_dtype)
    vocab = model.config.vocab_size
    plan = mf.StepPlan(prefill=tuple(_seq(state, i, _tokens(i, n, vocab), 0) for i, n in enumerate(contexts)))
    batch, mode = mf.plan_step(model.config, state, plan, backend="torch")
    _, state = mf.forward(model.params, state, batch, mode)
    return state


def _decode(state, contexts: list[int]) -> mf.StepPlan:
    return mf.StepPlan(decode=tuple(_seq(state, i, [7 + i], n) for i, n in enumerate(contexts)))


def _rel(got: torch.Tensor, truth: torch.Tensor) -> float:
    return float((got.double() - truth).norm() / truth.norm())


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "fp8"])
def test_v4_mini_triton_equals_torch_in_bf16_against_float64(mini, kv_cache_dtype):
    """Prefill (crossing the window, an HCA block and ~75 CSA blocks) then decode steps over the boundaries
    (the float64 run over caches of the same kind)."""
    wide = dataclasses.replace(mini, params=mf.pytree.tree_map(
        lambda t: t.double() if t.is_floating_point() else t, mini.params))
    prompt = _tokens(11, 300, mini.config.vocab_size)
    runs = {}
    for name, model, backend in (("truth", wide, "torch"), ("torch", mini, "torch"), ("triton", mini, "triton")):
        state = _state(model, 2, kv_cache_dtype)
        rows = []
        plan = mf.StepPlan(prefill=(_seq(state, 0, prompt, 0, 300),))
        for step in range(6):
            batch, mode = mf.plan_step(model.config, state, plan, backend=backend)
            logits, state = mf.forward(model.params, state, batch, mode)
            rows.append(logits[: mode.num_logits].double())
            plan = mf.StepPlan(decode=(_seq(state, 0, [100 + step], 300 + step),))
        runs[name] = torch.cat(rows)
        del state
    truth = runs["truth"]
    err_torch, err_triton = _rel(runs["torch"], truth), _rel(runs["triton"], truth)
    print(f"{kv_cache_dtype} caches, relative error against float64: torch {err_torch:.3e}, "
          f"triton {err_triton:.3e}")
    assert err_triton <= 1.5 * err_torch + 2e-3
    assert err_triton < 0.1


def _graph_equals_eager(model, state, plan) -> mf.ForwardMode:
    return compare(model, "triton", state, plan, padding=LADDER, exact=True)


@pytest.mark.parametrize("num_seqs", [1, 2, 3, 4, 7, 8, 9])
def test_decode_graph_equals_eager_at_every_key(mini, num_seqs):
    """Captured keys 1, 2, 4, 8; 3 and 7 pad to the key above; 9 is above the largest (eager)."""
    contexts = [1 + 43 * i for i in range(num_seqs)]   # from a window of one to 345 tokens (two HCA blocks)
    state = _with_context(mini, contexts)
    mode = _graph_equals_eager(mini, state, _decode(state, contexts))
    assert mode.use_graph == (num_seqs <= 8)


@pytest.mark.parametrize("num_seqs", [3, 9])
def test_decode_graph_equals_eager_over_fp8_caches(mini, num_seqs):
    contexts = [1 + 43 * i for i in range(num_seqs)]
    state = _with_context(mini, contexts, "fp8")
    assert type(state.layers[2].window).__name__ == "FP8LatentCache"
    mode = _graph_equals_eager(mini, state, _decode(state, contexts))
    assert mode.use_graph == (num_seqs <= 8)


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "fp8"])
def test_mixed_graph_equals_eager(mini, kv_cache_dtype):
    state = _with_context(mini, [200, 127, 4], kv_cache_dtype)
    vocab = mini.config.vocab_size
    prefill = tuple(_seq(state, 3 + i, _tokens(20 + i, n, vocab), 0) for i, n in enumerate([150, 33]))
    plan = mf.StepPlan(prefill=prefill, decode=_decode(state, [200, 127, 4]).decode)
    mode = _graph_equals_eager(mini, state, plan)
    assert mode.kind == "mixed"


def test_no_host_sync_inside_a_step_and_a_donated_state_raises(mini):
    step = mf.make_step(mini, backend="triton", padding=LADDER)
    contexts = [130, 257]
    state = _with_context(mini, contexts)
    plans = (_decode(state, contexts), _decode(state, [n + 1 for n in contexts]))
    stale, _, last = run_without_host_sync(step, state, plans)
    with pytest.raises(mf.DonatedStateError):
        step(stale, *last)
