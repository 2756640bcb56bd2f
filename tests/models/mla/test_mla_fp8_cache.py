"""The engine with an FP8 latent cache on a DeepSeek-V3 model: the tokens and logits of the 16-bit cache's.

The model is the shipped demo (a trained V3-architecture model, in float32 on the CPU): a model with
random weights flips its MoE routing and greedy ties at the slightest change of its keys (a tiny random
V3 moved its logits by 20% of their scale under 3% noise on the latents), which says nothing about the
cache. FP8 moves each latent value by at most 2^-4 of its group's largest magnitude.
"""

from __future__ import annotations

import random

import pytest
import torch

import mla_func as mf
from support.fp8_cache_cases import MIN_GREEDY_AGREEMENT, assert_fp8_engine_agrees


@pytest.fixture(scope="module")
def demo():
    return mf.load_model("demo", dtype=torch.float32, device="cpu")


def test_fp8_cache_keeps_greedy_tokens_and_logits(demo):
    assert_fp8_engine_agrees(demo)


def test_fp8_engine_state_and_budget(demo):
    engine = mf.Engine(demo, block_size=16, num_blocks=8, kv_cache_dtype="fp8")
    assert engine.config.kv_cache_dtype == "fp8"
    c = demo.config
    block = c.num_hidden_layers * 16 * (c.kv_lora_rank + 4 + 4 * c.qk_rope_head_dim)
    assert engine.state.bytes_per_block() == engine.cache_budget.bytes_per_block[0] == block


@pytest.mark.gpu
def test_gpu_fp8_cache_in_graphs_and_bf16():
    """On a GPU in bf16, decode steps replayed from CUDA graphs over the FP8 cache: the FP8 engine keeps the
    greedy tokens of the eager steps (whose split counts, and so last bits, differ) and of the bf16 cache."""
    model = mf.load_model("demo", dtype=torch.bfloat16, device="cuda")
    rng = random.Random(12)
    prompts = [[rng.randrange(2, model.config.vocab_size) for _ in range(rng.randrange(20, 80))] for _ in range(8)]
    greedy = mf.SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)

    def run(**kwargs):
        engine = mf.Engine(model, block_size=64, num_blocks=64, max_num_seqs=8, **kwargs)
        return [c.raise_for_error().token_ids for c in engine.generate(prompts, greedy)]

    def agreement(want, got):
        return sum(a == b for w, g in zip(want, got) for a, b in zip(w, g)) / sum(len(w) for w in want)

    graphed = run(kv_cache_dtype="fp8")
    assert agreement(run(kv_cache_dtype="fp8", graphs=False), graphed) >= MIN_GREEDY_AGREEMENT
    assert agreement(run(), graphed) >= MIN_GREEDY_AGREEMENT


# Held-out prompts the GPU agreement figures are taken over, and the greedy tokens each continues with.
HELDOUT_PROMPTS = 32          # of the 36 the eval subset has with over 16 tokens
HELDOUT_NEW_TOKENS = 48
HELDOUT_AGREEMENT = 0.95


def _free_running_agreement(want: list, got: list) -> float:
    """Share of generated tokens equal position by position (a continuation that drifts counts every token after)."""
    return sum(a == b for w, g in zip(want, got) for a, b in zip(w, g)) / sum(len(w) for w in want)


@pytest.mark.gpu
def test_gpu_fp8_cache_greedy_text_over_heldout_prompts():
    """The demo in bf16 on the Triton backend with graphs, on the openings of held-out documents (text it was
    never trained on), greedy continuations of the bf16 cache's engine. Two figures, printed:

    * teacher-forced: along each bf16 continuation, the FP8 cache's engine picks the same greedy token at
      every position (`Engine.score` in chunks of 16, so that all but the newest keys are read from the
      cache) on at least 95% of them;
    * free-running: the FP8 engine's own continuations equal position by position (one different token
      changes all that follow), beside the same figure for the bf16 cache with graphs off (steps whose
      last bits differ): the drift greedy decoding has without any change to the cache."""
    from mla_func.demo.evaluate import eval_subset_documents
    from mla_func.demo.speculation import heldout_prompts

    model = mf.load_model("demo", dtype=torch.bfloat16, device="cuda")
    prompts = heldout_prompts(model.tokenizer, eval_subset_documents(), count=HELDOUT_PROMPTS, prompt_tokens=16)
    greedy = mf.SamplingParams(temperature=0.0, max_tokens=HELDOUT_NEW_TOKENS, ignore_eos=True)

    def engine(kv_cache_dtype, **kwargs):
        settings = dict(block_size=16, num_blocks=1024, max_num_seqs=HELDOUT_PROMPTS, kv_cache_dtype=kv_cache_dtype)
        return mf.Engine(model, **{**settings, **kwargs})

    def generate(eng):
        return [list(c.raise_for_error().token_ids) for c in eng.generate(prompts, greedy)]

    bf16_engine = engine("auto")
    assert bf16_engine.step.graphs
    bf16 = generate(bf16_engine)
    fp8 = generate(engine("fp8"))
    eager = generate(engine("auto", graphs=False))
    scorers = {d: engine(d, max_num_seqs=16, max_num_batched_tokens=16) for d in ("auto", "fp8")}
    same = total = 0
    for prompt, continuation in zip(prompts, bf16):
        text = list(prompt) + continuation
        rows = slice(len(prompt) - 1, len(text) - 1)            # the positions that predicted the continuation
        want, got = (scorers[d].score(text)[rows].argmax(-1) for d in ("auto", "fp8"))
        same += int((want == got).sum())
        total += len(continuation)
    teacher_forced = same / total
    print(f"demo, bf16, {len(prompts)} held-out prompts x {HELDOUT_NEW_TOKENS} greedy tokens: FP8 vs bf16 cache "
          f"teacher-forced {teacher_forced:.4f}; free-running {_free_running_agreement(bf16, fp8):.4f} "
          f"(bf16 graphs vs eager: {_free_running_agreement(bf16, eager):.4f})")
    assert teacher_forced >= HELDOUT_AGREEMENT
