"""Row tiles of a fixed height: the reference's way of making a product's rows independent of their count.

A BLAS picks its code path by the problem's shape (a GEMV for one row, other
blockings for more), so `F.linear(x)[t]` may change in the last bits with the
number of rows of x. Run on tiles of exactly `ROW_TILE` rows (the last one
zero-padded), every BLAS call has one shape, so a row reduces the same way in a
batch of 1 or of 1000. The batch-invariant reference tables (`reference.invariant`,
`reference.v4_invariant`) build their products from these.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from . import linear as ref_linear

ROW_TILE = 16


def by_row_tiles(fn: Callable[..., torch.Tensor | tuple[torch.Tensor, ...]],
                 *rows: torch.Tensor, tile: int = ROW_TILE) -> tuple[torch.Tensor, ...]:
    """fn over `tile`-row slices of `rows` (same first dim; the last slice zero-padded),
    each of its results concatenated over the slices and cut back to the rows given."""
    num_rows = rows[0].shape[0]
    pad = -num_rows % tile or (tile if num_rows == 0 else 0)
    if pad:
        rows = tuple(torch.cat([r, r.new_zeros((pad, *r.shape[1:]))]) for r in rows)
    parts = []
    for piece in zip(*(r.split(tile) for r in rows)):
        result = fn(*piece)
        parts.append(result if isinstance(result, tuple) else (result,))
    return tuple(torch.cat(column)[:num_rows] for column in zip(*parts))


def linear(x: torch.Tensor, weight: torch.Tensor, *, out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """`reference.linear.linear` on ROW_TILE-row tiles: x [T, K], weight [N, K] -> [T, N]."""
    return by_row_tiles(lambda tile: ref_linear.linear(tile, weight, out_dtype=out_dtype), x)[0]
