"""Encoder inputs in the scheduler (issue #22): the reference scheduler's encoder budget and cache
(:mod:`kvref.impl.reference.scheduler_encoder`) in lock step with vLLM 0.33.0's
``_try_schedule_encoder_inputs`` / ``EncoderCacheManager`` (``scheduler_encoder`` machine, part of
``conform-scheduler``).

Planted faults in vLLM's encoder cache show the comparison sees each rule: evicting the newest
freeable entry instead of the oldest, or releasing an item one token late, must diverge; so must
a V2-runner vLLM that installs items a prefix hit covers."""

from __future__ import annotations

import pytest

from tests.conformance.scheduler_targets import vllm_scheduler  # noqa: F401 - the module-scoped fixture

#: the derandomized examples the path test runs (the check draws 8 at fast, 40 at ci)
EXAMPLES = 20


@pytest.mark.vllm
def test_encoder_traces_match_vllm_and_reach_every_rule(vllm_scheduler):
    from kvref.models.machines.scheduler_encoder import run_encoder_machine

    # the same derandomized traces under every profile: the paths asserted below are reached by them
    run = run_encoder_machine(EXAMPLES, reproducible=True)
    assert run.ok, run.failure
    assert run.traces >= 20
    c = run.coverage
    for path in ("encoder_inputs_scheduled", "encoder_evictions", "encoder_cache_hits", "encoder_duplicate_inputs",
                 "encoder_chunks_cut", "encoder_waiting_skipped", "encoder_unchunked_rollback",
                 "encoder_v2_releases", "encoder_embed_mismatch_rejected", "encoder_preempted_inputs_restored"):
        assert c.get(path, 0) > 0, (path, c)


@pytest.mark.vllm
def test_vllm_serving_a_reused_uuid_of_another_size_is_a_divergence(vllm_scheduler, monkeypatch):
    """vLLM without its embed-count check (before ``_reject_on_encoder_cache_embed_mismatch``):
    the request reusing an identifier with another size is scheduled instead of failing."""
    from vllm.v1.core.sched.scheduler import Scheduler

    from kvref.models.machines.scheduler_encoder import run_encoder_machine

    monkeypatch.setattr(Scheduler, "_reject_on_encoder_cache_embed_mismatch", lambda self, *args: False)
    run = run_encoder_machine(EXAMPLES, reproducible=True, shrink=False)
    assert not run.ok
    assert "Divergence" in run.failure, run.failure


def _evict_newest_first(original):
    def can_allocate(self, request, input_id, encoder_compute_budget, num_embeds_to_schedule):
        saved = self.freeable
        self.freeable = type(saved)(reversed(list(saved.items())))  # popitem(last=False) takes the newest
        try:
            return original(self, request, input_id, encoder_compute_budget, num_embeds_to_schedule)
        finally:
            kept = self.freeable
            self.freeable = type(saved)(reversed(list(kept.items())))
    return can_allocate


def _release_one_token_late(original):
    def free_encoder_inputs(self, request):
        for input_id in list(self.encoder_cache_manager.get_cached_input_ids(request)):
            pos = request.mm_features[input_id].mm_position
            if pos.offset + pos.length < request.num_computed_tokens - request.num_output_placeholders:
                self._free_encoder_input(request, input_id)
    return free_encoder_inputs


@pytest.mark.vllm
@pytest.mark.parametrize("target, fault", [
    ("vllm.v1.core.encoder_cache_manager.EncoderCacheManager.can_allocate", _evict_newest_first),
    ("vllm.v1.core.sched.scheduler.Scheduler._free_encoder_inputs", _release_one_token_late)])
def test_vllm_with_a_planted_encoder_fault_is_a_divergence(vllm_scheduler, monkeypatch, target, fault):
    import importlib

    from kvref.models.machines.scheduler_encoder import run_encoder_machine

    module, cls, name = target.rsplit(".", 2)
    owner = getattr(importlib.import_module(module), cls)
    monkeypatch.setattr(owner, name, fault(getattr(owner, name)))
    run = run_encoder_machine(EXAMPLES, reproducible=True, shrink=False)
    assert not run.ok
    assert "Divergence" in run.failure and "encoder" in run.failure, run.failure


@pytest.mark.vllm
def test_vllm_v2_installing_covered_items_is_a_divergence(vllm_scheduler, monkeypatch):
    from vllm.v1.core.sched import output

    from kvref.models.machines.scheduler_encoder import run_encoder_machine

    monkeypatch.setattr(output, "strip_covered_mm_data", lambda features, num_computed, uses_mrope=False: features)
    run = run_encoder_machine(EXAMPLES, reproducible=True, shrink=False)
    assert not run.ok
    assert "Divergence" in run.failure and "encoder_input_updates" in run.failure, run.failure


@pytest.mark.vllm
def test_a_second_image_waits_for_the_encoder_budget(vllm_scheduler):
    """Two requests, each with an image of 4 embeddings, on a budget of one image per step: the
    first encodes its image, the second schedules only the tokens before its own; both agree on
    the chunks, the encoder inputs and the cache."""
    from kvref.impl.interface import PoolConfig
    from kvref.impl.reference.scheduler import Scheduler
    from kvref.impl.reference.scheduler_encoder import EncoderBudget
    from kvref.impl.scheduler_types import SchedulerConfig
    from kvref.models.machines.scheduler import _attn
    from kvref.models.machines.scheduler_encoder import EncoderLockstep, EncoderRequestSpec
    from kvref.spec.kv_cache_interface import FullAttentionSpec, KVCacheGroupSpec

    env = vllm_scheduler.VllmEnv()
    budget = EncoderBudget(encoder_compute_budget=4, encoder_cache_size=8)
    cfg = SchedulerConfig(max_num_batched_tokens=32, max_num_seqs=4)
    pool = PoolConfig.off_plan("two short multimodal requests", num_blocks=20,
                               groups=(KVCacheGroupSpec(("full",), _attn(FullAttentionSpec, 4)),), max_model_len=32,
                               scheduler_block_size=4, hash_block_size=4,
                               max_in_flight_tokens=cfg.max_in_flight_tokens, enable_caching=True)
    d = EncoderLockstep(pool, cfg, {
        "vllm": lambda p, c: vllm_scheduler.VllmScheduler(p, c, env, encoder_budget=budget),
        "ref": lambda p, c: Scheduler(p, c, encoder_budget=budget)})
    # img2 has 4 embeddings (ITEM_SIZES)
    d.add(EncoderRequestSpec("a", (1, 2) + (9,) * 4 + (3, 4), 2, 0, 0.0, items=(("img2", 2),)))
    d.add(EncoderRequestSpec("b", (5, 6, 7) + (9,) * 4 + (8,), 2, 0, 1.0, items=(("img0", 3),)))
    out = d.schedule()  # compared with vLLM inside, encoder state too
    assert {s.request_id: s.num_scheduled_tokens for s in out.scheduled} == {"a": 8, "b": 3}
    view = d.targets["ref"].encoder_view()
    assert view["scheduled_encoder_inputs"] == {"a": (0,)}
    assert view["cache"]["num_free_slots"] == 4


@pytest.mark.vllm
def test_a_reused_uuid_of_another_size_fails_the_request_and_frees_its_blocks(vllm_scheduler):
    """"a" caches img2 with 4 embeddings; "b" carries img2 with 3: it schedules nothing, and the
    step's update finishes it as an error (vLLM _reject_on_encoder_cache_embed_mismatch); "a"
    goes on. Compared with vLLM after every call."""
    from kvref.impl.interface import PoolConfig
    from kvref.impl.reference.scheduler import Scheduler
    from kvref.impl.reference.scheduler_encoder import EncoderBudget
    from kvref.impl.scheduler_types import SchedulerConfig
    from kvref.models.machines.scheduler import _attn
    from kvref.models.machines.scheduler_encoder import EncoderLockstep, EncoderRequestSpec
    from kvref.spec.kv_cache_interface import FullAttentionSpec, KVCacheGroupSpec

    env = vllm_scheduler.VllmEnv()
    budget = EncoderBudget(encoder_compute_budget=8, encoder_cache_size=8)
    cfg = SchedulerConfig(max_num_batched_tokens=32, max_num_seqs=4)
    pool = PoolConfig.off_plan("two short multimodal requests", num_blocks=20,
                               groups=(KVCacheGroupSpec(("full",), _attn(FullAttentionSpec, 4)),), max_model_len=32,
                               scheduler_block_size=4, hash_block_size=4,
                               max_in_flight_tokens=cfg.max_in_flight_tokens, enable_caching=True)
    d = EncoderLockstep(pool, cfg, {
        "vllm": lambda p, c: vllm_scheduler.VllmScheduler(p, c, env, encoder_budget=budget),
        "ref": lambda p, c: Scheduler(p, c, encoder_budget=budget)})
    d.add(EncoderRequestSpec("a", (1, 2) + (9,) * 4 + (3, 4), 4, 0, 0.0, items=(("img2", 2),)))
    d.engine_step()
    d.add(EncoderRequestSpec("b", (5, 6, 7) + (9,) * 3 + (8,), 4, 0, 1.0, items=(("img2", 3),), sizes=(3,)))
    ref = d.targets["ref"]
    out = d.schedule()
    assert [s.request_id for s in out.scheduled] == ["a"]
    assert ref.encoder.encoder_cache_mismatch_reqs == {"b"}
    d.engine_step()  # settles the step, which finishes "b" as an error
    assert "b" not in ref.requests and "a" in ref.requests
    assert not ref.encoder.encoder_cache_mismatch_reqs


def test_encoder_cache_evicts_the_oldest_unreferenced_entry():
    from kvref.impl.reference.scheduler_encoder import EncoderCacheManager
    from kvref.impl.request import MultiModalFeatureSpec, PlaceholderRange, Request

    def req(rid, ident):
        return Request(rid, [1] * 8, mm_features=(MultiModalFeatureSpec(ident, PlaceholderRange(0, 4)),))

    m = EncoderCacheManager(8)
    a, b, c = req("a", "x"), req("b", "y"), req("c", "z")
    for r in (a, b):
        assert m.can_allocate(r, 0, 4, 0)
        m.allocate(r, 0)
    m.free(a)
    m.free(b)
    assert [h for h, _ in m.freeable.items()] == ["x", "y"]
    assert m.can_allocate(c, 0, 4, 0)  # evicts x, the oldest
    m.allocate(c, 0)
    m.check_invariants()
    assert m.get_freed_mm_hashes() == ["x"] and "y" in m.cached
    assert not m.can_allocate(req("d", "w"), 0, 3, 0)  # over the compute budget


def test_a_request_repeating_an_image_keeps_it_until_its_last_occurrence():
    from kvref.impl.reference.scheduler_encoder import EncoderCacheManager
    from kvref.impl.request import MultiModalFeatureSpec, PlaceholderRange, Request

    r = Request("a", [1] * 12, mm_features=(MultiModalFeatureSpec("x", PlaceholderRange(0, 4)),
                                            MultiModalFeatureSpec("x", PlaceholderRange(6, 4))))
    m = EncoderCacheManager(4)
    m.allocate(r, 0)
    assert m.check_and_update_cache(r, 1)
    m.free_encoder_input(r, 0)
    assert m.cached["x"] == {"a"} and not m.freeable  # the second occurrence still needs it
    m.free_encoder_input(r, 1)
    assert list(m.freeable) == ["x"]
    m.check_invariants()


def test_bad_encoder_inputs_are_rejected():
    from kvref.impl.interface import PoolConfig
    from kvref.impl.reference.scheduler import Scheduler
    from kvref.impl.reference.scheduler_connector import ScriptedConnector
    from kvref.impl.reference.scheduler_encoder import EncoderBudget
    from kvref.impl.request import MultiModalFeatureSpec, PlaceholderRange, Request
    from kvref.impl.scheduler_types import SchedulerConfig
    from kvref.models.machines.scheduler import _attn
    from kvref.spec.errors import InvalidFieldError
    from kvref.spec.kv_cache_interface import FullAttentionSpec, KVCacheGroupSpec

    with pytest.raises(InvalidFieldError, match="encoder_cache_size"):
        EncoderBudget(encoder_compute_budget=4, encoder_cache_size=-1)
    with pytest.raises(InvalidFieldError, match="disable_chunked_mm_input"):
        EncoderBudget(disable_chunked_mm_input="yes")
    cfg = SchedulerConfig(max_num_batched_tokens=8, max_num_seqs=2)
    pool = PoolConfig.off_plan("a small pool", num_blocks=8,
                               groups=(KVCacheGroupSpec(("full",), _attn(FullAttentionSpec, 4)),), max_model_len=16,
                               scheduler_block_size=4, hash_block_size=4,
                               max_in_flight_tokens=cfg.max_in_flight_tokens, enable_caching=True)
    with pytest.raises(InvalidFieldError, match="encoder_budget"):
        Scheduler(pool, cfg, encoder_budget=(4, 4))
    s = Scheduler(pool, cfg, connector=ScriptedConnector())
    with pytest.raises(InvalidFieldError, match="mm_features"):
        s.add_request(Request("a", [1] * 8, mm_features=(MultiModalFeatureSpec("x", PlaceholderRange(0, 4)),)))
    assert not s.requests
