"""The SimpleCPU connector's look-up / allocation hand-off edges, reference vs vLLM 0.33.0 on
generated traces (:mod:`kvref.models.offload.simple_cpu_lookup_edges`, issue #22): clean vLLM
agrees and the probes meet real CPU hits; each planted fault in vLLM's
``get_num_new_matched_tokens`` / ``update_state_after_alloc`` is caught."""

from __future__ import annotations

import contextlib
import inspect
import random
import sys
import textwrap

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.conftest import profile_examples
from tests.vllm_env import require_vllm

pytestmark = pytest.mark.vllm


@pytest.fixture(scope="module")
def E():
    require_vllm()
    import kvref.impl.vllm.offload  # noqa: F401  (imports vLLM once per module)
    from kvref.models.offload import simple_cpu_lookup_edges

    return simple_cpu_lookup_edges


def test_clean_vllm_agrees_and_the_edges_are_met(E):
    stats = E.run_lookup_edge_cases(1, 12)  # fixed draws (random.Random): the same under every profile
    assert stats["traces"] == 12
    assert stats["probes"] > 0
    assert stats["hits_declined"] > 0  # a pinned CPU hit the scheduler took none of
    assert stats["unissued_loads"] > 0  # an allocated load dropped before the worker got it
    assert stats["dropped_by_reset"] > 0  # ... by a connector reset
    assert stats["aborted_while_pinned"] > 0  # aborted between the look-up and the allocation


@settings(max_examples=profile_examples(5, 20), deadline=None, database=None)
@given(seed=st.integers(0, 2**31 - 1), n_ops=st.integers(10, 40))
def test_generated_traces_agree(E, seed, n_ops):
    from kvref.models.offload.simple_cpu_world import SimpleOffloadConfig
    from kvref.models.offload.traces import random_ops

    rng = random.Random(seed)
    E.run_lookup_edges(SimpleOffloadConfig.random(rng), random_ops(rng, n_ops), seed)


@contextlib.contextmanager
def _planted(method: str, old: str, new: str):
    """vLLM's ``SimpleCPUOffloadScheduler.<method>`` with ``old`` replaced by ``new`` (once)."""
    from vllm.v1.simple_kv_offload import manager

    cls = manager.SimpleCPUOffloadScheduler
    func = vars(cls)[method]
    src = inspect.getsource(func)
    assert src.count(old) == 1, (method, old)
    ns: dict = {}
    exec(compile(textwrap.dedent(src.replace(old, new)), f"<fault {method}>", "exec"),  # noqa: S102
         vars(sys.modules[manager.__name__]), ns)
    setattr(cls, method, ns[method])
    try:
        yield
    finally:
        setattr(cls, method, func)


FAULTS = {
    # a request that reads no prefix cache still gets a CPU hit
    "skip-reading-ignored": ("get_num_new_matched_tokens", "if request.skip_reading_prefix_cache:", "if False:"),
    # a retried look-up keeps the first look-up's pin (the CPU block is never freed)
    "stale-pin-kept": ("get_num_new_matched_tokens",
                       "if stale := self._pending_cpu_hits.pop(request.request_id, None):",
                       "if (stale := self._pending_cpu_hits.pop(request.request_id, None)) and False:"),
    # a hit the scheduler declined keeps its pin
    "declined-pin-kept": ("update_state_after_alloc", "a pending CPU hit; releasing the stale pin.\",\n"
                          "                    req_id,\n                )\n"
                          "                self._free_pending_cpu_hit(pending)",
                          "a pending CPU hit; releasing the stale pin.\",\n"
                          "                    req_id,\n                )"),
    # an aborted request's load that was never issued keeps its CPU and GPU pins
    "unissued-load-kept": ("request_finished", "            else:\n                self._cleanup_load_request(req_id)",
                           "            else:\n                pass"),
    # a request aborted between its look-up and its allocation keeps the CPU hit pinned
    "abort-keeps-pin": ("request_finished", "if pending is not None:\n            self._free_pending_cpu_hit(pending)",
                        "if pending is not None:\n            pass"),
    # a reset keeps an un-issued load (and its pins) as if it were running on the worker
    "reset-keeps-unissued-load": ("reset", "                self._reqs_to_load[req_id] = state\n"
                                  "                self._cleanup_load_request(req_id)",
                                  "                self._abandoned_reqs_to_load[req_id] = state"),
}


@pytest.mark.parametrize("fault", sorted(FAULTS))
def test_planted_fault_is_caught(E, fault):
    from kvref.models.offload.world_common import OffloadInvariantError

    with _planted(*FAULTS[fault]), pytest.raises(OffloadInvariantError):
        E.run_lookup_edge_cases(1, 12)
