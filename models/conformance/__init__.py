"""Conformance harnesses: one trace applied to several implementations and compared.

``differential`` (the KV-cache-manager harness and its divergence reports), ``trace`` (a plain,
replayable trace of scheduler-level operations), ``accepted`` (differences a vLLM developer
accepted on purpose, via a baseline), ``startup_liveness`` (startup sizing's word checked at runtime).
The state machines that generate the traces live in :mod:`kvref.models.machines`.
"""
