"""Small random DeepSeek-V3.2 models from transformers (the oracle for sparse attention), and a tie guard.

The indexer's per-head ReLU makes exact ties common with few heads, and a tie at
the k-th score makes transformers' own choice (and so the oracle) ambiguous. The
configs here use 16 indexer heads, and `check_top_k_margins` fails a test loudly
when the gap between the k-th and the (k+1)-th visible score of any query of any
layer is too small for two correct implementations to be sure to agree.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch
from transformers import DeepseekV32Config, DeepseekV32ForCausalLM

import mla_func as mf
from support.mla_reference import TINY_V3, YARN, _randomize

V32 = dict(
    TINY_V3,
    num_hidden_layers=2,
    q_lora_rank=24,
    n_group=2,
    topk_group=1,
    routed_scaling_factor=2.5,
    index_n_heads=16,
    index_head_dim=16,
    index_topk=8,
)

VARIANTS = {
    "v32": {},
    # YaRN scales the rope tables that MLA and the indexer share; a second head dim split.
    "v32-yarn": dict(rope_parameters=YARN, index_head_dim=12, qk_rope_head_dim=8, num_hidden_layers=3),
}


def make_v32(variant: str = "v32", dtype: torch.dtype = torch.float32, seed: int = 0,
             **overrides: object) -> torch.nn.Module:
    config = DeepseekV32Config(**{**V32, **VARIANTS[variant], **overrides}, attn_implementation="eager",
                               experts_implementation="eager")
    torch.manual_seed(seed)
    model = DeepseekV32ForCausalLM(config)
    _randomize(model, seed)
    return model.to(dtype).eval()


def save_and_load(reference: torch.nn.Module, path: Path, dtype: torch.dtype) -> mf.Model:
    reference.save_pretrained(path)
    return mf.load_model(path, dtype=dtype, device="cpu")


def record_scores(ops: mf.kernels.Ops) -> tuple[mf.kernels.Ops, list[tuple[torch.Tensor, torch.Tensor]]]:
    """`ops` whose index_scores also appends (scores [T, L], key_lens [T]) of each call."""
    seen: list[tuple[torch.Tensor, torch.Tensor]] = []
    index_scores = ops.dsa.index_scores

    def recording(q, head_weights, index_cache, block_table, key_lens, /, *, weight_scale=1.0):
        scores = index_scores(q, head_weights, index_cache, block_table, key_lens, weight_scale=weight_scale)
        seen.append((scores, key_lens))
        return scores

    return dataclasses.replace(ops, dsa=dataclasses.replace(ops.dsa, index_scores=recording)), seen


# The oracle computes its scores in float32 (in a float64 model too): a gap between the k-th and
# the (k+1)-th score below this share of the score scale could flip its choice.
MIN_RELATIVE_GAP = 2e-5


def smallest_top_k_gap(model: mf.Model, token_ids: list[int], block_size: int = 4) -> tuple[float, int, int]:
    """Run `token_ids` through the model in one prefill; the smallest relative gap between the k-th
    and the (k+1)-th visible index score of any query of any layer, with its (layer, position).
    (inf, -1, -1) when no query sees more than k keys."""
    k = model.config.index_topk
    ops, seen = record_scores(mf.kernels.ops_for("torch"))
    state = mf.init_state(model, num_blocks=2 + len(token_ids) // block_size, block_size=block_size)
    table = tuple(range(1, state.num_blocks))
    plan = mf.StepPlan(prefill=(mf.SeqPlan(tuple(token_ids), 0, table),))
    batch, mode = mf.plan_step(model.config, state, plan)
    mf.forward(model.params, state, batch, mode, ops=ops)
    smallest = (float("inf"), -1, -1)
    for layer, (scores, key_lens) in enumerate(seen):
        for row in range(scores.shape[0]):
            visible = scores[row, : int(key_lens[row])].double()
            if visible.numel() <= k:
                continue
            top = visible.sort(descending=True).values
            smallest = min(smallest, (float((top[k - 1] - top[k]) / top.abs().max()), layer, row))
    return smallest


def check_top_k_margins(model: mf.Model, token_ids: list[int], block_size: int = 4) -> float:
    """Run `token_ids` through the model in one prefill and fail the test if any query of any layer
    has a near-tie at its k-th visible index score. Returns the smallest relative gap found."""
    gap, layer, row = smallest_top_k_gap(model, token_ids, block_size)
    if gap < MIN_RELATIVE_GAP:
        pytest.fail(f"near-tie at the k-th index score (layer {layer}, position {row}: relative gap {gap:.2e} "
                    f"< {MIN_RELATIVE_GAP:g}): the oracle's choice is ambiguous; change the seed or the tokens")
    return gap
