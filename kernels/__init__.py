"""Ops behind functional wrappers: a torch reference, Triton kernels, AITER on ROCm."""

from .collectives import SINGLE_PROCESS, group_collectives, with_collectives
from .ops import CollectiveOps, DenseOps, MLAOps, MoEOps, Ops
from .registry import BACKENDS, default_backend, ops_for, record_expert_choice

__all__ = ["BACKENDS", "SINGLE_PROCESS", "CollectiveOps", "DenseOps", "MLAOps", "MoEOps", "Ops", "default_backend",
           "group_collectives", "ops_for", "record_expert_choice", "with_collectives"]
