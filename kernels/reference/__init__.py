"""Plain-PyTorch reference implementations: run anywhere, differentiable, the oracle."""
