"""Soak: many random requests through one engine, with bad requests and abandoned streams mixed in.

    python bench/soak.py [--requests 10000] [--seed 0] [--model v2-lite] [--no-graphs]
    python bench/soak.py --model tiny --requests 300 --round-size 32 --max-num-seqs 16 \
        --max-num-batched-tokens 256                        # a quick check on CPU

Requests arrive in rounds of --round-size, each one `generate` call, or (one
round in five) a `generate_stream` closed after a random number of events.
Each request has a random prompt length, output length and sampling parameters
(greedy and sampled, top-k / top-p, penalties, min_tokens, stop ids, seeds); about
one in twenty is bad on purpose (an empty or too long prompt, a float or
out-of-vocabulary id, a bad parameter), and must come back as an error
completion. The cache is sized to half of what every sequence at full length
needs, so preemption happens.

After every round: no request is left queued and every block is free (else the
difference is counted as leaked), and one completed request's prompt + output
is scored: rows of its logits that are not finite are counted. These checks
sync with the device, between rounds only, never inside a step.

Prints a table of counts and writes JSON under bench/results/. Exits 1 if any
of unexpected exceptions, wrong outcomes, leaked blocks or non-finite logits is
not 0.
"""

from __future__ import annotations

import argparse
import platform
import random
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402

import mla_func as mf  # noqa: E402
from mla_func.serving.requests import RequestError  # noqa: E402


def bad_request(kind: str, vocab: int, max_model_len: int) -> tuple[Any, Any]:
    """(prompt, params) of one deliberately bad request of `kind`."""
    ok = mf.SamplingParams(max_tokens=4)
    return {
        "empty prompt": ([], ok),
        "id outside vocabulary": ([1, vocab], ok),
        "float id": ([1, 2.5], ok),
        "prompt too long": ([1] * (max_model_len + 3), ok),
        "not a prompt": (None, ok),
        "negative temperature": ([1, 2], {"temperature": -1.0}),
        "unknown field": ([1, 2], {"temprature": 0.5}),
        "stop id outside vocabulary": ([1, 2], {"stop_token_ids": (vocab,)}),
        "min_tokens above max_tokens": ([1, 2], {"min_tokens": 5, "max_tokens": 2}),
        "not params": ([1, 2], 3.5),
    }[kind]


BAD_KINDS = ["empty prompt", "id outside vocabulary", "float id", "prompt too long", "not a prompt",
             "negative temperature", "unknown field", "stop id outside vocabulary", "min_tokens above max_tokens",
             "not params"]


def good_params(rng: random.Random, vocab: int, max_output: int) -> mf.SamplingParams:
    max_tokens = rng.randint(1, max_output)
    penalised = rng.random() < 0.3
    return mf.SamplingParams(
        temperature=rng.choice([0.0, 1e-40, 0.7, 1.0, 1.3]),
        top_k=rng.choice([0, 0, 20, 2**63]),
        top_p=rng.choice([1.0, 1.0, 0.9]),
        max_tokens=max_tokens,
        min_tokens=rng.randint(0, max_tokens) if rng.random() < 0.2 else 0,
        seed=rng.getrandbits(63) if rng.random() < 0.5 else None,
        stop_token_ids=tuple(rng.randrange(vocab) for _ in range(rng.randint(0, 2))),
        ignore_eos=rng.random() < 0.5,
        repetition_penalty=rng.uniform(1.0, 1.3) if penalised else 1.0,
        presence_penalty=rng.uniform(0.0, 0.5) if penalised else 0.0,
        frequency_penalty=rng.uniform(0.0, 0.5) if penalised else 0.0,
    )


def make_round(rng: random.Random, n: int, vocab: int, args: argparse.Namespace, max_model_len: int):
    """Prompts, params and, per request, the bad kind it was made with (None for a good one)."""
    prompts, params, kinds = [], [], []
    for _ in range(n):
        if rng.random() < args.bad_fraction:
            kind = rng.choice(BAD_KINDS)
            prompt, p = bad_request(kind, vocab, max_model_len)
        else:
            kind = None
            prompt = [rng.randrange(vocab) for _ in range(rng.randint(1, args.max_prompt_len))]
            p = good_params(rng, vocab, args.max_output_len)
        prompts.append(prompt)
        params.append(p)
        kinds.append(kind)
    return prompts, params, kinds


def run_round(engine: mf.Engine, rng: random.Random, prompts, params, kinds, counts: Counter) -> list[mf.Completion]:
    """One generate, or a stream abandoned at a random event; tallies outcomes into `counts`."""
    completions: list[mf.Completion] = []
    outputs = 0
    if rng.random() < 0.2:
        stop_after = rng.randint(0, sum(getattr(p, "max_tokens", 4) for p in params))
        stream = engine.generate_stream(prompts, params)
        for n, event in enumerate(stream):
            outputs += event.token_id >= 0
            if event.completion is not None:
                completions.append(event.completion)
            if n >= stop_after:
                break
        stream.close()
        counts["streams abandoned"] += 1
        counts["requests abandoned"] += len(prompts) - len(completions)
    else:
        completions = engine.generate(prompts, params)
        outputs = sum(len(c.token_ids) for c in completions)
    counts["output tokens"] += outputs
    for c in completions:
        kind = kinds[c.index]
        if c.error is not None:
            counts[f"error: {kind}" if kind else "wrong outcome: good request failed"] += 1
        elif kind is not None:
            counts[f"wrong outcome: {kind} accepted"] += 1
        else:
            counts[f"completed ({c.finish_reason})"] += 1
    return completions


def check_engine(engine: mf.Engine, rng: random.Random, completions: list[mf.Completion], counts: Counter) -> None:
    """Leaked blocks, a request left queued, and the finiteness of one completed request's logits."""
    allocator = engine.scheduler.allocator
    counts["leaked blocks"] += allocator.num_usable_blocks - allocator.num_free_blocks
    counts["requests left queued"] += int(engine.scheduler.has_unfinished())
    done = [c for c in completions if c.error is None and c.token_ids]
    if done:
        c = rng.choice(done)
        ids = list(c.prompt_token_ids + c.token_ids)[: engine.config.max_model_len]
        logits = engine.score(ids)
        counts["non-finite logits rows"] += int((~torch.isfinite(logits)).any(dim=-1).sum().item())
        counts["requests scored"] += 1
    if rng.random() < 0.2:
        try:
            engine.score([1, 2.5])
            counts["wrong outcome: bad score accepted"] += 1
        except RequestError:
            counts["error: bad score"] += 1


def cpu_name() -> str:
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.exists():
        for line in cpuinfo.read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor() or platform.machine()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--requests", type=int, default=10_000)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--model", default="v2-lite" if torch.cuda.is_available() else "tiny",
                        help="preset name (default: v2-lite on CUDA, tiny on CPU)")
    parser.add_argument("--round-size", type=int, default=256, help="requests per generate call (default: 256)")
    parser.add_argument("--max-prompt-len", type=int, default=128, help="prompts of 1 to this many tokens")
    parser.add_argument("--max-output-len", type=int, default=32, help="max_tokens from 1 to this")
    parser.add_argument("--bad-fraction", type=float, default=0.05)
    parser.add_argument("--max-num-seqs", type=int, default=256)
    parser.add_argument("--max-num-batched-tokens", type=int, default=8192)
    parser.add_argument("--no-graphs", action="store_true")
    parser.add_argument("--commit", default=None)
    parser.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / "results")
    args = parser.parse_args()

    started = time.perf_counter()
    model = mf.load_model(args.model)
    block_size = 16
    max_model_len = args.max_prompt_len + args.max_output_len
    full = args.max_num_seqs * -(-max_model_len // block_size)
    engine = mf.Engine(model, block_size=block_size, num_blocks=1 + full // 2, max_num_seqs=args.max_num_seqs,
                       max_num_batched_tokens=args.max_num_batched_tokens, max_model_len=max_model_len,
                       graphs=not args.no_graphs)
    captured = engine.warmup(progress=False)
    setup_s = time.perf_counter() - started
    rng = random.Random(args.seed)
    counts: Counter[str] = Counter()
    unexpected: list[str] = []
    generate_s = check_s = 0.0
    vocab = model.config.vocab_size
    done = 0
    while done < args.requests:
        n = min(args.round_size, args.requests - done)
        prompts, params, kinds = make_round(rng, n, vocab, args, max_model_len)
        t0 = time.perf_counter()
        completions: list[mf.Completion] = []
        try:
            completions = run_round(engine, rng, prompts, params, kinds, counts)
        except Exception as e:  # counted and reported: finding these is what the soak is for
            unexpected.append(f"{type(e).__name__}: {e}")
        t1 = time.perf_counter()
        try:
            check_engine(engine, rng, completions, counts)
        except Exception as e:
            unexpected.append(f"check: {type(e).__name__}: {e}")
        generate_s += t1 - t0
        check_s += time.perf_counter() - t1
        done += n
        print(f"\r{done}/{args.requests} requests, {counts['output tokens']} output tokens, "
              f"{len(unexpected)} unexpected exceptions", end="", file=sys.stderr, flush=True)
    print(file=sys.stderr)

    counts["requests"] = done
    counts["unexpected exceptions"] = len(unexpected)
    failures = sum(v for k, v in counts.items() if k.startswith("wrong outcome")) + len(unexpected) + \
        counts["leaked blocks"] + counts["requests left queued"] + counts["non-finite logits rows"]
    cuda = torch.cuda.is_available()
    result = dict(
        benchmark="soak", preset=args.model, gpu=common.gpu_name() if cuda else f"cpu: {cpu_name()}",
        device=common.gpu_slug() if cuda else "cpu", date=common.today(), commit=common.git_commit(args.commit),
        torch=torch.__version__, seed=args.seed, graphs=not args.no_graphs, graphs_captured=captured,
        engine=dict(block_size=block_size, num_blocks=engine.config.num_blocks, max_num_seqs=args.max_num_seqs,
                    max_num_batched_tokens=args.max_num_batched_tokens, max_model_len=max_model_len,
                    backend=engine.config.backend),
        round_size=args.round_size, max_prompt_len=args.max_prompt_len, max_output_len=args.max_output_len,
        counts=dict(sorted(counts.items())), rows=[dict(what=k, count=v) for k, v in sorted(counts.items())],
        unexpected=unexpected[:20], failures=failures,
        setup_s=setup_s, generate_s=generate_s, check_s=check_s, total_s=time.perf_counter() - started,
        output_tok_s=counts["output tokens"] / generate_s if generate_s else 0.0,
    )
    path = common.write_json(result, args.out, "soak")
    common.print_table([dict(what=k, count=v) for k, v in sorted(counts.items())], [("what", "what"), ("count", "count")])
    print(f"\n{result['output_tok_s']:.0f} output tokens/s; setup {setup_s:.1f} s, generate {generate_s:.1f} s, "
          f"checks {check_s:.1f} s, total {result['total_s']:.1f} s on {result['gpu']}; failures {failures}")
    print(f"wrote {path}")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
