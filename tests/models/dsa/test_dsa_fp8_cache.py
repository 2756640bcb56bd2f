"""The engine with an FP8 latent cache on a DeepSeek-V3.2 model: the tokens and logits of the 16-bit cache's.

The model is the shipped demo's trained weights made a V3.2 checkpoint: its config.json names
deepseek_v32 with an indexer of 4 heads keeping 24 keys, whose weights are drawn at random (see
`demo_as_v32`). A model with random weights everywhere flips its routing, its key selection and its
greedy ties at the slightest change of its keys, which says nothing about the cache (see
tests/models/mla/test_mla_fp8_cache.py). The indexer's keys stay in the model's dtype, so each row
selects its keys from the same scores with either cache once its input is the same.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

import mla_func as mf
import mla_func.demo
from support.fp8_cache_cases import assert_fp8_engine_agrees
from mla_func.kernels.latent_cache import FP8LatentCache
from mla_func.models.registry import config_from_hf_dict
from mla_func.models.tensor_shapes import hf_tensor_shapes

INDEX_TOPK = 24


def demo_as_v32(path: Path, index_topk: int) -> mf.Model:
    """The demo checkpoint as a V3.2 one in `path`: its tensors, and random indexer tensors (projections
    drawn as N(0, 1 / fan_in), the key norm's weight 1 and bias 0)."""
    demo = Path(mla_func.demo.__file__).parent / "model"
    raw = json.loads((demo / "config.json").read_text())
    raw.update(model_type="deepseek_v32", architectures=["DeepseekV32ForCausalLM"], index_n_heads=4,
               index_head_dim=32, index_topk=index_topk)
    tensors = load_file(demo / "model.safetensors")
    gen = torch.Generator().manual_seed(0)
    for name, shape in hf_tensor_shapes(config_from_hf_dict(raw)).items():
        if name in tensors:
            continue
        if len(shape) > 1:
            tensors[name] = (torch.randn(shape, generator=gen) * shape[-1] ** -0.5).to(torch.bfloat16)
        else:
            tensors[name] = torch.full(shape, 1.0 if name.endswith("k_norm.weight") else 0.0, dtype=torch.bfloat16)
    save_file(tensors, str(path / "model.safetensors"))
    (path / "config.json").write_text(json.dumps(raw))
    return mf.load_model(path, dtype=torch.float32, device="cpu")


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return demo_as_v32(tmp_path_factory.mktemp("demo-v32"), INDEX_TOPK)


def test_fp8_cache_keeps_greedy_tokens_and_logits(model):
    """The indexer keeps 24 of up to 50 keys: the selection runs over the FP8 engine's own hidden states."""
    assert model.config.family.name == "dsa"
    assert_fp8_engine_agrees(model)


def test_fp8_state_keeps_indexer_keys_in_the_model_dtype(model):
    c = model.config
    state = mf.init_state(model, num_blocks=4, block_size=16, kv_cache_dtype="fp8")
    for layer in state.layers:
        assert isinstance(layer, mf.DSALayerCache) and isinstance(layer.kv, FP8LatentCache)
        assert layer.kv.values.element_size() == 1 and layer.index_k.dtype == model.dtype
    per_token = c.kv_lora_rank + 4 + 4 * c.qk_rope_head_dim + 4 * c.index_head_dim
    assert state.bytes_per_block() == c.num_hidden_layers * 16 * per_token
