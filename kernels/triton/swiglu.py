"""The SwiGLU activation of the expert kernels' float32 gate and up accumulators (one tile function)."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def swiglu_activation(acc_gate, acc_up, limit, X_DTYPE: tl.constexpr, CLAMP: tl.constexpr):
    """silu(gate) * up of float32 accumulators, rounded to x's dtype as the reference keeps it. With CLAMP,
    DeepSeek-V4's clamped SwiGLU (`moe`'s CLAMP path): the pre-activations rounded to x's dtype first, as
    the reference's projections are, then the gate clamped from above at `limit`, up both ways."""
    if CLAMP:
        acc_gate = tl.minimum(acc_gate.to(X_DTYPE).to(tl.float32), limit)
        acc_up = tl.minimum(tl.maximum(acc_up.to(X_DTYPE).to(tl.float32), -limit), limit)
    return (acc_gate / (1.0 + tl.exp(-acc_gate)) * acc_up).to(X_DTYPE)
