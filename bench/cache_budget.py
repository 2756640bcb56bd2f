"""Cache bytes a token and the longest context that fits, per model shape (bf16; arithmetic, no GPU).

    python bench/cache_budget.py        # prints the table, writes bench/results/cache-budget/cpu/<date>-<commit7>.json

Every figure is `mla_func.core.cache_budget.cache_budget(config, dtype=bfloat16, block_size=16)`: the
blocks each cache group holds at a context of T tokens times its bytes a block, measured on a state on
the meta device (nothing allocated). V4's group 0 (window keys, compressor and indexer inputs) holds
only the blocks of a sequence's last `lookback` tokens (127 here: the window of 128, and HCA's blocks
of 128), so its bytes a token fall with the context toward the compressed entries' and indexer keys';
"longest" and "seqs" count the most a sequence holds on its way to that length (`peak_bytes`).
Shapes:

* v2-lite, v32-lite, v4-mini: the presets;
* V3 (61 layers): v2-lite's attention shapes (kv_lora_rank 512, qk_rope_head_dim 64) in DeepSeek-V3's
  61 layers, which is all the latent cache depends on;
* V3.2 (61 layers): v32-lite's (the latents and index_head_dim 128) in V3.2's 61 layers;
* V4-Flash layout (43 layers): v4-mini's per-layer shapes (head_dim 512, window 128, CSA 4:1 with
  index_head_dim 128, HCA 128:1) in V4-Flash's 43 layers as its released `compress_ratios` lays them out:
  two sliding-window layers, then CSA and HCA alternating from CSA to CSA (21 CSA, 20 HCA).
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402

from mla_func.core.cache_budget import cache_budget  # noqa: E402
from mla_func.core.config import ModelConfig  # noqa: E402
from mla_func.models.presets import v2_lite, v32_lite, v4_mini  # noqa: E402

CONTEXTS = (1 << 13, 1 << 16, 1 << 20)   # 8K, 64K and 1M tokens
BUDGET_GIB = 64                  # the cache memory the "longest context" column assumes
GIB = 1 << 30


def v4_flash_layout() -> ModelConfig:
    """v4-mini's per-layer shapes in V4-Flash's 43 layers (compress_ratios 0, 0, then 4, 128, ..., 4)."""
    mini = v4_mini()
    hf = mini.family.config_to_hf(mini)
    layers = ["sliding_attention"] * 2 + [("compressed_sparse_attention", "heavily_compressed_attention")[i % 2]
                                          for i in range(41)]
    hf.update(num_hidden_layers=43, layer_types=layers, mlp_layer_types=["hash_moe"] * 3 + ["moe"] * 40)
    return mini.family.config_from_hf(hf, mini.family)


SHAPES = {
    "v2-lite": v2_lite,
    "V3 (61 layers)": lambda: dataclasses.replace(v2_lite(), num_hidden_layers=61),
    "v32-lite": v32_lite,
    "V3.2 (61 layers)": lambda: dataclasses.replace(v32_lite(), num_hidden_layers=61),
    "v4-mini": v4_mini,
    "V4-Flash layout (43 layers)": v4_flash_layout,
}


def row(name: str, config: ModelConfig) -> dict:
    budget = cache_budget(config, dtype=torch.bfloat16, block_size=16)
    out: dict = dict(model=name, layers=config.num_hidden_layers,
                     tokens_per_entry=[g.tokens_per_entry for g in budget.groups],
                     lookback=[g.lookback for g in budget.groups],
                     bytes_per_block=list(budget.bytes_per_block))
    for t in CONTEXTS:
        k = f"{t >> 10}k"
        out[f"bytes_per_token_{k}"] = budget.bytes_per_token(t)
        out[f"gib_per_seq_{k}"] = budget.sequence_bytes(t) / GIB
        # Each group's share: group 0 grows with every token, a compressed group with every entry.
        out[f"bytes_per_token_by_group_{k}"] = [n * b / t for n, b in zip(budget.blocks(t), budget.bytes_per_block)]
    out["longest_context_in_budget"] = budget.longest_context(BUDGET_GIB * GIB)
    out["seqs_of_64k_in_budget"] = budget.sequences_that_fit(1 << 16, BUDGET_GIB * GIB)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / "results")
    parser.add_argument("--no-write", action="store_true", help="print the table only")
    args = parser.parse_args()
    rows = [row(name, make()) for name, make in SHAPES.items()]
    common.print_table(rows, [("model", "model"), ("layers", "layers"), ("bytes_per_token_8k", "B/token 8K"),
                              ("bytes_per_token_64k", "B/token 64K"),
                              ("gib_per_seq_64k", "GiB/seq 64K"), ("bytes_per_token_1024k", "B/token 1M"),
                              ("gib_per_seq_1024k", "GiB/seq 1M"),
                              ("longest_context_in_budget", f"longest in {BUDGET_GIB} GiB"),
                              ("seqs_of_64k_in_budget", f"64K seqs in {BUDGET_GIB} GiB")])
    if not args.no_write:
        path = common.write_json(dict(device="cpu", dtype="bfloat16", block_size=16, budget_gib=BUDGET_GIB,
                                      contexts=list(CONTEXTS), rows=rows), args.out, "cache-budget")
        print(f"wrote {path}")


if __name__ == "__main__":
    main()
