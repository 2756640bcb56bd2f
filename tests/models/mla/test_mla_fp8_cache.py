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
