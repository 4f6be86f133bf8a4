"""The one loader of vLLM: the pieces every adapter uses, imported once per process (#26).

Every adapter in :mod:`kvref.impl.vllm` (the KV cache manager, the scheduler, the scripted KV
connector, the spec converter in :mod:`.specs`) takes vLLM's classes from :func:`load_vllm`, so the
environment vLLM needs on CPU, the ``NONE_HASH`` it starts from and the message a missing vLLM gives
are set in one place. (There were two loaders, one per adapter; :mod:`.specs` says how their dtype
mappings differed.)
"""

from __future__ import annotations

import os
from typing import Any

_V: dict[str, Any] = {}


def set_cpu_environment() -> None:
    """The environment vLLM needs to import and run on a machine without a GPU (caller's values win)."""
    os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")


def load_vllm() -> dict[str, Any]:
    """Import the vLLM pieces the adapters need (once per process) and return them by name.

    Raises ImportError naming what is missing when vLLM cannot be imported.
    """
    if _V:
        return _V
    set_cpu_environment()
    try:
        import torch
        from vllm.config import CacheConfig, ModelConfig, SchedulerConfig as VSchedulerConfig, VllmConfig
        from vllm.lora.request import LoRARequest
        from vllm.multimodal.inputs import MultiModalFeatureSpec, PlaceholderRange
        from vllm.sampling_params import SamplingParams
        from vllm.utils.hashing import get_hash_fn_by_name, sha256
        from vllm.utils.torch_utils import STR_DTYPE_TO_TORCH_DTYPE
        from vllm.v1 import kv_cache_interface as kci
        from vllm.v1.core import kv_cache_utils as utils
        from vllm.v1.core.kv_cache_manager import KVCacheBlocks, KVCacheManager
        from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
        from vllm.v1.core.sched.async_scheduler import AsyncScheduler
        from vllm.v1.core.sched.scheduler import Scheduler
        from vllm.v1.outputs import DraftTokenIds as VDraftTokenIds, ModelRunnerOutput
        from vllm.v1.request import Request as VRequest, RequestStatus as VStatus
        from vllm.v1.structured_output import StructuredOutputManager
    except ImportError as exc:  # pragma: no cover - depends on the environment
        raise ImportError(f"kvref.impl.vllm needs vLLM installed (any version; kvref models 0.33.0): {exc}") from exc
    # NONE_HASH is process-global in vLLM; sha256 seeds it with a fixed string (or PYTHONHASHSEED),
    # which is what kvref's reference hashing reproduces.
    init_none_hash(sha256)
    loaded = dict(locals())
    loaded.pop("exc", None)
    loaded["dtypes"] = STR_DTYPE_TO_TORCH_DTYPE
    _V.update(loaded)
    return _V
