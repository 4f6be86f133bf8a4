"""The CPU primary tier (vLLM ``tiering/manager.py::CPUPrimaryTierOffloadingManager``).

kvref's :class:`CPUOffloadingManager` plus the byte buffer secondary tiers read and write, and
``prepare_read``: a pin for a cascade that, unlike ``prepare_load``, is not a request's access
(it must not change the eviction policy's view of the request). Writes from secondary tiers use
``prepare_store``/``complete_store`` (vLLM aliases them ``prepare_write``/``complete_write``).
"""

from __future__ import annotations

from typing import Collection

from kvref.spec.errors import InvalidFieldError, check_int

from ..cpu_offloading_manager import CPUOffloadingManager, _check_keys
from ..keys import OffloadKey
from .tier_base import PrimaryBuffer


#: the largest primary buffer the reference allocates (it keeps every byte)
MAX_BUFFER_BYTES = 1 << 30


class CPUPrimaryTier(CPUOffloadingManager):
    def __init__(self, num_chunks: int, row_bytes: int, cache_policy: str = "lru",
                 enable_events: bool = False) -> None:
        check_int("row_bytes", row_bytes, minimum=1)
        check_int("num_chunks", num_chunks, minimum=1)
        if num_chunks * row_bytes > MAX_BUFFER_BYTES:
            raise InvalidFieldError("num_chunks", num_chunks, f"num_chunks * row_bytes <= {MAX_BUFFER_BYTES} "
                                                              "(the model holds the buffer in memory)")
        super().__init__(num_chunks, cache_policy=cache_policy, enable_events=enable_events)
        self.buffer = PrimaryBuffer(num_chunks, row_bytes)

    def prepare_read(self, keys: Collection[OffloadKey]) -> list[int]:
        """Pin ready chunks for a cascade; returns their chunk ids."""
        return self._pin_ready_chunks(_check_keys("keys", keys), "a cascade reads resident, ready chunks")
