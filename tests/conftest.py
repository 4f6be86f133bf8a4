"""Shared pytest set-up: Hypothesis profiles, vLLM availability, GPU marker handling.

Profiles: ``fast`` (default, for a laptop), ``ci`` (selected when CI=true, see scripts/run-tests.sh),
``nightly`` (100x the CI example counts). Pick one with ``KVREF_HYPOTHESIS_PROFILE``.
"""

from __future__ import annotations

import os
import sys

import pytest
from hypothesis import HealthCheck, settings

_COMMON = dict(deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                                      HealthCheck.filter_too_much])
settings.register_profile("fast", max_examples=50, **_COMMON)
# Not derandomized: seeded runs (run_machine(seed=...), kvref verify --seed inside a test) inherit
# the loaded profile, and a derandomized profile would make every seed draw the same traces (tried:
# test_kv_events' four seeded runs then repeat one trace and miss resets). Tests that assert a rare
# path was reached derandomize themselves (models/hypothesis_runs/reproducible.py).
settings.register_profile("ci", max_examples=200, derandomize=False, print_blob=True, **_COMMON)
settings.register_profile("nightly", max_examples=20000, print_blob=True, **_COMMON)
settings.load_profile(os.environ.get("KVREF_HYPOTHESIS_PROFILE", "ci" if os.environ.get("CI") == "true" else "fast"))

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")


def profile_examples(fast: int, ci: int, nightly: int | None = None) -> int:
    """Example count for the active profile (for tests that need more or fewer than the default)."""
    name = settings._current_profile  # type: ignore[attr-defined]
    if name == "nightly":
        return nightly if nightly is not None else ci * 100
    return ci if name == "ci" else fast


@pytest.fixture(autouse=True, scope="module")
def _release_native_agents():
    """After each test module, the NIXL agents its vLLM worlds started are destroyed (the P2P
    world's pool, what KVCR start-ups left: kvref.impl.vllm.native_agents): each agent's UCX
    threads poll with a zero timeout for as long as it exists, and a module that left a handful
    made every later test of its process crawl (#22/#26). Nothing is imported for a module that
    drove neither."""
    yield
    if "kvref.impl.vllm.p2p_nixl" in sys.modules or "kvref.impl.vllm.tiering_kvcr" in sys.modules:
        from kvref.impl.vllm.native_agents import release_native_agents

        release_native_agents()


def _cuda_available() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return torch.cuda.is_available()


def interpreter_wanted(environ, cuda_available) -> bool:
    """Whether to set ``TRITON_INTERPRET=1``: only when unset and no CUDA device is present.

    Triton has no CPU back-end; with ``TRITON_INTERPRET=1`` the kernel tests (``tests/impl/torch``)
    run kvref's kernels on CPU tensors in its interpreter. Where a CUDA device is present the
    variable is left unset, so the kernels compile and run on CUDA tensors (issue #24: forcing the
    interpreter on a GPU machine never ran the cubins). A caller's explicit setting wins either
    way (``TRITON_INTERPRET=0`` without a GPU: the kernel tests skip with the reason).

    Decided here, in the root conftest, before any test module is imported: triton reads the
    variable when a function is decorated, and that includes triton.language's own ``@jit``
    helpers (``tl.zeros``, ``tl.sum``'s combiners), decorated when ``triton.language`` is first
    imported. Collecting ``tests/conformance`` imports vLLM, which imports triton.language; when
    the variable was set only by ``tests/impl/torch/conftest.py`` (collected later) those helpers
    stayed compiled-mode functions, and every kernel test of an xdist worker that had collected
    them first failed with "Cannot call @triton.jit'd outside of the scope of a kernel" (57 of
    58 failures of stop 36's CI).
    """
    return "TRITON_INTERPRET" not in environ and not cuda_available()


if interpreter_wanted(os.environ, _cuda_available):
    os.environ["TRITON_INTERPRET"] = "1"


def _profile_only_skip(item) -> str | None:
    """The reason of a ``skipif`` whose condition holds and that names another Hypothesis profile
    (``reason="nightly profile only"``), for a parametrized case; else None."""
    if getattr(item, "callspec", None) is None:
        return None
    for mark in item.iter_markers("skipif"):
        reason = str(mark.kwargs.get("reason", ""))
        conditions = mark.args or (mark.kwargs.get("condition"),)
        if "nightly" in reason and all(isinstance(c, bool) and c for c in conditions):
            return reason
    return None


#: test files scripts/run-tests.sh runs in its one-process pass after the parallel one (marked
#: ``serial`` here): each starts its own Ray cluster (two at once on one machine stalled a retry test
#: for 20 minutes), or sends SIGINT at a wall-clock moment that a loaded core makes meaningless
SERIAL_FILES = frozenset({
    "tests/cli/test_ray.py",
    "tests/cli/test_ray_explore.py",
    "tests/hardening/test_interrupts.py",
})

#: test files scripts/run-tests.sh runs last, each in a process of its own (marked ``isolated``):
#: a file that leaves native threads busy for the rest of its process, where the leak cannot be
#: reached (``scripts/native_thread_probe.py FILE`` measures what a file leaves). None at present:
#: test_tiering_kvcr.py and the five test_p2p*.py files were here (their NIXL agents' UCX threads
#: polled with a zero timeout, 1-2 cores busy for every later test of the process: CI ran past
#: 5,400 s, stop 33) until the agents were destroyed when a module ends (the fixture above,
#: kvref.impl.vllm.native_agents; #22/#26): each now leaves no busy thread
ISOLATED_FILES: frozenset[str] = frozenset()

#: set by the hook below: how many profile-only parametrizations were left out, for the one line
_PROFILE_DESELECTED: list[int] = []


def pytest_collection_modifyitems(config, items):
    # Cases the active profile will not run are not collected (issue #25: `make test` printed ~120
    # lines of `s` for 8,350 nightly-only parametrizations, and "collected 11,964" overstated what
    # runs); pytest reports them as deselected, and the header says so in one line.
    keep, left_out = [], []
    for item in items:
        (left_out if _profile_only_skip(item) else keep).append(item)
    if left_out:
        config.hook.pytest_deselected(items=left_out)
        items[:] = keep
    _PROFILE_DESELECTED[:] = [len(left_out)]
    for item in items:
        path = item.nodeid.split("::", 1)[0]
        if path in SERIAL_FILES:
            item.add_marker(pytest.mark.serial)
        if path in ISOLATED_FILES:
            item.add_marker(pytest.mark.isolated)
    if not _cuda_available():
        skip_gpu = pytest.mark.skip(reason="no CUDA device on this machine (GPU-only test)")
        for item in items:
            if "gpu" in item.keywords:
                item.add_marker(skip_gpu)


def pytest_report_collectionfinish(config, start_path, items):
    n = _PROFILE_DESELECTED[0] if _PROFILE_DESELECTED else 0
    if n:
        return (f"kvref: {n:,} nightly-only parametrized cases not collected under the "
                f"{settings._current_profile!r} profile (KVREF_HYPOTHESIS_PROFILE=nightly runs them)")  # type: ignore[attr-defined]
    return []
