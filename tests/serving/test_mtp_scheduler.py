"""The scheduler with verify rows: lengths and blocks follow the tokens kept, never the drafts.

A fake model (the one of test_scheduler) keeps its own paged cache and makes each token a
hash of the context it reads back through the block tables; drafts are right or wrong at
random. Every request must finish with the tokens it gets alone, whatever was drafted,
rejected, preempted or reused from the prefix cache: a block registered with a rejected
draft in it, a length counting rejected tokens, or a stale entry read back would change
a token.
"""

from __future__ import annotations

import random
from dataclasses import replace

import pytest

from mla_func.serving.scheduler import FinishReason, Request, ScheduledStep, Scheduler, SchedulerConfig
from mla_func.state.layer_cache import CacheGroup
from test_scheduler import VOCAB, PagedFakeModel, next_token, run_alone


def _verify(model: PagedFakeModel, step: ScheduledStep, rng: random.Random) -> list:
    """Run `step` with drafts written into its verify rows; returns the tokens each row keeps."""
    plan, q = step.plan, step.plan.decode_q_len
    decode = []
    for row in plan.decode:
        context = [model.slots[(row.block_table[p // model.bs], p % model.bs)][1] for p in range(row.start_pos)]
        drafts = []
        for _ in range(q - 1):
            right = next_token(context + [row.token_ids[0]] + drafts)
            drafts.append(right if rng.random() < 0.6 else (right + 1) % VOCAB)
        decode.append(replace(row, token_ids=row.token_ids[:1] + tuple(drafts)))
    fed = replace(step, plan=replace(plan, decode=tuple(decode)))
    sampled = model.run(replace(fed, plan=replace(fed.plan, decode=())))  # writes the prefill rows
    for row in decode:
        for i, tok in enumerate(row.token_ids):
            pos = row.start_pos + i
            model.slots[(row.block_table[pos // model.bs], pos % model.bs)] = (pos, tok)
    for row in decode:
        kept = []
        for j in range(q):
            context = []
            for pos in range(row.start_pos + j + 1):
                stored, tok = model.slots[(row.block_table[pos // model.bs], pos % model.bs)]
                assert stored == pos
                context.append(tok)
            kept.append(next_token(context))
            if j + 1 < q and row.token_ids[j + 1] != kept[-1]:
                break
        sampled.append(tuple(kept))
    return sampled


@pytest.mark.parametrize("k", [1, 3])
@pytest.mark.parametrize("num_blocks", [14, 200])
def test_verify_rows_keep_the_tokens_of_decoding_alone(k, num_blocks):
    rng = random.Random(k * 100 + num_blocks)
    cfg = SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=20, cache_groups=(CacheGroup(num_blocks, 4),),
                          max_model_len=48, long_prefill_token_threshold=6, speculative_tokens=k)
    shared = [rng.randrange(VOCAB) for _ in range(8)]
    requests = []
    for i in range(14):
        prompt = [rng.randrange(VOCAB) for _ in range(rng.randrange(1, 12))]
        requests.append(Request(i, tuple(shared + prompt if i % 2 else prompt), rng.randrange(1, 20),
                                stop_token_ids=(5,) if i % 3 == 0 else ()))
    sched = Scheduler(cfg)
    for r in requests:
        sched.add(r)
    model = PagedFakeModel(cfg.block_size)
    outputs, preempted, query_lengths = {}, 0, set()
    while (step := sched.schedule()) is not None:
        plan = step.plan
        assert plan.num_prefill_tokens + len(plan.decode) * plan.decode_q_len <= cfg.max_num_batched_tokens
        query_lengths.add(plan.decode_q_len)
        preempted += len(step.preempted)
        for f in sched.update(step, _verify(model, step, rng)):
            outputs[f.request_id] = (f.output_token_ids, f.finish_reason)
        sched.check_invariants()
    for r in requests:
        assert outputs[r.request_id] == run_alone(r, cfg.max_model_len)
    assert query_lengths >= {1, k + 1}
    assert (preempted > 0) == (num_blocks == 14)
    allocator = sched.allocator
    assert allocator.num_free_blocks == allocator.num_usable_blocks
    if num_blocks == 200:
        assert allocator.num_cached_blocks > 0


def test_a_verify_row_never_passes_its_request_length():
    cfg = SchedulerConfig(max_num_seqs=2, max_num_batched_tokens=8, cache_groups=(CacheGroup(20, 4),), max_model_len=64,
                          speculative_tokens=3)
    sched = Scheduler(cfg)
    sched.add(Request("a", (1, 2, 3), max_tokens=3))
    step = sched.schedule()
    sched.update(step, [7])
    step = sched.schedule()  # one token generated, two to go: one draft at most
    assert step.plan.decode_q_len == 2 and step.plan.decode[0].token_ids == (7, 7)
    finished = sched.update(step, [(8, 9)])
    assert [(f.output_token_ids, f.finish_reason) for f in finished] == [((7, 8, 9), FinishReason.LENGTH)]


def test_verify_tokens_are_checked():
    cfg = SchedulerConfig(max_num_seqs=2, max_num_batched_tokens=8, cache_groups=(CacheGroup(20, 4),), max_model_len=64,
                          speculative_tokens=2)
    sched = Scheduler(cfg)
    sched.add(Request("a", (1, 2, 3), max_tokens=10))
    sched.update(sched.schedule(), [7])
    step = sched.schedule()
    with pytest.raises(ValueError, match=r"row 0 \('a'\) has num_logits=3 but got sampled token \(1, 2, 3, 4\)"):
        sched.update(step, [(1, 2, 3, 4)])
    with pytest.raises(ValueError, match="max_num_batched_tokens \\(8\\) must be >= max_num_seqs \\(4\\) \\* 3"):
        SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=8, cache_groups=(CacheGroup(20, 4),), max_model_len=64,
                        speculative_tokens=2)
