"""DeepSeek-V3.2: MLA with DeepSeek Sparse Attention (a lightning indexer and top-k selection).
"""
