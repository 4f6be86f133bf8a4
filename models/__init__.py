"""kvref.models: everything that drives implementations and compares them.

One sub-package per concept: ``machines`` (Hypothesis state machines), ``conformance`` (harnesses,
traces, accepted differences), ``explorer`` (exhaustive small-scope search), ``offload`` (the two
CPU-offload engines), ``strategies`` (Hypothesis strategies), ``mutants`` (fault campaigns, on the
reference and on vLLM's source), ``run_check`` (checking a recorded vLLM run), ``kv_events`` (the
KV-event stream watcher) and ``hypothesis_runs`` (reproducible, bounded Hypothesis runs).
"""
