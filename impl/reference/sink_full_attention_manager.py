"""Full attention with attention-sink tokens (vLLM ``SinkFullAttentionManager``).

Behaves exactly as full attention; the sink (``sink_len`` tokens) must fill whole blocks. NOTE:
vLLM 0.33.0 cannot build this manager through its coordinator (its ``__init__`` does not take
``needs_kv_cache_zeroing``, which ``get_manager_for_kv_cache_spec`` passes: ``TypeError``), so
only the reference runs it behind ``KVCacheManager`` (docs/differences.md).
"""

from __future__ import annotations

from kvref.spec.errors import InvalidFieldError
from kvref.spec.kv_cache_interface import SinkFullAttentionSpec

from .full_attention_manager import FullAttentionManager


class SinkFullAttentionManager(FullAttentionManager):
    def __init__(self, kv_cache_spec: SinkFullAttentionSpec, **kwargs) -> None:
        super().__init__(kv_cache_spec, **kwargs)
        sink_len = kv_cache_spec.sink_len
        if sink_len is None or sink_len % self.block_size:
            raise InvalidFieldError("SinkFullAttentionSpec.sink_len", sink_len,
                                    f"a positive multiple of block_size={self.block_size} (vLLM asserts)")
        self.sink_len = sink_len
