"""Small engines around the two CPU-offload schedulers, with content models beside them.

"SimpleCPU" is vLLM's ``simple_kv_offload`` scheduler (``simple_cpu_world``); "OffloadingConnector" is
the offloading connector's scheduler + CPU offloading manager (``offloading_connector_world``);
``world_common`` is the engine side both share, ``traces`` the random engine traces they run.
"""
