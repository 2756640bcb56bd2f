"""A new, stateful layer kind added from outside: no change to the forward, the state or the step.

The toy kind keeps a running sum of its input per cache slot in a paged leaf of
its own and adds a learned scale of it to the residual stream. Its expected
output is computed here independently, token by token.
"""

from __future__ import annotations

import dataclasses

import torch

import mla_func as mf
from mla_func.pytree import register_dataclass, static_field, tree_leaves, tree_map
from mla_func.state.layer_cache import CacheGroup

BLOCK_SIZE = 4


@register_dataclass
@dataclasses.dataclass(frozen=True, slots=True)
class ToyParams:
    scale: torch.Tensor  # [D]


@register_dataclass
@dataclasses.dataclass(frozen=True, slots=True)
class ToyCache:
    seen: torch.Tensor   # [num_blocks, block_size, D] this layer's input, per token slot
    steps: torch.Tensor  # [] how many steps this layer ran: a non-paged leaf
    group: int = static_field(default=0)

    def paged(self) -> tuple[torch.Tensor, ...]:
        return (self.seen,)

    def paged_in(self, group: int) -> tuple[torch.Tensor, ...]:
        return self.paged() if group == self.group else ()


@dataclasses.dataclass(frozen=True, slots=True)
class ToyLayer:
    """residual += scale * x; the cache keeps x of every real row in its slot."""

    name: str = "toy"

    def lookback(self, config) -> None:
        return None

    def init_cache(self, config, groups: tuple[CacheGroup, ...], *, dtype, device) -> ToyCache:
        g = groups[0]
        return ToyCache(seen=torch.zeros(g.num_blocks, g.block_size, config.hidden_size, dtype=dtype, device=device),
                        steps=torch.zeros((), dtype=dtype, device=device))

    def enter(self, p, delta, residual, ctx):
        residual = delta if residual is None else residual + delta
        return residual, residual

    def body(self, p, entered, residual, cache, ctx):
        slots = ctx.batch.slot_mapping
        real = ctx.batch.real_rows()
        seen = cache.seen.clone() if not ctx.inplace else cache.seen
        flat = seen.view(-1, seen.shape[-1])
        flat.index_copy_(0, slots.clamp(min=0)[real], entered[real])
        return p.scale * entered, residual, ToyCache(seen=seen, steps=cache.steps + 1, group=cache.group)


def _toy_model(model):
    kinds = (*mf.layer_kinds(model.config), ToyLayer())
    scale = torch.linspace(0.5, 1.5, model.config.hidden_size, dtype=model.dtype)
    params = dataclasses.replace(model.params, layers=(*model.params.layers, ToyParams(scale)))
    return kinds, params


def test_a_stateful_toy_layer_kind_runs_through_forward_state_and_step():
    model = mf.load_model("tiny", dtype=torch.float64, device="cpu", seed=41)
    kinds, params = _toy_model(model)
    state = mf.init_state(model, num_blocks=16, block_size=BLOCK_SIZE, layers=kinds)
    assert isinstance(state.layers[-1], ToyCache) and len(state.leaves()) == len(kinds) + 1
    plan = mf.StepPlan(prefill=(mf.SeqPlan((3, 4, 5, 6, 7), 0, (1, 2), 5),))
    batch, mode = mf.plan_step(model.config, state, plan)

    # Independently: the plain model's hidden states after its last layer, then the toy layer by hand.
    plain_state = mf.init_state(model, num_blocks=16, block_size=BLOCK_SIZE)
    plain, _ = mf.forward_outputs(model.params, plain_state, batch, mode, copy=True)
    assert plain.hidden is not None
    out, new_state = mf.forward_outputs(params, state, batch, mode, layers=kinds, copy=True)
    assert out.hidden is not None and out.hidden.shape == (5, model.config.hidden_size)
    assert not torch.allclose(out.logits, plain.logits)

    step = mf.make_step(model, fn=lambda p, s, b, m: mf.forward_outputs(p, s, b, m, layers=kinds), params=params)
    stepped_state, stepped = step(state, batch, mode)
    torch.testing.assert_close(stepped.output.logits, out.logits[: mode.num_logits], rtol=0, atol=0)
    assert state.is_donated and not stepped_state.is_donated
    toy = stepped_state.layers[-1]
    assert float(toy.steps) == 1.0
    # Each real token's slot holds this layer's input; the scratch block stays zero.
    assert bool(toy.seen[1:3].flatten(0, 1)[:5].abs().sum(-1).gt(0).all())
    assert bool((toy.seen[0] == 0).all()) and bool((toy.seen[2, 1:] == 0).all())
    # Tree operations keep every leaf of every kind.
    clone = tree_map(torch.clone, stepped_state)
    assert isinstance(clone.layers[-1], ToyCache) and not clone.is_donated
    assert all(torch.equal(a, b) for a, b in zip(tree_leaves(clone), stepped_state.leaves()))


def test_the_toy_layer_output_matches_a_hand_computation():
    """With scale s, the toy layer adds s * x to the stream it was handed, x = the residual stream."""
    model = mf.load_model("tiny", dtype=torch.float64, device="cpu", seed=42)
    kinds, params = _toy_model(model)
    plan = mf.StepPlan(prefill=(mf.SeqPlan((9, 8, 7), 0, (1,), 3),))
    state = mf.init_state(model, num_blocks=8, block_size=BLOCK_SIZE, layers=kinds)
    batch, mode = mf.plan_step(model.config, state, plan)
    out, _ = mf.forward_outputs(params, state, batch, mode, layers=kinds, copy=True)

    # By hand: run the plain layers' functions, then the toy layer, then the final norm and head.
    from mla_func.kernels import ops_for

    ops = ops_for("torch")
    plain_state = mf.init_state(model, num_blocks=8, block_size=BLOCK_SIZE)
    ctx = mf.LayerContext(batch=batch, mode=mode, config=model.config, ops=ops, rope_cos=params.rope_cos,
                          rope_sin=params.rope_sin, valid=batch.real_rows(), inplace=False)
    delta, residual = torch.nn.functional.embedding(batch.input_ids, params.embed), None
    for kind, p, cache in zip(mf.layer_kinds(model.config), model.params.layers, plain_state.layers):
        entered, residual = kind.enter(p, delta, residual, ctx)
        delta, residual, _ = kind.body(p, entered, residual, cache, ctx)
    stream = residual + delta
    stream = stream + params.layers[-1].scale * stream
    normed = stream * torch.rsqrt(stream.pow(2).mean(-1, keepdim=True) + model.config.rms_norm_eps) * params.norm
    torch.testing.assert_close(out.logits, normed @ params.lm_head.t(), rtol=1e-10, atol=1e-10)
