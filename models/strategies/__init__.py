"""Hypothesis strategies: ``pools`` (KV cache pools and the requests that run on them) and
``planning`` (layer sets and engine settings for startup planning).
"""
