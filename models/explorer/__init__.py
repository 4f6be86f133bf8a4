"""The explicit-state explorer: every reachable state of a small scope, exhaustively.

``engine`` (breadth-first search over a ``System``), ``vocabulary`` (steps, traces, findings),
``search`` (the level-synchronous search, one process or many), ``toy`` (a toy system), and the
systems plugged into it: ``kv`` (the reference KV cache manager + scheduler), ``simple_cpu`` (the
SimpleCPU offload path), ``offloading_connector`` (the OffloadingConnector path); ``conformance``
replays every transition of a scope's graph on vLLM.
"""
