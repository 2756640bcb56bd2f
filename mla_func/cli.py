"""The `mla-func` command line: `generate` streams a completion, `bench` measures offline throughput."""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Sequence

import torch

from .checkpoint import load_model
from .engine import Engine
from .sampling import SamplingParams

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def _add_model_args(parser: argparse.ArgumentParser, default_model: str) -> None:
    parser.add_argument("--model", default=default_model,
                        help=f"checkpoint folder or preset name (default: {default_model})")
    parser.add_argument("--device", default=None, help="default: cuda when available, else cpu")
    parser.add_argument("--dtype", choices=sorted(_DTYPES), default=None,
                        help="default: bfloat16 on cuda, float32 on cpu")
    parser.add_argument("--backend", choices=["torch", "triton", "aiter"], default=None,
                        help="kernels (default: triton on cuda, torch on cpu)")
    parser.add_argument("--no-graphs", action="store_true", help="run every step eagerly")


def _load(args: argparse.Namespace):
    return load_model(args.model, dtype=_DTYPES[args.dtype] if args.dtype else None, device=args.device)


def _prompt_ids(model, prompt: str) -> list[int] | str:
    """Text for a model with a tokenizer; otherwise the prompt must be token ids ("1,2,3" or "1 2 3")."""
    if model.tokenizer is not None:
        return prompt
    try:
        return [int(t) for t in prompt.replace(",", " ").split()]
    except ValueError:
        raise SystemExit(f"error: model {model.config.model_type} has no tokenizer; give the prompt as token ids") from None


def _add_penalty_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--repetition-penalty", type=float, default=1.0,
                        help="divide positive / multiply negative logits of prompt and output tokens (default: 1.0, off)")
    parser.add_argument("--presence-penalty", type=float, default=0.0,
                        help="subtract from the logits of tokens already generated (default: 0.0, off)")
    parser.add_argument("--frequency-penalty", type=float, default=0.0,
                        help="subtract per time a token was generated (default: 0.0, off)")
    parser.add_argument("--min-tokens", type=int, default=0,
                        help="no end-of-sequence or stop token before this many tokens (default: 0)")


def generate_main(args: argparse.Namespace) -> int:
    model = _load(args)
    engine = Engine(model, backend=args.backend, graphs=not args.no_graphs, max_num_seqs=1,
                    max_num_batched_tokens=max(512, args.max_tokens))
    params = SamplingParams(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p,
                            max_tokens=args.max_tokens, seed=args.seed, repetition_penalty=args.repetition_penalty,
                            presence_penalty=args.presence_penalty, frequency_penalty=args.frequency_penalty,
                            min_tokens=args.min_tokens)
    prompt = _prompt_ids(model, args.prompt)
    started = time.perf_counter()
    first_token_at = None
    generated: list[int] = []
    shown = ""
    completion = None
    for event in engine.generate_stream([prompt], params):
        if event.completion is not None and event.completion.error is not None:
            print(f"error: {event.completion.error}", file=sys.stderr)
            return 2
        if first_token_at is None:
            first_token_at = time.perf_counter()
        generated.append(event.token_id)
        if model.tokenizer is not None:
            # Decode everything so far: a multi-byte character may span tokens.
            text = model.tokenizer.decode(generated)
            if not text.endswith("\ufffd"):
                sys.stdout.write(text[len(shown):])
                shown = text
        else:
            sys.stdout.write(f"{event.token_id} ")
        sys.stdout.flush()
        completion = event.completion or completion
    finished = time.perf_counter()
    print()
    decode_time = finished - (first_token_at or finished)
    rate = (len(generated) - 1) / decode_time if len(generated) > 1 and decode_time > 0 else float("nan")
    print(
        f"[prompt tokens {len(completion.prompt_token_ids) if completion else 0}, generated tokens {len(generated)}, "
        f"time to first token {((first_token_at or finished) - started) * 1e3:.0f} ms, {rate:.1f} tokens/s, "
        f"finish reason {completion.finish_reason if completion else 'none'}]",
        file=sys.stderr,
    )
    return 0


def bench_main(args: argparse.Namespace) -> int:
    from .benchmark import run_throughput

    model = _load(args)
    result = run_throughput(
        model, num_prompts=args.num_prompts, input_len=(args.min_input_len, args.max_input_len),
        output_len=args.output_len, backend=args.backend, graphs=not args.no_graphs,
        max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens, seed=args.seed,
    )
    print(
        f"{result['num_prompts']} requests, {result['prompt_tokens']} prompt + {result['output_tokens']} output tokens "
        f"in {result['seconds']:.2f} s: {result['output_tok_s']:.1f} output tokens/s, "
        f"{result['total_tok_s']:.1f} total tokens/s"
    )
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="mla-func", description="DeepSeek-style MLA inference.")
    commands = parser.add_subparsers(dest="command", required=True)

    gen = commands.add_parser("generate", help="stream a completion of a prompt")
    gen.add_argument("prompt")
    _add_model_args(gen, default_model="demo")
    gen.add_argument("--max-tokens", type=int, default=64)
    gen.add_argument("--temperature", type=float, default=0.8)
    gen.add_argument("--top-k", type=int, default=0, help="0 = off")
    gen.add_argument("--top-p", type=float, default=1.0, help="1 = off")
    gen.add_argument("--seed", type=int, default=None, help="default: a fresh random seed")
    _add_penalty_args(gen)
    gen.set_defaults(run=generate_main)

    bench = commands.add_parser("bench", help="offline throughput on random prompts")
    _add_model_args(bench, default_model="demo")
    bench.add_argument("--num-prompts", type=int, default=64)
    bench.add_argument("--min-input-len", type=int, default=32)
    bench.add_argument("--max-input-len", type=int, default=128)
    bench.add_argument("--output-len", type=int, default=32)
    bench.add_argument("--max-num-seqs", type=int, default=64)
    bench.add_argument("--max-num-batched-tokens", type=int, default=2048)
    bench.add_argument("--seed", type=int, default=0)
    bench.set_defaults(run=bench_main)

    args = parser.parse_args(argv)
    try:
        return args.run(args)
    except (ValueError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
