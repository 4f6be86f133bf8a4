"""conform-offload's SimpleCPU generator reaches the behaviour classes the vLLM campaign found escaping.

Three SimpleCPU source faults (docs/vllm_mutants.md) survived conform-offload because its traces
never took their paths: async scheduling (a request carries output placeholders while the
connector picks the blocks to store), a block-aligned prompt looked up again when its last block
is on the CPU (the hit must stop one token short), and the preemption of a request whose store
cursor had advanced. The tests count, on fixed traces drawn the way the check draws them
(``SimpleOffloadConfig.random`` + ``random_ops``), that each path is taken, and then plant each
fault in vLLM's own ``SimpleCPUOffloadScheduler`` in-process (the catalogue's edit compiled into
the one method it touches, :mod:`tests.conformance.simple_offload_faults`) and require a
reference-vs-vLLM divergence on the same traces. Clean vLLM agrees on all of them.
"""

from __future__ import annotations

import random
from collections import Counter

import pytest
from kvref.models.offload.simple_cpu_world import (
    SimpleOffloadConfig,
    SimpleOffloadWorld,
)
from kvref.models.offload.traces import apply_op, random_ops

from tests.conformance.simple_offload_faults import vllm_fault
from tests.vllm_env import require_vllm

pytestmark = pytest.mark.vllm

N_TRACES = 40  # the SimpleCPU half of conform-offload's fast budget (80 traces)


@pytest.fixture(scope="module")
def V():
    require_vllm()
    import kvref.impl.vllm.offload  # noqa: F401  (imports vLLM once per module)


def _cases(seed: int, n: int = N_TRACES):
    rng = random.Random(seed)
    for _ in range(n):
        cfg = SimpleOffloadConfig.random(rng)
        yield cfg, random_ops(rng, rng.randint(30, 70))


class _CountingWorld(SimpleOffloadWorld):
    """Counts the paths the three fault classes live on (reference backend)."""

    def __init__(self, *a, counts: Counter, **kw) -> None:
        super().__init__(*a, **kw)
        self.counts = counts

    def step(self, chunk):
        eager = not self.cfg.lazy
        placeholders = [rid for rid in self.live("running") if self.reqs[rid].req.num_output_placeholders]
        bs = self.cfg.block_size
        fresh = [rid for rid in self.live("waiting") if self.reqs[rid].computed == 0
                 and self.reqs[rid].req.num_tokens % bs == 0]
        state = self.b.connector_state()["stores"]
        resumed = [rid for rid in self.live("waiting") if self.reqs[rid].computed == 0
                   and any(state.get(rid, ([0],))[0])]
        meta = super().step(chunk)
        if eager and placeholders and meta[3] >= 0:
            self.counts["async_store_with_placeholders"] += 1
        if meta[0] >= 0 and any(rid in self.load_event_of for rid in fresh):
            self.counts["aligned_prompt_cpu_load"] += 1
        if any(self.reqs[rid].phase != "waiting" for rid in resumed):
            self.counts["resumed_after_stores"] += 1
        return meta

    def _preempt_request(self, r):
        if any(self.b.connector_state()["stores"].get(r.rid, ([0],))[0]):
            self.counts["preempted_with_store_cursor"] += 1
        super()._preempt_request(r)


def test_generator_reaches_async_stores_aligned_cpu_hits_and_preempted_cursors():
    counts: Counter = Counter()
    for cfg, ops in _cases(0):
        counts["async_traces"] += cfg.async_scheduling
        w = _CountingWorld(cfg, "reference", allow_duplicates_within_event=True, counts=counts)
        for op in ops:
            apply_op(w, op)
    need = ("async_traces", "async_store_with_placeholders", "aligned_prompt_cpu_load",
            "preempted_with_store_cursor", "resumed_after_stores")
    assert all(counts[k] > 0 for k in need), dict(counts)


def _first_divergence(seed: int) -> tuple[int, int, str] | None:
    for i, (cfg, ops) in enumerate(_cases(seed)):
        worlds = [SimpleOffloadWorld(cfg, b, allow_duplicates_within_event=True) for b in ("reference", "vllm")]
        for j, op in enumerate(ops):
            try:
                outs = [apply_op(w, op) for w in worlds]
            except AssertionError as exc:  # the content model (vLLM's world) caught it
                return i, j, f"invariant: {exc}"
            if outs[0] != outs[1]:
                return i, j, "step outputs differ"
            if worlds[0].observe() != worlds[1].observe():
                return i, j, "observed state differs"
    return None


def test_clean_vllm_agrees_on_the_traces(V):
    assert _first_divergence(0) is None


@pytest.mark.parametrize("fault_id", ["simple.stores_unconfirmed_tokens", "simple.hit_covers_last_token",
                                      "simple.preempt_keeps_store_cursor"])
def test_planted_fault_is_flagged(V, fault_id):
    with vllm_fault(fault_id):
        found = _first_divergence(0)
    assert found is not None, f"{fault_id} survived {N_TRACES} SimpleCPU traces"
