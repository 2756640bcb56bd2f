"""Language-model steps on the pure forward: scoring packed windows, perplexity, generation.

A *window* is a list of `L + 1` token ids: its first `L` are fed, its last `L`
are the next-token targets (see `data.pack`). Several windows run as one prefill
step, each a sequence with its own blocks of a fresh cache and every one of its
rows producing logits. The training loss over such a step (with the MTP layer's)
is `mtp_lm.windows_losses`.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
import torch.nn.functional as F

from mla_func.core.batch import Batch
from mla_func.core.config import ModelConfig
from mla_func.core.forward import forward
from mla_func.core.mode import ForwardMode
from mla_func.core.params import Params
from mla_func.core.plan import SeqPlan, StepPlan
from mla_func.core.prepare import init_state, plan_step
from mla_func.state.kv_cache import KVCacheState


def windows_step(config: ModelConfig, windows: Sequence[Sequence[int]], *, block_size: int,
                 device: torch.device | str = "cpu") -> tuple[KVCacheState, Batch, ForwardMode, torch.Tensor]:
    """The prefill step of `windows` (B windows of L + 1 tokens) on a fresh cache.

    returns (state, batch, mode, targets [B * L] int64); the step's logits rows are
            the B * L fed tokens in order, so they line up with `targets`.
    """
    blocks_per_seq = -(-(len(windows[0]) - 1) // block_size)
    seqs = []
    for b, window in enumerate(windows):
        first = 1 + b * blocks_per_seq  # block 0 is the cache's scratch block
        seqs.append(SeqPlan(tuple(window[:-1]), 0, tuple(range(first, first + blocks_per_seq)), len(window) - 1))
    # A fresh zeroed cache per step: a training step is a pure function of its windows.
    state = init_state(config, num_blocks=1 + len(windows) * blocks_per_seq, block_size=block_size, device=device)
    batch, mode = plan_step(config, state, StepPlan(prefill=tuple(seqs)), backend="torch")
    targets = torch.tensor([t for w in windows for t in w[1:]], dtype=torch.int64, device=device)
    return state, batch, mode, targets


@torch.no_grad()
def perplexity(params: Params, windows: Sequence[Sequence[int]], *, batch_size: int = 4, block_size: int = 64) -> tuple[float, int]:
    """exp(mean next-token NLL) over every target of `windows`, and the number of targets.

    Windows are scored `batch_size` at a time; the sum of NLLs is kept in float64
    so the result does not depend on the batching beyond float32 logits.
    """
    if not windows:
        raise ValueError("perplexity: no windows to score")
    total, count = 0.0, 0
    for i in range(0, len(windows), batch_size):
        chunk = windows[i : i + batch_size]
        state, batch, mode, targets = windows_step(params.config, chunk, block_size=block_size, device=params.embed.device)
        logits, _ = forward(params, state, batch, mode)
        nll = F.cross_entropy(logits[: mode.num_logits].double(), targets, reduction="sum")
        total += float(nll)
        count += targets.numel()
    return math.exp(total / count), count
