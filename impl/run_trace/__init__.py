"""kvref.impl.run_trace — the trace of a real vLLM run, as the reference needs it to replay it.

A *run trace* is what :mod:`kvref.impl.vllm.record` writes while vLLM serves (through vLLM's own
``--scheduler-cls`` hook) and what ``kvref check-run`` reads: a versioned header (the KV cache
config and scheduler settings), then one JSON record per line — arrivals, aborts, every
``schedule()`` as the KV cache sees it, every ``update_from_output`` — gzip-compressed as a stream
so a run of any length is written and checked in bounded memory. Stdlib only; the format is
documented in docs/record.md and in :mod:`.format`.
"""

from .format import (
    FORMAT,
    OPTIONAL_RECORD_TYPES,
    RECORD_TYPES,
    VERSION,
    TokenAnonymizer,
    TraceFormatError,
    decode_tokens,
    encode_tokens,
)
from .reader import TraceReader
from .writer import TraceWriter

__all__ = [
    "FORMAT", "OPTIONAL_RECORD_TYPES", "RECORD_TYPES", "VERSION", "TokenAnonymizer", "TraceFormatError",
    "TraceReader", "TraceWriter", "decode_tokens", "encode_tokens",
]
