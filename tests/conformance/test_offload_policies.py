"""vLLM 0.33.0's CPU-tier cache policies (LRU, ARC, an out-of-tree one through its factory) vs the
reference on generated call sequences, and faults planted in vLLM's policies (monkeypatched for the
test) that the same sequences find (#22)."""

from __future__ import annotations

import pytest

from tests.vllm_env import require_vllm

pytestmark = pytest.mark.vllm


def test_policies_match_reference_and_reach_the_rare_paths(monkeypatch):
    """Every call agrees; the sequences reach ARC's touch of a ready and of a pending T1 chunk, the
    removal of a T2 chunk, LRU's heap rebuild and the base class's per-group request commit."""
    require_vllm()
    from vllm.v1.kv_offload.cpu.policies import arc, base, lru

    from kvref.models.machines.offload_policies import run_policy_cases

    seen = {"arc_ready": 0, "arc_pending": 0, "arc_remove_t2": 0, "lru_rebuild": 0, "base_commit": 0}
    touch, remove, update, commit = (arc.ARCCachePolicy.touch, arc.ARCCachePolicy.remove,
                                     lru.LRUCachePolicy._update_heap, base.CachePolicy.on_request_finished)

    def counting_touch(self, keys, ctx):
        keys = list(keys)
        for k in keys:
            if k in self.t1:
                seen["arc_ready" if self.t1[k].is_ready else "arc_pending"] += 1
        return touch(self, keys, ctx)

    def counting_remove(self, key):
        seen["arc_remove_t2"] += key in self.t2
        return remove(self, key)

    def counting_update(self, updated):
        seen["lru_rebuild"] += len(updated) >= max(64, len(self._evictable) // 4)
        return update(self, updated)

    def counting_commit(self, *args):
        seen["base_commit"] += 1
        return commit(self, *args)

    monkeypatch.setattr(arc.ARCCachePolicy, "touch", counting_touch)
    monkeypatch.setattr(arc.ARCCachePolicy, "remove", counting_remove)
    monkeypatch.setattr(lru.LRUCachePolicy, "_update_heap", counting_update)
    from kvref.impl.vllm.offload_policies import TouchPerGroupLRUCachePolicy

    monkeypatch.setattr(TouchPerGroupLRUCachePolicy, "on_request_finished", counting_commit)
    out = run_policy_cases(0, 60)  # seeded (random.Random): the same sequences under every profile
    assert out["ops"] > 10 * out["cases"] and out["bulk"] >= 2
    assert all(seen.values()), seen


@pytest.mark.parametrize("fault", ["arc_pending_promoted", "arc_remove_t2_kept", "lru_unheapified",
                                   "base_first_group_only"])
def test_planted_policy_faults_are_found(monkeypatch, fault):
    require_vllm()
    from vllm.v1.kv_offload.cpu.policies import arc, base, lru

    from kvref.impl.vllm.offload_policies import TouchPerGroupLRUCachePolicy
    from kvref.models.machines.offload_policies import run_policy_cases

    if fault == "arc_pending_promoted":
        def touch(self, keys, ctx):
            for key in reversed(list(keys)):
                if key in self.t1:
                    self.t2[key] = self.t1.pop(key)
                elif key in self.t2:
                    self.t2.move_to_end(key)
                else:
                    self._adapt_to_ghost_hit(key)
        monkeypatch.setattr(arc.ARCCachePolicy, "touch", touch)
    elif fault == "arc_remove_t2_kept":
        monkeypatch.setattr(arc.ARCCachePolicy, "remove", lambda self, key: self.t1.pop(key, None))
    elif fault == "lru_unheapified":
        update = lru.LRUCachePolicy._update_heap

        def unheapified(self, updated):
            if updated and len(updated) >= max(64, len(self._evictable) // 4):
                self._heap = [(self._ranks[k], k) for k in self._evictable]
                return
            return update(self, updated)
        monkeypatch.setattr(lru.LRUCachePolicy, "_update_heap", unheapified)  # the real one heapifies
    else:
        def first_group(self, key_groups, insertion_only, reused, ctx):
            return base.CachePolicy.on_request_finished(self, key_groups[:1], insertion_only, reused, ctx)
        monkeypatch.setattr(TouchPerGroupLRUCachePolicy, "on_request_finished", first_group)
    with pytest.raises(AssertionError):
        run_policy_cases(0, 48)


def test_factory_refuses_a_taken_name_and_an_unknown_one():
    require_vllm()
    from kvref.impl.vllm.offload_policies import policy_class, registered_policies
    from kvref.models.machines.offload_policies import check_factory

    before = registered_policies()
    check_factory()  # raises on an accepted re-registration or an unknown name resolved
    assert registered_policies() == before and {"lru", "arc"} <= set(before)
    assert policy_class("TouchPerGroupLRUCachePolicy", "kvref.impl.vllm.offload_policies").__name__ == \
        "TouchPerGroupLRUCachePolicy"
