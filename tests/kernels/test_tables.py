"""The Triton and AITER op tables."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from mla_func.kernels import ops_for


def _ops_of(table):
    # The collectives are no backend's kernels: every table holds the one-process identities until
    # `with_collectives` binds it to a group (test_every_table_runs_one_process).
    groups = [getattr(table, f.name) for f in dataclasses.fields(table)
              if dataclasses.is_dataclass(getattr(table, f.name)) and f.name != "collectives"]
    return {f.name: getattr(group, f.name) for group in groups for f in dataclasses.fields(group)}


# Ops the Triton table runs as their reference (none: every op has a kernel).
REFERENCE_ON_TRITON: frozenset[str] = frozenset()


def test_triton_table_names_every_op():
    table = ops_for("triton")
    assert table.backend == "triton"
    reference = _ops_of(ops_for("torch"))
    for name, op in _ops_of(table).items():
        assert op is not None
        if name in REFERENCE_ON_TRITON:
            assert op is reference[name], f"triton has a kernel of {name}: take it off REFERENCE_ON_TRITON"
        else:
            assert op is not reference[name], f"triton runs the reference {name}"
    assert table.dense.rope.__module__.endswith("triton.rope")
    # The decode kernel, behind the op that applies an FP8 W_UV after it (`fp8_heads`).
    assert table.mla.mla_decode.dense.__module__.endswith("triton.decode")


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_batch_invariant_tables_replace_what_follows_the_batch(backend):
    plain, invariant = ops_for(backend), ops_for(backend, batch_invariant=True)
    assert invariant.batch_invariant and not plain.batch_invariant and invariant.backend == backend
    changed = {name for name, op in _ops_of(invariant).items() if op is not _ops_of(plain)[name]}
    # DeepSeek-V4's (`v4_invariant`); the reference's compressor pools its completing rows on row tiles.
    v4 = {"index_scores", "window_entry_attention", "hc_site", "hc_write_back", "hc_write_back_site", "hc_head",
          "clamped_experts"} | ({"compress_entries"} if backend == "torch" else set())
    assert changed == {"linear", "logits", "rms_norm_linear", "write_latent_absorb", "absorb_query", "mla_decode",
                       "route", "fused_moe", "sparse_mla_decode"} | v4
    with pytest.raises(ValueError, match="aiter"):
        ops_for("aiter", batch_invariant=True)


def test_tables_derive_from_the_reference_by_group():
    torch_ops = ops_for("torch")
    assert torch_ops.backend == "torch"
    assert len(_ops_of(torch_ops)) == 30
    assert all(op.__module__.startswith("mla_func.kernels.reference.") for op in _ops_of(torch_ops).values())


@pytest.mark.parametrize("batch_invariant", [False, True])
def test_every_table_runs_one_process(batch_invariant):
    from mla_func.kernels import SINGLE_PROCESS

    for backend in ("torch", "triton"):
        assert ops_for(backend, batch_invariant=batch_invariant).collectives is SINGLE_PROCESS
    x = torch.randn(3, 4)
    assert SINGLE_PROCESS.all_reduce(x) is x and SINGLE_PROCESS.all_gather(x, dim=1) is x


def test_recorded_route_is_the_table_route_plus_a_record():
    from mla_func.kernels import record_expert_choice

    recording, chosen = record_expert_choice(ops_for("torch"))
    assert recording.dense is ops_for("torch").dense and recording.mla is ops_for("torch").mla
    x = torch.randn(5, 8)
    gate = torch.randn(6, 8)
    valid = torch.tensor([True, True, True, False, True])
    kwargs = dict(top_k=2, scoring_func="softmax", topk_method="greedy", n_group=None, topk_group=None,
                  norm_topk_prob=True, routed_scaling_factor=1.0, num_shared=1)
    weights, ids = recording.moe.route(x, gate, None, valid, **kwargs)
    expected_weights, expected_ids = ops_for("torch").moe.route(x, gate, None, valid, **kwargs)
    assert torch.equal(ids, expected_ids) and torch.equal(weights, expected_weights)
    assert len(chosen) == 1 and torch.equal(chosen[0], expected_ids[:, :2])


def test_aiter_table_fails_loudly_without_aiter():
    try:
        import aiter  # noqa: F401
    except ImportError:
        from mla_func.kernels import aiter as aiter_kernels

        with pytest.raises(RuntimeError, match="aiter"):
            aiter_kernels.ops()
    else:
        pytest.skip("aiter is installed; covered by test_aiter.py")


def test_aiter_page_list_matches_block_table(device):
    from mla_func.kernels.aiter import token_page_list

    table = torch.tensor([[3, 1, 4], [2, 0, 5]], dtype=torch.int32, device=device)
    lens = torch.tensor([6, 0], dtype=torch.int32, device=device)
    indptr, indices = token_page_list(table, lens, 4)
    assert indptr.tolist() == [0, 6, 6]
    assert indices[:6].tolist() == [12, 13, 14, 15, 4, 5]


def test_aiter_decode_of_several_queries_is_the_reference(device):
    # AITER's kernel serves one query a sequence; q_len > 1 is named to run the reference.
    from support.kernel_cases import generator, paged_cache, randn
    from mla_func.kernels import aiter as aiter_kernels
    from mla_func.kernels.reference import attention as ref_attention

    gen = generator(5, device)
    lens = [3, 9, 0]
    kv_cache, block_table = paged_cache(lens, 4, 24, torch.float32, device, gen)
    q = randn((3 * len(lens), 2, 24), torch.float32, device, gen)
    w_uv = randn((2, 8, 16), torch.float32, device, gen)
    seq_lens = torch.tensor(lens, dtype=torch.int32, device=device)
    kwargs = dict(softmax_scale=0.2, kv_lora_rank=16, w_uv=w_uv, q_len=3)
    out, lse = aiter_kernels.mla_decode(q, kv_cache, block_table, seq_lens, **kwargs)
    ref_out, ref_lse = ref_attention.mla_decode(q, kv_cache, block_table, seq_lens, **kwargs)
    assert out.shape == (9, 2, 8)
    torch.testing.assert_close(out, ref_out, atol=0, rtol=0)
    torch.testing.assert_close(lse, ref_lse, atol=0, rtol=0)
