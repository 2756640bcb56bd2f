"""Multi-token prediction: DeepSeek-V3's MTP layer as a drafter of speculative decoding.
"""
