"""make_step: a pure step function, memoized over static shapes, replayed as CUDA graphs.

Any pure `fn(params, state, batch, mode) -> (output, state)` can be memoized (the
model's forward is one; a drafter or a verifier is another): its `output` is a
pytree whose every leaf is indexed by logits row first ([mode.padded_num_logits, ...]).
A step's `mode.static_key` fixes the shape of every tensor it touches. The first
call with a key captures a CUDA graph of `fn` over static input buffers; later
calls copy the batch into those buffers (one pytree map) and replay. A step that
does not fit the padding ladders (`mode.use_graph` is False) runs the same `fn`
eagerly, with one warning. Without CUDA every step is eager.

The captured graph writes the state buffers it was captured with; the state is
donated into the step and the returned state holds the same buffers (every leaf
of the state pytree, whatever the layer kinds).
"""

from __future__ import annotations

import dataclasses
import logging
import time
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from tqdm.auto import tqdm

from mla_func.core.batch import Batch, check_batch
from mla_func.core.batch_build import build_batch
from mla_func.core.config import ModelConfig
from mla_func.core.forward import ForwardOutput, forward_outputs
from mla_func.core.ladders import padding_ladders
from mla_func.core.mode import SEGMENT_KINDS, ForwardMode, PaddingPolicy, SegmentKind
from mla_func.core.model import Model
from mla_func.core.plan import StepPlan
from mla_func.core.prepare import plan_step
from mla_func.kernels import default_backend
from mla_func.pytree import tree_flatten, tree_map
from mla_func.state.kv_cache import KVCacheState
from mla_func.state.layer_cache import CacheGroup

logger = logging.getLogger(__name__)

__all__ = ["Step", "StepFn", "StepOutput", "make_step", "padding_ladders"]

StepFn = Callable[[Any, KVCacheState, Batch, ForwardMode], tuple[Any, KVCacheState]]


def model_step_fn(params: Any, state: KVCacheState, batch: Batch, mode: ForwardMode) -> tuple[Any, KVCacheState]:
    """The model's forward as a step function: (ForwardOutput with logits only, state)."""
    return forward_outputs(params, state, batch, mode, return_hidden=False)


@dataclass(frozen=True, slots=True)
class StepOutput:
    """What a step returns besides the state.

    output: the step function's output pytree, each leaf cut to its [mode.num_logits]
            real rows, in plan order (prefill sequences' rows, then decode rows);
            fresh tensors, never views of a graph's static output.
    mode:   the mode the step ran with.
    graph:  whether it replayed a CUDA graph.
    """

    output: Any
    mode: ForwardMode
    graph: bool

    @property
    def logits(self) -> torch.Tensor:
        """[mode.num_logits, V] the real logits rows (for a function returning a `ForwardOutput`)."""
        out: ForwardOutput = self.output
        return out.logits


@dataclass(slots=True)
class _Captured:
    graph: torch.cuda.CUDAGraph
    batch: Batch                      # static input buffers
    output: Any                       # static output buffers (a pytree)
    state_ptrs: tuple[int, ...]       # the state buffers the graph writes
    layers: tuple[Any, ...]           # a state's layer tuple known to hold those buffers


def _copy_leaves(static: Batch, batch: Batch) -> None:
    """Copy batch's tensors into the graph's static input buffers: one multi-tensor launch per dtype
    (a decode batch of three cache groups has 10 leaves, and a copy a leaf would cost 10 launches before
    every replay; the per-row view is made inside the graph, `rows.row_metadata`, and is never copied)."""
    statics, static_spec = tree_flatten(static)
    values, spec = tree_flatten(batch)
    if spec != static_spec:
        raise ValueError("step: the batch's structure differs from the one its graph was captured with")
    groups: dict[torch.dtype, tuple[list[torch.Tensor], list[torch.Tensor]]] = {}
    for dst, src in zip(statics, values):
        dsts, srcs = groups.setdefault(dst.dtype, ([], []))
        dsts.append(dst)
        srcs.append(src)
    for dsts, srcs in groups.values():
        torch._foreach_copy_(dsts, srcs, non_blocking=True)


def _real_rows(output: Any, mode: ForwardMode, *, clone: bool) -> Any:
    n = mode.num_logits
    return tree_map(lambda t: t[:n].clone() if clone else t[:n], output)


def _state_ptrs(state: KVCacheState) -> tuple[int, ...]:
    return tuple(t.data_ptr() for t in state.leaves())


@dataclass
class Step:
    """A memoized, graph-captured step function. Build with `make_step`.

    `prepare(state, plan)` decides the mode with this step's padding ladders and
    builds the batch; `step(state, batch, mode)` runs it and returns
    `(new_state, StepOutput)`, donating `state`.
    """

    fn: StepFn
    params: Any
    config: ModelConfig
    backend: str
    graphs: bool
    padding: PaddingPolicy
    block_size: int | None
    graph_kinds: tuple[str, ...] = SEGMENT_KINDS
    max_position: int | None = None  # the RoPE tables' length; None: the config's max_position_embeddings
    batch_invariant: bool = False    # every mode it decides is batch-invariant (`ForwardMode.batch_invariant`)
    w8a8: bool = False               # every mode it decides quantizes FP8 products' activations (`ForwardMode.w8a8`)
    _memo: dict[tuple[object, ...], _Captured] = field(default_factory=dict, repr=False)
    _pool: Any = field(default=None, repr=False)
    _warned: set[str] = field(default_factory=set, repr=False)

    @property
    def captured_keys(self) -> tuple[tuple[object, ...], ...]:
        return tuple(self._memo)

    def _check_state(self, state: KVCacheState, user: str) -> None:
        state.check_live(user)
        if self.block_size is not None and state.block_size != self.block_size:
            raise ValueError(f"{user}: this step's ladders were made for blocks of {self.block_size} tokens, the "
                             f"state's hold {state.block_size} (make_step(block_size=...))")

    def prepare(self, state: KVCacheState, plan: StepPlan) -> tuple[Batch, ForwardMode]:
        """Decide the mode of `plan` (padded to this step's ladders) and build its batch."""
        self._check_state(state, "step.prepare")
        return plan_step(self.config, state, plan, backend=self.backend, padding=self.padding,
                         graphs=self.graphs, graph_kinds=self.graph_kinds, max_position=self.max_position,
                         batch_invariant=self.batch_invariant, w8a8=self.w8a8)

    def __call__(self, state: KVCacheState, batch: Batch, mode: ForwardMode) -> tuple[KVCacheState, StepOutput]:
        self._check_state(state, "step")
        check_batch(batch, mode)
        if mode.backend != self.backend:
            raise ValueError(f"step: mode was decided for backend {mode.backend!r}, this step runs {self.backend!r}")
        if mode.use_graph and not self.graphs:
            raise ValueError("step: the mode was decided to replay a graph, this step runs without graphs; "
                             "decide it with step.prepare")
        if not mode.use_graph:
            if mode.graph_fallback:
                self._warn_once("eager", f"step {mode.static_key} does not fit the graph ladders: running it eagerly")
            return self._eager(state, batch, mode)
        captured = self._memo.get(mode.static_key)
        if captured is None:
            captured = self._capture(state, batch, mode)
        elif state.layers is not captured.layers:
            # Replays hand back the same layer tuple, so this full check runs only after
            # an eager step or on a state made elsewhere.
            if captured.state_ptrs != _state_ptrs(state):
                self._warn_once("buffers", "step: this state's buffers are not the ones the graphs write; "
                                "running eagerly")
                return self._eager(state, batch, mode)
            captured.layers = state.layers
        _copy_leaves(captured.batch, batch)
        captured.graph.replay()
        # The copy out of the graph's buffers comes before the donation: if it fails (out of
        # memory), the caller's state is still live, and it holds the replay's writes.
        output = StepOutput(_real_rows(captured.output, mode, clone=True), mode, graph=True)
        state.donate("step")
        return state.renewed(), output

    def _eager(self, state: KVCacheState, batch: Batch, mode: ForwardMode) -> tuple[KVCacheState, StepOutput]:
        output, new_state = self.fn(self.params, state, batch, mode)
        return new_state, StepOutput(_real_rows(output, mode, clone=False), mode, graph=False)

    def decode_graph_modes(self, state: KVCacheState | None = None, *,
                           decode_q_len: int = 1) -> tuple[ForwardMode, ...]:
        """The modes of every decode graph this step's ladders allow: one per (batch rung, width rung).

        state: the state they will run on (the modes carry its cache groups; their block sizes
               are part of the key); without it, modes of group 0 alone at the step's block size,
               for their count and keys only: their group 0's block count is a stand-in (the least
               a group may have), so the forward refuses them on a state.
        decode_q_len: query tokens a decode sequence feeds (1 + the drafts a verify step checks).
        """
        if not self.graphs or SegmentKind.DECODE not in self.graph_kinds:
            return ()
        if state is not None:
            groups = state.groups
        elif self.block_size is None:
            raise ValueError("decode_graph_modes: this step accepts any block size; pass the state's")
        else:
            groups = (CacheGroup(num_blocks=2, block_size=self.block_size),)
        return tuple(
            ForwardMode.padded_only(SegmentKind.DECODE, backend=self.backend, cache_groups=groups,
                                    decode_seqs=seqs, block_table_width=width,
                                    batch_invariant=self.batch_invariant, w8a8=self.w8a8,
                                    decode_q_len=decode_q_len)
            for seqs in self.padding.decode_seqs
            for width in self.padding.block_table_widths
        )

    def warmup(self, state: KVCacheState, modes: Sequence[ForwardMode], *, progress: bool = False,
               hidden_size: int = 0) -> None:
        """Capture graphs for `modes` up front, largest first, with all-padding batches.

        Padding rows write only the scratch block, so `state` stays valid.
        progress: show a progress bar (capturing a large model's graphs takes seconds each).
        hidden_size: for a step whose batches carry `Batch.hidden` (a drafter's): its width D; the
                     padding batch then holds zero hidden states [T, D] in the state's dtype.
        """
        self._check_state(state, "step.warmup")
        todo = [m for m in sorted(modes, key=lambda m: m.num_tokens, reverse=True)
                if m.use_graph and m.static_key not in self._memo]
        for mode in tqdm(todo, desc="capturing graphs", unit="graph", disable=not progress):
            empty = mode.without_real_rows()
            batch = build_batch(StepPlan(decode_q_len=mode.decode_q_len), empty, block_size=state.block_size,
                                device=state.device)
            if hidden_size:
                batch = dataclasses.replace(batch, hidden=torch.zeros(
                    (empty.num_tokens, hidden_size), dtype=state.dtype, device=state.device))
            self._capture(state, batch, empty)

    def _capture(self, state: KVCacheState, batch: Batch, mode: ForwardMode) -> _Captured:
        key = mode.static_key
        static_batch = tree_map(torch.clone, batch)
        torch.cuda.synchronize()
        free_before = torch.cuda.mem_get_info()[0]
        started = time.perf_counter()
        # Warm-up on a side stream initialises library workspaces outside the graph,
        # as capture requires; it computes the step for real (same state writes as replay).
        # Each run gets a handle of its own over the same buffers: capture must not
        # donate the caller's state.
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            self.fn(self.params, state.renewed(), static_batch, mode)
        torch.cuda.current_stream().wait_stream(side)
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        graph = torch.cuda.CUDAGraph()
        # An error here propagates as it is; the memo is written only after a capture succeeds.
        with torch.cuda.graph(graph, pool=self._pool):
            output, _ = self.fn(self.params, state.renewed(), static_batch, mode)
        torch.cuda.synchronize()
        captured = _Captured(graph=graph, batch=static_batch, output=output, state_ptrs=_state_ptrs(state),
                             layers=state.layers)
        self._memo[key] = captured
        logger.info(
            "captured %s in %.1f ms, %.1f MiB", key, (time.perf_counter() - started) * 1e3,
            (free_before - torch.cuda.mem_get_info()[0]) / 2**20,
        )
        return captured

    def _warn_once(self, kind: str, message: str) -> None:
        if kind not in self._warned:
            self._warned.add(kind)
            warnings.warn(message, stacklevel=3)


def check_w8a8(user: str, model: Model, w8a8: bool, batch_invariant: bool) -> None:
    """ValueError, naming `user`, where w8a8 steps cannot run `model`: with batch_invariant (no table quantizes
    activations batch-invariantly) or without FP8 weights (there would be nothing to quantize for)."""
    if not w8a8:
        return
    if batch_invariant:
        raise ValueError(f"{user}: w8a8=True with batch_invariant=True; the batch-invariant ops multiply FP8 weights "
                         "by 16-bit activations in one K order, and no table quantizes activations batch-invariantly")
    if not model.has_fp8_weights:
        raise ValueError(f"{user}: w8a8=True quantizes the activations of FP8 weights' products, and this model has no "
                         "FP8 weights (load an FP8 checkpoint, or load_model(..., quantization='fp8'))")


def make_step(
    model: Model,
    *,
    fn: StepFn | None = None,
    params: Any = None,
    backend: str | None = None,
    graphs: bool = True,
    graph_kinds: tuple[str, ...] = SEGMENT_KINDS,
    padding: PaddingPolicy | None = None,
    max_num_seqs: int = 256,
    max_num_batched_tokens: int = 8192,
    max_model_len: int | None = None,
    block_size: int | None = None,
    batch_invariant: bool = False,
    w8a8: bool = False,
) -> Step:
    """A pure step function over `model`'s device, memoized by the mode's static key.

    fn:       the pure `fn(params, state, batch, mode) -> (output pytree, state)` to memoize
              (default: the model's forward, whose output is a `ForwardOutput`); every leaf of
              its output is [mode.padded_num_logits, ...].
    params:   the pytree `fn` is given (default: the model's params).
    backend:  defaults to "triton" on CUDA, "torch" elsewhere.
    graphs:   capture and replay CUDA graphs (only on CUDA devices; elsewhere eager).
    graph_kinds: the segment kinds ("prefill", "decode", "mixed") that may use graphs;
              steps of other kinds run eagerly (and unpadded) without a warning.
    padding:  the ladders steps are padded to; with graphs, by default `padding_ladders`
              for `max_num_seqs`, `max_num_batched_tokens` and `max_model_len / block_size`
              blocks a sequence (max_model_len defaults to the model's maximum); without
              graphs, exact sizes (padding buys an eager step nothing).
    block_size: the block size of the states this step runs on, checked at every call;
              None accepts any (the default ladders then assume blocks of 16 tokens).
    batch_invariant: decide every step batch-invariant: a row's logits and cache entries
              depend on its own sequence only, not on its batch-mates, the padding rung,
              the step kind or where a prompt was cut into chunks (`ForwardMode.batch_invariant`).
    w8a8:     decide every step with w8a8 FP8 products (`ForwardMode.w8a8`): a model with FP8 weights
              multiplies them by its activations quantized per token and group of 128 (the checkpoints'
              "dynamic" activation scheme, as DeepSeek's inference code runs them) rather than by the
              dequantized weights; ValueError for a model without FP8 weights or with batch_invariant.
    """
    if batch_invariant and not model.config.family.supports_batch_invariant:
        raise ValueError(f"make_step: batch_invariant=True covers families with batch-invariant ops; "
                         f"{model.config.family.title}'s layers have no batch-invariant ops yet")
    check_w8a8("make_step", model, w8a8, batch_invariant)
    device = model.device
    use_graphs = graphs and device.type == "cuda"
    if padding is None and not use_graphs:
        padding = PaddingPolicy.exact()
    elif padding is None:
        max_len = max_model_len or model.max_positions
        padding = padding_ladders(
            max_num_seqs=max_num_seqs,
            max_num_batched_tokens=max_num_batched_tokens,
            max_blocks_per_seq=-(-max_len // (block_size or 16)),
        )
    return Step(fn=fn or model_step_fn, params=model.params if params is None else params, config=model.config,
                backend=backend or default_backend(device), graphs=use_graphs, padding=padding,
                block_size=block_size, max_position=model.max_positions, graph_kinds=tuple(graph_kinds),
                batch_invariant=batch_invariant, w8a8=w8a8)
