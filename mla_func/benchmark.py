"""Offline throughput: many random requests through one engine, with a progress bar."""

from __future__ import annotations

import random
import time
from typing import Any

from tqdm.auto import tqdm

from .checkpoint import Model
from .engine import Engine
from .sampling import SamplingParams


def random_requests(vocab_size: int, num_prompts: int, input_len: tuple[int, int], seed: int) -> list[list[int]]:
    """`num_prompts` prompts of uniform random lengths in [input_len[0], input_len[1]] and random tokens."""
    rng = random.Random(seed)
    return [[rng.randrange(vocab_size) for _ in range(rng.randint(*input_len))] for _ in range(num_prompts)]


def run_throughput(
    model: Model,
    *,
    num_prompts: int,
    input_len: tuple[int, int],
    output_len: int,
    backend: str | None = None,
    graphs: bool = True,
    max_num_seqs: int = 256,
    max_num_batched_tokens: int = 8192,
    block_size: int = 16,
    seed: int = 0,
    warmup: bool = True,
) -> dict[str, Any]:
    """Generate `output_len` tokens (greedy, no early stop) for each random prompt; time the whole run.

    Returns counts, seconds, output tokens/s and total (prompt + output) tokens/s.
    The warm-up captures every decode graph, then a short run on other random
    prompts of the same lengths compiles kernels, so timing excludes both; its prompts
    share no prefix with the measured ones, so no measured prefill is skipped by
    the prefix cache.
    """
    prompts = random_requests(model.config.vocab_size, num_prompts, input_len, seed)
    params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)
    engine = Engine(model, backend=backend, graphs=graphs, max_num_seqs=max_num_seqs,
                    max_num_batched_tokens=max_num_batched_tokens, block_size=block_size,
                    max_model_len=min(model.config.max_position_embeddings, input_len[1] + output_len + block_size))
    if warmup:
        engine.warmup()
        others = random_requests(model.config.vocab_size, min(num_prompts, max_num_seqs), input_len, seed + 1)
        engine.generate(others, SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))
    total = num_prompts * output_len
    started = time.perf_counter()
    outputs = 0
    with tqdm(total=total, desc="output tokens", unit="tok") as bar:
        for event in engine.generate_stream(prompts, params):
            if event.completion is not None and event.completion.error is not None:
                raise event.completion.error
            outputs += 1
            bar.update(1)
    seconds = time.perf_counter() - started
    prompt_tokens = sum(len(p) for p in prompts)
    return dict(
        num_prompts=num_prompts, prompt_tokens=prompt_tokens, output_tokens=outputs, seconds=seconds,
        output_tok_s=outputs / seconds, total_tok_s=(outputs + prompt_tokens) / seconds,
        max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
    )
