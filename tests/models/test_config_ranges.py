"""Config fields that used to load and then fail or mislead at the first step are checked at load time.

Tiny V3.2 and V4 checkpoints written by transformers' `save_pretrained` (once per module)
have one config.json field changed per case: an out-of-range or mistyped value is a
ConfigError naming the field and the allowed values or range; an in-range one still
loads; and an index_topk or sliding_window past max_position_embeddings is clamped to it,
which gives the same logits as any value that covers the whole context.
"""

from __future__ import annotations

import dataclasses
import json
import re
import shutil
import warnings
from pathlib import Path

import pytest
import torch

import mla_func as mf
from support.checkpoint_edits import edit_config, edit_tensors
from support.dsa_reference import make_v32
from support.v4_reference import Seq, new_state, save_reference

CSA_RATE = "compress_rates.compressed_sparse_attention"


@pytest.fixture(scope="module")
def folders(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("ranges")
    save_reference(root / "v4", seed=7)
    make_v32(seed=1).save_pretrained(root / "v32")
    return {"v4": root / "v4", "v32": root / "v32"}


def _edited(folders: dict[str, Path], tmp_path: Path, model: str, **changes: object) -> Path:
    folder = tmp_path / model
    shutil.copytree(folders[model], folder)
    edit_config(folder, **changes)
    return folder


def _load(folder: Path) -> mf.Model:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # transformers' bookkeeping fields are reported by design
        return mf.load_model(folder, device="cpu")


REFUSED = [
    # V4's MoE fields, checked as V2/V3's are.
    ("v4", "routed_scaling_factor", 0, "must be a finite number > 0"),
    ("v4", "routed_scaling_factor", -2.5, "must be a finite number > 0"),
    ("v4", "routed_scaling_factor", "1.5", "must be a finite number > 0"),
    ("v4", "routed_scaling_factor", None, "must be a finite number > 0"),
    ("v4", "routed_scaling_factor", 10**400, "must be a finite number > 0"),
    ("v4", "num_experts_per_tok", 0, r"in \[1, n_routed_experts=4\]"),
    ("v4", "num_experts_per_tok", 99, r"in \[1, n_routed_experts=4\]"),
    ("v4", "num_experts_per_tok", True, r"in \[1, n_routed_experts=4\]"),
    ("v4", "n_routed_experts", 0, ">= 1"),
    ("v4", "moe_intermediate_size", 0, ">= 1"),
    ("v4", "n_shared_experts", 0, "must be 1"),
    ("v4", "scoring_func", "softmax", "expected one of"),
    ("v4", "scoring_func", ["sigmoid"], "expected one of"),
    # V4's hyper-connections: a loop bound.
    ("v4", "hc_sinkhorn_iters", 10**9, r"in \[1, 1000\]"),
    ("v4", "hc_sinkhorn_iters", 0, r"in \[1, 1000\]"),
    ("v4", "hc_sinkhorn_iters", "20", r"in \[1, 1000\]"),
    ("v4", "hc_sinkhorn_iters", 2.5, r"in \[1, 1000\]"),
    ("v4", "hc_sinkhorn_iters", None, r"in \[1, 1000\]"),
    ("v4", "hc_eps", 10**400, "must be a finite number > 0"),
    # Window and top-k: a bad type or a value below 1 (a large one is clamped, below).
    ("v4", "sliding_window", 0, r"in \[1, max_position_embeddings=256\]"),
    ("v4", "sliding_window", "8", r"in \[1, max_position_embeddings=256\]"),
    ("v32", "index_topk", 0, r"in \[1, max_position_embeddings=256\]"),
    ("v32", "index_topk", "8", r"in \[1, max_position_embeddings=256\]"),
    ("v32", "index_topk", -(10**12), r"in \[1, max_position_embeddings=256\]"),
    ("v32", "num_experts_per_tok", 99, r"in \[1, n_routed_experts=8\]"),
]


@pytest.mark.parametrize(("model", "field", "value", "why"), REFUSED,
                         ids=[f"{m}-{f}-{v!r}"[:60] for m, f, v, _ in REFUSED])
def test_out_of_range_fields_are_refused_by_name(folders, tmp_path, model, field, value, why):
    folder = _edited(folders, tmp_path, model, **{field: value})
    with pytest.raises(mf.ConfigError, match=rf"config field '{re.escape(field)}' = .*{why}"):
        _load(folder)


# List-valued fields with a list or an object for an entry: the error names the field, the index and the choices.
ENTRIES = [
    ("v4", "layer_types", [["sliding_attention"]] * 4, 0,
     "('sliding_attention', 'compressed_sparse_attention', 'heavily_compressed_attention')"),
    ("v4", "layer_types", ["sliding_attention", {"kind": "csa"}, "sliding_attention", "sliding_attention"], 1,
     "('sliding_attention', 'compressed_sparse_attention', 'heavily_compressed_attention')"),
    ("v4", "mlp_layer_types", ["moe", "moe", ["hash_moe"], "moe"], 2, "('hash_moe', 'moe')"),
    ("v32", "layer_types", [["indexed_attention"], "indexed_attention"], 0,
     "('indexed_attention', 'deepseek_sparse_attention')"),
    ("v32", "layer_types", ["indexed_attention", ["indexed_attention"]], 1,
     "('indexed_attention', 'deepseek_sparse_attention')"),
]


@pytest.mark.parametrize(("model", "field", "value", "index", "allowed"), ENTRIES,
                         ids=[f"{m}-{f}-{i}" for m, f, _, i, _ in ENTRIES])
def test_list_entries_of_the_wrong_type_are_refused_by_index(folders, tmp_path, model, field, value, index, allowed):
    folder = _edited(folders, tmp_path, model, **{field: value})
    with pytest.raises(mf.ConfigError) as error:
        _load(folder)
    assert f"config field '{field}'[{index}] = " in str(error.value)
    assert f"expected one of {allowed}" in str(error.value)


@pytest.mark.parametrize(("model", "changes", "field"), [
    ("v4", {"layer_types": ["sliding_attention"] * 3}, "layer_types"),
    ("v4", {"layer_types": "sliding_attention"}, "layer_types"),
    ("v4", {"compress_rates": {"compressed_sparse_attention": [4], "heavily_compressed_attention": 16}}, CSA_RATE),
    ("v4", {"eos_token_id": [[1]]}, "eos_token_id"),
    ("v32", {"layer_types": ["indexed_attention"]}, "layer_types"),
    ("v32", {"eos_token_id": {"id": 1}}, "eos_token_id"),
])
def test_other_list_valued_fields_are_refused_by_name(folders, tmp_path, model, changes, field):
    folder = _edited(folders, tmp_path, model, **changes)
    with pytest.raises(mf.ConfigError, match=f"config field '{re.escape(field)}'"):
        _load(folder)


ACCEPTED = [
    ("v4", "routed_scaling_factor", 2.0),
    ("v4", "routed_scaling_factor", 1),
    ("v4", "num_experts_per_tok", 1),
    ("v4", "num_experts_per_tok", 4),
    ("v4", "hc_sinkhorn_iters", 1),
    ("v4", "hc_sinkhorn_iters", 1000),
    ("v4", "sliding_window", 1),
    ("v4", "sliding_window", 256),
    ("v4", "scoring_func", "sigmoid"),
    ("v32", "index_topk", 1),
    ("v32", "index_topk", 256),
]


def _hash_tables_of_width(k: int):
    """An edit giving V4's hash-routing tables (`tid2eid`, [vocab, num_experts_per_tok]) k expert ids a token."""

    def edit(tensors: dict[str, torch.Tensor]) -> None:
        for name in [n for n in tensors if n.endswith("gate.tid2eid")]:
            tensors[name] = torch.arange(tensors[name].shape[0] * k).view(-1, k) % 4

    return edit


@pytest.mark.parametrize(("model", "field", "value"), ACCEPTED, ids=[f"{m}-{f}-{v!r}" for m, f, v in ACCEPTED])
def test_in_range_values_load(folders, tmp_path, model, field, value):
    folder = _edited(folders, tmp_path, model, **{field: value})
    if field == "num_experts_per_tok":
        edit_tensors(folder, _hash_tables_of_width(value))
    config = _load(folder).config
    held = config.family_fields if model == "v4" and field in ("hc_sinkhorn_iters", "sliding_window") else config
    assert getattr(held, field) == value


def _v32_logits(model: mf.Model, tokens: list[int]) -> torch.Tensor:
    state = mf.init_state(model, num_blocks=8, block_size=16)
    plan = mf.StepPlan(prefill=(mf.SeqPlan(tuple(tokens), 0, (1, 2), len(tokens)),))
    batch, mode = mf.plan_step(model.config, state, plan)
    return mf.prefill(model.params, state, batch, mode)[0]


def _v4_logits(model: mf.Model, tokens: list[int]) -> torch.Tensor:
    state = new_state(model)
    plan = mf.StepPlan(prefill=(Seq(0, state.groups).plan(tokens, 0),))
    batch, mode = mf.plan_step(model.config, state, plan)
    return mf.prefill(model.params, state, batch, mode)[0]


@pytest.mark.parametrize(("model", "field", "covering"), [("v32", "index_topk", 24), ("v4", "sliding_window", 24)])
def test_values_past_max_position_embeddings_are_clamped_to_it(folders, tmp_path, model, field, covering):
    """10**12 once made the first step ask the allocator for 8 TB. Clamped to max_position_embeddings it
    selects every key of a 20-token prompt, as any value of at least 20 does: the same logits."""
    tokens = list(range(3, 23))
    huge = _load(_edited(folders, tmp_path / "huge", model, **{field: 10**12}))
    enough = _load(_edited(folders, tmp_path / "enough", model, **{field: covering}))
    config = huge.config.family_fields if model == "v4" else huge.config
    assert getattr(config, field) == huge.config.max_position_embeddings == 256
    logits = _v32_logits if model == "v32" else _v4_logits
    torch.testing.assert_close(logits(huge, tokens), logits(enough, tokens), rtol=1e-5, atol=1e-5)
    # A config built in Python is refused rather than changed.
    raw = json.loads((folders[model] / "config.json").read_text())
    base = mf.config_from_hf_dict(raw)
    bound = r"must be an integer in \[1, max_position_embeddings=256\]"
    with pytest.raises(mf.ConfigError, match=rf"'{field}' = 257: {bound}"):
        if model == "v4":
            dataclasses.replace(base, family_fields=dataclasses.replace(base.family_fields, sliding_window=257))
        else:
            dataclasses.replace(base, index_topk=257)
