"""DeepSeek-V3's layer (or V4-Flash's) at its real size, decoding on one GPU and on N: the time a layer takes,
tensor-parallel against data-parallel attention with expert parallelism.

    python bench/layer.py [--tensor-parallel 2] [--layers 2] [--batches 1 64 256] [--contexts 4096 32768]
                          [--modes tp dp-ep] [--fp8] [--kv-cache-dtype auto|fp8] [--iters 10] [--commit SHA]

Random bf16 weights (not a checkpoint's: the time of a step does not depend on their values, only on
their shapes and on how routing spreads tokens, which random routers spread near evenly) of DeepSeek-V3's
true dimensions: hidden 7168; 128 heads, q_lora_rank 1536, kv_lora_rank 512, nope 128, rope 64, v 128;
256 routed experts of 2048 columns, top-8 (8 groups, 4 of them kept, sigmoid scores, noaux_tc) and one
shared expert. Every layer is a MoE layer (DeepSeek-V3's first three dense layers are left out); the
vocabulary is 1024 (the embedding and the LM head then cost a few µs a step). A layer's weights are
23 GB in bf16, so one H100 holds two of them and, at batch 256 x 32K tokens, their latent cache
(2 x 9.7 GB); building the second layer stacks its experts from separate tensors (2 x 22.5 GB for a
moment), the peak of the one-GPU run (about 68 GB).

Each mode (one rank first, then N ranks each way of --modes: by default tensor-parallel, and
data-parallel attention with whole experts a rank) runs in a group of fresh processes and times
one decode step of `batch` sequences of `context` tokens, graphs on, as `bench/step.py
--tensor-parallel` does (`step_parallel.decode_rows`). `layer_ms` is the step's time over the layer
count. Prints a table and writes JSON under bench/results/layer/. `--device cpu --shape tiny` runs
the same on the CPU over gloo at the tiny preset's shapes, for a smoke test.

`--fp8`: the weights DeepSeek's FP8 checkpoints store quantized as block-scaled FP8 pairs (128 x 128
blocks, drawn whole, quantized, then cut with their blocks' scales: `ranks.random_shard(block=)`), the
rest in bf16, as V3 ships: about half the bf16 layer's 23 GB.

`--shape v4`: DeepSeek-V4-Flash's layer (V4's real per-layer shapes, `mla_func.models.v4.presets.v4_real_shapes`:
hidden 4096, 64 heads of 512, 256 routed experts of 2048, top 6), CSA and HCA layers in turn; with `--fp8` in
V4's released layout (FP8 linears, routed experts as random FP4 pairs: `ranks.random_shard`), 3.4 GB of experts
a layer. Results under bench/results/layer-fp8-v4/ (or layer-v4/). `--kv-cache-dtype fp8`: the latent cache
in FP8 (656 bytes a token and layer against 1,152). Results under bench/results/layer-fp8/ when either
is given, each row's `run` naming its weights and cache.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402
import ranks  # noqa: E402
import step_parallel  # noqa: E402

import mla_func as mf  # noqa: E402
from mla_func.models.v4.presets import v4_real_shapes  # noqa: E402
from mla_func.parallel import Parallel  # noqa: E402


FP8_BLOCK = (128, 128)  # DeepSeek's FP8 checkpoints' weight_block_size


# The real-size shapes; the others are tiny, for smoke tests on the CPU.
REAL_SHAPES = ("v3", "v4")
# V4's layers in the bench: its compressed kinds in turn (V4-Flash: 21 CSA and 20 HCA of 43), experts routed by
# the learned router (V4-Flash hashes only its first 3 layers' tokens).
V4_KINDS = ("compressed_sparse_attention", "heavily_compressed_attention")


def fp8_block(shape: str) -> tuple[int, int]:
    """The FP8 pairs' block: DeepSeek's for the real sizes; 16 x 16 for the tiny shapes, whose widths split
    across ranks are not multiples of 128 (a rank reads whole blocks)."""
    return FP8_BLOCK if shape in REAL_SHAPES else (16, 16)


def v3_layers(layers: int) -> mf.ModelConfig:
    """DeepSeek-V3's dimensions, `layers` MoE layers, a vocabulary of 1024."""
    return dataclasses.replace(
        mf.PRESETS["v2-lite"](), model_type="deepseek_v3", vocab_size=1024, hidden_size=7168,
        num_hidden_layers=layers, num_attention_heads=128, q_lora_rank=1536, kv_lora_rank=512,
        qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128, intermediate_size=18432,
        n_routed_experts=256, num_experts_per_tok=8, n_shared_experts=1, moe_intermediate_size=2048,
        first_k_dense_replace=0, routed_scaling_factor=2.5, norm_topk_prob=True, scoring_func="sigmoid",
        topk_method="noaux_tc", n_group=8, topk_group=4,
        rope=mf.RopeConfig(theta=10000.0, kind="yarn", factor=40.0, original_max_position_embeddings=4096,
                           beta_fast=32.0, beta_slow=1.0, mscale=1.0, mscale_all_dim=1.0),
        eos_token_ids=(1,))


def v4_layers(layers: int, tiny: bool = False) -> mf.ModelConfig:
    """V4-Flash's layer (V4's real per-layer shapes, 256 routed experts, top 6), `layers` of them, CSA and HCA
    in turn (`V4_KINDS`); `tiny`: the v4-tiny preset's shapes in the same layers (a smoke test)."""
    kinds = [V4_KINDS[i % 2] for i in range(layers)]
    if not tiny:
        # A vocabulary of 1024, as for V3: V4's 129,280 would add its head's 1 GB to every step.
        return dataclasses.replace(v4_real_shapes(kinds, ["moe"] * layers, n_routed_experts=256), vocab_size=1024)
    preset = mf.PRESETS["v4-tiny"]()
    family = preset.family
    return family.config_from_hf({**family.config_to_hf(preset), "num_hidden_layers": layers, "layer_types": kinds,
                                  "mlp_layer_types": ["moe"] * layers}, family)


def layer_config(shape: str, layers: int) -> mf.ModelConfig:
    """"v3": DeepSeek-V3's layer (`v3_layers`); "v4": V4-Flash's (`v4_layers`); "tiny", "v4-tiny": the tiny
    presets' shapes, every layer MoE (smoke tests)."""
    if shape == "v3":
        return v3_layers(layers)
    if shape in ("v4", "v4-tiny"):
        return v4_layers(layers, tiny=shape == "v4-tiny")
    return dataclasses.replace(mf.PRESETS["tiny"](), num_hidden_layers=layers, first_k_dense_replace=0)


def layer_rank(args: argparse.Namespace, mode: ranks.Mode, parallel: Parallel, device: torch.device) -> dict:
    """One rank: its shard of the layers, then every row timed; `layer_ms` a layer's share of a step."""
    cuda = device.type == "cuda"
    model = ranks.random_shard(layer_config(args.shape, args.layers), parallel,
                               dtype=torch.bfloat16 if cuda else torch.float32, device=device,
                               max_model_len=max(args.contexts) + 1 + step_parallel.BLOCK_SIZE,
                               block=fp8_block(args.shape) if args.fp8 else None)
    if cuda:
        # Building left the experts' separate tensors cached: the cache needs that memory whole.
        torch.cuda.empty_cache()
    rows = step_parallel.decode_rows(model, mode, parallel, device, batches=args.batches, contexts=args.contexts,
                                     iters=args.iters, backend=args.backend, kv_cache_dtype=args.kv_cache_dtype)
    for row in rows:
        row.update(layers=args.layers, layer_ms=row["graph_ms"] / args.layers)
        if args.fp8 or args.kv_cache_dtype == "fp8":
            cache = "FP8" if args.kv_cache_dtype == "fp8" else "bf16"
            row.update(run=f"{'fp8' if args.fp8 else 'bf16'} weights, {cache} cache")
    return step_parallel.rank_result(rows, parallel, device)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=2, help="MoE layers of the model (two fit one H100)")
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 64, 256])
    parser.add_argument("--contexts", type=int, nargs="+", default=[4096, 32768])
    parser.add_argument("--modes", nargs="+", default=["tp", "dp-ep"], choices=sorted(ranks.MODE_CODES),
                        help="the cuts of N ranks timed after one rank: tp (tensor parallel), ep (tp with whole "
                             "experts), dp (data-parallel attention), dp-ep (dp with whole experts)")
    parser.add_argument("--iters", type=int, default=10)
    parser.add_argument("--shape", default="v3", choices=["v3", "v4", "tiny", "v4-tiny"],
                        help="v3: DeepSeek-V3's layer; v4: V4-Flash's (CSA and HCA in turn; with --fp8 its FP4 "
                             "experts too); tiny, v4-tiny: the tiny presets' (smoke tests)")
    parser.add_argument("--backend", default=None, help="default triton on cuda, torch on cpu")
    parser.add_argument("--fp8", action="store_true",
                        help="weights as block-scaled FP8 pairs, as DeepSeek's checkpoints ship (default: bf16)")
    parser.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "fp8"],
                        help="the latent cache: auto (the activation dtype) or fp8")
    ranks.add_arguments(parser)
    parser.add_argument("--commit", default=None)
    parser.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / "results")
    parser.set_defaults(tensor_parallel=2)
    args = parser.parse_args()
    if not ranks.check_arguments(parser, args):
        parser.error(f"--tensor-parallel {args.tensor_parallel}: layer.py compares one rank with N >= 2")
    if args.expert_parallel or args.data_parallel_attention:
        parser.error("--expert-parallel, --data-parallel-attention: layer.py picks its cuts with --modes")
    if args.layers < 1 or args.iters < 1:
        parser.error(f"--layers and --iters: expected >= 1, got {args.layers} and {args.iters}")
    rows, facts = step_parallel.run_modes(args, layer_rank, args.modes)
    quantized = args.fp8 or args.kv_cache_dtype == "fp8"
    bench = ("layer-fp8" if quantized else "layer") + ("" if args.shape == "v3" else f"-{args.shape}")
    result = dict(shape=args.shape, layers=args.layers, dtype="bfloat16" if args.device == "cuda" else "float32",
                  backend=args.backend, block_size=step_parallel.BLOCK_SIZE, commit=common.git_commit(args.commit),
                  tensor_parallel=args.tensor_parallel, weights="random", iters=args.iters,
                  weight_format=("fp8 {}x{} blocks".format(*fp8_block(args.shape))
                                 + (", fp4 routed experts" if args.shape.startswith("v4") else "")) if args.fp8 else "bf16",
                  kv_cache_dtype=args.kv_cache_dtype, **facts, rows=rows)
    path = common.write_json(result, args.out, bench)
    print(f"\n{result['gpu']}, {args.layers} layers of {args.shape}, peak GB a rank {facts['peak_gb']} -> {path}")
    step_parallel.print_rows(rows, extra=(("layer_ms", "ms / layer"),))


if __name__ == "__main__":
    main()
