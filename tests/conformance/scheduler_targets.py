"""The targets the scheduler conformance tests drive in lock step, built once for every module that
compares kvref's scheduler with vLLM 0.33.0's (``vllm_env`` is a module-scoped fixture: importing
vLLM takes seconds, so once per test module):

* ``vllm``: vLLM's own scheduler and KV cache manager;
* ``ref``: the reference scheduler on the reference KVCacheManager;
* ``ref+vllmkv`` (with ``shim``): the reference scheduler on vLLM's KVCacheManager (isolates
  scheduling rules from block management).
"""

from __future__ import annotations

import pytest

from kvref.impl.reference.scheduler import Scheduler
from tests.vllm_env import require_vllm


@pytest.fixture(scope="module")
def vllm_env():
    require_vllm()
    from kvref.impl.vllm import scheduler as vllm_scheduler  # noqa: PLC0415 - imports vLLM (~6 s), once per module

    return vllm_scheduler, vllm_scheduler.VllmEnv()


def scheduler_targets(vllm_env, shim: bool = True) -> dict:
    """{target name: (pool config, scheduler config) -> scheduler} for :class:`Lockstep` and ``machine_with``."""
    mod, env = vllm_env
    targets = {"vllm": lambda p, c: mod.VllmScheduler(p, c, env), "ref": lambda p, c: Scheduler(p, c)}
    if shim:
        targets["ref+vllmkv"] = lambda p, c: Scheduler(p, c, mod.VllmKVCacheManagerShim(p, env))
    return targets


@pytest.fixture(scope="module")
def vllm_scheduler():
    """kvref's vLLM scheduler adapter module (``kvref.impl.vllm.scheduler``), imported once per test
    module; skips where vLLM is not installed. The scheduler-level conformance modules take it by
    importing this fixture instead of each keeping a copy."""
    require_vllm()
    from kvref.impl.vllm import scheduler  # noqa: PLC0415 - imports vLLM (~6 s), once per module

    return scheduler
