"""vLLM 0.33.0's KVCR secondary tier (kvcr 0.1.1, local DRAM, real NIXL/UCX copies) and the tiering
manager's tier-poll thread with a peer-serving tier, against kvref's reference, every observable
compared after every operation (#22); and faults planted in vLLM's code that the traces must find."""

from __future__ import annotations

import pytest

from tests.conftest import profile_examples
from tests.vllm_env import require_vllm

pytestmark = pytest.mark.vllm

KVCR_LAYOUTS = (("kvcr",), ("kvcr", "fs"), ("fs", "kvcr"))
POLLED_LAYOUTS = (("PolledTier", "fs"), ("fs", "PolledTier"), ("RequestLevelTier", "PolledTier"))


def _require_kvcr():
    require_vllm()
    pytest.importorskip("kvcr")
    pytest.importorskip("nixl")


def _traces(seed: int, n: int, layouts) -> dict:
    from kvref.models.machines.tiering import run_traces

    return run_traces(seed, n, layouts=layouts)


def test_kvcr_traces_agree_and_reach_the_kvcr_paths():
    """Seeded (deterministic) KVCR traces: every answer and state agrees, and KVCR's paths are
    reached: hits served back to the primary tier, LRU/FIFO evictions, stores refused with no
    evictable slot, failed copies, framework pins for a peer's read."""
    _require_kvcr()
    n = profile_examples(4, 12)
    stats = _traces(0, n, KVCR_LAYOUTS + (("kvcr",),))  # KVCR alone twice as often: pins run there
    assert stats["traces"] == n == stats["kvcr_traces"]
    for path in ("kvcr_hits", "kvcr_loads_ok", "kvcr_evictions", "kvcr_stores_ok", "kvcr_stores_failed",
                 "kvcr_copy_failures", "kvcr_pins"):
        assert stats.get(path, 0) > 0, (path, stats)


def test_poll_thread_traces_agree_and_serve_peers():
    """Seeded traces with a tier that opts into vLLM's tier-poll thread: rounds between manager
    calls collect its jobs and serve a peer's reads (pins through the parent, released later)."""
    _require_kvcr()
    n = profile_examples(3, 9)
    stats = _traces(1, n, POLLED_LAYOUTS)
    assert stats["polled_traces"] == n
    assert stats["poll_rounds"] > 0 and stats["peer_pins"] > 0, stats


def _finds(monkeypatch, target: str, replacement, layouts, seeds=range(3), n: int = 4) -> str:
    """Plant ``replacement`` at ``target`` (module:attribute path) in vLLM and return the divergence."""
    _require_kvcr()
    import importlib

    from kvref.models.machines.tiering import TieringDivergence

    mod_name, attr = target.split(":")
    obj = importlib.import_module(mod_name)
    *owners, name = attr.split(".")
    for o in owners:
        obj = getattr(obj, o)
    monkeypatch.setattr(obj, name, replacement(getattr(obj, name)))
    for seed in seeds:
        try:
            _traces(seed, n, layouts)
        except TieringDivergence as exc:
            return str(exc)
    raise AssertionError(f"the planted fault at {target} was not found")


K = "vllm.v1.kv_offload.tiering.kvcr.manager"


def test_finds_a_kvcr_store_that_ignores_failed_copies(monkeypatch):
    """A store job must fail when a block's copy failed (the primary chunk's pin is released either
    way, but the cascade failure is counted and back-pressure sees a failure)."""
    def optimistic(orig):
        def poll(self):
            from vllm.v1.kv_offload.tiering.base import JobResult

            return [JobResult(r.job_id, True, None, r.transfer_time, r.transfer_bytes) for r in orig(self)]
        return poll

    msg = _finds(monkeypatch, f"{K}:KVCRSecondaryTierManager._poll_finished_jobs", optimistic, KVCR_LAYOUTS)
    assert "vLLM" in msg


def test_finds_kvcr_evictions_that_are_not_announced(monkeypatch):
    """Every block KVCR evicts from its DRAM is announced as removed (a KV-event consumer would
    otherwise route requests to blocks that are gone)."""
    def silent(orig):
        def record(self, event):
            if not event.removed:
                orig(self, event)
        return record

    msg = _finds(monkeypatch, f"{K}:KVCRSecondaryTierManager._record_inventory", silent, KVCR_LAYOUTS)
    assert "events" in msg


def test_finds_pins_that_are_never_released(monkeypatch):
    """A framework pin kvcr gives back must end its store job (the primary chunks are unpinned)."""
    def keep(orig):
        def release_pin(self, pin_handle):
            return True
        return release_pin

    msg = _finds(monkeypatch, f"{K}:_FrameworkPinAdapter.release_pin", keep, (("kvcr",),), seeds=range(4))
    assert "vLLM" in msg


def test_finds_a_poll_round_that_leaves_the_step_gate_shut(monkeypatch):
    """A tier-poll round must put the step's poll gate back: left shut, the next lookups of the
    step skip their poll and answer from stale state."""
    def sticky(orig):
        def poll_tiers(self):
            self._process_finished_jobs(self._polled_tiers)
            self._processed_jobs_this_step = True
            for tier in self._polled_tiers:
                tier.serve_external_requests(self._tier_parents[tier])
        return poll_tiers

    msg = _finds(monkeypatch, "vllm.v1.kv_offload.tiering.manager:TieringOffloadingManager.poll_tiers", sticky,
                 POLLED_LAYOUTS)
    assert "vLLM" in msg


def test_kvcr_configs_are_refused_as_the_reference_says():
    """Generated KVCR tier configs behind an fs tier: vLLM builds exactly those the reference
    accepts, refuses the others with the rule's exception, and shuts the fs tier it built down."""
    _require_kvcr()
    from kvref.models.machines.tiering_config import run_config_cases

    # 16 at fast: seed 0's first 8 cases are all refusals (the fast profile failed with 8)
    n = profile_examples(16, 30)
    stats = run_config_cases(0, n)
    assert stats["configs"] == n
    assert stats["configs_accepted"] > 0 and stats["configs_refused"] > 0, stats


def test_finds_a_kvcr_tier_that_accepts_any_router(monkeypatch):
    """Planted: vLLM's KVCR tier no longer requires the router_hint capability."""
    _require_kvcr()
    import vllm.v1.kv_offload.tiering.kvcr.manager as km

    from kvref.models.machines.tiering_config import ConfigDivergence, run_config_cases

    monkeypatch.setattr(km, "_REQUIRED_ROUTER_CAPABILITIES", frozenset())
    with pytest.raises(ConfigDivergence, match="router"):
        run_config_cases(0, 8, ("router_capabilities",))


def test_every_config_rule_is_reached():
    """Seeded (no Hypothesis draw): three rounds of the check's families (its fast run is one, seed 0)
    refuse for every rule vLLM and kvcr check, and build some."""
    _require_kvcr()
    from kvref.models.machines.tiering_config import run_config_cases

    stats = run_config_cases(0, 36)
    rules = ("policy", "kvcr_service_socket_path", "router_capabilities", "self_describing_kv_events",
             "control_ports", "secondary_g2_slots", "operation_timeout_ms", "g3", "backend")
    assert stats["configs_accepted"] > 3 and [r for r in rules if not stats.get(f"refused_{r}")] == [], stats


KVCR_PLANTED = [  # (the family of cases that finds it, the edit)
    # with no local data-parallel rank the tier binds a port that is not there
    ("any", "dp_local_rank = 0\n", "dp_local_rank = 1\n"),
    # a data-parallel engine binds the first port, not its own
    ("dp_rank", "control_ports[dp_local_rank],", "control_ports[0],"),
    # a G3 tier's inventory is published without naming its tier
    ("self_describing", "or g3 is not None\n            )\n            and not self_describing_events",
     ")\n            and not self_describing_events"),
    # a negative slot count is taken as none
    ("secondary_g2_slots", "if secondary_g2_slots < 0:", "if secondary_g2_slots < -1:"),
    # the inventory sink is installed with KV events off
    ("events_off", "inventory_sink=(self._record_inventory if events_enabled else None)",
     "inventory_sink=self._record_inventory"),
    # local DRAM is configured beside a KVCR service
    ("service", "            if kvcr_service_socket_path is not None:\n                logger.warning(",
     "            if False:\n                logger.warning("),
    # a KVCR startup failure closes the buffers native work may still write into
    ("g3", "if not isinstance(exc, Exception) or isinstance(exc, KVCRStartupError):", "if False:"),
    # the local DRAM mapping is not kept after a startup failure that could not stop native work
    ("backend", "if local_mapping is not None:\n                    _RETAINED_NATIVE_BUFFERS.append(",
     "if False:\n                    _RETAINED_NATIVE_BUFFERS.append("),
]
KVCR_PLANTED_ELSEWHERE = [  # (family, method of KVCRSecondaryTierManager, the edit)
    # KVCR's metrics are declared without telemetry
    ("any", "build_metric_definitions", 'if not extra_config.get("enable_telemetry", False):', "if False:"),
    # KVCR's stats lose vLLM's namespace
    ("any", "get_stats", "metrics[_vllm_metric_name(name)] = metrics.pop(name)", "pass"),
]


@pytest.mark.parametrize("family,old,new", KVCR_PLANTED, ids=[f"{f}-{i}" for i, (f, _, _) in enumerate(KVCR_PLANTED)])
def test_planted_kvcr_config_faults_are_found(family, old, new):
    _require_kvcr()
    from kvref.models.machines.tiering_config import ConfigDivergence, run_config_cases
    from tests.conformance.tiering_planted import edited

    with edited("vllm.v1.kv_offload.tiering.kvcr.manager", "KVCRSecondaryTierManager", "__init__", old, new), \
            pytest.raises(ConfigDivergence):
        run_config_cases(0, 8, (family,))


@pytest.mark.parametrize("family,method,old,new", KVCR_PLANTED_ELSEWHERE, ids=[m for _, m, _, _ in KVCR_PLANTED_ELSEWHERE])
def test_planted_kvcr_metric_faults_are_found(family, method, old, new):
    _require_kvcr()
    from kvref.models.machines.tiering_config import ConfigDivergence, run_config_cases
    from tests.conformance.tiering_planted import edited

    with edited("vllm.v1.kv_offload.tiering.kvcr.manager", "KVCRSecondaryTierManager", method, old, new), \
            pytest.raises(ConfigDivergence):
        run_config_cases(0, 8, (family,))
