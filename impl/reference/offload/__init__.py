"""Scheduler side of vLLM 0.33.0's CPU offload: the SimpleCPU and OffloadingConnector schedulers,
the CPU offloading manager with LRU/ARC policies, offload keys and lookups. See docs/offload.md."""

from .arc_policy import ARCCachePolicy
from .cpu_offloading_manager import CPUOffloadingManager, PrepareStoreOutput
from .keys import (
    LookupResult,
    OffloadStateError,
    RequestContext,
    get_sliding_window_size_in_chunks,
    make_offload_key,
)
from .lookup import lookup_complete_chunks, maximal_prefix_lookup, sliding_window_lookup
from .lru_policy import LRUCachePolicy
from .offloading_scheduler import OffloadingConnectorScheduler, OffloadingStep
from .simple_cpu_offload_scheduler import SimpleCPUOffloadScheduler, SimpleOffloadStep


__all__ = ["ARCCachePolicy", "CPUOffloadingManager", "LRUCachePolicy", "LookupResult", "OffloadStateError",
           "OffloadingConnectorScheduler", "OffloadingStep", "PrepareStoreOutput",
           "RequestContext", "SimpleCPUOffloadScheduler",
           "SimpleOffloadStep", "get_sliding_window_size_in_chunks", "lookup_complete_chunks", "make_offload_key",
           "maximal_prefix_lookup", "sliding_window_lookup"]
