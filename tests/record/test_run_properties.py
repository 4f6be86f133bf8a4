"""The run properties of issue #28, each on a hand-built trace that violates it and one that does not.

The properties are checked from the trace alone (``properties_only=True``: what a user with a
vLLM other than 0.33.0 runs), so every case is written record by record with what vLLM would have
recorded: block ids per group, free-block counts, stats.
"""

from __future__ import annotations

import pytest

from kvref.models.run_check import check_trace

from tests.record.traces import add, full_setup, header_for, hybrid_setup, sched, update, write_trace


def _kinds(tmp_path, header, recs, name="t.jsonl", **kw):
    r = check_trace(write_trace(tmp_path / name, header, recs), properties_only=True, **kw)
    return [f.kind for f in r.findings], r


# ---- crash --------------------------------------------------------------------------------------------
def test_an_error_record_is_a_crash_finding_with_its_step(tmp_path):
    pool, cfg = full_setup()
    err = {"t": "error", "call": "schedule", "step": 1, "type": "ValueError",
           "message": "Cannot get 3 free blocks from the pool"}
    recs = [add("a", [1, 2, 3, 4, 5]), sched(0, [["a", "n", 5, 0, [[1, 2]]]]), update(0, {"a": [9]}), err]
    kinds, r = _kinds(tmp_path, header_for(pool, cfg), recs)
    assert kinds == ["crash"] and r.findings[0].step == 0 and "Cannot get 3 free blocks" in r.findings[0].message
    assert r.verdict == "CRASH" and not r.ok
    kinds, r = _kinds(tmp_path, header_for(pool, cfg), recs[:-1], name="clean.jsonl")
    assert kinds == [] and r.ok


# ---- starvation -----------------------------------------------------------------------------------------
def _async_idle(n_idle: int, then_schedule: bool) -> list:
    """Async: 'a' runs and holds the pool; 'b' waits; the engine keeps one step in flight."""
    recs = [add("a", [1] * 8, max_tokens=30), sched(0, [["a", "n", 8, 0, [[1, 2]]]]),
            sched(1, [["a", "c", 1, 8, [[3]]]]), update(0, {"a": [5]}), add("b", [2] * 8)]
    step = 2
    for _ in range(n_idle):  # nothing scheduled, one step always in flight
        recs += [sched(step, []), update(step - 1, {})]
        step += 1
    if then_schedule:
        recs += [sched(step, [["b", "n", 8, 0, [[4, 5]]]]), update(step - 1, {})]
    return recs


def test_starvation_under_async_scheduling_is_seen_whatever_is_in_flight(tmp_path):
    """vLLM's batch queue always keeps a step in flight under async scheduling: the old property
    ("nothing in flight") never fired there (issue #28: 20,000 idle calls of a hung run, no finding)."""
    pool, cfg = full_setup()
    cfg = type(cfg)(max_num_batched_tokens=cfg.max_num_batched_tokens, max_num_seqs=cfg.max_num_seqs,
                    async_scheduling=True)
    kinds, r = _kinds(tmp_path, header_for(pool, cfg), _async_idle(6, False))
    assert kinds == ["starvation"] and "b" in r.findings[0].message and "1 step(s) in flight" in r.findings[0].message
    kinds, _ = _kinds(tmp_path, header_for(pool, cfg), _async_idle(2, True), name="ok.jsonl")
    assert kinds == []


# ---- conservation -----------------------------------------------------------------------------------------
def _conservation(free_after_first: int) -> list:
    # max_tokens 1: the one sampled token finishes it by length (the stop-rule property holds)
    return [add("a", [1, 2, 3, 4, 5], max_tokens=1), dict(sched(0, [["a", "n", 5, 0, [[1, 2]]]]), free=free_after_first),
            dict(update(0, {"a": [9]}, fin=[["a", "length"]]), free=19)]


def test_free_plus_held_blocks_must_be_the_pool(tmp_path):
    pool, cfg = full_setup()  # 20 blocks: 19 usable
    kinds, r = _kinds(tmp_path, header_for(pool, cfg), _conservation(17))
    assert kinds == [] and r.ok
    kinds, r = _kinds(tmp_path, header_for(pool, cfg), _conservation(16), name="leak.jsonl")
    assert kinds == ["conservation"] and "leaked" in r.findings[0].message
    kinds, r = _kinds(tmp_path, header_for(pool, cfg), _conservation(18), name="early.jsonl")
    assert kinds == ["conservation"] and "freed while held" in r.findings[0].message


# ---- reuse while needed (window-aware, no blanket allowance) ------------------------------------------------
def _swa_reuse(b_swa_block: int) -> list:
    """full + sliding window 8, block size 4: after 'a' settled 16 tokens, vLLM frees its first two
    window blocks (5, 6) at a's next allocation; block 7 (position 2) is still inside the window."""
    return [add("a", list(range(1, 17)), max_tokens=10),
            sched(0, [["a", "n", 16, 0, [[1, 2, 3, 4], [5, 6, 7, 8]]]]), update(0, {"a": [20]}),
            sched(1, [["a", "c", 1, 16, [[9], [10]]]]), update(1, {"a": [21]}),
            add("b", [30, 31, 32, 33]),
            sched(2, [["a", "c", 1, 17, None], ["b", "n", 4, 0, [[11], [b_swa_block]]]]),
            update(2, {"a": [22], "b": [34]})]


def test_a_block_may_be_reused_only_once_it_lies_behind_its_holders_window(tmp_path):
    pool, cfg = hybrid_setup(num_blocks=40, window=8)
    kinds, _ = _kinds(tmp_path, header_for(pool, cfg), _swa_reuse(5))
    assert kinds == []
    kinds, r = _kinds(tmp_path, header_for(pool, cfg), _swa_reuse(7), name="early.jsonl")
    # the pre-#28 property let this pass (a window block counted as freed once it started before the
    # holder's computed tokens): an early-reuse bug hid behind the allowance
    assert kinds == ["reused_while_needed"] and "block 7" in r.findings[0].message and "a still needs" in \
        r.findings[0].message


# ---- prefix-cache hits hold their tokens ----------------------------------------------------------------
def _hit(b_prompt, hit: int) -> list:
    return [add("a", list(range(1, 9)), max_tokens=3), sched(0, [["a", "n", 8, 0, [[1, 2]]]]),
            update(0, {"a": [40]}), add("b", b_prompt),
            sched(1, [["a", "c", 1, 8, [[3]]], ["b", "n", len(b_prompt) - hit, hit, [[1, 2, 4][: -(-len(b_prompt) // 4)]]]]),
            update(1, {"a": [41], "b": [42]})]


def test_a_prefix_cache_hit_must_hold_the_hits_own_tokens(tmp_path):
    pool, cfg = full_setup()
    h = header_for(pool, cfg)
    kinds, _ = _kinds(tmp_path, h, _hit(list(range(1, 10)), 8))
    assert kinds == []
    kinds, r = _kinds(tmp_path, h, _hit(list(range(1, 5)) + [50, 51, 52, 53, 9], 8), name="other.jsonl")
    assert kinds == ["wrong_hit"] and "block 2" in r.findings[0].message and "other tokens" in r.findings[0].message


# ---- admission within the startup bound --------------------------------------------------------------------
def test_a_request_never_holds_more_blocks_than_startup_sized_it_for(tmp_path):
    pool, cfg = full_setup()  # max_model_len 32, block size 4: at most 8 blocks
    ok = [add("a", [1] * 12), sched(0, [["a", "n", 12, 0, [list(range(1, 9))]]])]
    assert _kinds(tmp_path, header_for(pool, cfg), ok)[0] == []
    bad = [add("a", [1] * 12), sched(0, [["a", "n", 12, 0, [list(range(1, 10))]]])]
    kinds, r = _kinds(tmp_path, header_for(pool, cfg), bad, name="bad.jsonl")
    assert kinds == ["admission_bound"] and "holds 9 blocks" in r.findings[0].message


# ---- metrics ----------------------------------------------------------------------------------------------
def _stats(**kw) -> dict:
    out = {"usage": 2 / 19, "req": 1, "q": 5, "h": 0, "preq": 0, "pq": 0, "ph": 0, "run": 1, "wait": 0}
    out.update(kw)
    return out


def test_the_metrics_endpoint_numbers_must_match_the_trace(tmp_path):
    pool, cfg = full_setup()

    def recs(stats):
        return [add("a", [1, 2, 3, 4, 5], max_tokens=5), dict(sched(0, [["a", "n", 5, 0, [[1, 2]]]]), free=17),
                dict(update(0, {"a": [9]}), free=17, stats=stats)]

    assert _kinds(tmp_path, header_for(pool, cfg), recs(_stats()))[0] == []
    kinds, r = _kinds(tmp_path, header_for(pool, cfg), recs(_stats(req=2, h=4)), name="hits.jsonl")
    assert kinds == ["metrics"] and "req: recorded 2, expected 1" in r.findings[0].message
    kinds, r = _kinds(tmp_path, header_for(pool, cfg), recs(_stats(usage=0.5)), name="usage.jsonl")
    assert kinds == ["metrics"] and "usage" in r.findings[0].message


def test_block_checks_are_off_where_the_trace_cannot_show_every_free(tmp_path):
    """Mamba outside "none" mode frees old state blocks by rules the trace does not show: conservation
    would raise false alarms there, so the block checks say they are off and why."""
    pool, cfg = full_setup()
    h = header_for(pool, cfg)
    h["pool"]["groups"].append({"layers": ["m"], "spec": {"type": "MambaSpec", "block_size": 32,
                                                           "mamba_cache_mode": "all"}})
    recs = [add("a", [1, 2, 3, 4, 5]), dict(sched(0, [["a", "n", 5, 0, [[1, 2], [3]]]]), free=3)]
    kinds, r = _kinds(tmp_path, h, recs)
    assert kinds == [] and r.summary["block_checks"] == "off: group 1 (mamba)"
    h["pool"]["groups"][1]["spec"]["mamba_cache_mode"] = "none"
    kinds, r = _kinds(tmp_path, h, recs, name="none.jsonl")
    assert kinds == ["conservation"] and r.summary["block_checks"] == "on"


# ---- stop rules (#28) ---------------------------------------------------------------------------------------
def _stops(fin_at: int, reason: str, sampled=(5, 3), **stop) -> list:
    """'a' (max_tokens 6) decodes one token a step; it finishes at step ``fin_at`` with ``reason``."""
    recs = [{**add("a", [1, 2, 3, 4], max_tokens=6), **stop}, sched(0, [["a", "n", 4, 0, [[1]]]])]
    for k, token in enumerate(sampled):
        fin = [["a", reason]] if k == fin_at else []
        if k:
            new = [[1 + (3 + k) // 4]] if (3 + k) % 4 == 0 else None  # a new block every 4 tokens
            recs.append(sched(k, [["a", "c", 1, 3 + k, new]]))
        recs.append(update(k, {"a": [token]}, fin=fin))
        if fin:
            break
    return recs


@pytest.mark.parametrize("stop, recs_args, kinds_want", [
    ({"eos": 3}, (1, "stop"), []),  # the EOS id at output 2: a stop
    ({"eos": 3}, (5, "stop"), ["stop_rule"]),  # the EOS id sampled and the request went on
    ({"eos": 3, "min": 4}, (1, "stop"), []),  # min_tokens holds back only the repetition rule
    ({}, (1, "stop"), ["stop_rule"]),  # no rule names token 3
    ({}, (5, "length", (5, 3, 7, 8, 1, 2)), []),  # max_tokens 6
    ({}, (4, "length", (5, 3, 7, 8, 1, 2)), ["stop_rule"]),  # one output short of max_tokens
    ({"rep": [1, 1, 3]}, (2, "repetition", (4, 4, 4)), []),  # one token three times
    ({"rep": [1, 1, 3], "min": 4}, (2, "repetition", (4, 4, 4)), ["stop_rule"]),  # before min_tokens
    ({"rep": [1, 1, 3], "min": 4}, (3, "repetition", (4, 4, 4, 4)), []),
])
def test_every_finish_follows_vllms_stop_rules(tmp_path, stop, recs_args, kinds_want):
    """The stop-rule property walks vLLM's check_stop over the trace's tokens, independent of the
    reference: a request that sampled its EOS and went on, or stopped where no rule stops it (a
    repetition before min_tokens, a length cap one short), is a finding naming the request."""
    pool, cfg = full_setup()
    kinds, r = _kinds(tmp_path, header_for(pool, cfg), _stops(*recs_args, **stop))
    assert kinds == kinds_want, r.findings
    if kinds_want:
        assert "request a" in r.findings[0].message and not r.ok
