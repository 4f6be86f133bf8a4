"""The vLLM pieces the scheduler adapters use, imported once per process.

A module of its own so that every adapter that needs vLLM's scheduler-side classes (the scheduler
adapter, the scripted KV connector) imports them from here, not from one another (#26: the
connector and the scheduler adapter imported each other).
"""

from __future__ import annotations

import os
from typing import Any

_V: dict[str, Any] = {}


def load_vllm() -> dict[str, Any]:
    """Import the vLLM pieces the adapter needs (once per process) and return them by name."""
    if _V:
        return _V
    os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    import torch
    from vllm.config import CacheConfig, ModelConfig, SchedulerConfig as VSchedulerConfig, VllmConfig
    from vllm.sampling_params import SamplingParams
    from vllm.utils.hashing import sha256
    from vllm.v1 import kv_cache_interface as vk
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
    from vllm.v1.core.sched.async_scheduler import AsyncScheduler
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.outputs import DraftTokenIds as VDraftTokenIds, ModelRunnerOutput
    from vllm.v1.request import Request as VRequest, RequestStatus as VStatus
    from vllm.v1.structured_output import StructuredOutputManager

    _V.update(locals())
    return _V
