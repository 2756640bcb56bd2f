"""The model families, each in its folder (`mla`, `dsa`, `v4`, `mtp`), the registry from a config.json
`model_type` to its family, and loading: checkpoints, shape presets and random weights.
"""
