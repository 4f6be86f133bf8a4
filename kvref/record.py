"""``--scheduler-cls kvref.record.RecordingAsyncScheduler``: record a vLLM run for ``kvref check-run``.

The public names vLLM's ``--scheduler-cls`` takes. Importing this module is cheap (vLLM's
``resolve_obj_by_qualname`` imports it, then asks for the class): the classes themselves live in
:mod:`kvref.impl.vllm.record`, the one layer that imports vLLM, and are loaded on first access.
See that module (and docs/record.md) for the settings: ``KVREF_RECORD=/path/run.kvtrace.gz``,
``KVREF_RECORD_ANONYMIZE=1``.
"""

from __future__ import annotations

__all__ = ["RecordingAsyncScheduler", "RecordingScheduler"]


def __getattr__(name: str):
    if name in __all__:
        from kvref.impl.vllm import record

        return getattr(record, name)
    raise AttributeError(f"module 'kvref.record' has no attribute {name!r}")
