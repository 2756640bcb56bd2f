"""Decode step latency of the "v2-lite" (or "v32-lite") preset: graphs vs eager vs transformers, against the roofline.

    python bench/step.py [--batches 1 8 32 64 128 256] [--contexts 1024 4096] [--commit SHA]

Each row: one decode step of `batch` sequences with `context` cached tokens each
(random bf16 weights, KV cache filled with random latents). The roofline is the
bytes a step must read — every weight it touches (the experts actually selected
in that step included) plus the KV cache (for v32-lite: every indexer key and the
selected latent rows only) — over the device-to-device copy bandwidth measured in
the same run. transformers runs beside v2-lite only. Each row also times the batch-invariant step
(`make_step(batch_invariant=True)`) on the same shapes;
"invariant cost" is its time over the default step's, less 1. Prints a table and
writes JSON under bench/results/. With --profile, each row's graph step is also profiled
with programmatic launch off (each kernel's own time), its longest kernels printed and
the list written into the JSON.

    python bench/step.py --tensor-parallel 2 [--expert-parallel] [--data-parallel-attention]

times the step on one rank and on N ranks of this host (one GPU each) in the same run, over the same
random weights, and writes `step-parallel` results instead (`bench/step_parallel.py`: batches 1, 64
and 256 by default; `--device cpu --preset tiny` runs it on the CPU over gloo, for a smoke test).
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import math
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402
import ranks  # noqa: E402
import step_parallel  # noqa: E402

import mla_func as mf  # noqa: E402
from mla_func.kernels import ops_for, record_expert_choice  # noqa: E402
from mla_func.models.mla.params import MLPParams, MoEParams  # noqa: E402
from mla_func.pytree import tree_leaves  # noqa: E402

BLOCK_SIZE = 64


def nbytes(t) -> int:
    """Bytes of a weight: a tensor, a block-scaled pair (values and scales), or None."""
    return 0 if t is None else sum(leaf.numel() * leaf.element_size() for leaf in tree_leaves(t))


def decode_setup(model: mf.Model, batch: int, context: int, step: mf.Step, kv_cache_dtype: str = "auto"):
    blocks_per_seq = math.ceil((context + 1) / BLOCK_SIZE)
    state = mf.init_state(model.config, num_blocks=1 + batch * blocks_per_seq, block_size=BLOCK_SIZE,
                          dtype=model.dtype, device="cuda", kv_cache_dtype=kv_cache_dtype)
    ranks.fill_random_cache(state, kv_cache_dtype)
    plan = mf.StepPlan(decode=tuple(
        mf.SeqPlan(((17 * i) % model.config.vocab_size,), context,
                   tuple(range(1 + i * blocks_per_seq, 1 + (i + 1) * blocks_per_seq)))
        for i in range(batch)
    ))
    batch_tensors, mode = step.prepare(state, plan)
    return state, batch_tensors, mode


def touched_bytes(model: mf.Model, state, batch_tensors, mode, context: int) -> tuple[int, int, float]:
    """(weight bytes, KV bytes, mean distinct experts a layer) of one step, from its actual routing."""
    ops, chosen = record_expert_choice(ops_for(mode.backend, mode.batch_invariant, mode.w8a8))
    handle = state.renewed()
    mf.forward(model.params, handle, batch_tensors, mode, ops=ops)
    p = model.params
    weight = nbytes(p.lm_head) + nbytes(p.norm) + mode.num_decode_seqs * p.embed.shape[1] * p.embed.element_size()
    distinct = []
    moe_layers = [layer for layer in p.layers if isinstance(layer.mlp, MoEParams)]
    for layer in p.layers:
        a = layer.attn
        weight += sum(nbytes(t) for t in (a.qkv_a_proj, a.kv_a_norm, a.w_uk, a.w_uv, a.o_proj, a.q_a_norm,
                                          a.q_b_proj, layer.input_norm, layer.post_attention_norm))
        if layer.indexer is not None:
            weight += sum(nbytes(t) for t in dataclasses.astuple(layer.indexer))
        if isinstance(layer.mlp, MLPParams):
            weight += nbytes(layer.mlp.gate_up) + nbytes(layer.mlp.down)
    for layer, ids in zip(moe_layers, chosen):
        m = layer.mlp
        experts = torch.unique(ids[ids >= 0]).numel()
        distinct.append(experts)
        per_expert = (nbytes(m.w13) + nbytes(m.w2)) // m.w13.shape[0]
        weight += nbytes(m.gate) + (experts + m.num_shared) * per_expert
    c = model.config
    keys = context + 1
    if c.has_indexer:
        # A sparse layer reads every indexer key and only the selected latent rows.
        per_seq = min(keys, c.index_topk) * c.kv_cache_dim + keys * c.index_head_dim
        kv = mode.num_decode_seqs * per_seq * model.dtype.itemsize * c.num_hidden_layers
    else:
        # Every cached byte of a token (an FP8 cache's values, scales and RoPE values alike).
        kv = mode.num_decode_seqs * keys * state.bytes_per_block() // state.block_size
    return weight, kv, sum(distinct) / max(len(distinct), 1)


def time_steps(step: mf.Step, state, batch_tensors, mode, iters: int) -> tuple[float, object]:
    """Wall milliseconds per step over `iters` back-to-back steps (after warm-up), synchronised at the end."""
    for _ in range(3):
        state, out = step(state, batch_tensors, mode)
    torch.cuda.synchronize()
    started = time.perf_counter()
    for _ in range(iters):
        state, out = step(state, batch_tensors, mode)
    torch.cuda.synchronize()
    return (time.perf_counter() - started) * 1e3 / iters, state


def transformers_decode(config: mf.ModelConfig, batch: int, context: int, new_tokens: int,
                        repeats: int) -> tuple[float, float]:
    """Median milliseconds per decode step of transformers' DeepseekV3ForCausalLM.generate: (cold, warm).

    Same shapes, bf16. A step is timed between two calls of a logits processor (each
    after a device synchronise), so the prefill is never in it. The first generate
    over these sequence lengths (cold) is slower than later ones: transformers'
    kernels meet each new length's shapes for the first time. `repeats` more
    generates give the warm median, the one a server would see on its second request.
    """
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM, LogitsProcessor, LogitsProcessorList

    class StepClock(LogitsProcessor):
        def __init__(self):
            self.stamps = []

        def __call__(self, input_ids, scores):
            torch.cuda.synchronize()
            self.stamps.append(time.perf_counter())
            return scores

    hf_config = DeepseekV3Config(**{
        **config.to_hf_dict(), "n_group": 1, "topk_group": 1, "num_nextn_predict_layers": 0,
    })
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = DeepseekV3ForCausalLM(hf_config).to(torch.bfloat16).eval()
    ids = torch.randint(0, config.vocab_size, (batch, context), device="cuda")

    def step_times() -> list[float]:
        clock = StepClock()
        with torch.no_grad():
            model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=1 + new_tokens,
                           min_new_tokens=1 + new_tokens, do_sample=False, pad_token_id=0,
                           logits_processor=LogitsProcessorList([clock]))
        return [(b - a) * 1e3 for a, b in zip(clock.stamps, clock.stamps[1:])]

    cold = step_times()
    warm = [ms for _ in range(repeats) for ms in step_times()]
    del model
    gc.collect()
    torch.cuda.empty_cache()
    return statistics.median(cold), statistics.median(warm)


def time_rows(model: mf.Model, args: argparse.Namespace, copy_bw: float, kv_cache_dtype: str = "auto",
              invariant: bool | None = None, w8a8: bool = False) -> list[dict]:
    """One row a (context, batch) of args: the graph step (and the eager and batch-invariant steps as args ask)
    against the roofline of the bytes it reads."""
    invariant = args.invariant if invariant is None else invariant
    max_len = max(args.contexts) + 1
    rows = []
    for context in args.contexts:
        for batch in args.batches:
            # A fresh step a row: each row has a state of its own, and a graph replays
            # only over the cache buffers it was captured with.
            invariant_ms = None
            if invariant:
                # The batch-invariant step first, on a state of its own (freed before the rest).
                bi_step = mf.make_step(model, backend=args.backend, max_num_seqs=max(args.batches),
                                       max_model_len=max_len, block_size=BLOCK_SIZE, batch_invariant=True)
                state, batch_tensors, mode = decode_setup(model, batch, context, bi_step, kv_cache_dtype)
                invariant_ms, state = time_steps(bi_step, state, batch_tensors, mode, args.iters)
                del state, batch_tensors, bi_step
                gc.collect()
                torch.cuda.empty_cache()
            graph_step = mf.make_step(model, backend=args.backend, max_num_seqs=max(args.batches),
                                      max_model_len=max_len, block_size=BLOCK_SIZE, w8a8=w8a8)
            eager_step = mf.make_step(model, backend=args.backend, graphs=False, padding=graph_step.padding,
                                      w8a8=w8a8)
            state, batch_tensors, mode = decode_setup(model, batch, context, graph_step, kv_cache_dtype)
            weight_bytes, kv_bytes, experts = touched_bytes(model, state, batch_tensors, mode, context)
            roofline_ms = (weight_bytes + kv_bytes) / copy_bw * 1e3
            graph_ms, state = time_steps(graph_step, state, batch_tensors, mode, args.iters)
            eager_ms = math.nan
            if args.eager:
                eager_ms, state = time_steps(eager_step, state, batch_tensors,
                                             dataclasses.replace(mode, use_graph=False), args.iters)
            profile = None
            if args.profile:
                profile = common.step_kernels(
                    lambda: mf.make_step(model, backend=args.backend, max_num_seqs=max(args.batches),
                                         max_model_len=max_len, block_size=BLOCK_SIZE, w8a8=w8a8),
                    state, batch_tensors, mode, f"B{batch} x {context}")
            rows.append(dict(
                batch=batch, context=context, graph_ms=graph_ms, eager_ms=eager_ms, roofline_ms=roofline_ms,
                graph_tok_s=batch / graph_ms * 1e3, eager_tok_s=batch / eager_ms * 1e3,
                roofline_tok_s=batch / roofline_ms * 1e3, pct_roofline=100 * roofline_ms / graph_ms,
                graph_speedup=eager_ms / graph_ms, weight_gb=weight_bytes / 1e9, kv_gb=kv_bytes / 1e9,
                experts_per_layer=experts, padded_batch=mode.padded_decode_seqs,
                **({"kernels_without_programmatic_launch": profile} if profile is not None else {}),
            ))
            if invariant_ms is not None:
                rows[-1].update(invariant_ms=invariant_ms, invariant_cost=invariant_ms / graph_ms - 1,
                                invariant_pct_roofline=100 * roofline_ms / invariant_ms)
            print({k: v for k, v in rows[-1].items() if k != "kernels_without_programmatic_launch"}, flush=True)
            del state, batch_tensors, graph_step, eager_step
            gc.collect()
            torch.cuda.empty_cache()
    return rows


def fp8_run(args: argparse.Namespace, copy_bw: float) -> None:
    """`--fp8`: the decode step with bf16 weights and cache, with block-scaled FP8 weights (their products taking
    the activations as they are, and as w8a8 steps), and with FP8 weights and the FP8 latent cache, in one run;
    each FP8 row's time over the bf16 row's of its batch and context."""
    variants = (("bf16", None, "auto", False), ("fp8", "fp8", "auto", False), ("fp8", "fp8", "auto", True),
                ("fp8", "fp8", "fp8", False))
    rows = []
    for weights, quantization, kv_cache_dtype, w8a8 in variants:
        model = mf.load_model(args.preset, dtype=torch.bfloat16, device="cuda", quantization=quantization)
        print(f"== weights {weights}{' w8a8' if w8a8 else ''}, cache {kv_cache_dtype}", flush=True)
        for row in time_rows(model, args, copy_bw, kv_cache_dtype, invariant=False, w8a8=w8a8):
            run = f"{weights} weights{' w8a8' if w8a8 else ''}, {'FP8' if kv_cache_dtype == 'fp8' else 'bf16'} cache"
            rows.append(dict(row, run=run, weights=weights, cache=kv_cache_dtype))
        del model
        gc.collect()
        torch.cuda.empty_cache()
    bf16 = {(r["batch"], r["context"]): r for r in rows if r["weights"] == "bf16"}
    for row in rows:
        base = bf16[(row["batch"], row["context"])]
        row["vs_bf16"] = row["graph_ms"] / base["graph_ms"]
        row["roofline_ratio"] = row["graph_ms"] / row["roofline_ms"]
    result = dict(preset=args.preset, dtype="bfloat16", backend=args.backend, block_size=BLOCK_SIZE,
                  gpu=common.gpu_name(), device=common.gpu_slug(), date=common.today(),
                  commit=common.git_commit(args.commit), torch=torch.__version__, copy_bandwidth_gb_s=copy_bw / 1e9,
                  rows=rows)
    path = common.write_json(result, args.out, "step-fp8" if args.preset == "v2-lite" else f"step-fp8-{args.preset}")
    print(f"\n{result['gpu']}  copy bandwidth {copy_bw / 1e9:.0f} GB/s  -> {path}")
    common.print_table(rows, [
        ("run", "run"), ("batch", "batch"), ("context", "ctx"), ("graph_ms", "graph ms"),
        ("roofline_ms", "roofline ms"), ("roofline_ratio", "x roofline"), ("vs_bf16", "x bf16 step"),
        ("weight_gb", "weight GB"), ("kv_gb", "KV GB"),
    ])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="v2-lite", choices=list(step_parallel.PRESETS),
                        help="the model: dense MLA (v2-lite) or DeepSeek-V3.2 sparse attention (v32-lite); "
                             "tiny: the small preset, for a smoke test of --tensor-parallel")
    parser.add_argument("--batches", type=int, nargs="+", default=None,
                        help="default 1 8 32 64 128 256; with --tensor-parallel, 1 64 256")
    parser.add_argument("--contexts", type=int, nargs="+", default=[1024, 4096])
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--hf-batches", type=int, nargs="*", default=[1, 8],
                        help="batches (at context 1024) to also run transformers' generate on")
    parser.add_argument("--hf-new-tokens", type=int, default=32,
                        help="decode steps timed in each transformers generate")
    parser.add_argument("--hf-repeats", type=int, default=2,
                        help="warm transformers generates a batch, timed after the cold one")
    parser.add_argument("--backend", default=None, help="default triton on cuda, torch on cpu")
    parser.add_argument("--no-invariant", dest="invariant", action="store_false",
                        help="skip the batch-invariant graph step run beside each row")
    parser.add_argument("--no-eager", dest="eager", action="store_false", help="skip the eager step of each row")
    parser.add_argument("--profile", action="store_true",
                        help="also profile each row's graph step kernel by kernel (programmatic launch off)")
    parser.add_argument("--fp8", action="store_true",
                        help="bf16 weights and cache, FP8 weights, FP8 weights and latent cache, in one run "
                             "(results under step-fp8/)")
    ranks.add_arguments(parser)
    parser.add_argument("--commit", default=None)
    parser.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / "results")
    args = parser.parse_args()
    if args.hf_new_tokens < 1 or args.hf_repeats < 1:
        parser.error(f"--hf-new-tokens and --hf-repeats: expected >= 1, got {args.hf_new_tokens} and {args.hf_repeats}")
    several = ranks.check_arguments(parser, args)
    if several and args.profile:
        parser.error("--profile: profiles one process's step; run it without --tensor-parallel")
    args.batches = args.batches or ([1, 64, 256] if several else [1, 8, 32, 64, 128, 256])
    if several:
        step_parallel.run(args)
        return

    copy_bw = common.copy_bandwidth()
    if args.fp8:
        fp8_run(args, copy_bw)
        return
    model = mf.load_model(args.preset, dtype=torch.bfloat16, device="cuda")
    rows = time_rows(model, args, copy_bw)
    del model
    gc.collect()
    torch.cuda.empty_cache()
    for batch in args.hf_batches if args.preset == "v2-lite" else ():
        cold_ms, ms = transformers_decode(mf.PRESETS["v2-lite"](), batch, 1024, args.hf_new_tokens, args.hf_repeats)
        for row in rows:
            if row["batch"] == batch and row["context"] == 1024:
                row["hf_ms"], row["hf_cold_ms"] = ms, cold_ms
                row["hf_tok_s"], row["hf_cold_tok_s"] = batch / ms * 1e3, batch / cold_ms * 1e3
                row["vs_hf"] = row["graph_tok_s"] / row["hf_tok_s"]
                row["vs_hf_cold"] = row["graph_tok_s"] / row["hf_cold_tok_s"]
                row["roofline_vs_hf"] = row["roofline_tok_s"] / row["hf_tok_s"]
        print(f"transformers batch {batch} context 1024: {ms:.1f} ms/step warm, {cold_ms:.1f} cold", flush=True)

    result = dict(
        preset=args.preset, dtype="bfloat16", backend=args.backend, block_size=BLOCK_SIZE,
        gpu=common.gpu_name(), device=common.gpu_slug(), date=common.today(), commit=common.git_commit(args.commit),
        torch=torch.__version__, copy_bandwidth_gb_s=copy_bw / 1e9, rows=rows,
    )
    path = common.write_json(result, args.out, "step" if args.preset == "v2-lite" else f"step-{args.preset}")
    print(f"\n{result['gpu']}  copy bandwidth {copy_bw / 1e9:.0f} GB/s  -> {path}")
    common.print_table(rows, [
        ("batch", "batch"), ("context", "ctx"), ("graph_ms", "graph ms"), ("invariant_ms", "invariant ms"),
        ("invariant_cost", "invariant cost"), ("eager_ms", "eager ms"),
        ("roofline_ms", "roofline ms"), ("pct_roofline", "% roofline"), ("graph_speedup", "graph x"),
        ("graph_tok_s", "tok/s"), ("hf_tok_s", "hf tok/s"), ("vs_hf", "x hf"), ("vs_hf_cold", "x hf cold"),
        ("roofline_vs_hf", "roofline x hf"), ("experts_per_layer", "experts/layer"),
    ])


if __name__ == "__main__":
    main()
