"""Session 17's run properties (issue #28, "check-run with teeth"): each on a hand-built trace that
violates it and on one that does not, checked ``--properties-only`` (what a user on another vLLM runs).

* nothing scheduled past a request's tokens (vLLM: ``num_new_tokens = num_tokens - num_computed``),
  a streaming session's kept outputs less its final sampled token included;
* admissions in waiting-queue order (FCFS: arrivals at the back, preempted requests back at the
  front in their running order, as ``reset_prefix_cache`` and the running loop put them);
* a reset succeeds exactly when no block is in use (``BlockPool.reset_prefix_cache``).

Cheap: a few hand-written records each (well under a second in all at CI=true).
"""

from __future__ import annotations

from dataclasses import replace

from kvref.models.run_check import check_trace

from tests.record.traces import add, full_setup, header_for, sched, update, write_trace


def _kinds(tmp_path, header, recs, name):
    r = check_trace(write_trace(tmp_path / name, header, recs), properties_only=True, check_invariants_every=1)
    return [f.kind for f in r.findings], r


# ---- nothing scheduled past a request's tokens -----------------------------------------------------------
def test_a_step_never_schedules_more_tokens_than_the_request_has(tmp_path):
    pool, cfg = full_setup()
    h = header_for(pool, cfg)

    def run(first: int) -> list:
        return [add("a", [1, 2, 3, 4, 5], max_tokens=3), sched(0, [["a", "n", first, 0, [[1, 2]]]]),
                update(0, {"a": [9]})]

    kinds, r = _kinds(tmp_path, h, run(6), "past.jsonl")
    assert kinds == ["past_tokens"] and "past the 5 tokens it has" in r.findings[0].message
    kinds, r = _kinds(tmp_path, h, run(5), "ok.jsonl")
    assert kinds == [] and r.ok


def test_async_placeholders_allow_one_token_per_sampling_step_in_flight(tmp_path):
    """Async scheduling: vLLM schedules a decode step before the previous one's token is back
    (``num_output_placeholders``); one step in flight that samples allows one more token, not two."""
    pool, cfg = full_setup()
    h = header_for(pool, replace(cfg, async_scheduling=True))

    def run(second: int) -> list:
        return [add("a", [1, 2, 3, 4], max_tokens=5), sched(0, [["a", "n", 4, 0, [[1]]]]),
                sched(1, [["a", "c", second, 4, [[2]]]]), update(0, {"a": [9]}), update(1, {"a": [8]})]

    kinds, _ = _kinds(tmp_path, h, run(1), "ok.jsonl")
    assert kinds == []
    kinds, r = _kinds(tmp_path, h, run(2), "past.jsonl")
    assert kinds == ["past_tokens"] and "1 placeholder/draft slots" in r.findings[0].message


def _session(resume_tokens: int) -> list:
    """A streaming session: a 3-token turn stops at max_tokens 2 (tokens 9, 10 sampled; 9 computed),
    its next input [7, 8] arrives while it waits; vLLM keeps [1, 2, 3, 9] (the final sampled 10 is
    dropped), so the resumed turn has 6 tokens and 4 computed."""
    s = add("s", [1, 2, 3], max_tokens=2)
    s["resumable"] = True
    nxt = add("s", [7, 8], max_tokens=2)
    nxt["resumable"] = True
    return [s, sched(0, [["s", "n", 3, 0, [[1]]]]), update(0, {"s": [9]}),
            sched(1, [["s", "c", 1, 3, None]]), update(1, {"s": [10]}), nxt,
            sched(2, [["s", "n", resume_tokens, 4, [[1, 2]]]]), update(2, {"s": [11]})]


def test_a_resumed_session_schedules_its_kept_outputs_less_the_final_token(tmp_path):
    """vLLM's ``_update_request_as_session`` keeps every output but the final sampled one (never
    computed): a session resumed with one token more than that (an off-by-one in the kept output)
    schedules past the tokens the trace gives it."""
    h = header_for(*full_setup())
    kinds, r = _kinds(tmp_path, h, _session(2), "ok.jsonl")
    assert kinds == [] and r.ok
    kinds, r = _kinds(tmp_path, h, _session(3), "past.jsonl")
    assert kinds == ["past_tokens"] and "a streaming session" in r.findings[0].message


# ---- admissions in waiting-queue order ---------------------------------------------------------------------
def _after_reset(admit: list) -> list:
    """FCFS: a, b run, c waits; reset_prefix_cache(reset_running_requests=True) preempts a and b
    (vLLM pops b then a, prepending each: the queue is a, b, c); the next step admits ``admit``."""
    recs = [add("a", [1] * 5), add("b", [2] * 5), add("c", [3] * 5),
            sched(0, [["a", "n", 5, 0, [[1, 2]]], ["b", "n", 5, 0, [[3, 4]]]]), update(0, {"a": [9], "b": [9]}),
            {"t": "reset", "running": True, "ok": True, "free": 19}]
    # fresh blocks from the head of vLLM's free queue after the reset's frees: 2, 4, 5, 6, ...
    free = iter([2, 4, 5, 6, 7, 8])
    step = sched(1, [[rid, "r" if rid != "c" else "n", 6 if rid != "c" else 5, 0, [[next(free), next(free)]]]
                     for rid in admit], pre=["a", "b"])
    step["pre_why"] = {"a": "reset_prefix_cache", "b": "reset_prefix_cache"}
    return recs + [step]


def test_preempted_requests_come_back_in_their_running_order(tmp_path):
    h = header_for(*full_setup())
    kinds, r = _kinds(tmp_path, h, _after_reset(["a", "b"]), "ok.jsonl")
    assert kinds == [] and r.ok
    kinds, r = _kinds(tmp_path, h, _after_reset(["a", "b", "c"]), "ok3.jsonl")
    assert kinds == []
    kinds, r = _kinds(tmp_path, h, _after_reset(["b", "a"]), "reversed.jsonl")
    assert kinds == ["admission_order"] and "b is admitted before a" in r.findings[0].message


def test_nothing_is_admitted_past_a_request_that_cannot_be_skipped(tmp_path):
    h = header_for(*full_setup())
    kinds, r = _kinds(tmp_path, h, _after_reset(["b"]), "past_a.jsonl")
    assert kinds == ["admission_order"] and "b is admitted past a" in r.findings[0].message
    kinds, r = _kinds(tmp_path, h, _after_reset(["c"]), "past_ab.jsonl")
    assert kinds == ["admission_order"] and "c is admitted past a" in r.findings[0].message


def test_the_priority_policy_orders_its_queue_by_priority_not_arrival(tmp_path):
    """Under the priority policy vLLM's waiting queue is a heap on (priority, arrival): the FCFS
    order is not asked of it."""
    pool, cfg = full_setup()
    h = header_for(pool, replace(cfg, policy="priority"))
    kinds, _ = _kinds(tmp_path, h, _after_reset(["b", "a"]), "priority.jsonl")
    assert kinds == []


# ---- a reset succeeds exactly when no block is in use ------------------------------------------------------
def _reset_while_held(ok: bool, free: int) -> list:
    """a holds 2 blocks of the 19 usable ones; reset_prefix_cache without preempting it."""
    return [add("a", [1] * 5, max_tokens=3), sched(0, [["a", "n", 5, 0, [[1, 2]]]]), update(0, {"a": [9]}),
            {"t": "reset", "running": False, "ok": ok, "free": free}]


def test_a_reset_reports_success_only_with_every_block_free(tmp_path):
    h = header_for(*full_setup())
    kinds, r = _kinds(tmp_path, h, _reset_while_held(False, 17), "refused.jsonl")
    assert kinds == [] and r.ok
    kinds, r = _kinds(tmp_path, h, _reset_while_held(True, 17), "ok_held.jsonl")
    assert kinds == ["reset_result"] and "reported success with 17 of 19" in r.findings[0].message
    # the pool says all free, but the trace has a still holding its blocks: a freed-while-held block
    kinds, r = _kinds(tmp_path, h, _reset_while_held(True, 19), "ok_lying.jsonl")
    assert kinds == ["reset_result", "conservation"] and "hold 2 block(s)" in r.findings[0].message
    # nothing held, every block free: a refusal is the finding
    idle = [{"t": "reset", "running": False, "ok": False, "free": 19}, add("a", [1] * 5),
            sched(0, [["a", "n", 5, 0, [[1, 2]]]])]
    kinds, r = _kinds(tmp_path, h, idle, "refused_idle.jsonl")
    assert kinds == ["reset_result"] and "reported failure with 19 of 19" in r.findings[0].message
    kinds, r = _kinds(tmp_path, h, [dict(idle[0], ok=True)] + idle[1:], "ok_idle.jsonl")
    assert kinds == [] and r.ok



# ---- fresh blocks in free-queue order ------------------------------------------------------------------------
def _after_finish(b_blocks: list) -> list:
    """a (5 tokens: block 1 full and cached, block 2 partial) finishes; vLLM frees its table tail
    first: block 2 (no hash) to the front of the free queue, block 1 (cached) to the back; b's fresh
    blocks come from the front."""
    return [add("a", [1] * 5, max_tokens=1), sched(0, [["a", "n", 5, 0, [[1, 2]]]]),
            update(0, {"a": [9]}, fin=[["a", "length"]]), add("b", [2] * 5), sched(1, [["b", "n", 5, 0, [b_blocks]]])]


def test_fresh_blocks_come_from_the_head_of_the_free_queue(tmp_path):
    pool, cfg = full_setup()
    h = header_for(pool, cfg)
    kinds, r = _kinds(tmp_path, h, _after_finish([2, 3]), "ok.jsonl")
    assert kinds == [] and r.ok and r.summary["free_order_check"] == "on"
    kinds, r = _kinds(tmp_path, h, _after_finish([3, 4]), "lru.jsonl")
    assert kinds == ["free_order"] and "block 3 fresh (group 0) while block 2 heads" in r.findings[0].message
    assert r.summary["free_order_check"] == "off from step 1: after its finding"
    # the queue's policy is vLLM 0.33.0's: a trace of another vLLM is not held to it
    other = {**h, "producer": {**h["producer"], "vllm": "0.34.0"}}
    kinds, r = _kinds(tmp_path, other, _after_finish([3, 4]), "other_vllm.jsonl")
    assert kinds == [] and r.summary["free_order_check"].startswith("off: vLLM 0.34.0")
    # without prefix caching no block has a hash: both go to the front, the tail first
    h = header_for(replace(pool, enable_caching=False), cfg)
    kinds, _ = _kinds(tmp_path, h, _after_finish([2, 1]), "nocache_ok.jsonl")
    assert kinds == []
    kinds, _ = _kinds(tmp_path, h, _after_finish([2, 3]), "nocache_bad.jsonl")
    assert kinds == ["free_order"]


def _reset_then(c_blocks: list) -> list:
    """Priority policy: a and b run (block 1 / 3 full and cached, 2 / 4 partial); a reset preempts
    both, last running first (b, then a): the free queue is 2, 4, 5 .. 19, 3, 1; c comes first."""
    recs = [add("a", [1] * 5), add("b", [2] * 5),
            sched(0, [["a", "n", 5, 0, [[1, 2]]], ["b", "n", 5, 0, [[3, 4]]]]), update(0, {"a": [9], "b": [9]}),
            {"t": "reset", "running": True, "ok": True, "free": 19}, add("c", [3] * 5)]
    step = sched(1, [["c", "n", 5, 0, [c_blocks]]], pre=["a", "b"])
    step["pre_why"] = {"a": "reset_prefix_cache", "b": "reset_prefix_cache"}
    return recs + [step]


def test_a_reset_frees_the_running_requests_last_to_first(tmp_path):
    """vLLM's reset_prefix_cache pops running requests from the end: under the priority policy
    (where the admission order does not show it) only the block ids a later request gets do."""
    pool, cfg = full_setup()
    h = header_for(pool, replace(cfg, policy="priority"))
    kinds, r = _kinds(tmp_path, h, _reset_then([2, 4]), "ok.jsonl")
    assert kinds == [] and r.ok
    kinds, r = _kinds(tmp_path, h, _reset_then([4, 2]), "first_to_last.jsonl")
    assert kinds == ["free_order"] and "block 4 fresh (group 0) while block 2 heads" in r.findings[0].message


# ---- the free queue on a sliding-window group (session 18) ---------------------------------------------------
def _window_header(window: int = 3, **pool_extra) -> dict:
    """FA (4-token blocks) + a 3-token sliding window in 2-token blocks: hits align to 4 tokens, so
    a window hit needs 1 block of each 2-block segment and vLLM 0.33.0's ``reachable_block_mask``
    caches only each segment's second block (table positions 1, 3, ...)."""
    from kvref.impl.interface import PoolConfig
    from kvref.impl.scheduler_types import SchedulerConfig
    from kvref.spec.kv_cache_interface import FullAttentionSpec, KVCacheGroupSpec, SlidingWindowSpec

    from tests.record.traces import ATTN

    groups = (KVCacheGroupSpec(("full",), FullAttentionSpec(block_size=4, **ATTN)),
              KVCacheGroupSpec(("swa",), SlidingWindowSpec(block_size=2, sliding_window=window, **ATTN)))
    cfg = SchedulerConfig(max_num_batched_tokens=16, max_num_seqs=4)
    pool = PoolConfig(num_blocks=20, groups=groups, max_model_len=32, scheduler_block_size=4, hash_block_size=2,
                      max_in_flight_tokens=cfg.max_in_flight_tokens)
    h = header_for(pool, cfg)
    h["pool"].update(pool_extra)
    return h


def _window_run(b_blocks: list) -> list:
    """a (8 tokens: FA blocks 1, 2; window blocks 3-6, all full) finishes; vLLM frees group by group,
    each table's tail first: FA 2, 1 (cached) to the back; window 6, 5, 4, 3 of which 4 and 6 are
    cached (back) and 5, 3 not (front, 5 at the head). The queue: 5, 3, 7 .. 19, 2, 1, 6, 4."""
    return [add("a", [1] * 8, max_tokens=1), sched(0, [["a", "n", 8, 0, [[1, 2], [3, 4, 5, 6]]]]),
            update(0, {"a": [9]}, fin=[["a", "length"]]), add("b", [2] * 5),
            sched(1, [["b", "n", 5, 0, b_blocks]])]


def test_a_sliding_window_group_caches_only_the_blocks_a_hit_can_reach(tmp_path):
    """Session 18 (#28): with the hit alignment and the retention interval in the header the
    free-queue check runs on sliding-window pools; an uncached window block goes to the front.
    Holding every window block cached (what the check assumed for full attention) would put 7 at
    the head: that run is the finding."""
    aligned = [{"cache_hit_alignment_tokens": 4, "drops_eagle_block": False}] * 2

    def header(**extra):
        h = _window_header(**extra)
        if "prefix_cache_retention_interval" in extra:
            h["pool"]["groups"] = [dict(g, **a) for g, a in zip(h["pool"]["groups"], aligned)]
        return h

    dense = header(prefix_cache_retention_interval=None, cache_round_tokens=4)
    kinds, r = _kinds(tmp_path, dense, _window_run([[5, 3], [7, 8, 9]]), "ok.jsonl")
    assert kinds == [] and r.ok and r.summary["free_order_check"] == "on"
    kinds, r = _kinds(tmp_path, dense, _window_run([[7, 8], [9, 10, 11]]), "all_cached.jsonl")
    assert kinds == ["free_order"] and "block 7 fresh (group 0) while block 5 heads" in r.findings[0].message
    # a trace without what the mask needs (before session 18), or under sparse retention (the
    # shared-prefix junction is not recorded): off, said so
    kinds, r = _kinds(tmp_path, _window_header(), _window_run([[7, 8], [9, 10, 11]]), "old.jsonl")
    assert kinds == [] and "sliding-window group whose cached blocks" in r.summary["free_order_check"]
    kinds, r = _kinds(tmp_path, header(prefix_cache_retention_interval=8, cache_round_tokens=4), _window_run([[7, 8], [9, 10, 11]]),
                      "sparse.jsonl")
    assert kinds == [] and "sparse prefix-cache retention" in r.summary["free_order_check"]


def test_a_refused_request_frees_its_skipped_blocks_before_its_preemption(tmp_path):
    """vLLM's ``allocate_slots`` frees a sliding-window request's skipped blocks before it refuses
    the allocation; the preemption that follows frees the rest (session 18, #28: a LoRA run's false
    alarm when the check freed all at the preemption). Caching off: every freed block goes to the
    front. a (8 tokens, window 3 in 2-token blocks) settles 8, is refused and preempted: first its
    skipped window blocks 7, 6, 5, then FA 4, 3, 2, 1, then window 8: the queue is 8, 4, 3, 2, 1, 7 ..."""
    from tests.record.traces import hybrid_setup

    pool, cfg = hybrid_setup(num_blocks=20, window=3, block_size=2, caching=False)
    h = header_for(pool, replace(cfg, policy="priority"))
    h["pool"]["prefix_cache_retention_interval"] = None
    h["pool"]["groups"] = [dict(g, cache_hit_alignment_tokens=2, drops_eagle_block=False) for g in h["pool"]["groups"]]

    def run(b_blocks: list) -> list:
        step1 = sched(1, [], pre=["a"])
        step1.update(pre_why={"a": "kv"}, refused=["a"])
        return [add("a", [1] * 8, max_tokens=9), sched(0, [["a", "n", 8, 0, [[1, 2, 3, 4], [5, 6, 7, 8]]]]),
                update(0, {"a": [9]}), step1, add("b", [2] * 5), sched(2, [["b", "n", 5, 0, b_blocks]])]

    kinds, r = _kinds(tmp_path, h, run([[8, 4, 3], [2, 1, 7]]), "ok.jsonl")
    assert kinds == [] and r.summary["free_order_check"] == "on"
    kinds, r = _kinds(tmp_path, h, run([[8, 7, 6], [5, 4, 3]]), "all_at_preemption.jsonl")
    assert kinds == ["free_order"] and "block 7 fresh (group 0) while block 4 heads" in r.findings[0].message


def test_a_hybrid_pool_caches_only_up_to_a_whole_scheduler_block(tmp_path):
    """vLLM's hybrid coordinator rounds what it caches down to the scheduler block
    (``_align_cacheable``, recorded as ``cache_round_tokens``): a 2-token window block past the last
    whole 4-token block stays unhashed (a vLLM run with 8-token FA and 2-token window blocks showed
    it, session 18). Window 5: a hit needs 2 blocks, a segment holds 2, every block is cacheable.
    a (6 tokens) finishes: FA 2 (partial) to the front, 1 to the back; window 5 (tokens 4-5, past
    the rounding) to the front, 4 and 3 to the back: the queue is 5, 2, 6 .. 19, 1, 4, 3."""
    h = _window_header(window=5, prefix_cache_retention_interval=None, cache_round_tokens=4)
    h["pool"]["groups"] = [dict(g, cache_hit_alignment_tokens=4, drops_eagle_block=False) for g in h["pool"]["groups"]]

    def run(b_blocks: list) -> list:
        return [add("a", [1] * 6, max_tokens=1), sched(0, [["a", "n", 6, 0, [[1, 2], [3, 4, 5]]]]),
                update(0, {"a": [9]}, fin=[["a", "length"]]), add("b", [2] * 5), sched(1, [["b", "n", 5, 0, b_blocks]])]

    kinds, r = _kinds(tmp_path, h, run([[5, 2], [6, 7, 8]]), "ok.jsonl")
    assert kinds == [] and r.ok and r.summary["free_order_check"] == "on"
    kinds, r = _kinds(tmp_path, h, run([[2, 6], [7, 8, 9]]), "unrounded.jsonl")
    assert kinds == ["free_order"] and "block 2 fresh (group 0) while block 5 heads" in r.findings[0].message
    # the rounding not in the trace (before session 18): off on a pool with a group smaller than the
    # scheduler block
    del h["pool"]["cache_round_tokens"]
    kinds, r = _kinds(tmp_path, h, run([[2, 6], [7, 8, 9]]), "old.jsonl")
    assert kinds == [] and "cache rounding" in r.summary["free_order_check"]
