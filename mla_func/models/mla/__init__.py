"""DeepSeek-V2 and V3: Multi-head Latent Attention over one latent cache, dense MLP and routed experts.

The pieces V3.2 (`models.dsa`) and the MTP layer (`models.mtp`) share are here too: the attention
params (with an optional indexer's projections), the feed-forward blocks, config.json reading.
"""
