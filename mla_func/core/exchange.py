"""Where a sharded layer's blocks meet across ranks: the all-reduce, or the row exchange.

With tensor-parallel attention every rank holds every row of the step, and a block split across
the ranks (the attention's heads, an MLP's columns, the experts) leaves a partial sum that one
all-reduce completes. With data-parallel attention (`CollectiveOps.tokens_split`) each rank's
step holds its own requests' rows and attends for them with every head, so attention needs no
collective; the blocks still split across ranks (MLPs, experts) take every rank's rows, padded
to `mode.exchange_rows` (the same on every rank), through an all-gather, and hand each rank the
sums of its own rows back through a reduce-scatter. With one process both are identities.

Which of every rank's rows are real, and their token ids (a hash router picks experts by token),
are the same in every layer of a step: `row_exchange` gathers them once a step, into the
`RowExchange` the forward hands every layer, so a layer's exchange is one gather of its rows and
one reduce-scatter of their sums.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from mla_func.core.mode import ForwardMode
from mla_func.kernels import CollectiveOps


@dataclass(frozen=True, slots=True)
class RowExchange:
    """Every rank's rows of a data-parallel step, in rank order, each rank's padded to `rows`.

    valid:     [size * rows] bool, False on padding rows (which a router sends nowhere)
    token_ids: [size * rows] int64, each row's token id (0 on padding rows)
    rows:      the rows each rank brings (`ForwardMode.exchange_rows`)
    """

    valid: torch.Tensor
    token_ids: torch.Tensor
    rows: int


def row_exchange(token_ids: torch.Tensor, valid: torch.Tensor, mode: ForwardMode,
                 collectives: CollectiveOps) -> RowExchange | None:
    """This step's `RowExchange` when every rank brings its own rows (one all-gather), else None.

    token_ids [T] int64; valid [T] bool (this rank's padding rows False)."""
    if not collectives.tokens_split:
        return None
    rows, pad = mode.exchange_rows, mode.exchange_rows - token_ids.shape[0]
    if pad < 0:
        raise ValueError(f"a data-parallel step of {token_ids.shape[0]} rows exchanges {rows} a rank: plan it "
                         "with parallel.data_parallel.plan_rank_step")
    # One gather carries both: -1 marks a padding row.
    every = collectives.all_gather(F.pad(torch.where(valid, token_ids, -1), (0, pad), value=-1), dim=0)
    return RowExchange(valid=every >= 0, token_ids=every.clamp(min=0), rows=rows)


def attention_output(out: torch.Tensor, collectives: CollectiveOps) -> torch.Tensor:
    """A sharded layer's attention output [T, D]: summed over the ranks' heads, or this rank's own."""
    return out if collectives.tokens_split else collectives.all_reduce(out)


def _gathered(x: torch.Tensor, exchange: RowExchange, collectives: CollectiveOps) -> torch.Tensor:
    """Every rank's rows: x [T, D] -> [size * rows, D]."""
    pad = exchange.rows - x.shape[0]
    # A graph's decode step pads every rank to one key: its rows need no padding copy.
    return collectives.all_gather(x if pad == 0 else F.pad(x, (0, 0, 0, pad)), dim=0)


def _own_rows(sums: torch.Tensor, own: int, collectives: CollectiveOps) -> torch.Tensor:
    """This rank's `own` rows of every rank's rows summed over the ranks: sums [size * R, D] (R, the
    exchange's rows a rank) -> [own, D]."""
    return collectives.reduce_scatter(sums, dim=0)[:own]


def _required(exchange: RowExchange | None, collectives: CollectiveOps) -> RowExchange:
    if exchange is None:
        raise ValueError(f"a data-parallel step over {collectives.size} ranks needs the step's RowExchange "
                         "(core.exchange.row_exchange), which the forward makes once a step")
    return exchange


def shared_block(block: Callable[[torch.Tensor, torch.Tensor], torch.Tensor], x: torch.Tensor, valid: torch.Tensor,
                 exchange: RowExchange | None, collectives: CollectiveOps) -> torch.Tensor:
    """`block(x, valid)` [T, D] -> [T, D] of a block whose weights the ranks split (it returns this
    rank's partial sum): over this step's rows, or over every rank's rows when each rank holds its own.

    x [T, D]; valid [T] bool (padding rows False, which a router sends nowhere); exchange: the step's
    `row_exchange` (None unless every rank brings its own rows).
    """
    if not collectives.tokens_split:
        return collectives.all_reduce(block(x, valid))
    exchange = _required(exchange, collectives)
    return _own_rows(block(_gathered(x, exchange, collectives), exchange.valid), x.shape[0], collectives)


def shared_token_block(block: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor], x: torch.Tensor,
                       token_ids: torch.Tensor, valid: torch.Tensor, exchange: RowExchange | None,
                       collectives: CollectiveOps) -> torch.Tensor:
    """`shared_block` of a block that also reads each row's token id (a router that picks experts by
    token): `block(x, token_ids, valid)` [T, D] -> [T, D]; token_ids [T] int64. Every rank's ids come
    from the step's `exchange`."""
    if not collectives.tokens_split:
        return collectives.all_reduce(block(x, token_ids, valid))
    exchange = _required(exchange, collectives)
    every_x = _gathered(x, exchange, collectives)
    return _own_rows(block(every_x, exchange.token_ids, exchange.valid), x.shape[0], collectives)
