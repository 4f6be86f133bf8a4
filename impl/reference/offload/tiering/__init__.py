"""Multi-tier CPU offloading (vLLM 0.33.0 ``vllm/v1/kv_offload/tiering/``), the reference.

``TieringOffloadingManager`` (manager.py) puts secondary tiers behind the CPU offloading manager:
every chunk stored to the CPU *primary* tier is cascaded to every secondary tier, a primary miss
is looked up in the secondary tiers and promoted back (the lookup answers HIT_PENDING meanwhile),
and chunks read by a cascade are pinned by ref counts. The secondary tiers modelled are vLLM's
file-system tier (fs_tier.py, with its async lookups, async_lookup.py) and its in-memory example
tier (example_tier.py); backpressure.py is the store-latency detector that drops cascades to a
slow tier. Work that vLLM runs on threads (fs I/O, the lookup worker) happens here only when the
caller says so (``finish_job``, ``run_lookup_worker``), so a trace fixes every interleaving.
"""
