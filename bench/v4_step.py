"""Decode step latency of the "v4-mini" preset: graphs vs eager, against the roofline.

    python bench/v4_step.py [--batches 1 64] [--contexts 8192 65536] [--commit SHA] [--profile] [--invariant]

Each row: one decode step of `batch` sequences with `context` cached tokens each
(random bf16 weights, every cache leaf filled with random values). The roofline is
the bytes a step must read over the device-to-device copy bandwidth measured in the
same run: every weight it touches (attention, compressors, indexer, hyper-connection
and norm weights of every layer; the experts actually routed to in that step; the
LM head; the embedding rows) plus, per sequence and layer, the keys its attention
reads: the window (128 keys of 512), HCA's complete entries (context / 128), CSA's
selected entries (top 512) and its indexer's keys (context / 4 keys of 128). Reads
of the compressor's inputs on a step that completes a block, and every cache write,
are a few KB a sequence and not counted. Prints a table (last) and writes JSON under
bench/results/.

With --profile, each row's graph step is also profiled with programmatic launch off (each
kernel's own time) and its longest kernels printed; the list goes into the JSON too.

With --fp8-cache, each (batch, context) runs twice, over bf16 caches and over FP8 ones
(`kv_cache_dtype="fp8"`: window keys and entries as 448 e4m3 values, 4 float32 scales and 64 bf16
rope values, indexer keys as 128 e4m3 values and a scale), the cache bytes counted at each form's
size; `vs_bf16` is the FP8 row's graph time over the bf16 row's. Written as `v4-step-fp8`.

With --invariant, each row also times the batch-invariant graph step (`make_step(batch_invariant=True)`,
the Triton table's invariant ops) on the same shapes, on a state of its own: "invariant cost" is its
time over the default step's, less 1 (the figures `bench/step.py` reports for v2-lite).

The state is the engine's: cache group 0 (every layer's window keys, compressor and indexer
inputs) holds only the blocks within its lookback (`CacheGroup.lookback`), the compressed
groups every entry, so a sequence's cache grows only with its compressed parts (about 650
bytes a token of v4-mini at long context, `bench/cache_budget.py`). A row that does not fit
records the error instead.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import math
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402

import mla_func as mf  # noqa: E402
from mla_func.kernels import ops_for  # noqa: E402
from mla_func.kernels.latent_cache import scale_groups  # noqa: E402

BLOCK_SIZE = 64


def nbytes(t: torch.Tensor | None) -> int:
    return 0 if t is None else t.numel() * t.element_size()


def tree_bytes(tree) -> int:
    return sum(nbytes(t) for t in mf.pytree.tree_leaves(tree) if isinstance(t, torch.Tensor))


def fill_random(t: torch.Tensor) -> None:
    """Random values in a cache leaf: N(0, 1), or for FP8 values their e4m3 rounding (the float8 dtypes have
    no random kernels)."""
    if t.element_size() == 1:
        t.copy_(torch.randn(t.shape, device=t.device).to(t.dtype))
    else:
        t.normal_(0.0, 1.0)


def decode_setup(model: mf.Model, batch: int, context: int, step: mf.Step, kv_cache_dtype: str = "auto"):
    """A state as the engine holds it for `batch` sequences of `context` cached tokens: group 0 (window keys,
    compressor and indexer inputs) only the blocks within its lookback (the earlier ones are the scratch
    block in each table, as the scheduler leaves them), every compressed group whole; and the decode batch."""
    per_seq = math.ceil((context + 1) / BLOCK_SIZE)
    state = mf.init_state(model, num_blocks=1 + batch * per_seq, block_size=BLOCK_SIZE, max_num_seqs=batch,
                          max_num_batched_tokens=batch, kv_cache_dtype=kv_cache_dtype)
    for cache in state.leaves():
        fill_random(cache)
    seqs = []
    for i in range(batch):
        tables = []
        for g in state.groups:
            first, n = g.first_live_block(context), g.blocks_for(context + 1)
            live = n - first
            tables.append((0,) * first + tuple(range(1 + i * live, 1 + (i + 1) * live)))
        seqs.append(mf.SeqPlan(((17 * i) % model.config.vocab_size,), context, tables[0], 1,
                               group_block_tables=tuple(tables[1:])))
    batch_tensors, mode = step.prepare(state, mf.StepPlan(decode=tuple(seqs)))
    return state, batch_tensors, mode


def routed_experts(model: mf.Model, state, batch_tensors, mode) -> list[int]:
    """Distinct routed experts of each layer in this step (from an eager forward that records them)."""
    ops = ops_for(mode.backend, mode.batch_invariant, mode.w8a8)
    seen: list[int] = []
    experts = ops.v4.clamped_experts

    def recording(x, w13, w2, topk_weights, topk_ids, *, limit):
        # One call a layer over routed and shared experts (stacked after the routed ones).
        routed = model.params.layers[len(seen)].mlp.num_routed
        seen.append(int(torch.unique(topk_ids[(topk_ids >= 0) & (topk_ids < routed)]).numel()))
        return experts(x, w13, w2, topk_weights, topk_ids, limit=limit)

    recorded = dataclasses.replace(ops, v4=dataclasses.replace(ops.v4, clamped_experts=recording))
    mf.forward(model.params, state.renewed(), batch_tensors, dataclasses.replace(mode, use_graph=False), ops=recorded)
    if len(seen) != len(model.params.layers):
        raise RuntimeError(f"routed_experts: recorded {len(seen)} expert calls for {len(model.params.layers)} layers")
    return seen


def touched_bytes(model: mf.Model, experts: list[int], batch: int, context: int,
                  kv_cache_dtype: str = "auto") -> tuple[int, int]:
    """(weight bytes, cache bytes) one decode step must read (keys and index keys at the cache's size)."""
    p, v = model.params, model.config.family_fields
    assert v is not None
    weight = nbytes(p.lm_head) + nbytes(p.norm) + batch * p.embed.shape[1] * p.embed.element_size()
    cache = 0
    itemsize = model.dtype.itemsize
    rope = model.config.qk_rope_head_dim
    if kv_cache_dtype == "fp8":
        # e4m3 values, a float32 scale a 128 (`latent_cache.scale_groups`), rope values as they are.
        key_bytes = (v.head_dim - rope) + 4 * scale_groups(v.head_dim - rope) + rope * itemsize
        index_key_bytes = v.index_head_dim + 4
    else:
        key_bytes, index_key_bytes = v.head_dim * itemsize, v.index_head_dim * itemsize
    keys = context + 1
    for layer, layer_type, routed in zip(p.layers, v.layer_types, experts):
        a = layer.attn
        weight += tree_bytes((layer.attn_norm, layer.ffn_norm, layer.attn_hc, layer.ffn_hc, layer.hc_head))
        weight += tree_bytes((a.in_proj, a.q_a_norm, a.q_b_proj, a.kv_norm, a.o_a_proj, a.o_b_proj,
                              a.sinks, a.compressor, a.indexer))
        m = layer.mlp
        per_expert = (nbytes(m.w13) + nbytes(m.w2)) // m.w13.shape[0]
        weight += nbytes(m.gate) + (routed + m.w13.shape[0] - m.num_routed) * per_expert
        entries = 0
        if layer_type == "heavily_compressed_attention":
            entries = keys // v.rate(layer_type)
        elif layer_type == "compressed_sparse_attention":
            count = keys // v.rate(layer_type)
            entries = min(v.index_topk, count)
            cache += batch * count * index_key_bytes
        cache += batch * (min(v.sliding_window, keys) + entries) * key_bytes
    return weight, cache


def time_steps(step: mf.Step, state, batch_tensors, mode, iters: int) -> tuple[float, object]:
    """Wall milliseconds per step over `iters` back-to-back steps (after warm-up), synchronised at the end."""
    for _ in range(3):
        state, _ = step(state, batch_tensors, mode)
    torch.cuda.synchronize()
    started = time.perf_counter()
    for _ in range(iters):
        state, _ = step(state, batch_tensors, mode)
    torch.cuda.synchronize()
    return (time.perf_counter() - started) * 1e3 / iters, state


def invariant_step_ms(model, batch, context, args, max_len) -> float:
    """Milliseconds per batch-invariant graph step of `batch` x `context` (its state freed before returning)."""
    step = mf.make_step(model, backend=args.backend, max_num_seqs=max(args.batches), max_model_len=max_len,
                        block_size=BLOCK_SIZE, batch_invariant=True)
    state, batch_tensors, mode = decode_setup(model, batch, context, step)
    ms, state = time_steps(step, state, batch_tensors, mode, args.iters)
    del state, batch_tensors, step
    gc.collect()
    torch.cuda.empty_cache()
    return ms


def run_row(model, batch, context, args, copy_bw, max_len, kv_cache_dtype: str = "auto") -> dict:
    # The batch-invariant step first, so that its state is freed before the default step's is made.
    invariant_ms = invariant_step_ms(model, batch, context, args, max_len) if args.invariant else None
    graph_step = mf.make_step(model, backend=args.backend, max_num_seqs=max(args.batches), max_model_len=max_len,
                              block_size=BLOCK_SIZE)
    eager_step = mf.make_step(model, backend=args.backend, graphs=False, padding=graph_step.padding)
    state, batch_tensors, mode = decode_setup(model, batch, context, graph_step, kv_cache_dtype)
    experts = routed_experts(model, state, batch_tensors, mode)
    weight_bytes, cache_bytes = touched_bytes(model, experts, batch, context, kv_cache_dtype)
    roofline_ms = (weight_bytes + cache_bytes) / copy_bw * 1e3
    graph_ms, state = time_steps(graph_step, state, batch_tensors, mode, args.iters)
    eager_ms = math.nan
    if args.eager:
        eager_ms, state = time_steps(eager_step, state, batch_tensors, dataclasses.replace(mode, use_graph=False),
                                     args.iters)
    profile = None
    if args.profile:
        profile = common.step_kernels(
            lambda: mf.make_step(model, backend=args.backend, max_num_seqs=max(args.batches), max_model_len=max_len,
                                 block_size=BLOCK_SIZE),
            state, batch_tensors, mode, f"B{batch} x {context}")
    invariant = {} if invariant_ms is None else dict(
        invariant_ms=invariant_ms, invariant_cost=invariant_ms / graph_ms - 1,
        invariant_pct_roofline=100 * roofline_ms / invariant_ms)
    return dict(batch=batch, context=context, graph_ms=graph_ms, eager_ms=eager_ms, roofline_ms=roofline_ms,
                pct_roofline=100 * roofline_ms / graph_ms, roofline_ratio=graph_ms / roofline_ms,
                graph_speedup=eager_ms / graph_ms, graph_tok_s=batch / graph_ms * 1e3,
                weight_gb=weight_bytes / 1e9, cache_gb=cache_bytes / 1e9,
                experts_per_layer=sum(experts) / max(1, len(experts)), padded_batch=mode.padded_decode_seqs,
                **invariant, **({"kernels_without_programmatic_launch": profile} if profile is not None else {}))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 64])
    parser.add_argument("--contexts", type=int, nargs="+", default=[8192, 65536])
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--backend", default="triton")
    parser.add_argument("--no-eager", dest="eager", action="store_false", help="skip the eager step of each row")
    parser.add_argument("--commit", default=None)
    parser.add_argument("--profile", action="store_true",
                        help="also profile each row's step kernel by kernel (programmatic launch off)")
    parser.add_argument("--invariant", action="store_true",
                        help="also time the batch-invariant graph step of each row (its cost over the default)")
    parser.add_argument("--fp8-cache", action="store_true",
                        help="run each row over bf16 and over FP8 caches (written as v4-step-fp8)")
    parser.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / "results")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench/v4_step.py needs a CUDA GPU")

    copy_bw = common.copy_bandwidth()
    max_len = max(args.contexts) + 2
    model = mf.load_model("v4-mini", dtype=torch.bfloat16, device="cuda", max_model_len=max_len)
    rows = []
    for context in args.contexts:
        for batch in args.batches:
            for cache in ("auto", "fp8") if args.fp8_cache else ("auto",):
                run = dict(run="FP8 cache" if cache == "fp8" else "bf16 cache") if args.fp8_cache else {}
                try:
                    rows.append(dict(**run, **run_row(model, batch, context, args, copy_bw, max_len, cache)))
                except torch.cuda.OutOfMemoryError as exc:
                    # A shape that does not fit this GPU is a result of the run: recorded, and the run goes on.
                    rows.append(dict(**run, batch=batch, context=context, error=f"out of memory: {str(exc)[:160]}"))
                if cache == "fp8" and "graph_ms" in rows[-1] and "graph_ms" in rows[-2]:
                    rows[-1]["vs_bf16"] = rows[-1]["graph_ms"] / rows[-2]["graph_ms"]
                print({k: v for k, v in rows[-1].items() if k != "kernels_without_programmatic_launch"}, flush=True)
                gc.collect()
                torch.cuda.empty_cache()

    result = dict(
        preset="v4-mini", dtype="bfloat16", backend=args.backend, block_size=BLOCK_SIZE, invariant=args.invariant,
        gpu=common.gpu_name(), device=common.gpu_slug(), date=common.today(), commit=common.git_commit(args.commit),
        torch=torch.__version__, copy_bandwidth_gb_s=copy_bw / 1e9,
        targets="batch 1: graph_ms <= 1.5 x roofline_ms; batch 64 at 64K: >= 70% of roofline", rows=rows,
    )
    path = common.write_json(result, args.out, "v4-step-fp8" if args.fp8_cache else "v4-step")
    print(f"\n{result['gpu']}  copy bandwidth {copy_bw / 1e9:.0f} GB/s  -> {path}")
    common.print_table(rows, [
        ("run", "run"), ("batch", "batch"), ("context", "ctx"), ("graph_ms", "graph ms"), ("vs_bf16", "x bf16 cache"), ("invariant_ms", "invariant ms"),
        ("invariant_cost", "invariant cost"), ("eager_ms", "eager ms"), ("roofline_ms", "roofline ms"),
        ("pct_roofline", "% roofline"), ("roofline_ratio", "t/t_roof"),
        ("graph_speedup", "graph x"), ("graph_tok_s", "tok/s"), ("weight_gb", "weights GB"),
        ("cache_gb", "cache GB"), ("experts_per_layer", "experts/layer"), ("error", "error"),
    ])


if __name__ == "__main__":
    main()
