"""Serving: the engine, its scheduler and requests, sampling and penalties, and speculative decoding.
"""
