"""FP8 latent caches for the kernel tests: a random paged cache quantized as the cache write stores it."""

from __future__ import annotations

import random

import torch

import mla_func as mf

from mla_func.kernels.latent_cache import FP8LatentCache
from mla_func.kernels.reference.cache import quantized_cache

# dense [num_blocks, bs, C + R] -> the FP8 cache holding every one of its rows as `write_kv` would.
fp8_cache_of = quantized_cache


def dequantized(cache: FP8LatentCache) -> torch.Tensor:
    """Every row of the cache as attention reads it: [num_blocks, bs, C + R] in the RoPE values' dtype."""
    num_blocks, block_size, _ = cache.shape
    device = cache.rope.device
    return cache.rows(torch.arange(num_blocks, device=device)[:, None], torch.arange(block_size, device=device)[None, :])


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether two tensors of one dtype and shape hold the same bytes (NaN and -0.0 included)."""
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(
        a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))


# What the engine tests compare an FP8 cache's engine with: greedy tokens over random prompts, and every
# prompt position's logits (teacher-forced through `Engine.score`). Logits rows are judged by their
# median and 90th percentile errors (a row's max |difference| over its max |logit|): a row whose MoE
# routing is near a tie may take another expert in any two runs that differ in their last bits, and then
# differs by far more than the cache's rounding. Measured on the demo's trained layers (V3, and V3.2 with
# a random indexer) over three prompt sets: medians 0.3%, 90th percentiles 0.6-1.6%, every greedy token
# equal.
ENGINE_SETTINGS = dict(block_size=4, num_blocks=200, max_num_seqs=4, max_num_batched_tokens=16)
MIN_GREEDY_AGREEMENT = 0.9
MAX_MEDIAN_ERROR = 0.01
MAX_P90_ERROR = 0.03


def engine_agreement(model, prompts: list[list[int]], max_tokens: int = 10) -> tuple[float, torch.Tensor]:
    """(share of the greedy tokens the "fp8" engine generates equal to the "auto" engine's, position by
    position; [positions] max |logits difference| / max |logits| of each prompt position's row)."""
    auto = mf.Engine(model, **ENGINE_SETTINGS)
    fp8 = mf.Engine(model, **ENGINE_SETTINGS, kv_cache_dtype="fp8")
    greedy = mf.SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    want = [c.raise_for_error().token_ids for c in auto.generate(prompts, greedy)]
    got = [c.raise_for_error().token_ids for c in fp8.generate(prompts, greedy)]
    same = sum(a == b for w, g in zip(want, got) for a, b in zip(w, g)) / sum(len(w) for w in want)
    rows = []
    for p in prompts:
        a, b = auto.score(p), fp8.score(p)
        rows.append((a - b).abs().amax(-1) / a.abs().amax(-1))
    return same, torch.cat(rows)


def assert_fp8_engine_agrees(model, seed: int = 11) -> None:
    """The engines of either cache on six random prompts of 20 to 40 tokens: see `ENGINE_SETTINGS`' comment."""
    rng = random.Random(seed)
    prompts = [[rng.randrange(2, model.config.vocab_size) for _ in range(rng.randrange(20, 40))] for _ in range(6)]
    same, errors = engine_agreement(model, prompts)
    assert same >= MIN_GREEDY_AGREEMENT
    assert errors.median() <= MAX_MEDIAN_ERROR and errors.quantile(0.9) <= MAX_P90_ERROR
