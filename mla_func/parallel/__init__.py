"""Sharding a model across ranks: the `Parallel` value, joining a group, reading a rank's shard.

A sharded model is the same pure forward over one rank's shard of the params pytree; the
shard knows its ranks (`Params.collectives`), and the layers join partial results with
`ops.collectives` (see `mla_func.kernels.collectives`).
"""

from mla_func.parallel.config import Parallel
from mla_func.parallel.launch import join, leave

__all__ = ["Parallel", "join", "leave"]
