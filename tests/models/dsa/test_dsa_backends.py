"""A DeepSeek-V3.2 model on the Triton op table (the interpreter on CPU) against the torch reference.

Every op the sparse layer calls is a Triton kernel here: the DSA group (indexer keys and
scores, top-k, sparse MLA), and the dense and MLA ops around it (norms, projections, the
half-split indexer rope, the latent write and absorption), fed by this layer's own shapes.
"""

from __future__ import annotations

import pytest
import torch

import mla_func as mf
from support.dsa_reference import make_v32
from support.mla_reference import rel_err

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# Power-of-two head dims of at least 16, as the Triton kernels want.
SHAPES = dict(qk_nope_head_dim=16, qk_rope_head_dim=16, v_head_dim=16, kv_lora_rank=32, index_head_dim=32,
              hidden_size=64, q_lora_rank=32)


def run(model, backend, prompt, next_tokens):
    state = mf.init_state(model, num_blocks=16, block_size=16)
    table = (1, 2)
    plans = [mf.StepPlan(prefill=(mf.SeqPlan(tuple(prompt), 0, table, len(prompt)),))]
    plans += [mf.StepPlan(decode=(mf.SeqPlan((t,), len(prompt) + i, table),)) for i, t in enumerate(next_tokens)]
    rows = []
    for plan in plans:
        batch, mode = mf.plan_step(model.config, state, plan, backend=backend)
        logits, state = mf.forward(model.params, state, batch, mode)
        rows.append(logits[: mode.num_logits])
    return torch.cat(rows)


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    path = tmp_path_factory.mktemp("v32-triton")
    make_v32("v32", seed=4, **SHAPES).save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def model(folder):
    return mf.load_model(folder, dtype=torch.float32, device=DEVICE)


def test_triton_table_equals_reference(model):
    triton_dsa = mf.kernels.ops_for("triton").dsa
    # The sparse decode behind the op that applies an FP8 W_UV after it (`fp8_heads`).
    assert all(op.__module__.startswith("mla_func.kernels.triton.dsa_")
               for op in (triton_dsa.write_index_key, triton_dsa.index_scores, triton_dsa.top_k_indices,
                          triton_dsa.sparse_mla_decode.dense))
    prompt, next_tokens = [(7 * i + 3) % 97 for i in range(19)], [5, 61, 30]
    got = run(model, "triton", prompt, next_tokens)
    want = run(model, "torch", prompt, next_tokens)
    assert got.shape == want.shape == (22, 97)
    assert rel_err(got, want) <= 1e-4


def test_bfloat16_runs_on_the_triton_table(folder, model):
    """In bf16 the indexer's head weights stay float32 (their input widened, one dtype per linear)."""
    bf16 = mf.load_model(folder, dtype=torch.bfloat16, device=DEVICE)
    assert bf16.params.layers[0].indexer.weights_proj.dtype == torch.float32
    prompt = [(5 * i + 1) % 97 for i in range(12)]
    got = run(bf16, "triton", prompt, [9])
    want = run(model, "torch", prompt, [9])
    assert rel_err(got, want) <= 5e-2
