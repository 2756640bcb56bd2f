"""Speculative decoding with the MTP layer: verify-step cost and end-to-end tokens/s (CUDA).

    python bench/speculative.py [--batches 1 32] [--context 1024] [--e2e-model PATH] [--commit SHA]

Verify rows: the "v2-lite" preset (random bf16 weights, random cache), graph-replayed
steps of `batch` sequences with `context` cached tokens each: the plain decode step
(one query token a sequence) and the verify step (k + 1 = 2, 3, 4 query tokens a
sequence, as the engine runs it: logits and hidden state of every row), and the draft
step (the MTP layer, one row a sequence). "x decode" is a step's time over the decode
step's; the target is <= 1.15 at batch 1 and <= 1.3 at batch 32. Target steps also show
their roofline (bytes of the weights they touch — each routed expert chosen by any of the
step's tokens once — and the KV rows they read, over the copy bandwidth): at batch 1 a
verify row's tokens route to other experts than the decode token's, so its roofline grows
with k ("roofline x decode").

End to end: `mla-func bench`-style runs (random prompts of 32-128 tokens, 128 greedy
output tokens each, no early stop) at batch 1 and 8 with k = 0..3, on a model with an
MTP layer (`--e2e-model`, a checkpoint folder; by default the demo model, skipped with
a message when it has none), reporting output tokens/s and the measured acceptance rate.

Iterations and tokens (`--match`): the README's promise, measured. The same 8 random
prompts (4-120 tokens; alternately greedy and seeded at temperature 0.7; 64 tokens each)
run at batch 1 and 8 with k = 0..3, in the default mode and in the batch-invariant mode.
Each run reports how many requests kept k = 0's tokens (of the same mode), where the
first difference came, tokens/s, and where an iteration's time goes: the target step
(decode or verify), the drafter's steps (draft chain and catch-up), and the rest (host
work, sampling, syncs), from CUDA events around each step.
Prints tables and writes JSON under bench/results/.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import math
import random
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402
from step import touched_bytes  # noqa: E402

import mla_func as mf  # noqa: E402
from mla_func.models.mtp.layer import DrafterFn, drafter_params, init_drafter_state, mtp_layer, target_step_fn  # noqa: E402
from mla_func.serving.benchmark import run_throughput  # noqa: E402

BLOCK_SIZE = 64


def _setup(model: mf.Model, step: mf.Step, batch: int, context: int, q: int, drafter: bool):
    blocks_per_seq = math.ceil((context + q) / BLOCK_SIZE)
    state = mf.init_state(model, num_blocks=1 + batch * blocks_per_seq, block_size=BLOCK_SIZE)
    if drafter:
        state = init_drafter_state(model, state)
    for cache in state.leaves():
        cache.normal_(0.0, 1.0)
    vocab = model.config.vocab_size
    plan = mf.StepPlan(decode=tuple(
        mf.SeqPlan(tuple((17 * i + j) % vocab for j in range(q)), context,
                   tuple(range(1 + i * blocks_per_seq, 1 + (i + 1) * blocks_per_seq)), q)
        for i in range(batch)), decode_q_len=q)
    batch_tensors, mode = step.prepare(state, plan)
    if drafter:
        hidden = torch.randn(mode.num_tokens, model.config.hidden_size, dtype=model.dtype, device="cuda")
        batch_tensors = dataclasses.replace(batch_tensors, hidden=hidden)
    return state, batch_tensors, mode


def _time(step: mf.Step, state, batch_tensors, mode, iters: int) -> float:
    for _ in range(3):
        state, out = step(state, batch_tensors, mode)
    assert out.graph, f"step {mode.static_key} did not replay a graph"
    torch.cuda.synchronize()
    started = time.perf_counter()
    for _ in range(iters):
        state, _ = step(state, batch_tensors, mode)
    torch.cuda.synchronize()
    return (time.perf_counter() - started) * 1e3 / iters


def verify_rows(batches: list[int], context: int, iters: int, backend: str, copy_bw: float) -> list[dict]:
    """Decode, verify and draft steps; the target steps also against their roofline: the bytes of every
    weight they touch (each routed expert a layer's tokens chose, counted once) and KV row they read."""
    model = mf.load_model("v2-lite", dtype=torch.bfloat16, device="cuda", mtp=True)
    rows = []
    for batch in batches:
        kinds = [("decode", 1, None, False), *((f"verify k={q - 1}", q, target_step_fn, False) for q in (2, 3, 4)),
                 ("draft", 1, DrafterFn(mtp_layer(model.config)), True)]
        base = base_roofline = math.nan
        for name, q, fn, drafter in kinds:
            step = mf.make_step(model, fn=fn, params=drafter_params(model) if drafter else None, backend=backend,
                                max_num_seqs=max(batches), max_model_len=context + 8, block_size=BLOCK_SIZE)
            state, batch_tensors, mode = _setup(model, step, batch, context, q, drafter)
            roofline = {}
            if not drafter:
                weight, kv, experts = touched_bytes(model, state, batch_tensors, mode, context)
                roofline = dict(roofline_ms=(weight + kv) / copy_bw * 1e3, experts_per_layer=experts)
            ms = _time(step, state, batch_tensors, mode, iters)
            base = ms if name == "decode" else base
            base_roofline = roofline.get("roofline_ms", math.nan) if name == "decode" else base_roofline
            rows.append(dict(batch=batch, context=context, step=name, query_tokens=q, ms=ms, x_decode=ms / base,
                             **roofline, roofline_x_decode=roofline.get("roofline_ms", math.nan) / base_roofline,
                             x_roofline=ms / roofline.get("roofline_ms", math.nan)))
            print(rows[-1], flush=True)
            del state, batch_tensors, step
            gc.collect()
            torch.cuda.empty_cache()
    return rows


def end_to_end(model_path: str, batches: list[int], output_len: int, backend: str) -> list[dict]:
    try:
        model = mf.load_model(model_path, dtype=torch.bfloat16, device="cuda", mtp=True)
    except mf.CheckpointError as e:
        print(f"end to end skipped: {model_path} has no MTP layer ({e})", flush=True)
        return []
    rows = []
    for batch in batches:
        for k in range(4):
            result = run_throughput(model, num_prompts=batch, input_len=(32, 128), output_len=output_len,
                                    backend=backend, max_num_seqs=batch, max_num_batched_tokens=2048,
                                    speculative_tokens=k, progress=False)
            rows.append(dict(batch=batch, k=k, output_tok_s=result["output_tok_s"],
                             acceptance_rate=result["acceptance_rate"], seconds=result["seconds"]))
            print(rows[-1], flush=True)
    return rows


class _TimedStep:
    """A step whose calls record CUDA events, read after the run (no sync added between steps)."""

    def __init__(self, step: mf.Step, spans: list[tuple[torch.cuda.Event, torch.cuda.Event]]):
        self.step, self.spans = step, spans
        self.graphs = step.graphs

    def prepare(self, *args, **kwargs):
        return self.step.prepare(*args, **kwargs)

    def __call__(self, *args, **kwargs):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        out = self.step(*args, **kwargs)
        end.record()
        self.spans.append((start, end))
        return out


def _match_requests(vocab_size: int, seed: int) -> tuple[list[list[int]], list[mf.SamplingParams]]:
    rng = random.Random(seed)
    prompts = [[rng.randrange(2, vocab_size) for _ in range(rng.randint(4, 120))] for _ in range(8)]
    params = [mf.SamplingParams(temperature=0.0, max_tokens=64, ignore_eos=True) if i % 2 == 0 else
              mf.SamplingParams(temperature=0.7, seed=rng.randrange(2**31), max_tokens=64, ignore_eos=True)
              for i in range(8)]
    return prompts, params


def token_match(model_path: str, batches: list[int], backend: str, seed: int) -> list[dict]:
    """Per (mode, batch, k): requests whose tokens equal k = 0's, tokens/s, and ms an iteration in the
    target step, the drafter's steps and the rest."""
    model = mf.load_model(model_path, dtype=torch.bfloat16, device="cuda", mtp=True)
    prompts, params = _match_requests(model.config.vocab_size, seed)
    rows = []
    for invariant in (False, True):
        for batch in batches:
            plain = None
            for k in range(4):
                engine = mf.Engine(model, backend=backend, max_num_seqs=batch, batch_invariant=invariant,
                                   speculative_tokens=k)
                engine.warmup(progress=False)
                engine.generate(prompts, params)   # kernels compile for this run's shapes
                target, drafter = [], []
                engine.step = _TimedStep(engine.step, target)
                spec = engine._speculative
                if spec is not None:
                    spec.drafter = _TimedStep(spec.drafter, drafter)
                torch.cuda.synchronize()
                started = time.perf_counter()
                completions = engine.generate(prompts, params)
                torch.cuda.synchronize()
                seconds = time.perf_counter() - started
                tokens = [c.token_ids for c in completions]
                plain = tokens if k == 0 else plain
                firsts = [next((j for j, (x, y) in enumerate(zip(a, b)) if x != y), None)
                          for a, b in zip(plain, tokens)]
                iterations = len(target)
                target_ms = sum(a.elapsed_time(b) for a, b in target)
                drafter_ms = sum(a.elapsed_time(b) for a, b in drafter)
                rows.append(dict(
                    mode="batch-invariant" if invariant else "default", batch=batch, k=k,
                    matched=sum(f is None for f in firsts), requests=len(firsts),
                    greedy_matched=sum(f is None for f in firsts[0::2]),
                    seeded_matched=sum(f is None for f in firsts[1::2]),
                    first_differences=[f for f in firsts if f is not None],
                    output_tok_s=sum(map(len, tokens)) / seconds, iterations=iterations,
                    acceptance_rate=engine.speculative_stats.acceptance_rate,
                    ms_per_iteration=seconds * 1e3 / iterations, target_ms_per_iteration=target_ms / iterations,
                    drafter_ms_per_iteration=drafter_ms / iterations,
                    rest_ms_per_iteration=(seconds * 1e3 - target_ms - drafter_ms) / iterations))
                print(rows[-1], flush=True)
    return rows


def host_profile(model_path: str, backend: str, batch: int, ks: list[int], rows: int = 30) -> None:
    """Where the host's time goes in the engine loop: cProfile over one run of the match requests
    per k (after a warm run), the functions by their own time."""
    import cProfile
    import pstats

    model = mf.load_model(model_path, dtype=torch.bfloat16, device="cuda", mtp=True)
    prompts, params = _match_requests(model.config.vocab_size, 0)
    for k in ks:
        engine = mf.Engine(model, backend=backend, max_num_seqs=batch, speculative_tokens=k)
        engine.warmup(progress=False)
        engine.generate(prompts, params)
        profile = cProfile.Profile()
        profile.enable()
        engine.generate(prompts, params)
        profile.disable()
        print(f"\n== host profile: batch {batch}, k = {k} ==")
        pstats.Stats(profile).sort_stats("tottime").print_stats(rows)


def estimated_speedup(verify: list[dict], acceptance: dict[int, float]) -> list[dict]:
    """Decode tokens/s with k drafts over without, on the measured v2-lite steps (host time left out).

    An iteration keeps 1 + k * a tokens (a: the fraction of drafts accepted, `acceptance[k]`)
    and costs one verify step plus k drafter steps (k - 1 in the chain, one catch-up), each
    as measured against the decode step at the same batch: (1 + k a) / (verify + k draft).
    """
    rows = []
    for batch in sorted({r["batch"] for r in verify}):
        at = {r["step"]: r["x_decode"] for r in verify if r["batch"] == batch}
        for k, accepted in sorted(acceptance.items()):
            cost = at[f"verify k={k}"] + k * at["draft"]
            rows.append(dict(batch=batch, k=k, acceptance_rate=accepted, tokens_per_iteration=1 + k * accepted,
                             iteration_x_decode=cost, speedup=(1 + k * accepted) / cost))
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 32])
    parser.add_argument("--context", type=int, default=1024)
    parser.add_argument("--iters", type=int, default=50)
    parser.add_argument("--e2e-model", default="demo")
    parser.add_argument("--e2e-batches", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--backend", default="triton")
    parser.add_argument("--match", action="store_true", help="only the token-match and iteration-cost runs")
    parser.add_argument("--host-profile", type=int, nargs="+", metavar="K", default=None,
                        help="only profile the engine loop's host time (cProfile) at batch 8 for these k")
    parser.add_argument("--match-seed", type=int, default=None, help="the random prompts' seed (default: fresh)")
    parser.add_argument("--commit", default=None)
    parser.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / "results")
    args = parser.parse_args()
    if args.host_profile is not None:
        host_profile(args.e2e_model, args.backend, 8, args.host_profile)
        return
    match_seed = args.match_seed if args.match_seed is not None else random.SystemRandom().randrange(2**31)
    match = token_match(args.e2e_model, args.e2e_batches, args.backend, match_seed)
    verify = [] if args.match else verify_rows(args.batches, args.context, args.iters, args.backend,
                                               common.copy_bandwidth())
    e2e = [] if args.match else end_to_end(args.e2e_model, args.e2e_batches, args.output_len, args.backend)
    # The demo's measured acceptance (default mode, batch 8), and DeepSeek-V3's reported 85-90% for one draft.
    measured = {r["k"]: r["acceptance_rate"] for r in match
                if r["mode"] == "default" and r["batch"] == max(args.e2e_batches) and r["k"] > 0}
    speedup = [] if not verify else (
        [dict(r, acceptance="demo") for r in estimated_speedup(verify, measured)]
        + [dict(r, acceptance="DeepSeek-V3 reported") for r in estimated_speedup(verify, {1: 0.85})])
    result = dict(benchmark="speculative", preset="v2-lite", dtype="bfloat16", backend=args.backend,
                  block_size=BLOCK_SIZE, e2e_model=args.e2e_model, gpu=common.gpu_name(), gpu_slug=common.gpu_slug(),
                  date=common.today(), commit=common.git_commit(args.commit), torch=torch.__version__,
                  match_seed=match_seed, token_match_rows=match, verify_rows=verify, end_to_end_rows=e2e,
                  estimated_speedup_rows=speedup)
    path = common.write_json(result, args.out, "speculative")
    print(f"\n{result['gpu']} -> {path}")
    common.print_table(match, [("mode", "mode"), ("batch", "batch"), ("k", "k"), ("matched", "same tokens"),
                               ("greedy_matched", "greedy"), ("seeded_matched", "seeded"),
                               ("output_tok_s", "tok/s"), ("acceptance_rate", "acceptance"),
                               ("ms_per_iteration", "ms/iter"), ("target_ms_per_iteration", "target ms"),
                               ("drafter_ms_per_iteration", "drafter ms"), ("rest_ms_per_iteration", "rest ms")])
    if not verify:
        return
    common.print_table(verify, [("batch", "batch"), ("context", "ctx"), ("step", "step"), ("ms", "ms"),
                                ("x_decode", "x decode"), ("experts_per_layer", "experts/layer"),
                                ("roofline_ms", "roofline ms"), ("roofline_x_decode", "roofline x decode"),
                                ("x_roofline", "t/t_roof")])
    common.print_table(speedup, [("acceptance", "acceptance of"), ("batch", "batch"), ("k", "k"),
                                 ("acceptance_rate", "rate"), ("tokens_per_iteration", "tokens/iter"),
                                 ("iteration_x_decode", "iter x decode"), ("speedup", "speed-up")])
    if e2e:
        common.print_table(e2e, [("batch", "batch"), ("k", "k"), ("output_tok_s", "tok/s"),
                                 ("acceptance_rate", "acceptance")])


if __name__ == "__main__":
    main()
