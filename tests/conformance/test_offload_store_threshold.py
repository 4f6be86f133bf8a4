"""conform-offload drives the CPU offloading manager's admission filter against vLLM's (#22).

``store_threshold`` (``kv_connector_extra_config``): a chunk is stored only once it has been offered
that many times, offers being counted in an LRU table of at most ``max_tracker_size`` keys (vLLM's
``CPUOffloadingManager._record_accesses``: keys of the current offer are protected from ageing
out). ``OffloadingConfig.random`` draws a threshold of 2-3 one configuration in four, with a tracker
of a few keys or a roomy one. On the OffloadingConnector cases ``kvref verify`` draws (fixed seed,
the same on every run and profile) these tests count that offers are held back by the threshold
and that tracked offers age out, require clean vLLM to agree op by op, and plant two faults in
vLLM's own ``_record_accesses`` (source edits compiled in-process), each flagged.
"""

from __future__ import annotations

import contextlib
import inspect
import random
import sys
import textwrap
from collections import Counter

import pytest
from kvref.models.offload.offloading_connector_world import OffloadingConfig, OffloadingWorld
from kvref.models.offload.traces import apply_offloading_op

from tests.vllm_env import require_vllm

pytestmark = pytest.mark.vllm


def _threshold_cases(seed: int = 0, n: int = 80):
    from kvref.verify import _offload_cases

    for cfg, ops in _offload_cases(random.Random(seed), n):
        if isinstance(cfg, OffloadingConfig) and cfg.store_threshold >= 2:
            yield cfg, ops


def _first_divergence(cases) -> str | None:
    for i, (cfg, ops) in enumerate(cases):
        worlds = [OffloadingWorld(cfg, b, strict=False) for b in ("reference", "vllm")]
        for j, op in enumerate(ops):
            try:
                outs = [apply_offloading_op(w, op) for w in worlds]
            except KeyError:
                break  # vLLM 0.33.0's known KeyError after a connector reset (docs/offload.md)
            if outs[0] != outs[1] or worlds[0].observe() != worlds[1].observe():
                return f"trace {i} op {j} {op} on {cfg}"
    return None


@contextlib.contextmanager
def _planted(old: str, new: str):
    from vllm.v1.kv_offload.cpu import manager

    cls = manager.CPUOffloadingManager
    func = vars(cls)["_record_accesses"]
    src = inspect.getsource(func)
    assert src.count(old) == 1, old
    ns: dict = {}
    exec(compile(textwrap.dedent(src.replace(old, new)), "<fault _record_accesses>", "exec"),  # noqa: S102
         vars(sys.modules[manager.__name__]), ns)
    cls._record_accesses = ns["_record_accesses"]
    try:
        yield
    finally:
        cls._record_accesses = func


FAULTS = {
    # a repeated offer is not counted: nothing tracked ever reaches the threshold
    "repeat-not-counted": ("self.counts[key] += 1", "self.counts[key] += 0"),
    # the tracker evicts its newest entry instead of the oldest
    "tracker-evicts-newest": ("self.counts.popitem(last=False)", "self.counts.popitem(last=True)"),
}


@pytest.fixture(scope="module")
def V():
    require_vllm()
    import kvref.impl.vllm.offload  # noqa: F401  (imports vLLM once per module)


def test_generated_cases_hold_offers_back_and_age_them_out():
    seen: Counter = Counter()
    for cfg, ops in _threshold_cases():
        seen["configs"] += 1
        w = OffloadingWorld(cfg, "reference", strict=False)
        manager = w._b.manager
        original = manager.prepare_store

        def prepare_store(keys, ctx, manager=manager, original=original):
            keys = list(keys)
            tracked = len(manager.counts)
            out = original(keys, ctx)
            seen["held back"] += sum(manager.policy.get(k) is None and manager.counts.get(k, 0) < manager.store_threshold
                                     for k in keys)
            seen["aged out"] += len(manager.counts) < tracked + sum(k not in manager.counts for k in keys)
            return out

        manager.prepare_store = prepare_store
        for op in ops:
            try:
                apply_offloading_op(w, op)
            except KeyError:
                break
    assert seen["configs"] >= 5, seen
    assert seen["held back"] >= 20, seen
    assert seen["aged out"] >= 3, seen


def test_vllm_agrees_with_a_store_threshold(V):
    assert _first_divergence(_threshold_cases()) is None


@pytest.mark.parametrize("fault", sorted(FAULTS))
def test_planted_admission_fault_is_flagged(V, fault):
    with _planted(*FAULTS[fault]):
        found = _first_divergence(_threshold_cases())
    assert found is not None, f"{fault} not flagged"
