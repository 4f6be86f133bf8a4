"""Issue #23: multi-module MTP's re-prefillable tail (vLLM's ``num_prefill_lookahead``) vs vLLM 0.33.0.

With ``num_prefill_lookahead = n`` the drafter reads ``n`` prefill tokens past a chunk, so vLLM's
coordinator keeps the last ``n - 1`` computed tokens out of the prefix cache
(``get_num_cacheable_tokens``) and refuses caching EAGLE pools whose scheduler block is smaller
than ``n``. The reference models both (``PoolConfig.num_prefill_lookahead``); these tests compare
it with vLLM's ``KVCacheManager`` on a hand trace, on a planted fault and on generated pools.
"""

from __future__ import annotations

import pytest
from hypothesis import settings
from hypothesis.stateful import run_state_machine_as_test

from kvref.impl.interface import PoolConfig
from kvref.impl.reference.kv_cache_coordinator import KVCacheCoordinator
from kvref.models.conformance.differential import Divergence, Harness
from kvref.models.conformance.trace import Op
from kvref.models.machines.kv_cache_manager import kv_cache_manager_machine
from kvref.spec.errors import InvalidFieldError
from kvref.spec.kv_cache_interface import FullAttentionSpec, KVCacheGroupSpec, SlidingWindowSpec
from tests.conftest import profile_examples
from tests.vllm_env import require_vllm

pytestmark = pytest.mark.vllm


@pytest.fixture(scope="module")
def vllm_specs():
    require_vllm()
    import kvref.impl.vllm.specs as specs  # noqa: PLC0415 - imports vLLM once per module

    return specs


def _pool(num_prefill_lookahead: int, swa: bool = False, block_size: int = 4) -> PoolConfig:
    fa = FullAttentionSpec(block_size=block_size, num_kv_heads=1, head_size=8, dtype="float16")
    groups = [KVCacheGroupSpec(("full",), fa)]
    if swa:
        groups.append(KVCacheGroupSpec(("swa",), SlidingWindowSpec(
            block_size=block_size, num_kv_heads=1, head_size=8, dtype="float16", sliding_window=2 * block_size)))
    return PoolConfig(num_blocks=32, groups=tuple(groups), max_model_len=96, scheduler_block_size=block_size,
                      hash_block_size=block_size, use_eagle=True, num_prefill_lookahead=num_prefill_lookahead)


def _trace() -> list[Op]:
    """One request computes 13 tokens in two chunks; a second one with the same prompt looks up."""
    prompt = list(range(13))
    admit = dict(full_sequence_must_fit=False, reserved_blocks=0, in_flight=False)
    return [Op("add", dict(rid="a", prompt=prompt, max_tokens=2, cache_salt=None)),
            Op("admit", dict(rid="a", chunk=9, token=1, **admit)),
            Op("step", dict(rid="a", chunk=4, lookahead=0, token=1, in_flight=False)),
            Op("add", dict(rid="b", prompt=prompt + [5, 6, 7], max_tokens=2, cache_salt=None)),
            Op("admit", dict(rid="b", chunk=16, token=2, **admit))]


def _cached(h: Harness) -> int:
    pool = h.managers["reference"].manager.block_pool
    return sum(1 for b in pool.blocks if b.block_hash is not None)


@pytest.mark.parametrize("swa", [False, True])
def test_reprefillable_tail_is_not_published(vllm_specs, swa):
    """vLLM and the reference publish the same blocks after every op; with a lookahead of 3 the
    last 2 computed tokens are re-prefillable, so fewer blocks are cached than without."""
    published = {}
    for n in (0, 3):
        h = Harness(_pool(n, swa=swa), ["reference", "vllm"])
        for op in _trace():
            h.apply(op)
        published[n] = _cached(h)
    assert published[3] < published[0]


def test_ignoring_the_reprefillable_tail_is_caught(vllm_specs, monkeypatch):
    """A reference that publishes every computed token (the pre-#23 rule) diverges from vLLM."""
    monkeypatch.setattr(KVCacheCoordinator, "get_num_cacheable_tokens",
                        lambda self, num_computed_tokens, group_id: max(0, num_computed_tokens))
    h = Harness(_pool(3), ["reference", "vllm"])
    with pytest.raises(Divergence):
        for op in _trace():
            h.apply(op)


@pytest.mark.parametrize("n,eagle,caching,refused", [
    (5, True, True, True), (4, True, True, False), (5, False, True, False), (5, True, False, False)])
def test_lookahead_beyond_the_scheduler_block_is_refused_as_vllm_does(vllm_specs, n, eagle, caching, refused):
    """vLLM's coordinator raises ValueError for a caching EAGLE pool whose scheduler block is
    smaller than the lookahead; PoolConfig refuses exactly those, naming the field."""
    fields = dict(num_blocks=32, groups=_pool(0).groups, max_model_len=96, scheduler_block_size=4,
                  hash_block_size=4, use_eagle=eagle, enable_caching=caching)
    try:
        PoolConfig(**fields, num_prefill_lookahead=n)
        ours = False
    except InvalidFieldError as exc:
        assert "num_prefill_lookahead" in str(exc)
        ours = True
    without = PoolConfig(**fields)
    kwargs = {**vllm_specs.kv_cache_manager_kwargs(without), "num_prefill_lookahead": n}
    vllm_kv_cache_manager = type(vllm_specs.build_kv_cache_manager(without))
    try:
        vllm_kv_cache_manager(vllm_specs.to_vllm_kv_cache_config(without), **kwargs)
        theirs = False
    except ValueError:
        theirs = True
    assert ours == theirs == refused


def test_machine_with_drawn_prefill_lookahead(vllm_specs):
    """Generated EAGLE pools with a drawn lookahead (1..4) against vLLM, everything observable
    compared after every op; derandomized, so the multi-token lookahead is always reached."""
    machine = kv_cache_manager_machine(("reference", "vllm"), group_sets=("fa", "fa+swa", "fa+fa", "swa"),
                                       eagle="always", prefill_lookahead=True)
    run_state_machine_as_test(machine, settings=settings(
        max_examples=profile_examples(12, 60), stateful_step_count=30, deadline=None, derandomize=True,
        database=None))
    pools = machine.stats.prefill_lookahead_pools
    assert sum(c for n, c in pools.items() if n >= 2) > 0, pools
    assert machine.stats.prefix_hits > 0
