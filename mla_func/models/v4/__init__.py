"""DeepSeek-V4: window, compressed and heavily compressed attention layers, sinks, hyper-connections,
hash-routed experts.
"""
