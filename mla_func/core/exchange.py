"""Where a sharded layer's blocks meet across ranks: the all-reduce, or the row exchange.

With tensor-parallel attention every rank holds every row of the step, and a block split across
the ranks (the attention's heads, an MLP's columns, the experts) leaves a partial sum that one
all-reduce completes. With data-parallel attention (`CollectiveOps.tokens_split`) each rank's
step holds its own requests' rows and attends for them with every head, so attention needs no
collective; the blocks still split across ranks (MLPs, experts) take every rank's rows, padded
to `mode.exchange_rows` (the same on every rank), through an all-gather, and hand each rank the
sums of its own rows back through a reduce-scatter. With one process both are identities.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from mla_func.core.mode import ForwardMode
from mla_func.kernels import CollectiveOps


def attention_output(out: torch.Tensor, collectives: CollectiveOps) -> torch.Tensor:
    """A sharded layer's attention output [T, D]: summed over the ranks' heads, or this rank's own."""
    return out if collectives.tokens_split else collectives.all_reduce(out)


def _every_rank(x: torch.Tensor, flags: torch.Tensor, fill: int, mode: ForwardMode, collectives: CollectiveOps
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """Every rank's rows, each rank's padded to `mode.exchange_rows`: x [T, D] -> [size * rows, D],
    flags [T] (an integer per row) -> [size * rows], `fill` on padding rows."""
    rows, pad = mode.exchange_rows, mode.exchange_rows - x.shape[0]
    if pad < 0:
        raise ValueError(f"a data-parallel step of {x.shape[0]} rows exchanges {rows} a rank: plan it with "
                         "parallel.data_parallel.plan_rank_step")
    every_x = collectives.all_gather(F.pad(x, (0, 0, 0, pad)), dim=0)
    return every_x, collectives.all_gather(F.pad(flags, (0, pad), value=fill), dim=0)


def shared_block(block: Callable[[torch.Tensor, torch.Tensor], torch.Tensor], x: torch.Tensor, valid: torch.Tensor,
                 mode: ForwardMode, collectives: CollectiveOps) -> torch.Tensor:
    """`block(x, valid)` [T, D] -> [T, D] of a block whose weights the ranks split (it returns this
    rank's partial sum): over this step's rows, or over every rank's rows when each rank holds its own.

    x [T, D]; valid [T] bool (padding rows False, which a router sends nowhere).
    """
    if not collectives.tokens_split:
        return collectives.all_reduce(block(x, valid))
    # As int32: not every backend gathers bools.
    every_x, every_valid = _every_rank(x, valid.to(torch.int32), 0, mode, collectives)
    return collectives.reduce_scatter(block(every_x, every_valid.bool()), dim=0)[:x.shape[0]]


def shared_token_block(block: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor], x: torch.Tensor,
                       token_ids: torch.Tensor, valid: torch.Tensor, mode: ForwardMode,
                       collectives: CollectiveOps) -> torch.Tensor:
    """`shared_block` of a block that also reads each row's token id (a router that picks experts by
    token): `block(x, token_ids, valid)` [T, D] -> [T, D]; token_ids [T] int64.

    When every rank brings its rows, their ids come along in the one gather `shared_block` spends on
    the valid flags: -1 marks a padding row.
    """
    if not collectives.tokens_split:
        return collectives.all_reduce(block(x, token_ids, valid))
    every_x, every_ids = _every_rank(x, torch.where(valid, token_ids, -1), -1, mode, collectives)
    every_valid = every_ids >= 0
    return collectives.reduce_scatter(block(every_x, every_ids.clamp(min=0), every_valid), dim=0)[:x.shape[0]]
