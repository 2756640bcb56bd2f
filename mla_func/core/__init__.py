"""The pure function and its inputs: config, family record, plan, mode, batch, per-row views, layer
protocol, forward, and the memoized step.

Nothing here names a model family; a model reaches its family through `config.family`.
"""
