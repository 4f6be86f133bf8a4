"""The prefill cadence, the adaptive long-prefill threshold and PRIORITY victims already scheduled
in the step, in ``conform-scheduler`` (issue #22): the reference scheduler in lock step with vLLM
0.33.0's (``scheduler_branches``).

Planted faults show the comparison sees each rule: a vLLM without the cadence, or without the
adaptive floor, must diverge."""

from __future__ import annotations

import pytest

from tests.conftest import profile_examples
from tests.conformance.scheduler_targets import vllm_scheduler  # noqa: F401 - the module-scoped fixture


@pytest.mark.vllm
def test_branch_traces_match_vllm_and_reach_every_rule(vllm_scheduler):
    from kvref.models.machines.scheduler_branches import run_branches_machine

    # the same derandomized traces under every profile: the rare paths asserted below are reached
    # by these 30 (the check itself draws 150 at ci)
    run = run_branches_machine(30, reproducible=True)
    assert run.ok, run.failure
    assert run.traces >= 25
    c = run.coverage
    for path in ("cadence_held_chunk", "cadence_held_waiting", "cadence_capacity_escape",
                 "adaptive_threshold_raised", "outranking_arrivals", "priority_victim_before_scheduled"):
        assert c.get(path, 0) > 0, (path, c)


def _planted(vllm_scheduler, monkeypatch, field: str, value) -> None:
    original = vllm_scheduler.VllmEnv.configure

    def configure(self, pool, config):
        vc = original(self, pool, config)
        setattr(vc.scheduler_config, field, value)
        return vc

    monkeypatch.setattr(vllm_scheduler.VllmEnv, "configure", configure)


@pytest.mark.vllm
@pytest.mark.parametrize("field, value", [("prefill_schedule_interval", 1),
                                          ("long_prefill_token_threshold_adaptive", False)])
def test_vllm_without_the_rule_is_a_divergence(vllm_scheduler, monkeypatch, field, value):
    from kvref.models.machines.scheduler_branches import run_branches_machine

    _planted(vllm_scheduler, monkeypatch, field, value)
    run = run_branches_machine(profile_examples(30, 60), reproducible=True, shrink=False)
    assert not run.ok
    assert "Divergence" in run.failure, run.failure


@pytest.mark.vllm
def test_a_priority_victim_already_scheduled_gives_its_step_back(vllm_scheduler):
    """Two requests decode on a full pool; the one behind (better priority) needs a block, so the
    first, scheduled already in this step, is the victim: vLLM takes it out of the step (tokens,
    blocks) and both agree on the batch, the queues and the free blocks."""
    from kvref.impl.interface import PoolConfig
    from kvref.impl.reference.scheduler import Scheduler
    from kvref.impl.scheduler_types import PRIORITY, SchedulerConfig
    from kvref.models.machines.scheduler import RequestSpec, _attn
    from kvref.models.machines.scheduler_branches import BranchesLockstep
    from kvref.spec.kv_cache_interface import FullAttentionSpec, KVCacheGroupSpec

    env = vllm_scheduler.VllmEnv()
    cfg = SchedulerConfig(max_num_batched_tokens=16, max_num_seqs=4, policy=PRIORITY)
    pool = PoolConfig.off_plan("two requests that outgrow seven blocks together", num_blocks=7,
                               groups=(KVCacheGroupSpec(("full",), _attn(FullAttentionSpec, 2)),), max_model_len=16,
                               scheduler_block_size=2, hash_block_size=2,
                               max_in_flight_tokens=cfg.max_in_flight_tokens, enable_caching=False)
    d = BranchesLockstep(pool, cfg, {"vllm": lambda p, c: vllm_scheduler.VllmScheduler(p, c, env),
                                     "ref": lambda p, c: Scheduler(p, c)})
    d.add(RequestSpec("a", tuple(range(1, 6)), 10, 2, 0.0))
    d.engine_step()
    d.add(RequestSpec("b", (9, 9, 9, 9), 10, -5, 1.0))
    d.engine_step()
    out = d.schedule()  # compared with vLLM inside
    assert [s.request_id for s in out.scheduled] == ["b"]
    assert out.preempted_req_ids == {"a"}
    assert d.last_snapshot.running == ("b",)
