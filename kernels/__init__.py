"""Ops behind functional wrappers: a torch reference, Triton kernels, AITER on ROCm."""

from .ops import DenseOps, MLAOps, MoEOps, Ops
from .registry import BACKENDS, default_backend, ops_for, record_expert_choice

__all__ = ["BACKENDS", "DenseOps", "MLAOps", "MoEOps", "Ops", "default_backend", "ops_for", "record_expert_choice"]
