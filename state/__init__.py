"""Explicit state pytrees: the paged latent KV cache and the block allocator."""
