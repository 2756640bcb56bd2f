"""Benchmarks over several ranks of this host: how a run cuts the model, each rank's shard of a shape
preset's random weights, the ranks started from one command, and rank 0's figures handed back to it.

`load_model(parallel=)` shards checkpoint folders; a shape preset's random weights are drawn here
instead, tensor by tensor, each from a seed of its own name. So every rank (and one process) draws the
same whole tensor and keeps the share its family's `tensor_split` rule gives it (the loader's cut), or
its own whole experts under expert parallelism (`Family.expert_parallel_params`): one rank and N ranks
run the same weights, and route every token to the same experts.

Each `Mode` runs in a group of fresh processes (`mla_func.parallel.workers.run_ranks`, one GPU a rank
on CUDA, NCCL; gloo on the CPU), the one-rank baseline included: the command's own process never
holds GPU memory, and one mode's buffers are gone before the next starts.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import math
import os
import sys
import tempfile
import traceback
import zlib
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

import mla_func as mf
from mla_func.checkpoint.fp8 import QUANTIZATION_CONFIG, block_quantize
from mla_func.checkpoint.fp8_pairs import released_fp8_layout
from mla_func.core.params import Params, params_from_hf
from mla_func.kernels.fp4_weight import SCALE_DTYPE as FP4_SCALE_DTYPE
from mla_func.kernels.fp4_weight import BlockFP4Weight
from mla_func.kernels.quantized import BlockFP8Weight, Weight
from mla_func.models.tensor_shapes import hf_tensor_shapes
from mla_func.parallel import Parallel
from mla_func.parallel.shard import Shard, cut_weight
from mla_func.parallel.workers import run_ranks

# `--modes` codes -> (expert_parallel, data_parallel_attention, symmetric_memory)
MODE_CODES = {"tp": (False, False, False), "ep": (True, False, False), "dp": (False, True, False),
              "dp-ep": (True, True, False), "tp-sym": (False, False, True), "dp-sym": (False, True, True)}
ONE_RANK = "1 rank"


@dataclass(frozen=True, slots=True)
class Mode:
    """How a run cuts the model: over `ranks` ranks (1: the whole model in one process), with whole
    experts a rank or not, attention split by heads (tensor parallel) or by requests; symmetric_memory: the
    collectives through symmetric memory (`Parallel.symmetric_memory`) rather than NCCL."""

    ranks: int
    expert_parallel: bool = False
    data_parallel_attention: bool = False
    symmetric_memory: bool = False

    @property
    def name(self) -> str:
        """'1 rank', 'TP 2', 'TP 2 + EP', 'DP-attention 2', 'DP-attention 2 + EP', 'TP 2 (symmetric memory)',
        'DP-attention 2 (symmetric memory)': a result row's `mode`."""
        if self.ranks == 1:
            return ONE_RANK
        attention = "DP-attention" if self.data_parallel_attention else "TP"
        return f"{attention} {self.ranks}" + (" + EP" if self.expert_parallel else "") \
            + (" (symmetric memory)" if self.symmetric_memory else "")

    def rank_parallel(self, group: Parallel) -> Parallel:
        """This rank's `Parallel`: the group's, cut this way; with one rank no group (the unsharded model,
        whose collectives are identities)."""
        if self.ranks == 1:
            return Parallel()
        return dataclasses.replace(group, expert_parallel=self.expert_parallel,
                                   data_parallel_attention=self.data_parallel_attention,
                                   symmetric_memory=self.symmetric_memory)


def modes(ranks: int, codes: Sequence[str]) -> list[Mode]:
    """One rank, then `ranks` ranks cut each way of `codes` (keys of MODE_CODES)."""
    if ranks < 2:
        raise ValueError(f"modes: a comparison needs at least 2 ranks, got {ranks}")
    unknown = [c for c in codes if c not in MODE_CODES]
    if unknown:
        raise ValueError(f"modes: unknown mode codes {unknown}; expected some of {sorted(MODE_CODES)}")
    return [Mode(1), *(Mode(ranks, *MODE_CODES[c]) for c in codes)]


def mode_codes(args: argparse.Namespace) -> list[str]:
    """TP always; EP, DP-attention and both, as --expert-parallel / --data-parallel-attention ask; with
    --symmetric-memory, TP (and DP-attention, if asked) through symmetric memory's collectives too."""
    ep, dp, sym = args.expert_parallel, args.data_parallel_attention, args.symmetric_memory
    return ["tp"] + ["ep"] * ep + ["dp"] * dp + ["dp-ep"] * (ep and dp) + ["tp-sym"] * sym + ["dp-sym"] * (dp and sym)


def _seed_of(name: str, seed: int) -> int:
    # A seed a tensor name: every rank draws each tensor alike, whatever it fetches before it.
    return (seed << 32) + zlib.crc32(name.encode())


def _random_tensor(config: mf.ModelConfig, name: str, shape: tuple[int, ...], device: torch.device,
                   seed: int) -> torch.Tensor:
    """Checkpoint tensor `name` of a random model, whole: zero biases, unit norms, uniform index tables,
    the rest normal with std 1/sqrt(fan_in) (activations of order one through every layer), float32."""
    generator = torch.Generator(device=device).manual_seed(_seed_of(name, seed))
    if name.endswith((".bias", "e_score_correction_bias")):
        return torch.zeros(shape, device=device)
    if not config.family.held_dtype(name, torch.float32).is_floating_point:
        return torch.randint(0, config.n_routed_experts or 1, shape, device=device, generator=generator)
    if len(shape) == 1:
        return torch.ones(shape, device=device)
    return torch.empty(shape, device=device).normal_(0.0, shape[1] ** -0.5, generator=generator)


def _random_fp4(name: str, shape: tuple[int, ...], fan_in: int, block: tuple[int, int], device: torch.device,
                seed: int) -> BlockFP4Weight:
    """Checkpoint tensor `name` [N, K] (or a rank's cut of it) as random FP4 pairs: uniform e2m1 codes (their
    values' root mean square is 2.93) and one e8m0 scale a `block` (1 x 32), the power of two nearest
    1 / (2.93 sqrt(fan_in)), so that its values spread as `_random_tensor`'s do."""
    generator = torch.Generator(device=device).manual_seed(_seed_of(name, seed))
    *lead, n, k = shape
    packed = torch.randint(0, 256, (*lead, n, k // 2), device=device, dtype=torch.uint8, generator=generator)
    exponent = round(math.log2(1 / (2.93 * fan_in ** 0.5)))
    scale = torch.full((*lead, n // block[0], k // block[1]), 127 + exponent, device=device, dtype=torch.uint8)
    return BlockFP4Weight(packed, scale.view(FP4_SCALE_DTYPE), block)


def random_shard(config: mf.ModelConfig, parallel: Parallel, *, dtype: torch.dtype, device: torch.device,
                 seed: int = 0, max_model_len: int | None = None,
                 block: tuple[int, int] | None = None) -> mf.Model:
    """This rank's shard of a model of `config`'s shapes with random weights (the whole model with one rank).

    Cut as `load_model(folder, parallel=parallel)` cuts a checkpoint; ValueError (or ConfigError) when
    the family cannot be cut that way or the ranks do not divide a width, naming it.
    block: the weights are stored as the family's released checkpoints store them (`Family.quant_layout`, FP8
           in blocks of `block`): every FP8 tensor is drawn whole, quantized in blocks of `block` (rows,
           columns), then cut with its blocks' scales (ValueError where a cut falls inside a block); every FP4
           one (V4's routed experts) is drawn as random pairs at the rank's cut (`_random_fp4`); those the
           family holds dequantized are drawn in float. The params hold what a sharded folder of the layout loads.
    """
    shapes = hf_tensor_shapes(config)
    ranks, rank = parallel.tensor_parallel, parallel.rank
    rule = None
    if ranks > 1:
        split = config.family.tensor_split
        if split is None:
            raise ValueError(f"random_shard: {config.family.title} models cannot be sharded")
        rule = split(config, parallel.sharding)
    layout = None
    if block is not None:
        raw = {"quantization_config": {**QUANTIZATION_CONFIG, "weight_block_size": list(block)}}
        layout = (config.family.quant_layout or released_fp8_layout)(config, raw, "random weights")

    def fetch(name: str) -> Weight:
        dim = None if rule is None else rule(name)
        stored = None if layout is None or layout.held_dense(name) else layout.format_of(name)
        if stored is not None and stored.pack > 1:
            shape = list(shapes[name])
            if dim is not None:
                start, stop = Shard(dim, rank, ranks).bounds(shape[dim])
                shape[dim] = stop - start
            if shape[-2] % stored.block[0] or shape[-1] % stored.block[1]:
                raise ValueError(f"random_shard: {name!r} cut to {tuple(shape)} across {ranks} ranks falls inside "
                                 f"its FP4 blocks of {stored.block}")
            return _random_fp4(name, tuple(shape), shapes[name][-1], stored.block, device, seed)
        whole: Weight = _random_tensor(config, name, shapes[name], device, seed)
        if stored is not None:
            whole = BlockFP8Weight(*block_quantize(whole, stored.block), stored.block)
        if dim is None:
            return whole
        if isinstance(whole, torch.Tensor):
            start, stop = Shard(dim, rank, ranks).bounds(whole.shape[dim])
            return whole.narrow(dim, start, stop - start).contiguous()
        # A pair is cut with its blocks' scales; the rule names the dim of [N, K] (0: rows, 1: columns).
        return cut_weight(whole, Shard(dim - 2, rank, ranks), f"random_shard: {name!r}")

    params: Params
    if ranks > 1 and parallel.expert_parallel:
        build = config.family.expert_parallel_params
        if build is None:
            raise ValueError(f"random_shard: {config.family.title} models have no expert-parallel params")
        params = build(config, fetch, rank=rank, ranks=ranks, dtype=dtype, device=device, progress=False,
                       max_model_len=max_model_len)
    else:
        params = params_from_hf(config, fetch, dtype=dtype, device=device, progress=False,
                                max_model_len=max_model_len)
    return mf.Model(config=config, params=dataclasses.replace(params, collectives=parallel.collectives))


# FP8 values are drawn in float32 a slice of blocks at a time, at most this many values: drawn whole, a
# batch 1024 x 32K FP8 cache's float32 draw alone took 69 GB, and one GPU ran out of memory.
_DRAW_VALUES = 1 << 26


def fill_random_cache(state: mf.KVCacheState, kv_cache_dtype: str = "auto") -> None:
    """Random latents in every cache leaf of `state` (in place): normal values, FP8 values drawn in float32
    (`_DRAW_VALUES` at a time) then cast, and an FP8 cache's float32 scales positive (`kv_cache_dtype` "fp8")."""
    for cache in state.leaves():
        if cache.dtype.itemsize == 1:
            blocks = max(1, _DRAW_VALUES // max(1, cache[0].numel()))
            for part in cache.split(blocks):
                part.copy_(torch.randn(part.shape, device=cache.device).to(cache.dtype))
        else:
            cache.normal_(0.0, 1.0)
            if kv_cache_dtype == "fp8" and cache.dtype == torch.float32:
                cache.abs_()


def rank_device(device_type: str, parallel: Parallel) -> torch.device:
    """This rank's device: its own GPU on CUDA (cuda:rank, as `join` set it), else the CPU."""
    return torch.device("cuda", parallel.rank) if device_type == "cuda" else torch.device("cpu")


def synchronize(device: torch.device) -> None:
    """Wait for the device's queued work (nothing to wait for on the CPU)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def slowest(value: float, parallel: Parallel, device: torch.device) -> float:
    """The largest of every rank's `value` (this rank's own without a group). Every rank must call it:
    it is a collective, so it also lines the ranks up."""
    if parallel.group is None:
        return value
    t = torch.tensor([value], dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=parallel.group)
    return float(t.item())


# (payload, mode, this rank's Parallel, its device) -> rank 0's result (JSON-able)
RankBench = Callable[[Any, Mode, Parallel, torch.device], dict]


@contextlib.contextmanager
def _gpus_hidden(hide: bool) -> Iterator[None]:
    # `join` picks NCCL wherever CUDA is visible: a CPU run hides the GPUs from the ranks it starts.
    saved = os.environ.get("CUDA_VISIBLE_DEVICES")
    if hide:
        os.environ["CUDA_VISIBLE_DEVICES"] = ""
    try:
        yield
    finally:
        if hide and saved is None:
            del os.environ["CUDA_VISIBLE_DEVICES"]
        elif hide and saved is not None:
            os.environ["CUDA_VISIBLE_DEVICES"] = saved


def _rank_main(task: tuple[RankBench, Any, Mode, str, str], parallel: Parallel) -> int:
    bench, payload, mode, device_type, out = task
    if device_type == "cpu":
        torch.set_num_threads(1)  # ranks share the host's cores: one thread each, as the CPU tests run
    try:
        result = bench(payload, mode, mode.rank_parallel(parallel), rank_device(device_type, parallel))
    except Exception:
        err = sys.__stderr__ or sys.stderr
        print(f"[rank {parallel.rank}] {mode.name} failed:", file=err)
        traceback.print_exc(file=err)
        err.flush()
        # At once, past run_ranks' leave(): its barrier would meet the other ranks inside a step's collective,
        # and they would wait out the group's timeout; an exit stops them now.
        os._exit(1)
    if parallel.rank == 0:
        Path(out).write_text(json.dumps(result))
    return 0


def run_group(mode: Mode, bench: RankBench, payload: Any, *, device_type: str, timeout_s: float = 600.0) -> dict:
    """Run `bench(payload, mode, parallel, device)` on `mode.ranks` fresh processes of this host (one GPU
    each on "cuda"); what rank 0 returned. `bench` and `payload` must pickle (a module-level function,
    plain data). ChildProcessError names a rank that failed (the others are stopped); timeout_s bounds
    the group's rendezvous and every collective wait."""
    with tempfile.TemporaryDirectory() as tmp, _gpus_hidden(device_type == "cpu"):
        out = Path(tmp) / "rank0.json"
        run_ranks(mode.ranks, _rank_main, (bench, payload, mode, device_type, str(out)), timeout_s=timeout_s)
        return json.loads(out.read_text())


def against_one_rank(rows: list[dict], *, case: tuple[str, ...], time_key: str, rate_key: str) -> None:
    """Add to each row of several ranks, in place, its figures over the one-rank row of the same case
    (the fields `case`): `time_vs_one_rank` (its `time_key` over the one rank's) and `vs_one_rank` (its
    `rate_key` over the one rank's); and to each mode other than plain TP, `vs_tp`: its `rate_key` over
    the tensor-parallel row of as many ranks."""
    by_case = {(row["mode"], *(row[k] for k in case)): row for row in rows}
    for row in rows:
        if row["ranks"] == 1:
            continue
        one = by_case.get((ONE_RANK, *(row[k] for k in case)))
        if one is not None:
            row["time_vs_one_rank"] = row[time_key] / one[time_key]
            row["vs_one_rank"] = row[rate_key] / one[rate_key]
        tp = by_case.get((Mode(row["ranks"]).name, *(row[k] for k in case)))
        if tp is not None and tp is not row:
            row["vs_tp"] = row[rate_key] / tp[rate_key]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """--tensor-parallel, --expert-parallel, --data-parallel-attention and --device (see `check_arguments`)."""
    parser.add_argument("--tensor-parallel", type=int, default=1, metavar="N",
                        help="time one rank and N ranks of this host (one GPU each) in one run, tensor-parallel")
    parser.add_argument("--expert-parallel", action="store_true",
                        help="with --tensor-parallel: also N ranks holding whole experts")
    parser.add_argument("--data-parallel-attention", action="store_true",
                        help="with --tensor-parallel: also N ranks attending for their own requests")
    parser.add_argument("--symmetric-memory", action="store_true",
                        help="with --tensor-parallel: also TP (and DP-attention, if asked) with the collectives "
                             "through symmetric memory instead of NCCL")
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"],
                        help="cpu: --tensor-parallel's ranks on the CPU over gloo (a smoke test)")


def check_arguments(parser: argparse.ArgumentParser, args: argparse.Namespace) -> bool:
    """Whether the run compares several ranks (--tensor-parallel N >= 2); parser.error for a flag that
    needs them without them, or more ranks than this host has GPUs. Fills --backend's default: triton on
    CUDA, torch on the CPU."""
    if args.tensor_parallel < 1:
        parser.error(f"--tensor-parallel: expected >= 1, got {args.tensor_parallel}")
    several = args.tensor_parallel > 1
    if not several and (args.expert_parallel or args.data_parallel_attention or args.symmetric_memory
                        or args.device != "cuda"):
        parser.error("--expert-parallel, --data-parallel-attention, --symmetric-memory and --device cpu need "
                     "--tensor-parallel N >= 2")
    if args.symmetric_memory and args.device != "cuda":
        parser.error("--symmetric-memory: symmetric memory needs the ranks' GPUs (--device cuda)")
    if several and args.device == "cuda" and torch.cuda.device_count() < args.tensor_parallel:
        parser.error(f"--tensor-parallel {args.tensor_parallel}: this host has {torch.cuda.device_count()} GPU(s)")
    args.backend = args.backend or ("triton" if args.device == "cuda" else "torch")
    return several
