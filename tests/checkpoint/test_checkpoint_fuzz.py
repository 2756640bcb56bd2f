"""Fuzzing the loader with hostile checkpoints (hypothesis).

A valid tiny checkpoint written by transformers' `save_pretrained` (one file, and
sharded with an index) is mutated: random JSON values in config.json fields,
random index entries (names that leave the folder included), corrupted
safetensors headers (random bytes, wrong sizes, huge header sizes, bad dtypes,
shapes and offsets), and odd folder entries (FIFOs, directories, symlinks out).
Every load must either succeed or raise CheckpointError / ConfigError, within a
time limit, without opening any file outside the folder.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import tempfile
import warnings
from pathlib import Path

import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

import mla_func as mf
from support.checkpoint_edits import outside, recording_opens, time_limit
from support.mla_reference import make_reference, save_reference

FUZZ = settings(max_examples=100, deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow])
INDEX = "model.safetensors.index.json"

json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.sampled_from([0, 1, -1, 2, 10**12, 10**400])
    | st.floats(allow_nan=True, allow_infinity=True) | st.text(max_size=12),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=8,
)


@pytest.fixture(scope="module")
def originals(tmp_path_factory):
    """(single-file checkpoint, sharded checkpoint, a folder of files outside both)."""
    root = tmp_path_factory.mktemp("fuzz")
    reference = make_reference("v2-group-yarn", seed=3)
    single = save_reference(reference, root / "single")
    reference.save_pretrained(root / "sharded", max_shard_size="40KB")
    elsewhere = root / "elsewhere"
    elsewhere.mkdir()
    shutil.copy(single / "model.safetensors", elsewhere / "model.safetensors")
    (elsewhere / "secret.json").write_text('{"weight_map": {}}')
    return single, root / "sharded", elsewhere


def load_or_refuse(folder: Path) -> str:
    """'loaded' or 'refused'; any other exception, a hang or a file opened outside `folder` fails."""
    model = None
    with warnings.catch_warnings(), time_limit(15), recording_opens() as opened:
        warnings.simplefilter("ignore")  # unknown config fields warn by design
        try:
            model = mf.load_model(folder, device="cpu")
        except (mf.CheckpointError, mf.ConfigError):
            pass  # a refusal is an allowed outcome; any other exception fails the test
    assert outside(opened, folder) == [], f"opened outside {folder}"
    if model is not None:  # what loads must be usable: finite RoPE tables and softmax scale
        assert model.params.rope_cos.isfinite().all() and model.params.rope_sin.isfinite().all()
        assert math.isfinite(model.config.softmax_scale) and model.config.softmax_scale > 0
    outcome = "refused" if model is None else "loaded"
    event(outcome)
    return outcome


def mutated(original: Path, mutate) -> str:
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp) / "ckpt"
        shutil.copytree(original, folder, symlinks=True)
        mutate(folder)
        return load_or_refuse(folder)


config_edits = st.lists(
    st.tuples(
        st.sampled_from([
            "vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
            "kv_lora_rank", "q_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim", "intermediate_size",
            "moe_intermediate_size", "n_routed_experts", "num_experts_per_tok", "n_shared_experts", "n_group",
            "topk_group", "topk_method", "scoring_func", "first_k_dense_replace", "moe_layer_freq",
            "routed_scaling_factor", "norm_topk_prob", "rms_norm_eps", "rope_theta", "rope_parameters",
            "rope_scaling", "rope_interleave", "max_position_embeddings", "tie_word_embeddings", "eos_token_id",
            "model_type", "hidden_act", "quantization_config", "sliding_window", "rope_parameters.factor",
            "rope_parameters.rope_theta", "rope_parameters.beta_fast", "rope_parameters.mscale",
            "rope_parameters.original_max_position_embeddings", "rope_parameters.rope_type",
        ]),
        st.one_of(st.just("<delete>"), json_values),
    ),
    min_size=1, max_size=3,
)


@FUZZ
@given(edits=config_edits, whole=st.none() | st.binary(max_size=64))
def test_fuzzed_config_json(originals, edits, whole):
    def mutate(folder: Path) -> None:
        path = folder / "config.json"
        if whole is not None:
            path.write_bytes(whole)
            return
        config = json.loads(path.read_text())
        for name, value in edits:
            target, key = config, name
            if name.startswith("rope_parameters."):
                target, key = config.get("rope_parameters"), name.split(".", 1)[1]
                if not isinstance(target, dict):
                    continue  # an earlier edit removed or replaced the whole rope_parameters
            if value == "<delete>":
                target.pop(key, None)
            else:
                target[key] = value
        path.write_text(json.dumps(config))

    mutated(originals[0], mutate)


file_names = st.one_of(
    st.sampled_from([
        "model-00001-of-00006.safetensors", "model-00002-of-00006.safetensors", "../single/model.safetensors",
        "../elsewhere/model.safetensors", "/etc/passwd", "config.json", "", ".", "..", "nothing.safetensors",
        "sub/model.safetensors", "a\0b.safetensors",
    ]),
    st.text(max_size=20),
    json_values,
)


@FUZZ
@given(
    entries=st.lists(st.tuples(st.text(max_size=40) | st.sampled_from(["model.norm.weight", "lm_head.weight"]), file_names),
                     max_size=4),
    absolute=st.booleans(),
    whole=st.none() | json_values | st.binary(max_size=48),
)
def test_fuzzed_index(originals, entries, absolute, whole):
    _, sharded, elsewhere = originals

    def mutate(folder: Path) -> None:
        path = folder / INDEX
        if isinstance(whole, bytes):
            path.write_bytes(whole)
            return
        index = json.loads(path.read_text()) if whole is None else whole
        weight_map = index.get("weight_map") if isinstance(index, dict) else None
        if isinstance(weight_map, dict):
            for name, file in entries:
                weight_map[name] = str(elsewhere / "model.safetensors") if absolute and file == "/etc/passwd" else file
        path.write_text(json.dumps(index))

    mutated(sharded, mutate)


def header_edit(draw_entry: dict, field: str, value: object) -> None:
    if field == "<delete>":
        draw_entry.clear()
    else:
        draw_entry[field] = value


header_values = st.one_of(
    json_values,
    st.sampled_from(["F32", "F16", "BF16", "F64", "I8", "U8", "BOOL", "F8_E4M3", "F8_E5M2", "I64", "C64", "F4", "X"]),
    st.lists(st.integers(-5, 2**66), max_size=3),
)


@FUZZ
@given(
    kind=st.sampled_from(["random", "header_size", "truncate", "flip", "entry"]),
    data=st.binary(max_size=64),
    number=st.integers(0, 2**64 - 1),
    edits=st.lists(st.tuples(st.integers(0, 1000), st.sampled_from(["dtype", "shape", "data_offsets", "<delete>"]),
                             header_values), min_size=1, max_size=3),
)
def test_fuzzed_safetensors_header(originals, kind, data, number, edits):
    def mutate(folder: Path) -> None:
        path = folder / "model.safetensors"
        raw = path.read_bytes()
        n = int.from_bytes(raw[:8], "little")
        if kind == "random":
            raw = data
        elif kind == "header_size":
            raw = number.to_bytes(8, "little") + raw[8:]
        elif kind == "truncate":
            raw = raw[: number % len(raw)]
        elif kind == "flip":
            for i, byte in enumerate(data[:8]):
                at = 8 + (number >> (i * 7)) % n
                raw = raw[:at] + bytes([byte]) + raw[at + 1:]
        else:
            header = json.loads(raw[8:8 + n])
            names = sorted(k for k in header if k != "__metadata__")
            for at, field, value in edits:
                header_edit(header[names[at % len(names)]], field, value)
            text = json.dumps(header, separators=(",", ":")).encode()
            raw = len(text).to_bytes(8, "little") + text + raw[8 + n:]
        path.write_bytes(raw)

    mutated(originals[0], mutate)


@FUZZ
@given(
    name=st.sampled_from(["model.safetensors", "extra.safetensors", "config.json"]),
    entry=st.sampled_from(["fifo", "directory", "link-out", "link-fifo", "link-dangling", "link-loop"]),
)
def test_fuzzed_folder_entries(originals, name, entry):
    single, _, elsewhere = originals

    def mutate(folder: Path) -> None:
        path = folder / name
        if path.exists():
            path.unlink()
        if entry == "fifo":
            os.mkfifo(path)
        elif entry == "directory":
            path.mkdir()
        elif entry == "link-out":
            path.symlink_to(elsewhere / ("secret.json" if name == "config.json" else "model.safetensors"))
        elif entry == "link-fifo":
            os.mkfifo(folder / "pipe")
            path.symlink_to("pipe")
        elif entry == "link-dangling":
            path.symlink_to("missing")
        else:
            path.symlink_to(name)

    assert mutated(single, mutate) == "refused"
