"""Block residency metrics (vLLM ``--kv-cache-metrics``, issue #22): the reference
``KVCacheMetricsCollector`` on the reference pool, and vLLM's own collector on vLLM's pool paired
with it by the KV-manager machine (``kv_metrics_pairing``) — the machine behind
``conform-kv-manager``."""

from __future__ import annotations

import pytest

from kvref.impl.reference.block_pool import BlockPool
from kvref.impl.reference.kv_cache_metrics import KVCacheMetricsCollector
from kvref.models.machines.kv_metrics_pairing import event_time_errors, metrics_view
from kvref.spec.errors import InvalidFieldError
from tests.conftest import profile_examples
from tests.vllm_env import require_vllm


class Clock:
    """A clock the test moves: one second per reading."""

    def __init__(self) -> None:
        self.now = 0

    def __call__(self) -> int:
        self.now += 10**9
        return self.now


def _pool(caching: bool = True, rate: float = 1.0, sampler=None) -> tuple[BlockPool, KVCacheMetricsCollector]:
    pool = BlockPool(num_gpu_blocks=6, enable_caching=caching, hash_block_size=2)
    pool.metrics_collector = KVCacheMetricsCollector(rate, sampler=sampler, clock=Clock())
    return pool, pool.metrics_collector


def test_a_followed_block_reports_its_life_when_reused():
    pool, m = _pool()
    a, b = pool.get_new_blocks(2)
    assert metrics_view(m) == {a.block_id: 0, b.block_id: 0}
    pool.touch([a])
    pool.touch([a])
    assert metrics_view(m) == {a.block_id: 2, b.block_id: 0}
    pool.free_blocks([a, a, a, b])
    # the whole pool again: b and a are reused, so both report their lives (a: two hits, one gap)
    taken = pool.get_new_blocks(5)
    events = m.drain_events()
    assert sorted(len(e.reuse_gaps_seconds) for e in events) == [0, 1]
    assert all(not event_time_errors(e) for e in events)
    hit = next(e for e in events if e.reuse_gaps_seconds)
    assert hit.idle_seconds < hit.lifetime_seconds  # a was hit after it was allocated
    assert set(metrics_view(m)) == {blk.block_id for blk in taken}


def test_without_caching_a_reused_block_is_not_evicted():
    pool, m = _pool(caching=False)
    (a,) = pool.get_new_blocks(1)
    pool.free_blocks([a])
    pool.get_new_blocks(5)
    assert m.drain_events() == []
    assert a.block_id in metrics_view(m)


def test_sampling_follows_the_sampler_and_reset_forgets_everything():
    draws = iter([0.9, 0.1, 0.7, 0.2, 0.0])
    pool, m = _pool(rate=0.5, sampler=lambda: next(draws))
    blocks = pool.get_new_blocks(4)
    assert sorted(metrics_view(m)) == [blocks[1].block_id, blocks[3].block_id]
    assert not pool.reset_prefix_cache()  # blocks in use: refused, nothing forgotten
    assert len(metrics_view(m)) == 2
    pool.free_blocks(blocks)
    assert pool.reset_prefix_cache()
    assert metrics_view(m) == {} and m.drain_events() == []


def test_evict_blocks_reports_a_followed_block():
    pool, m = _pool()
    (a,) = pool.get_new_blocks(1)
    pool.evict_blocks([a.block_id])
    assert [len(e.reuse_gaps_seconds) for e in m.drain_events()] == [0]
    assert metrics_view(m) == {}


@pytest.mark.parametrize("bad", [0, -0.5, 1.5, True, "0.5", None])
def test_a_bad_sample_rate_names_the_field(bad):
    with pytest.raises(InvalidFieldError, match="sample_rate"):
        KVCacheMetricsCollector(bad)


def test_impossible_event_times_are_reported():
    from kvref.impl.reference.kv_cache_metrics import KVCacheEvictionEvent

    assert event_time_errors(KVCacheEvictionEvent(1.0, -2.0, ()))
    assert event_time_errors(KVCacheEvictionEvent(1.0, 0.5, (0.9, 0.9)))
    assert event_time_errors(KVCacheEvictionEvent(1.0, 0.5, (0.1, -0.1)))
    assert not event_time_errors(KVCacheEvictionEvent(1.0, 1.0001, ()))  # vLLM's second clock read
    assert not event_time_errors(KVCacheEvictionEvent(1.0, 0.5, (0.2, 0.3)))


@pytest.mark.vllm
def test_vllm_metrics_match_the_reference_on_generated_traces():
    require_vllm()
    from kvref.models.machines.kv_cache_manager import run_machine

    run = run_machine(("reference", "vllm"), profile_examples(8, 20), seed=0, shrink=False)
    assert run.ok, run.failure
    s = run.stats
    assert s.metrics_events > 0 and s.metrics_max_followed > 0


def _hit_trace(pairing_differs: list) -> None:
    """Reference and vLLM managers paired with metrics on: a request computes 16 tokens, finishes,
    and a second one with the same prompt hits its blocks (accesses of followed blocks); then
    both go and a third takes the pool's blocks again (evictions with reuse gaps)."""
    from kvref.impl.interface import PoolConfig, make_manager
    from kvref.models.conformance.differential import Harness
    from kvref.models.conformance.trace import Op
    from kvref.models.machines.kv_metrics_pairing import MetricsPairing
    from kvref.spec.kv_cache_interface import FullAttentionSpec, KVCacheGroupSpec

    spec = FullAttentionSpec(block_size=4, num_kv_heads=1, head_size=8, dtype="float16")
    pool = PoolConfig(num_blocks=9, groups=(KVCacheGroupSpec(("l0",), spec),), max_model_len=32,
                      scheduler_block_size=4, hash_block_size=4, enable_caching=True)
    managers = {k: make_manager(k, pool) for k in ("reference", "vllm")}
    h = Harness(pool, managers)
    pairing = MetricsPairing(managers, 9)  # odd: every block followed
    prompt = list(range(17))
    ops = [Op("add", dict(rid="a", prompt=prompt, max_tokens=1, cache_salt=None)),
           Op("admit", dict(rid="a", chunk=17, full_sequence_must_fit=False, reserved_blocks=0, in_flight=False,
                            token=5)),
           Op("finish", dict(rid="a"))]
    for turn in ("b", "c"):
        ops += [Op("add", dict(rid=turn, prompt=prompt + [1], max_tokens=1, cache_salt=None)),
                Op("admit", dict(rid=turn, chunk=18, full_sequence_must_fit=False, reserved_blocks=0,
                                 in_flight=False, token=5)),
                Op("finish", dict(rid=turn))]
    ops += [Op("add", dict(rid="d", prompt=list(range(100, 131)), max_tokens=1, cache_salt=None)),
            Op("admit", dict(rid="d", chunk=31, full_sequence_must_fit=False, reserved_blocks=0, in_flight=False,
                             token=5))]
    for op in ops:
        with pairing.vllm_random():
            h.apply(op)
        pairing_differs.append(pairing.compare())
    assert pairing.max_followed_hit > 0 and pairing.num_events_with_gaps > 0


@pytest.mark.vllm
def test_hits_and_reuse_gaps_are_compared():
    require_vllm()
    differs: list = []
    _hit_trace(differs)
    assert differs and all(d is None for d in differs), differs


@pytest.mark.vllm
@pytest.mark.parametrize("planted", ["on_block_accessed", "on_block_evicted"])
def test_a_vllm_collector_that_misses_a_call_is_found(monkeypatch, planted):
    require_vllm()
    from vllm.v1.core.kv_cache_metrics import KVCacheMetricsCollector as VllmCollector

    monkeypatch.setattr(VllmCollector, planted, lambda self, block: None)
    differs: list = []
    _hit_trace(differs)
    assert any(d is not None and "KV cache metrics" in d for d in differs)
