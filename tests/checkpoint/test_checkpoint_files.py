"""Hostile checkpoint folders: names that leave the folder, FIFOs, symlinks, bad headers, bad shards.

Each load runs under a time limit (a hang fails the test instead of stalling it)
and records the files it opens: none may lie outside the folder.
"""

from __future__ import annotations

import json
import os
import shutil

import pytest
import torch
from safetensors.torch import load_file

import mla_func as mf
from support.checkpoint_edits import edit_tensors, outside, recording_opens, time_limit
from support.mla_reference import make_reference, reference_logits, rel_err, save_reference
from support.hand_plans import logits_of

INDEX = "model.safetensors.index.json"


@pytest.fixture(scope="module")
def reference():
    return make_reference("v3-qlora-noaux", seed=11)


@pytest.fixture()
def checkpoint(reference, tmp_path):
    return save_reference(reference, tmp_path / "ckpt")


@pytest.fixture()
def sharded(reference, tmp_path):
    reference.save_pretrained(tmp_path / "sharded", max_shard_size="40KB")
    return tmp_path / "sharded"


def load(path, **kwargs):
    """load_model within 20 s, asserting every opened file lies inside `path`."""
    with time_limit(20), recording_opens() as opened:
        try:
            return mf.load_model(path, device="cpu", **kwargs)
        finally:
            assert outside(opened, path) == []


def write_index(path, weight_map):
    (path / INDEX).write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))


def weight_map_of(path):
    return json.loads((path / INDEX).read_text())["weight_map"]


@pytest.mark.parametrize("escape", ["../outside/model.safetensors", "OUTSIDE_ABSOLUTE", "sub/../../outside/model.safetensors"])
def test_index_names_cannot_leave_the_folder(reference, tmp_path, escape):
    folder = save_reference(reference, tmp_path / "ckpt")
    (tmp_path / "outside").mkdir()
    shutil.copy(folder / "model.safetensors", tmp_path / "outside" / "model.safetensors")
    (folder / "model.safetensors").unlink()
    name = str(tmp_path / "outside" / "model.safetensors") if escape == "OUTSIDE_ABSOLUTE" else escape
    write_index(folder, {k: name for k in load_file(tmp_path / "outside" / "model.safetensors")})
    with pytest.raises(mf.CheckpointError, match=rf"{INDEX}: weight_map\[.*\]: file name .* is not a plain file name"):
        load(folder)


def test_index_naming_etc_passwd_opens_nothing(checkpoint):
    write_index(checkpoint, {"model.embed_tokens.weight": "/etc/passwd"})
    with pytest.raises(mf.CheckpointError, match=r"weight_map\['model.embed_tokens.weight'\] = '/etc/passwd'"):
        load(checkpoint)


@pytest.mark.parametrize("victim", ["model.safetensors", "config.json"])
def test_a_fifo_is_refused_without_hanging(checkpoint, victim):
    (checkpoint / victim).unlink()
    os.mkfifo(checkpoint / victim)
    with pytest.raises(mf.CheckpointError, match=rf"{victim}: a FIFO, not a regular file"):
        load(checkpoint)


def test_a_fifo_named_by_the_index_or_linked_to_is_refused(sharded, tmp_path):
    shard = sorted(set(weight_map_of(sharded).values()))[2]
    (sharded / shard).unlink()
    os.mkfifo(sharded / "pipe")
    (sharded / shard).symlink_to("pipe")
    with pytest.raises(mf.CheckpointError, match=rf"{shard} \(-> .*pipe\): a FIFO"):
        load(sharded)


def test_a_directory_named_like_a_shard_is_refused(checkpoint):
    (checkpoint / "extra.safetensors").mkdir()
    with pytest.raises(mf.CheckpointError, match="extra.safetensors: a directory, not a regular file"):
        load(checkpoint)


def test_hub_cache_symlinks_into_blobs_load(reference, tmp_path):
    """The Hugging Face hub cache: snapshots/<rev>/<file> are symlinks to ../../blobs/<hash>."""
    plain = save_reference(reference, tmp_path / "plain")
    repo = tmp_path / "models--org--tiny"
    blobs, snapshot = repo / "blobs", repo / "snapshots" / "0123abcd"
    blobs.mkdir(parents=True)
    snapshot.mkdir(parents=True)
    for i, file in enumerate(sorted(plain.iterdir())):
        shutil.copy(file, blobs / f"blob{i}")
        (snapshot / file.name).symlink_to(f"../../blobs/blob{i}")
    with time_limit(20), recording_opens() as opened:
        model = mf.load_model(snapshot, device="cpu")
    assert outside(opened, repo) == [] and any("blobs" in p for p in opened)
    tokens = [2, 7, 1, 8, 2, 8]
    assert torch.equal(logits_of(model, tokens), logits_of(load(plain), tokens))


def test_symlinks_inside_the_folder_load(reference, checkpoint):
    (checkpoint / "weights").mkdir()
    (checkpoint / "model.safetensors").rename(checkpoint / "weights" / "real.safetensors")
    (checkpoint / "model.safetensors").symlink_to("weights/real.safetensors")
    tokens = [3, 1, 4]
    assert rel_err(logits_of(load(checkpoint), tokens), reference_logits(reference, tokens)) <= 1e-4


@pytest.mark.parametrize("hub_like", [False, True])
def test_symlinks_out_of_the_folder_are_refused(reference, tmp_path, hub_like):
    """Outside the folder is refused even next to a hub layout, unless it is the repository's blobs folder."""
    folder = tmp_path / ("repo/snapshots/rev" if hub_like else "ckpt")
    save_reference(reference, folder)
    (tmp_path / "elsewhere").mkdir()
    (folder / "model.safetensors").rename(tmp_path / "elsewhere" / "model.safetensors")
    (folder / "model.safetensors").symlink_to(tmp_path / "elsewhere" / "model.safetensors")
    with pytest.raises(mf.CheckpointError, match=r"model.safetensors is a symlink to .*elsewhere.*outside the checkpoint folder"):
        load(folder)


def test_dangling_and_looping_symlinks_are_refused(checkpoint):
    (checkpoint / "a.safetensors").symlink_to("nothing-there")
    with pytest.raises(mf.CheckpointError, match="a.safetensors: no such file"):
        load(checkpoint)
    (checkpoint / "a.safetensors").unlink()
    (checkpoint / "b.safetensors").symlink_to("c.safetensors")
    (checkpoint / "c.safetensors").symlink_to("b.safetensors")
    with pytest.raises(mf.CheckpointError, match="b.safetensors: cannot resolve"):
        load(checkpoint)


def test_a_tensor_in_two_shards_is_refused_naming_both(sharded):
    files = sorted(set(weight_map_of(sharded).values()))
    edit_tensors(sharded, lambda t: t.update({"model.norm.weight": torch.ones(32)}), file=files[0])
    holder = weight_map_of(sharded)["model.norm.weight"]
    first, second = sorted([files[0], holder])
    with pytest.raises(mf.CheckpointError, match=rf"'model.norm.weight' is in two shards, {first} and {second}"):
        load(sharded)


def test_an_index_that_disagrees_with_the_shards_is_refused(sharded):
    weight_map = weight_map_of(sharded)
    files = sorted(set(weight_map.values()))
    wrong = next(f for f in files if f != weight_map["model.norm.weight"])
    write_index(sharded, weight_map | {"model.norm.weight": wrong})
    with pytest.raises(mf.CheckpointError, match=rf"weight_map\['model.norm.weight'\] = '{wrong}', but the tensor is in"):
        load(sharded)
    write_index(sharded, weight_map | {"model.ghost.weight": files[0]})
    with pytest.raises(mf.CheckpointError, match=rf"weight_map\['model.ghost.weight'\] = '{files[0]}', which does not hold it"):
        load(sharded)


@pytest.mark.parametrize(
    "index, message",
    [
        ("{not json", "not valid JSON"),
        ("[1, 2]", "field 'weight_map' must be a non-empty object"),
        ('{"weight_map": []}', "field 'weight_map' must be a non-empty object"),
        ('{"weight_map": {"model.norm.weight": 7}}', r"weight_map\['model.norm.weight'\] = 7: expected a \*.safetensors"),
        ('{"weight_map": {"model.norm.weight": "gone.safetensors"}}', "gone.safetensors: no such file"),
    ],
)
def test_malformed_index_names_the_file_and_field(sharded, index, message):
    (sharded / INDEX).write_text(index)
    with pytest.raises(mf.CheckpointError, match=rf"{INDEX}.*{message}"):
        load(sharded)


def corrupt(path, data: bytes):
    (path / "model.safetensors").write_bytes(data)


@pytest.mark.parametrize(
    "make, message",
    [
        (lambda raw: raw[:5], "too short for a safetensors header"),
        (lambda raw: (10**12).to_bytes(8, "little") + raw[8:], "header size 1000000000000 exceeds the file"),
        (lambda raw: raw[:8] + b"\xff" * 16 + raw[24:], "header is not UTF-8"),
        (lambda raw: raw[:8] + b"[" + raw[9:], "header is not valid JSON"),
        (lambda raw: raw[:-7], "fall outside the .* data bytes of the file"),
    ],
)
def test_safetensors_header_errors_name_the_file(checkpoint, make, message):
    corrupt(checkpoint, make((checkpoint / "model.safetensors").read_bytes()))
    with pytest.raises(mf.CheckpointError, match=rf"model.safetensors: .*{message}"):
        load(checkpoint)


def rewrite_header(path, edit):
    raw = (path / "model.safetensors").read_bytes()
    n = int.from_bytes(raw[:8], "little")
    header = json.loads(raw[8:8 + n])
    edit(header)
    text = json.dumps(header, separators=(",", ":")).encode().ljust(n)
    assert len(text) == n
    corrupt(path, raw[:8] + text + raw[8 + n:])


def test_overlapping_tensors_are_refused(checkpoint):
    def overlap(h):
        h["model.norm.weight"]["data_offsets"] = h["model.embed_tokens.weight"]["data_offsets"][:1] * 2
        h["model.norm.weight"]["data_offsets"][1] += 128

    rewrite_header(checkpoint, overlap)
    with pytest.raises(mf.CheckpointError, match="model.safetensors: tensors .* overlap"):
        load(checkpoint)


def test_wrong_byte_length_is_refused(checkpoint):
    rewrite_header(checkpoint, lambda h: h["model.norm.weight"].update(shape=[33]))
    with pytest.raises(mf.CheckpointError, match=r"'model.norm.weight': F32 \[33\] needs 132 bytes, data_offsets give 128"):
        load(checkpoint)
