"""Scheduler: every request finishes with the tokens it would get alone, within the limits.

The fake model keeps its own paged KV cache: each row writes its tokens (with
their positions) into the slots its block table names, and a row that makes
logits reads its whole context back through the block table. Its next token is
a hash of that context. So a wrong block table, a stale or overwritten cached
block, a gap in positions or a wrong token fed all change the token stream,
which is compared with running each request alone (computed without the
scheduler).
"""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from mla_func.serving.scheduler import FinishReason, Request, ScheduledStep, Scheduler, SchedulerConfig
from mla_func.state.layer_cache import CacheGroup

VOCAB = 23


def next_token(context) -> int:
    return hash(tuple(context)) % VOCAB


def run_alone(req: Request, max_model_len: int) -> tuple[tuple[int, ...], FinishReason]:
    tokens = list(req.prompt_token_ids)
    out = []
    while True:
        t = next_token(tokens)
        tokens.append(t)
        out.append(t)
        if t in req.stop_token_ids:
            return tuple(out), FinishReason.STOP
        if len(out) == req.max_tokens or len(tokens) == max_model_len:
            return tuple(out), FinishReason.LENGTH


class PagedFakeModel:
    def __init__(self, block_size: int):
        self.bs = block_size
        self.slots: dict[tuple[int, int], tuple[int, int]] = {}  # (block, offset) -> (position, token)

    def run(self, step: ScheduledStep) -> list[int | None]:
        # Write every row first: the real model writes the step's KV before attention reads it.
        for row in step.rows:
            for i, tok in enumerate(row.token_ids):
                pos = row.start_pos + i
                self.slots[(row.block_table[pos // self.bs], pos % self.bs)] = (pos, tok)
        out = []
        for row in step.rows:
            if row.num_logits == 0:
                out.append(None)
                continue
            context = []
            for pos in range(row.seq_len):
                stored_pos, tok = self.slots[(row.block_table[pos // self.bs], pos % self.bs)]
                assert stored_pos == pos, f"slot for position {pos} holds position {stored_pos}"
                context.append(tok)
            out.append(next_token(context))
        return out


def ceil_div(a, b):
    return -(-a // b)


def fits(cfg: SchedulerConfig, req: Request) -> bool:
    p = len(req.prompt_token_ids)
    if p >= cfg.max_model_len:
        return False
    kv = min(p + req.max_tokens, cfg.max_model_len) - 1
    return ceil_div(kv, cfg.block_size) <= cfg.num_blocks - 1


def drive(cfg: SchedulerConfig, arrivals: list[tuple[int, Request]], max_steps: int = 20_000):
    """Run the scheduler to the end, checking every step. Returns (outputs, steps, rejected ids)."""
    sched = Scheduler(cfg)
    model = PagedFakeModel(cfg.block_size)
    arrivals = sorted(arrivals, key=lambda a: a[0])
    tokens: dict = {}  # the test's own view: prompt + sampled, per live request
    computed: dict = {}  # tokens of each live request the model has seen, as of the last step
    outputs: dict = {}
    rejected = []
    steps = []
    waited_last_step: set = set()  # decode-phase requests not scheduled in the previous step
    t = 0
    while True:
        while arrivals and arrivals[0][0] <= t:
            req = arrivals.pop(0)[1]
            if fits(cfg, req):
                sched.add(req)
                tokens[req.request_id] = list(req.prompt_token_ids)
                computed[req.request_id] = 0
            else:
                with pytest.raises(ValueError, match=repr(req.request_id)):
                    sched.add(req)
                rejected.append(req.request_id)
        decoding = {r for r in tokens if computed[r] > 0 and len(tokens[r]) - computed[r] == 1}
        step = sched.schedule()
        if step is None:
            assert not sched.has_unfinished()
            if not arrivals:
                break
            t = arrivals[0][0]
            continue
        steps.append(step)
        assert len(steps) <= max_steps, "no progress"
        plan = step.plan
        rows = step.rows

        # Limits.
        assert plan.num_seqs == len(step.request_ids) <= cfg.max_num_seqs
        assert plan.num_prefill_tokens + len(plan.decode) <= cfg.max_num_batched_tokens
        assert len(set(step.request_ids)) == len(step.request_ids)
        if cfg.long_prefill_token_threshold:
            assert all(r.num_tokens <= cfg.long_prefill_token_threshold for r in plan.prefill)
        if not cfg.enable_mixed:
            assert not (plan.prefill and plan.decode)

        # Fairness: decodes are never pushed out by prefills.
        preempted = set(step.preempted)
        scheduled = set(step.request_ids)
        decode_ids = set(step.request_ids[len(plan.prefill) :])
        if cfg.enable_mixed:
            assert decoding - preempted <= decode_ids, "a running decode was skipped"
        else:
            assert not ((waited_last_step & decoding) - preempted - scheduled), "a decode waited two steps"
            waited_last_step = decoding - preempted - scheduled

        # Plan consistency against the test's own view of each request.
        for r in preempted:
            computed[r] = 0
        written_blocks = []
        for rid, row in zip(step.request_ids, rows):
            seq = tokens[rid]
            assert 0 not in row.block_table
            assert len(row.block_table) == ceil_div(row.seq_len, cfg.block_size)
            if computed[rid] == 0:
                # First chunk since arrival or preemption: may skip only whole cached blocks.
                assert row.start_pos % cfg.block_size == 0
                assert cfg.enable_prefix_caching or row.start_pos == 0
            else:
                assert row.start_pos == computed[rid], "positions are not contiguous"
            assert row.token_ids == tuple(seq[row.start_pos : row.seq_len])
            assert row.num_logits == (1 if row.seq_len == len(seq) else 0)
            written_blocks.append({row.block_table[p // cfg.block_size] for p in range(row.start_pos, row.seq_len)})
        for i, row in enumerate(rows):
            others = {b for j, r in enumerate(rows) if j != i for b in r.block_table}
            assert not (written_blocks[i] & others), "a row writes a block another row uses"

        sampled = model.run(step)
        finished = sched.update(step, sampled)
        for rid, row, tok in zip(step.request_ids, rows, sampled):
            computed[rid] = row.seq_len
            if tok is not None:
                tokens[rid].append(tok)
        for f in finished:
            outputs[f.request_id] = (f.output_token_ids, f.finish_reason, f.num_preemptions)
            assert f.output_token_ids == tuple(tokens[f.request_id][len(f.prompt_token_ids) :])
            del tokens[f.request_id], computed[f.request_id]
        sched.check_invariants()
        t += 1

    assert not tokens, f"requests never finished: {sorted(tokens)}"
    # Everything is released; cached blocks may stay, but nobody owns a block.
    sched.allocator.check_invariants({})
    assert sched.allocator.num_free_blocks == cfg.num_blocks - 1
    return outputs, steps, rejected


@st.composite
def workloads(draw):
    block_size = draw(st.integers(1, 6))
    max_num_seqs = draw(st.integers(1, 5))
    cfg = SchedulerConfig(
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=draw(st.integers(max_num_seqs, 24)),
        # Room for a handful of tokens up to a few requests: small enough to force preemption.
        cache_groups=(CacheGroup(1 + ceil_div(draw(st.integers(1, 64)), block_size), block_size),),
        max_model_len=draw(st.integers(2, 48)),
        long_prefill_token_threshold=draw(st.sampled_from([None, 0, 1, 3, 7])),
        enable_mixed=draw(st.booleans()),
        enable_prefix_caching=draw(st.booleans()),
    )
    # Prompts share prefixes often (a few stems, small alphabet), so the prefix cache gets hits.
    stems = draw(st.lists(st.lists(st.integers(0, 3), min_size=0, max_size=12), min_size=1, max_size=3))
    n = draw(st.integers(1, 10))
    arrivals = []
    for i in range(n):
        stem = draw(st.sampled_from(stems))
        tail = draw(st.lists(st.integers(0, VOCAB - 1), min_size=0 if stem else 1, max_size=12))
        req = Request(
            request_id=f"r{i}",
            prompt_token_ids=tuple(stem + tail),
            max_tokens=draw(st.integers(1, 12)),
            stop_token_ids=tuple(draw(st.lists(st.integers(0, VOCAB - 1), max_size=2))),
        )
        arrivals.append((draw(st.integers(0, 15)), req))
    return cfg, arrivals


@settings(max_examples=600, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(workloads())
def test_every_request_finishes_with_the_tokens_it_gets_alone(workload):
    cfg, arrivals = workload
    outputs, _, rejected = drive(cfg, arrivals)
    for _, req in arrivals:
        if req.request_id in rejected:
            continue
        out, reason, _ = outputs[req.request_id]
        assert (out, reason) == run_alone(req, cfg.max_model_len), req.request_id


def test_preemption_recomputes_to_the_same_tokens():
    # 7 usable blocks of 2 tokens: three requests that each grow to 12 tokens cannot all stay.
    cfg = SchedulerConfig(
        max_num_seqs=3, max_num_batched_tokens=16, cache_groups=(CacheGroup(8, 2),), max_model_len=64
    )
    reqs = [Request(f"r{i}", tuple(range(i, i + 4)), max_tokens=9) for i in range(3)]
    outputs, steps, _ = drive(cfg, [(0, r) for r in reqs])
    assert any(s.preempted for s in steps)
    # The oldest request is never the one preempted.
    assert all("r0" not in s.preempted for s in steps)
    assert max(o[2] for o in outputs.values()) > 0
    for r in reqs:
        assert outputs[r.request_id][:2] == run_alone(r, cfg.max_model_len)


@pytest.mark.parametrize("caching", [True, False])
def test_prefix_cache_skips_the_shared_full_blocks(caching):
    bs = 4
    cfg = SchedulerConfig(
        max_num_seqs=2, max_num_batched_tokens=64, cache_groups=(CacheGroup(16, bs),), max_model_len=64,
        enable_prefix_caching=caching,
    )
    shared = list(range(10))  # two full blocks and a partial one
    a = Request("a", tuple(shared + [11, 12]), max_tokens=2)
    b = Request("b", tuple(shared + [13]), max_tokens=2)
    exact = Request("c", a.prompt_token_ids, max_tokens=2)  # the same prompt again
    outputs, steps, _ = drive(cfg, [(0, a), (5, b), (10, exact)])
    first_row = {}
    for s in steps:
        for rid, row in zip(s.request_ids, s.rows):
            first_row.setdefault(rid, row)
    if caching:
        assert first_row["b"].start_pos == 8
        assert first_row["b"].block_table[:2] == first_row["a"].block_table[:2]
        # All 12 prompt tokens are cached in three full blocks, but the last token must be
        # computed to get logits, and a shared block is never written: the third block is redone.
        assert first_row["c"].start_pos == 8 and first_row["c"].token_ids == (8, 9, 11, 12)
        assert first_row["c"].block_table[:2] == first_row["a"].block_table[:2]
        assert first_row["c"].block_table[2] != first_row["a"].block_table[2]
        assert first_row["c"].num_logits == 1
    else:
        assert first_row["b"].start_pos == first_row["c"].start_pos == 0
    for r in (a, b, exact):
        assert outputs[r.request_id][:2] == run_alone(r, cfg.max_model_len)


def test_decodes_keep_running_while_a_long_prompt_is_chunked():
    cfg = SchedulerConfig(
        max_num_seqs=4, max_num_batched_tokens=8, cache_groups=(CacheGroup(64, 4),), max_model_len=256,
        long_prefill_token_threshold=4,
    )
    short = [Request(f"s{i}", (i, i + 1), max_tokens=20) for i in range(3)]
    long = Request("long", tuple(range(100)), max_tokens=1)
    _, steps, _ = drive(cfg, [(0, r) for r in short] + [(2, long)])
    long_steps = [s for s in steps if "long" in s.request_ids]
    assert len(long_steps) == 25  # 100 tokens in chunks of at most 4
    mixed = [s for s in long_steps if s.plan.decode]
    assert mixed and all(len(s.plan.decode) == 3 for s in mixed[:10])


def test_unmixed_steps_alternate():
    cfg = SchedulerConfig(
        max_num_seqs=4, max_num_batched_tokens=8, cache_groups=(CacheGroup(64, 4),), max_model_len=256,
        long_prefill_token_threshold=4, enable_mixed=False,
    )
    reqs = [Request("s", (1, 2), max_tokens=20), Request("long", tuple(range(40)), max_tokens=1)]
    _, steps, _ = drive(cfg, [(0, reqs[0]), (1, reqs[1])])
    kinds = "".join("p" if s.plan.prefill else "d" for s in steps)
    # Step 0 prefills "s"; then "s" decodes and "long" prefills (10 chunks of 4) in turn.
    assert kinds[1:21] == "dp" * 10, kinds


def test_add_rejects_requests_that_cannot_fit():
    cfg = SchedulerConfig(max_num_seqs=2, max_num_batched_tokens=8, cache_groups=(CacheGroup(3, 4),), max_model_len=16)
    sched = Scheduler(cfg)
    with pytest.raises(ValueError, match=r"'big'.*needs up to 3 KV blocks.*only 2 usable"):
        sched.add(Request("big", tuple(range(8)), max_tokens=5))
    with pytest.raises(ValueError, match=r"'long'.*max_model_len=16"):
        sched.add(Request("long", tuple(range(16)), max_tokens=1))
    sched.add(Request("ok", tuple(range(8)), max_tokens=1))  # 8 tokens cached: 2 blocks
    with pytest.raises(ValueError, match="'ok' is already queued"):
        sched.add(Request("ok", (1,), max_tokens=1))


def test_request_and_config_validation_name_the_bad_value():
    with pytest.raises(ValueError, match="'x'.*max_tokens must be >= 1, got 0"):
        Request("x", (1,), max_tokens=0)
    with pytest.raises(ValueError, match="'x'.*empty"):
        Request("x", (), max_tokens=1)
    with pytest.raises(ValueError, match=r"max_num_batched_tokens \(2\) must be >= max_num_seqs \(4\)"):
        SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=2, cache_groups=(CacheGroup(4, 1),), max_model_len=8)


def test_update_rejects_misuse_and_abort_frees_blocks():
    cfg = SchedulerConfig(max_num_seqs=2, max_num_batched_tokens=8, cache_groups=(CacheGroup(8, 2),), max_model_len=32)
    sched = Scheduler(cfg)
    sched.add(Request("a", (1, 2, 3), max_tokens=4))
    sched.add(Request("b", (4, 5, 6), max_tokens=4))
    step = sched.schedule()
    with pytest.raises(RuntimeError, match="has not been passed to update"):
        sched.schedule()
    with pytest.raises(ValueError, match="has 2 rows, got 1"):
        sched.update(step, [1])
    with pytest.raises(ValueError, match=r"num_logits=1 but got sampled token None"):
        sched.update(step, [None, 2])
    aborted = sched.finish("b")
    assert aborted.finish_reason is FinishReason.ABORT and aborted.output_token_ids == ()
    finished = sched.update(step, [7, 8])  # b's row is ignored
    assert finished == []
    sched.check_invariants()
    with pytest.raises(KeyError, match="'b'"):
        sched.finish("b")
    step = sched.schedule()
    assert step.request_ids == ("a",) and step.rows[0].token_ids == (7,)


def test_an_older_prefill_preempts_a_younger_decode_chosen_in_the_same_step():
    # 7 usable blocks of 2 tokens. "old" prefills 10 tokens in chunks of 2, a new block each
    # step; "young" decodes from step 1 on. In step 4 one block is left: young's decode takes
    # it first, then old's chunk needs a block and young is preempted after being chosen.
    cfg = SchedulerConfig(
        max_num_seqs=2, max_num_batched_tokens=4, cache_groups=(CacheGroup(8, 2),), max_model_len=64,
        long_prefill_token_threshold=2,
    )
    old = Request("old", tuple(range(10)), max_tokens=1)
    young = Request("young", (3,), max_tokens=8)
    outputs, steps, _ = drive(cfg, [(0, old), (0, young)])
    assert "young" in steps[4].preempted and steps[4].request_ids == ("old",)
    assert steps[3].request_ids == ("old", "young")
    for r in (old, young):
        assert outputs[r.request_id][:2] == run_alone(r, cfg.max_model_len)


def _run_to_end(sched: Scheduler, model: PagedFakeModel) -> dict:
    outputs = {}
    while (step := sched.schedule()) is not None:
        for f in sched.update(step, model.run(step)):
            outputs[f.request_id] = (f.output_token_ids, f.finish_reason)
        sched.check_invariants()
    return outputs


def test_a_cancelled_step_is_scheduled_again():
    cfg = SchedulerConfig(max_num_seqs=3, max_num_batched_tokens=6, cache_groups=(CacheGroup(12, 2),), max_model_len=32)
    sched, model = Scheduler(cfg), PagedFakeModel(cfg.block_size)
    reqs = [Request("a", (1, 2, 3, 4), max_tokens=3), Request("b", (6, 7), max_tokens=3)]
    for r in reqs:
        sched.add(r)
    first = sched.schedule()
    sched.update(first, model.run(first))
    free_before = sched.allocator.num_free_blocks
    step = sched.schedule()  # both decode into a new block
    assert sched.allocator.num_free_blocks == free_before - 2
    sched.cancel(step)
    sched.check_invariants()
    assert sched.allocator.num_free_blocks == free_before
    with pytest.raises(ValueError, match="outstanding step is None"):
        sched.update(step, model.run(step))
    again = sched.schedule()
    assert again.request_ids == step.request_ids
    assert [(r.token_ids, r.start_pos, r.num_logits) for r in again.rows] == [
        (r.token_ids, r.start_pos, r.num_logits) for r in step.rows
    ]
    sched.update(again, model.run(again))
    outputs = _run_to_end(sched, model)
    for r in reqs:
        assert outputs[r.request_id] == run_alone(r, cfg.max_model_len)


def test_a_step_whose_requests_were_all_aborted_is_dropped():
    cfg = SchedulerConfig(max_num_seqs=2, max_num_batched_tokens=8, cache_groups=(CacheGroup(8, 2),), max_model_len=32)
    sched, model = Scheduler(cfg), PagedFakeModel(cfg.block_size)
    sched.add(Request("a", (1, 2, 3), max_tokens=4))
    sched.schedule()
    sched.finish("a")
    assert sched.schedule() is None  # no update() needed for a step nobody is waiting on
    sched.allocator.check_invariants({})
    late = Request("late", (4, 5), max_tokens=2)
    sched.add(late)
    assert _run_to_end(sched, model) == {"late": run_alone(late, cfg.max_model_len)}
