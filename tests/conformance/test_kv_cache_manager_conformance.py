"""Conformance of kvref's KV cache manager with vLLM 0.33.0's own ``KVCacheManager``.

The state machine drives both through the shared protocol with identical scheduler-level ops
(admission with prefix hits and the full-sequence gate, chunked prefill, decode, async in-flight
tokens, preemption and re-admission, frees, pool exhaustion, cache salts) and compares admission
decisions, hit lengths and ids, block ids per group (exactly), free-queue order and cached hashes
after every op. The CI profile runs at least 200 generated traces of at least 30 steps.
"""

from __future__ import annotations

import time

import pytest
from hypothesis import settings
from hypothesis.stateful import run_state_machine_as_test

from kvref.impl.interface import PoolConfig, make_manager
from kvref.impl.request import Request, RequestStatus
from kvref.models.conformance.differential import Divergence, Harness, replay
from kvref.models.machines.kv_cache_manager import kv_cache_manager_machine
from kvref.models.strategies.pools import GROUP_SETS
from kvref.models.conformance.trace import Op, Trace
from kvref.spec.errors import InvalidFieldError
from kvref.spec.kv_cache_interface import FullAttentionSpec, KVCacheGroupSpec, SlidingWindowSpec
from tests.conftest import profile_examples
from tests.vllm_env import require_vllm

pytestmark = pytest.mark.vllm

MIN_STEPS = 30
STEP_COUNT = 40


@pytest.fixture(scope="module")
def vllm_adapter():
    require_vllm()
    import kvref.impl.vllm.kv_cache_manager as adapter  # noqa: PLC0415 - imports vLLM (~6 s), once per module

    return adapter


def _fa_swa_pool(num_blocks: int = 64) -> PoolConfig:
    fa = FullAttentionSpec(block_size=16, num_kv_heads=1, head_size=1, dtype="float32")
    swa = SlidingWindowSpec(block_size=16, num_kv_heads=1, head_size=1, dtype="float32", sliding_window=32)
    return PoolConfig(num_blocks=num_blocks, groups=(KVCacheGroupSpec(("full",), fa), KVCacheGroupSpec(("swa",), swa)),
                      max_model_len=8192, scheduler_block_size=16, hash_block_size=16)


def _run(machine, examples: int) -> float:
    t = time.perf_counter()
    run_state_machine_as_test(machine, _min_steps=MIN_STEPS + 1,  # the initialize step counts as one
                              settings=settings(max_examples=examples, stateful_step_count=STEP_COUNT))
    return time.perf_counter() - t


def test_adapter_reproduces_vllms_hybrid_allocation(vllm_adapter):
    """FA + SWA, block size 16: the ids vLLM 0.33.0 hands out (shared_prefix via the hash map)."""
    m = make_manager("vllm", _fa_swa_pool())
    a = Request("a", list(range(70)))
    assert m.get_computed_blocks(a) == (((), ()), 0)
    assert m.allocate_slots(a, 70) == ((1, 2, 3, 4, 5), (6, 7, 8, 9, 10))
    a.num_computed_tokens, a.status = 70, RequestStatus.RUNNING
    b = Request("b", list(range(48)) + [999] * 5)
    hit, n = m.get_computed_blocks(b)
    assert n == 48 and hit == ((1, 2, 3), (0, 7, 8))  # SWA: the block before the window is null
    assert m.allocate_slots(b, 5, n, hit) == ((11,), (12,))
    assert m.get_block_ids("b") == ((1, 2, 3, 11), (0, 7, 8, 12))
    assert m.get_num_free_blocks() == 51
    assert len(m.cached_blocks()) == 8  # the 4 full blocks of "a" in each group; "b" adds no full block
    m.check_invariants()
    m.free(b)
    m.free(a)
    assert m.get_num_free_blocks() == 63
    # Uncached tails go to the front (reused first), cached blocks to the back in eviction order.
    queue = m.free_block_queue()
    cached_ids = {bid for (_, bid) in m.cached_blocks()}
    first_cached = next(i for i, bid in enumerate(queue) if bid in cached_ids)
    assert all(bid in cached_ids for bid in queue[first_cached:first_cached + len(cached_ids)])
    m.check_invariants()


def test_adapter_rejects_bad_input(vllm_adapter):
    with pytest.raises(InvalidFieldError, match="pool_config"):
        vllm_adapter.VllmKVCacheManager("not a pool")
    with pytest.raises(InvalidFieldError, match="kind"):
        make_manager("no-such-implementation", _fa_swa_pool())
    m = make_manager("vllm", _fa_swa_pool())
    r = Request("r", [1, 2, 3])
    assert m.allocate_slots(r, 3) is not None
    r.output_token_ids.append(5)
    m.allocate_slots(r, 1)
    r.output_token_ids.clear()  # outputs never shrink in vLLM: the mirror refuses
    with pytest.raises(InvalidFieldError, match="output_token_ids"):
        m.allocate_slots(r, 1)
    with pytest.raises(InvalidFieldError, match="new_computed_block_ids"):
        m.allocate_slots(Request("s", [1] * 40), 8, 16, ((999,), (1,)))
    with pytest.raises(InvalidFieldError, match="request"):
        m.get_computed_blocks("r")


def test_adapter_invariants_catch_a_corrupted_vllm_pool(vllm_adapter):
    m = make_manager("vllm", _fa_swa_pool())
    r = Request("r", list(range(40)))
    m.allocate_slots(r, 40)
    m.check_invariants()
    block = m._pool.blocks[1]
    block.ref_cnt += 1  # a leaked reference: held once by r's table, counted twice
    with pytest.raises(AssertionError, match="I9"):
        m.check_invariants()
    block.ref_cnt -= 1
    m._pool.free_block_queue.num_free_blocks += 1
    with pytest.raises(AssertionError, match="I5"):
        m.check_invariants()


def test_vllm_alone_keeps_its_own_invariants(vllm_adapter):
    """The harness's ops are valid vLLM usage: vLLM never raises and its pool stays consistent."""
    machine = kv_cache_manager_machine(("vllm",))
    _run(machine, profile_examples(15, 60))
    assert machine.stats.runs_with_at_least(MIN_STEPS) >= profile_examples(15, 60)


def test_reference_conforms_to_vllm(vllm_adapter):
    """The differential pairing: ≥ 200 traces of ≥ 30 steps under the ci profile."""
    examples = profile_examples(40, 200)
    machine = kv_cache_manager_machine(("reference", "vllm"))
    seconds = _run(machine, examples)
    st = machine.stats
    long_runs = st.runs_with_at_least(MIN_STEPS)
    assert long_runs >= examples, f"only {long_runs} of {len(st.steps)} traces reached {MIN_STEPS} steps"
    # The generated traces must exercise what they claim to (a vacuous strategy fails here). The
    # fast profile's 40 traces are too few to rely on every rare event.
    assert st.admissions > 0 and st.admission_rejections > 0 and st.preemptions > 0
    if examples >= 200:
        def rare_events(st):
            return {"prefix_hits": st.prefix_hits, "step_rejections": st.step_rejections,
                    "async_batches": st.async_batches, "external_loads": st.external_loads,
                    "evictions": st.evictions, "null_slots": st.null_slots}

        if not all(rare_events(st).values()):
            # Generation is random under the ci profile: one batch of 200 traces can miss a rare
            # event (a CI run once drew no step rejection). Draw a second batch before calling the
            # strategy vacuous; the stats accumulate over both.
            _run(machine, examples)
        missed = [name for name, n in rare_events(st).items() if not n]
        assert not missed, f"400 generated traces never reached {missed}: {st}"
        assert len(st.group_sets) >= 5, st.group_sets
    print(f"\nreference vs vLLM: {long_runs} traces, {st.ops_applied} ops in {seconds:.1f}s "
          f"({st.ops_applied / seconds:.0f} steps/s end to end, {st.ops_applied / st.seconds_in_harness:.0f} "
          f"steps/s in the harness); group sets {st.group_sets}; admissions {st.admissions} (with a prefix hit {st.prefix_hits}), rejected "
          f"{st.admission_rejections}, step rejections {st.step_rejections}, preemptions {st.preemptions}, "
          f"async batches {st.async_batches}, external loads {st.external_loads}, evictions {st.evictions}, "
          f"partial-block hashes {st.partial_entries}; seconds inside each implementation "
          f"{ {k: round(v, 2) for k, v in st.seconds_by_kind.items()} }")


def test_saved_trace_replays_and_divergence_is_reported(vllm_adapter, tmp_path):
    pool = _fa_swa_pool(num_blocks=12)
    h = Harness(pool, {"vllm-a": make_manager("vllm", pool), "vllm-b": make_manager("vllm", pool)})
    ops = [Op("add", dict(rid="a", prompt=list(range(40)), max_tokens=3, cache_salt=None)),
           Op("admit", dict(rid="a", chunk=64, full_sequence_must_fit=True, reserved_blocks=0, in_flight=False,
                            token=7)),
           Op("add", dict(rid="b", prompt=list(range(40)), max_tokens=3, cache_salt="salt")),
           Op("admit", dict(rid="b", chunk=64, full_sequence_must_fit=True, reserved_blocks=0, in_flight=False,
                            token=7)),
           Op("step", dict(rid="a", chunk=1, lookahead=0, in_flight=False, token=1)),
           Op("preempt", dict(rid="a")),
           Op("new_step", {}),
           Op("admit", dict(rid="a", chunk=64, full_sequence_must_fit=False, reserved_blocks=0, in_flight=False,
                            token=2)),
           Op("finish", dict(rid="b"))]
    for op in ops:
        h.apply(op)
    path = h.trace.save(tmp_path / "t.json")
    loaded = Trace.load(path)
    assert loaded.dumps() == h.trace.dumps()
    assert replay(loaded, ("vllm",)).ok
    assert replay(loaded, ("reference", "vllm")).ok
    # A manager that reorders its free queue must be caught by the comparison.
    vllm_mgr = make_manager("vllm", pool)

    class Reordered:
        def __getattr__(self, name):
            return getattr(vllm_mgr, name)

        def free_block_queue(self):
            return tuple(reversed(vllm_mgr.free_block_queue()))

    bad = Harness(pool, {"vllm": make_manager("vllm", pool), "vllm-reordered": Reordered()})
    with pytest.raises(Divergence, match="free_block_queue differs"):
        for op in ops:
            bad.apply(op)


@pytest.mark.parametrize("group_set", GROUP_SETS)
def test_each_group_set_conforms(vllm_adapter, group_set):
    """A few traces per group set, so none is starved by the mix of the main test."""
    machine = kv_cache_manager_machine(("reference", "vllm"), group_sets=(group_set,))
    _run(machine, profile_examples(5, 10))
    assert machine.stats.runs_with_at_least(MIN_STEPS) >= profile_examples(5, 10)


def test_eagle_pools_conform(vllm_adapter):
    """Every pool with EAGLE on (hits drop their last block; hybrid groups cache one block past the
    scheduler-block boundary, so full-attention blocks get partial-prefix hashes)."""
    machine = kv_cache_manager_machine(("reference", "vllm"), eagle="always",
                                       group_sets=tuple(g for g in GROUP_SETS if "chunked" not in g))
    _run(machine, profile_examples(10, 40))
    assert machine.stats.runs_with_at_least(MIN_STEPS) >= profile_examples(10, 40)
