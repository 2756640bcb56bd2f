"""make_step: the forward, memoized over static shapes, replayed as CUDA graphs.

A step's `mode.static_key` fixes the shape of every tensor it touches. The first
call with a key captures a CUDA graph of the forward over static input buffers;
later calls copy the batch into those buffers (one pytree map) and replay. A
step that does not fit the padding ladders (`mode.use_graph` is False) runs the
same forward eagerly, with one warning. Without CUDA every step is eager.

The captured graph writes the cache buffers of the state it was captured with;
the state is donated into the step and the returned state holds the same buffers.
"""

from __future__ import annotations

import dataclasses
import logging
import time
import warnings
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from tqdm.auto import tqdm

from .batch import Batch, build_batch, check_batch
from .checkpoint import Model
from .forward import forward
from .kernels import default_backend
from .mode import SEGMENT_KINDS, ForwardMode, PaddingPolicy
from .plan import StepPlan
from .pytree import tree_map
from .state.kv_cache import KVCacheState

logger = logging.getLogger(__name__)

# Up to this many block-table entries a step (max_num_seqs x blocks a sequence,
# 256 KiB of int32), every step uses the full table width: graphs are then keyed
# on batch sizes alone, so one warm-up captures every decode graph a run can meet,
# and copying the wider table costs microseconds.
_FULL_WIDTH_TABLE_ENTRIES = 1 << 16


def padding_ladders(
    *,
    max_num_seqs: int,
    max_num_batched_tokens: int,
    max_blocks_per_seq: int,
    prefill_token_sizes: Sequence[int] | None = None,
) -> PaddingPolicy:
    """The default ladders: decode sequences 1, 2, 4, 8, then steps of 8 up to 64 and of 16 beyond;
    prefill tokens and prefill sequences in powers of two (the last rung is the maximum itself);
    block-table widths one rung, `max_blocks_per_seq`, when a full table has at most 65536
    entries (max_num_seqs x max_blocks_per_seq), else powers of two as well."""

    def powers_of_two(start: int, top: int) -> tuple[int, ...]:
        rungs, r = [], start
        while r < top:
            rungs.append(r)
            r *= 2
        return (*rungs, top)

    decode = [r for r in (1, 2, 4) if r < max_num_seqs]
    r = 8
    while r < max_num_seqs:
        decode.append(r)
        r += 8 if r < 64 else 16
    decode.append(max_num_seqs)
    tokens = tuple(sorted(set(prefill_token_sizes))) if prefill_token_sizes else powers_of_two(16, max_num_batched_tokens)
    return PaddingPolicy(
        decode_seqs=tuple(decode),
        prefill_tokens=tokens,
        prefill_seqs=powers_of_two(1, max_num_seqs),
        block_table_widths=(
            (max_blocks_per_seq,) if max_num_seqs * max_blocks_per_seq <= _FULL_WIDTH_TABLE_ENTRIES
            else powers_of_two(1, max_blocks_per_seq)
        ),
    )


@dataclass(frozen=True, slots=True)
class StepOutput:
    """What a step returns besides the state.

    logits: [mode.num_logits, V] the real logits rows, in plan order
            (prefill sequences' rows, then decode rows); a fresh tensor, never a
            view of a graph's static output.
    mode:   the mode the step ran with.
    graph:  whether it replayed a CUDA graph.
    """

    logits: torch.Tensor
    mode: ForwardMode
    graph: bool


@dataclass(slots=True)
class _Captured:
    graph: torch.cuda.CUDAGraph
    batch: Batch                      # static input buffers
    logits: torch.Tensor              # static output buffer
    cache_ptrs: tuple[int, ...]       # the cache buffers the graph writes


@dataclass
class Step:
    """A memoized, graph-captured forward. Build with `make_step`.

    `prepare(state, plan)` decides the mode with this step's padding ladders and
    builds the batch; `step(state, batch, mode)` runs it and returns
    `(new_state, StepOutput)`, donating `state`.
    """

    model: Model
    backend: str
    graphs: bool
    padding: PaddingPolicy
    graph_kinds: tuple[str, ...] = SEGMENT_KINDS
    _memo: dict[tuple, _Captured] = field(default_factory=dict, repr=False)
    _pool: object = field(default=None, repr=False)
    _warned: set[str] = field(default_factory=set, repr=False)

    @property
    def captured_keys(self) -> tuple[tuple, ...]:
        return tuple(self._memo)

    def prepare(self, state: KVCacheState, plan: StepPlan) -> tuple[Batch, ForwardMode]:
        """Decide the mode of `plan` (padded to this step's ladders) and build its batch."""
        mode = ForwardMode.decide(
            plan, block_size=state.block_size, backend=self.backend, padding=self.padding, graphs=self.graphs,
            graph_kinds=self.graph_kinds,
        )
        config = self.model.config
        batch = build_batch(
            plan, mode, block_size=state.block_size, device=state.device, num_blocks=state.num_blocks,
            vocab_size=config.vocab_size, max_position=self.model.max_positions,
        )
        return batch, mode

    def __call__(self, state: KVCacheState, batch: Batch, mode: ForwardMode) -> tuple[KVCacheState, StepOutput]:
        state.check_live("step")
        check_batch(batch, mode)
        if mode.backend != self.backend:
            raise ValueError(f"step: mode was decided for backend {mode.backend!r}, this step runs {self.backend!r}")
        if not mode.use_graph:
            if self.graphs and mode.kind in self.graph_kinds:
                self._warn_once("eager", f"step {mode.static_key} does not fit the graph ladders: running it eagerly")
            logits, new_state = forward(self.model.params, state, batch, mode)
            return new_state, StepOutput(logits[: mode.num_logits], mode, graph=False)
        captured = self._memo.get(mode.static_key)
        if captured is None:
            captured = self._capture(state, batch, mode)
        elif captured.cache_ptrs != _cache_ptrs(state):
            self._warn_once("buffers", "step: this state's cache buffers are not the ones the graphs write; running eagerly")
            logits, new_state = forward(self.model.params, state, batch, mode)
            return new_state, StepOutput(logits[: mode.num_logits], mode, graph=False)
        tree_map(lambda static, value: static.copy_(value, non_blocking=True), captured.batch, batch)
        captured.graph.replay()
        state.donate("step")
        new_state = state.with_caches(state.kv_cache)
        return new_state, StepOutput(captured.logits[: mode.num_logits].clone(), mode, graph=True)

    def decode_graph_modes(self) -> tuple[ForwardMode, ...]:
        """The modes of every decode graph this step's ladders allow: one per (batch rung, width rung)."""
        if not self.graphs or "decode" not in self.graph_kinds:
            return ()
        return tuple(
            ForwardMode(
                kind="decode", backend=self.backend, num_prefill_tokens=0, num_prefill_seqs=0, num_decode_seqs=0,
                num_logits=0, padded_prefill_tokens=0, padded_prefill_seqs=0, padded_decode_seqs=seqs,
                padded_num_logits=seqs, block_table_width=width, use_graph=True,
            )
            for seqs in self.padding.decode_seqs
            for width in self.padding.block_table_widths
        )

    def warmup(self, state: KVCacheState, modes: Sequence[ForwardMode], *, progress: bool = False) -> None:
        """Capture graphs for `modes` up front, largest first, with all-padding batches.

        Padding rows write only the scratch block, so `state` stays valid.
        progress: show a progress bar (capturing a large model's graphs takes seconds each).
        """
        state.check_live("step.warmup")
        todo = [m for m in sorted(modes, key=lambda m: m.num_tokens, reverse=True)
                if m.use_graph and m.static_key not in self._memo]
        for mode in tqdm(todo, desc="capturing graphs", unit="graph", disable=not progress):
            empty = dataclasses.replace(mode, num_prefill_tokens=0, num_prefill_seqs=0, num_decode_seqs=0, num_logits=0)
            batch = build_batch(StepPlan(), empty, block_size=state.block_size, device=state.device)
            self._capture(state, batch, empty)

    def _capture(self, state: KVCacheState, batch: Batch, mode: ForwardMode) -> _Captured:
        key = mode.static_key
        params = self.model.params
        static_batch = tree_map(torch.clone, batch)

        def handle() -> KVCacheState:
            # A handle of its own over the same buffers: capture must not donate the caller's state.
            return KVCacheState(kv_cache=state.kv_cache)

        torch.cuda.synchronize()
        free_before = torch.cuda.mem_get_info()[0]
        started = time.perf_counter()
        # Warm-up on a side stream initialises library workspaces outside the graph,
        # as capture requires; it computes the step for real (same cache writes as replay).
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            forward(params, handle(), static_batch, mode)
        torch.cuda.current_stream().wait_stream(side)
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        graph = torch.cuda.CUDAGraph()
        # An error here propagates as it is; the memo is written only after a capture succeeds.
        with torch.cuda.graph(graph, pool=self._pool):
            logits, _ = forward(params, handle(), static_batch, mode)
        torch.cuda.synchronize()
        captured = _Captured(graph=graph, batch=static_batch, logits=logits, cache_ptrs=_cache_ptrs(state))
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


def _cache_ptrs(state: KVCacheState) -> tuple[int, ...]:
    return tuple(c.data_ptr() for c in state.kv_cache)


def make_step(
    model: Model,
    *,
    backend: str | None = None,
    graphs: bool = True,
    graph_kinds: tuple[str, ...] = SEGMENT_KINDS,
    padding: PaddingPolicy | None = None,
    max_num_seqs: int = 256,
    max_num_batched_tokens: int = 8192,
    max_model_len: int | None = None,
    block_size: int = 16,
) -> Step:
    """The forward of `model` as a memoized step.

    backend:  defaults to "triton" on CUDA, "torch" elsewhere.
    graphs:   capture and replay CUDA graphs (only on CUDA devices; elsewhere eager).
    graph_kinds: the segment kinds ("prefill", "decode", "mixed") that may use graphs;
              steps of other kinds run eagerly (and unpadded) without a warning.
    padding:  the ladders steps are padded to; with graphs, by default `padding_ladders`
              for `max_num_seqs`, `max_num_batched_tokens` and `max_model_len / block_size`
              blocks a sequence (max_model_len defaults to the model's maximum); without
              graphs, exact sizes (padding buys an eager step nothing).
    """
    device = model.device
    use_graphs = graphs and device.type == "cuda"
    if padding is None and not use_graphs:
        padding = PaddingPolicy.exact()
    elif padding is None:
        max_len = max_model_len or model.max_positions
        padding = padding_ladders(
            max_num_seqs=max_num_seqs,
            max_num_batched_tokens=max_num_batched_tokens,
            max_blocks_per_seq=-(-max_len // block_size),
        )
    return Step(model=model, backend=backend or default_backend(device), graphs=use_graphs, padding=padding,
                graph_kinds=tuple(graph_kinds))
