"""Triton kernels for NVIDIA GPUs (and the CPU interpreter under TRITON_INTERPRET=1)."""

from __future__ import annotations

from ..reference import rope as ref_rope
from ..registry import Ops
from .cache import write_kv
from .decode import mla_decode, mla_decode_num_splits, mla_decode_workspace
from .merge import merge_attn_states
from .moe import fused_moe
from .norm import rms_norm
from .prefill import prefill_attention

__all__ = [
    "fused_moe",
    "merge_attn_states",
    "mla_decode",
    "mla_decode_num_splits",
    "mla_decode_workspace",
    "ops",
    "prefill_attention",
    "rms_norm",
    "write_kv",
]


def ops() -> Ops:
    """The Triton op table."""
    return Ops(
        backend="triton",
        write_kv=write_kv,
        mla_decode=mla_decode,
        prefill_attention=prefill_attention,
        merge_attn_states=merge_attn_states,
        fused_moe=fused_moe,
        rms_norm=rms_norm,
        # RoPE touches [T, H, 64] + [T, 64] elements per layer, a few microseconds
        # of elementwise torch ops; it stays the reference until it is fused into
        # the q/kv projection epilogue, where a kernel would pay off.
        rope=ref_rope.rope,
    )
