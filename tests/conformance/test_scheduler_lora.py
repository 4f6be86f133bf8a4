"""LoRA's ``max_loras`` admission rule in the scheduler (issue #22): the reference scheduler
(:mod:`kvref.impl.reference.scheduler_lora`) in lock step with vLLM 0.33.0's (``scheduler_lora``
machine, part of ``conform-scheduler``).

A vLLM whose limit is one adapter higher than the reference's must diverge."""

from __future__ import annotations

import pytest

from tests.conformance.scheduler_targets import vllm_scheduler  # noqa: F401 - the module-scoped fixture

#: the derandomized traces the tests run (the check draws 4 at fast, 30 at ci)
EXAMPLES = 8


@pytest.mark.vllm
def test_lora_traces_match_vllm_and_hold_back_one_adapter_too_many(vllm_scheduler):
    from kvref.models.machines.scheduler_lora import run_lora_machine

    run = run_lora_machine(EXAMPLES, reproducible=True)
    assert run.ok, run.failure
    assert run.traces >= 6
    for path in ("lora_held_waiting", "lora_admitted_past_held"):
        assert run.coverage.get(path, 0) > 0, (path, run.coverage)


@pytest.mark.vllm
def test_vllm_with_one_adapter_more_is_a_divergence(vllm_scheduler, monkeypatch):
    from kvref.models.machines.scheduler_lora import run_lora_machine

    original = vllm_scheduler.VllmScheduler._set_max_loras
    monkeypatch.setattr(vllm_scheduler.VllmScheduler, "_set_max_loras",
                        lambda self, max_loras: original(self, max_loras + 1))
    run = run_lora_machine(EXAMPLES, reproducible=True, shrink=False)
    assert not run.ok
    assert "Divergence" in run.failure, run.failure


def test_a_third_adapter_waits_and_the_request_behind_it_is_admitted():
    """max_loras=2 and two adapters running: a waiting request with a third adapter is skipped,
    the one behind it (an adapter already running) is admitted past it, and the skipped one
    keeps its place at the head of the queue."""
    from kvref.impl.interface import PoolConfig
    from kvref.impl.reference.scheduler import Scheduler
    from kvref.impl.request import LoRARequest, Request
    from kvref.impl.scheduler_types import ModelOutput, SchedulerConfig
    from kvref.models.machines.scheduler import _attn
    from kvref.spec.kv_cache_interface import FullAttentionSpec, KVCacheGroupSpec

    cfg = SchedulerConfig(max_num_batched_tokens=64, max_num_seqs=4)
    pool = PoolConfig.off_plan("room for four short requests", num_blocks=24,
                               groups=(KVCacheGroupSpec(("full",), _attn(FullAttentionSpec, 4)),), max_model_len=32,
                               scheduler_block_size=4, hash_block_size=4,
                               max_in_flight_tokens=cfg.max_in_flight_tokens, enable_caching=True)
    s = Scheduler(pool, cfg, max_loras=2)

    def req(rid, lora_id):
        return Request(rid, [lora_id] * 5, max_tokens=8, lora_request=LoRARequest(f"a{lora_id}", lora_id, "/a"))

    s.add_request(req("a", 1))
    s.add_request(req("b", 2))
    out = s.schedule()
    s.update_from_output(out, ModelOutput({x.request_id: [7] for x in out.scheduled}))
    s.add_request(req("c", 3))
    s.add_request(req("d", 1))
    out = s.schedule()
    assert {x.request_id for x in out.scheduled} == {"a", "b", "d"}
    assert [r.request_id for r in s.waiting] == ["c"]
    s.check_invariants()


def test_bad_max_loras_is_rejected():
    from kvref.impl.interface import PoolConfig
    from kvref.impl.reference.scheduler import Scheduler
    from kvref.impl.reference.scheduler_connector import ScriptedConnector
    from kvref.impl.scheduler_types import SchedulerConfig
    from kvref.models.machines.scheduler import _attn
    from kvref.spec.errors import InvalidFieldError
    from kvref.spec.kv_cache_interface import FullAttentionSpec, KVCacheGroupSpec

    cfg = SchedulerConfig(max_num_batched_tokens=8, max_num_seqs=2)
    pool = PoolConfig.off_plan("a small pool", num_blocks=8,
                               groups=(KVCacheGroupSpec(("full",), _attn(FullAttentionSpec, 4)),), max_model_len=16,
                               scheduler_block_size=4, hash_block_size=4,
                               max_in_flight_tokens=cfg.max_in_flight_tokens, enable_caching=True)
    for bad in (0, -1, 1.5, "2"):
        with pytest.raises(InvalidFieldError, match="max_loras"):
            Scheduler(pool, cfg, max_loras=bad)
    with pytest.raises(InvalidFieldError, match="max_loras"):
        Scheduler(pool, cfg, connector=ScriptedConnector(), max_loras=1)
