"""Hypothesis state machines and lock-step drivers that drive several implementations with the
same operations and compare them: ``block_pool``, ``single_type_manager``, ``kv_cache_manager``,
``scheduler`` (plus its fake model runner), ``torch_differential`` and ``torch_datapath`` (the torch
implementation and its data path against the reference).
"""
