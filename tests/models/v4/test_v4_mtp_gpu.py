"""V4's MTP drafter on the GPU, as users run it: the speculative engine on CUDA (Triton backend, CUDA graphs)
gives the greedy tokens of decoding without drafts, for a sliding, a CSA and an HCA MTP layer.

fp32 echo checkpoints (`support.v4_mtp`): decode and verify steps agree to rounding there, and the echo
drafter's confident tokens leave no near-ties, so equal tokens are the right check. The runs go through
verify steps of k + 1 tokens, mixed steps, chunked prefills and preemption (`check_drafted_run`), and the
verify and drafter steps replay graphs.
"""

from __future__ import annotations

import pytest
import torch

import mla_func as mf
from mla_func.models.mtp.layer import mtp_layer
from support.mtp_checkpoints import StepRecorder, check_drafted_run, drafting_engine, drafting_requests
from support.v4_mtp import v4_mtp_checkpoint

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

SLIDING, CSA, HCA = "sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention"
# The decoder layers without CSA, so that a CSA MTP layer is the only one (its own indexer and tables).
NO_CSA = dict(layer_types=[SLIDING, HCA, SLIDING, HCA])
SMALL_VOCAB = 8
NUM_BLOCKS = 14


@pytest.fixture(scope="module", params=[(SLIDING, {}), (CSA, NO_CSA), (HCA, {})], ids=["sliding", "csa", "hca"])
def echo_model(request, tmp_path_factory):
    kind, overrides = request.param
    path = tmp_path_factory.mktemp("v4-mtp-echo-gpu") / "float"
    v4_mtp_checkpoint(path, seed=17, vocab_size=SMALL_VOCAB, echo=True, mtp_layer_type=kind, **overrides)
    model = mf.load_model(path, mtp=True, dtype=torch.float32, device="cuda")
    assert mtp_layer(model.config).base.attention == kind
    return model


@pytest.mark.parametrize("k", [1, 2])
def test_greedy_tokens_with_graphs_equal_decoding_without_drafts(echo_model, k):
    prompts, params = drafting_requests(k, SMALL_VOCAB)
    want = drafting_engine(echo_model, 0, graphs=False).generate(prompts, params)
    engine = drafting_engine(echo_model, k, num_blocks=NUM_BLOCKS)   # tight: preemption by recompute
    assert engine.step.backend == "triton"
    seen = StepRecorder(engine)
    got = engine.generate(prompts, params)
    check_drafted_run(engine, seen, got, want, k)
    assert any(key[4] == k + 1 for key in engine.step.captured_keys), "no verify step replayed a graph"
