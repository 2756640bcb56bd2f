"""The engine with FP8 caches on a DeepSeek-V3.2 model (latents and indexer keys): near the 16-bit caches'.

The model is the shipped demo's trained weights made a V3.2 checkpoint: its config.json names
deepseek_v32 with an indexer of 4 heads keeping 24 keys, whose weights are drawn at random (see
`demo_as_v32`). A model with random weights everywhere flips its routing, its key selection and its
greedy ties at the slightest change of its keys, which says nothing about the cache (see
tests/models/mla/test_mla_fp8_cache.py).

The indexer's keys are FP8 too (`FP8IndexCache`, one scale a key, as DeepSeek's own inference code keeps
them), so a row whose 24th and 25th best keys score within the keys' rounding (e4m3: 3% a value) may
select another key, and a greedy continuation that then takes another token goes on from a different
text. Measured on the CPU in float32 over five sets of six prompts of 20 to 40 tokens: logits rows
(teacher-forced, every prompt position) differ by a median 0.3% and a 90th percentile 0.7-0.8% of
their largest logit (the latent cache alone: 0.3% and 0.6-1.6%); the next token they pick agrees at
98.4-99.4% of positions; of ten greedy tokens, 24 of 30 continuations agree whole, the others part from
the 16-bit caches' after 1 to 7 tokens (agreement position by position 73-100%, 87% for the prompts below).
"""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

import mla_func as mf
import mla_func.demo
from support.fp8_cache_cases import ENGINE_SETTINGS, MAX_MEDIAN_ERROR, MAX_P90_ERROR, engine_agreement
from mla_func.kernels.index_cache import FP8IndexCache
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


def test_fp8_caches_keep_logits_and_most_greedy_tokens(model):
    """The indexer keeps 24 of up to 50 keys: the selection runs over the FP8 engine's own hidden states and
    FP8 keys. Bounds (see the module docstring): logits as the latent cache's alone, the teacher-forced next
    token at 97% of positions, greedy tokens position by position at 80%."""
    assert model.config.family.name == "dsa"
    rng = random.Random(11)
    prompts = [[rng.randrange(2, model.config.vocab_size) for _ in range(rng.randrange(20, 40))] for _ in range(6)]
    same, errors = engine_agreement(model, prompts)
    assert same >= 0.8
    assert errors.median() <= MAX_MEDIAN_ERROR and errors.quantile(0.9) <= MAX_P90_ERROR
    auto = mf.Engine(model, **ENGINE_SETTINGS)
    fp8 = mf.Engine(model, **ENGINE_SETTINGS, kv_cache_dtype="fp8")
    picks = torch.cat([auto.score(p).argmax(-1) == fp8.score(p).argmax(-1) for p in prompts])
    assert picks.float().mean() >= 0.97


def test_fp8_state_holds_fp8_indexer_keys(model):
    c = model.config
    state = mf.init_state(model, num_blocks=4, block_size=16, kv_cache_dtype="fp8")
    for layer in state.layers:
        assert isinstance(layer, mf.DSALayerCache) and isinstance(layer.kv, FP8LatentCache)
        assert isinstance(layer.index_k, FP8IndexCache)
        assert layer.kv.values.element_size() == 1 and layer.index_k.values.element_size() == 1
    # Latents: C values of a byte, a float32 scale, R float32 RoPE values; keys: Di bytes and a float32 scale.
    per_token = c.kv_lora_rank + 4 + 4 * c.qk_rope_head_dim + c.index_head_dim + 4
    assert state.bytes_per_block() == c.num_hidden_layers * 16 * per_token
    plain = mf.init_state(model, num_blocks=4, block_size=16)
    assert all(layer.index_k.dtype == model.dtype for layer in plain.layers)
