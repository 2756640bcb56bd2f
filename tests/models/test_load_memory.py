"""What load_model refuses before it allocates: too little memory, bad arguments, an MTP layer that is not there.

The memory check compares `memory.params_bytes` (which must be what loading then holds, to
the byte) with `memory.available_bytes` of the device; the tests replace the reader where
the outcome must not depend on this machine's memory.
"""

from __future__ import annotations

import shutil
import time
from pathlib import Path

import pytest
import torch

import mla_func as mf
import mla_func.models.memory as memory
from support.checkpoint_edits import edit_tensors
from support.dsa_reference import make_v32
from mla_func.models.mtp.params import NO_MTP_LAYER
from mla_func.models.presets import PRESETS
from mla_func.pytree import tree_leaves

GIB = 1 << 30
CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def v32_folder(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("memory") / "v32"
    make_v32(seed=2).save_pretrained(path)
    return path


def _held_bytes(model: mf.Model) -> int:
    """Bytes of every distinct storage the model's params (and drafter) hold."""
    storages = {}
    for leaf in tree_leaves((model.params, model.mtp)):
        if isinstance(leaf, torch.Tensor):
            storage = leaf.untyped_storage()
            storages[storage.data_ptr()] = storage.nbytes()
    return sum(storages.values())


def test_the_pure_check_refuses_only_what_does_not_fit():
    memory.check_fits(10 * GIB, 10 * GIB, model="m", dtype=torch.float32, device=CPU)
    memory.check_fits(10 * GIB, None, model="m", dtype=torch.float32, device=CPU)  # unknown: not refused
    with pytest.raises(mf.NotEnoughMemory) as error:
        memory.check_fits(int(63.4 * GIB), 24 * GIB, model="preset 'big'", dtype=torch.float32, device=CPU)
    message = str(error.value)
    assert message.startswith("not enough memory to load preset 'big': its params need 63.4 GiB in float32, "
                              "but cpu has 24.0 GiB available")
    assert "smaller dtype (bfloat16" in message and "smaller preset" in message
    with pytest.raises(mf.NotEnoughMemory, match="choose a smaller preset or model, or a device with more memory"):
        memory.check_fits(10 * GIB + 1, 10 * GIB, model="m", dtype=torch.bfloat16, device=CPU)
    assert issubclass(mf.NotEnoughMemory, ValueError) and "NotEnoughMemory" in mf.__all__


@pytest.mark.parametrize(("name", "kwargs"), [
    ("tiny", {}),
    ("tiny", {"mtp": True, "dtype": torch.bfloat16}),
    ("tiny", {"max_model_len": 100}),
    ("v4-tiny", {}),
    ("v4-tiny", {"dtype": torch.float16}),
    ("v4-tiny", {"mtp": True}),
])
def test_the_computed_need_is_what_a_preset_holds(name, kwargs):
    model = mf.load_model(name, device="cpu", **kwargs)
    need = memory.params_bytes(model.config, model.dtype, mtp=kwargs.get("mtp", False),
                               max_model_len=kwargs.get("max_model_len"))
    assert need == _held_bytes(model)


def test_the_computed_need_is_what_a_checkpoint_holds(v32_folder):
    for dtype in (torch.float32, torch.bfloat16):
        model = mf.load_model(v32_folder, device="cpu", dtype=dtype, max_model_len=64)
        assert memory.params_bytes(model.config, dtype, max_model_len=64) == _held_bytes(model)


def test_a_preset_too_large_is_refused_before_loading(monkeypatch):
    """v32-lite in float32 needs about 60 GiB: on a 24 GiB machine it is refused at once, naming both sizes."""
    monkeypatch.setattr(memory, "available_bytes", lambda device: 24 * GIB)
    need = memory.params_bytes(PRESETS["v32-lite"](), torch.float32)
    assert need > 50 * GIB
    started = time.perf_counter()
    with pytest.raises(mf.NotEnoughMemory) as error:
        mf.load_model("v32-lite", device="cpu", dtype=torch.float32)
    assert time.perf_counter() - started < 5
    message = str(error.value)
    assert "preset 'v32-lite'" in message and f"need {need / GIB:.1f} GiB in float32" in message
    assert "cpu has 24.0 GiB available" in message


def test_this_machine_refuses_what_it_cannot_hold():
    """The same check with this machine's own reading: refused when the need is past it (a large machine skips)."""
    need, available = memory.params_bytes(PRESETS["v32-lite"](), torch.float32), memory.available_bytes(CPU)
    assert isinstance(available, int) and available > 0
    if need <= available:
        pytest.skip(f"this machine has {available / GIB:.1f} GiB available: v32-lite would load")
    started = time.perf_counter()
    with pytest.raises(mf.NotEnoughMemory, match=rf"need {need / GIB:.1f} GiB .* GiB available"):
        mf.load_model("v32-lite", device="cpu", dtype=torch.float32)
    assert time.perf_counter() - started < 5


def test_a_model_that_fits_loads_to_the_byte(monkeypatch, v32_folder):
    assert mf.load_model("tiny", device="cpu").config.model_type == "deepseek_v3"   # this machine's own reading
    config = mf.read_config(v32_folder / "config.json")
    need = memory.params_bytes(config, torch.float32, max_model_len=64)
    monkeypatch.setattr(memory, "available_bytes", lambda device: need)
    mf.load_model(v32_folder, device="cpu", max_model_len=64)
    monkeypatch.setattr(memory, "available_bytes", lambda device: need - 1)
    with pytest.raises(mf.NotEnoughMemory, match=f"to load {v32_folder}: "):
        mf.load_model(v32_folder, device="cpu", max_model_len=64)


def test_available_bytes_reads_meminfo_else_the_page_counts(monkeypatch, tmp_path):
    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemTotal:       32768 kB\nMemFree:         1024 kB\nMemAvailable:    2048 kB\n")
    monkeypatch.setattr(memory, "_MEMINFO", meminfo)
    assert memory.available_bytes(CPU) == 2048 * 1024
    monkeypatch.setattr(memory, "_MEMINFO", tmp_path / "absent")
    fallback = memory.available_bytes(CPU)
    assert isinstance(fallback, int) and fallback > 0
    assert memory.available_bytes(torch.device("meta")) is None


@pytest.mark.parametrize(("argument", "value", "message"), [
    ("mtp", "no", "load_model: mtp must be a bool, got 'no'"),
    ("mtp", 1, "load_model: mtp must be a bool, got 1"),
    ("mtp", None, "load_model: mtp must be a bool, got None"),
    ("progress", "yes", "load_model: progress must be a bool or None, got 'yes'"),
    ("progress", 0, "load_model: progress must be a bool or None, got 0"),
])
def test_bool_arguments_must_be_bools(argument, value, message):
    with pytest.raises(ValueError) as error:
        mf.load_model("tiny", device="cpu", **{argument: value})
    assert str(error.value) == message


def test_a_checkpoint_without_an_mtp_layer_says_so(v32_folder, tmp_path):
    with pytest.raises(mf.CheckpointError) as error:
        mf.load_model(v32_folder, device="cpu", mtp=True)
    message = str(error.value)
    assert f"{v32_folder}: {NO_MTP_LAYER} (no tensor named model.layers.2.*)" in message
    assert NO_MTP_LAYER == "the checkpoint has no multi-token-prediction (MTP) layer"
    assert "speculative decoding (load_model(..., mtp=True))" in message and "missing tensors" not in message

    partial = tmp_path / "partial"
    shutil.copytree(v32_folder, partial)
    edit_tensors(partial, lambda t: t.__setitem__("model.layers.2.enorm.weight", torch.ones(32)))
    with pytest.raises(mf.CheckpointError, match=r"missing tensors: \['model\.layers\.2\.eh_proj\.weight'"):
        mf.load_model(partial, device="cpu", mtp=True)


@pytest.mark.gpu
def test_on_the_gpu_a_model_over_its_free_memory_is_refused_up_front():
    device = torch.device("cuda")
    free = torch.cuda.mem_get_info(device)[0]
    assert memory.available_bytes(device) == free
    config = PRESETS["v32-lite"]()
    # float64 v32-lite: about 120 GiB, over an H100's 80 GB (an H200's 141 GB could hold it).
    needed = memory.params_bytes(config, torch.float64)
    if needed <= free:
        pytest.skip(f"this GPU has {free / GIB:.0f} GiB free, enough for {needed / GIB:.0f} GiB")
    allocated, started = torch.cuda.memory_allocated(device), time.perf_counter()
    with pytest.raises(mf.NotEnoughMemory, match=r"v32-lite.*GiB in float64, but cuda(:\d+)? has"):
        mf.load_model("v32-lite", dtype=torch.float64, device="cuda")
    assert time.perf_counter() - started < 5
    assert torch.cuda.memory_allocated(device) == allocated   # refused before a byte was allocated
