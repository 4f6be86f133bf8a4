"""Streaming-input sessions (issue #22): kvref's session rules
(:mod:`kvref.impl.reference.scheduler_streaming`) against vLLM 0.33.0's own ``Scheduler.add_request``,
``_handle_stopped_request`` and ``_update_request_as_session`` on generated session histories.

Each history is a list of operations on one session: a turn generates tokens (with placeholders and
in-flight tokens left by async scheduling), a turn stops, an update arrives (queued while the
session runs, applied at once while it waits for input), a finishing update arrives, the session is
aborted. After every operation every observable is compared (prompt, outputs, computed tokens,
placeholders, stale output, ``max_tokens``, ``arrival_time``, waiting-for-input, queued updates,
``num_waiting_for_streaming_input``, liveness), and vLLM's block hashes must equal the hashes of
a fresh request over the same tokens (an independent oracle: a dropped token's hash must not
survive). Planted faults in vLLM must diverge."""

from __future__ import annotations

from contextlib import contextmanager

import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from tests.conftest import profile_examples
from tests.vllm_env import require_vllm

TOKENS = st.lists(st.integers(1, 9), min_size=1, max_size=5)
GEN = st.tuples(st.just("gen"), st.integers(1, 4), st.integers(0, 2), st.integers(0, 3))
STOP = st.tuples(st.just("stop"))
UPDATE = st.tuples(st.just("update"), TOKENS, st.integers(1, 4), st.integers(0, 5))
# each step: a turn generates (skipped while the session waits for input), then one action; the
# ending actions are drawn less often, so histories get to the paths after a wait
ACTION = st.one_of(STOP, UPDATE, STOP, UPDATE, st.tuples(st.just("finish")), st.tuples(st.just("abort")))
OPS = st.lists(st.tuples(GEN, ACTION), min_size=1, max_size=8).map(lambda steps: [op for s in steps for op in s])


@pytest.fixture(scope="module")
def vs_factory():
    require_vllm()
    from kvref.impl.interface import PoolConfig  # noqa: PLC0415 - imports vLLM once per module
    from kvref.impl.scheduler_types import SchedulerConfig
    from kvref.impl.vllm.scheduler import VllmEnv, VllmScheduler
    from kvref.models.machines.scheduler import _attn
    from kvref.spec.kv_cache_interface import FullAttentionSpec, KVCacheGroupSpec

    env = VllmEnv()
    cfg = SchedulerConfig(max_num_batched_tokens=16, max_num_seqs=4)
    pool = PoolConfig.off_plan("one streaming session", num_blocks=32,
                               groups=(KVCacheGroupSpec(("full",), _attn(FullAttentionSpec, 2)),), max_model_len=256,
                               scheduler_block_size=2, hash_block_size=2,
                               max_in_flight_tokens=cfg.max_in_flight_tokens, enable_caching=True)
    return lambda: VllmScheduler(pool, cfg, env)


def _ref_view(req, state, live: bool) -> dict:
    base = {"live": live, "num_waiting_for_streaming_input": state.num_waiting_for_streaming_input}
    if not live:
        return base
    return {**base, "prompt_token_ids": tuple(req.prompt_token_ids), "output_token_ids": tuple(req.output_token_ids),
            "num_computed_tokens": req.num_computed_tokens, "num_output_placeholders": req.num_output_placeholders,
            "num_stale_output_tokens": req.num_stale_output_tokens, "drop_stale_output": req.drop_stale_output,
            "max_tokens": req.max_tokens, "arrival_time": req.arrival_time,
            "waiting_for_input": req.request_id in state.waiting_for_input,
            "num_queued_updates": len(state.queues.get(req.request_id, ()))}


def run_history(vs, ops, reached: dict | None = None) -> None:
    """Drive one session through ``ops`` on vLLM and on kvref's rules; assert they agree."""
    from kvref.impl.reference import scheduler_streaming as ss
    from kvref.impl.request import Request
    from kvref.impl.vllm import scheduler_streaming as vss

    reached = reached if reached is not None else {}
    sched = vs.scheduler
    v = vs._v
    req = Request("s", [1, 2, 3], max_tokens=4)
    state = ss.SessionState()
    vss.add_session(vs, req)
    state.queues["s"] = __import__("collections").deque()
    live = True
    for n, op in enumerate(ops):
        if not live:
            break
        vr = sched.requests["s"]
        waiting = "s" in state.waiting_for_input
        kind = op[0]
        if kind == "gen":
            if waiting:
                continue
            _, k, p, f = op
            for t in range(k):
                vr.append_output_token_ids(10 + t)
                req.output_token_ids.append(10 + t)
            p = min(p, len(req.prompt_token_ids) + len(req.output_token_ids) - 1)
            for r in (vr, req):
                r.num_computed_tokens = len(req.prompt_token_ids) + len(req.output_token_ids) - 1
                r.num_output_placeholders = p
                r.num_in_flight_tokens = f
        elif kind == "stop":
            if waiting or not req.output_token_ids:
                continue
            reached["queued_applied" if state.queues["s"] and state.queues["s"][0] is not None
                    else "finish_queued" if state.queues["s"] else "waits"] = True
            finished_v = sched._handle_stopped_request(vr)
            finished_r = ss.handle_stopped_request(req, state)
            assert finished_v == finished_r, f"op {n}: finished {finished_v} vs {finished_r}"
            if finished_v:
                sched.finish_requests("s", v["VStatus"].FINISHED_STOPPED)
                ss.forget(state, "s")
                live = False
        elif kind == "update":
            _, prompt, mt, at = op
            upd = ss.StreamingUpdate(tuple(prompt), mt, float(at))
            reached["applied_at_once" if waiting else "queued"] = True
            vss.add_update(vs, "s", upd)
            assert ss.add_update(state, req, upd) == ("applied" if waiting else "queued")
        elif kind == "finish":
            vss.add_update(vs, "s", None)
            if ss.add_update(state, req, None) == "finish":
                reached["finish_while_waiting"] = True
                ss.forget(state, "s")
                live = False
        else:  # abort
            reached["abort_while_waiting" if waiting else "abort"] = True
            sched.finish_requests("s", v["VStatus"].FINISHED_ABORTED)
            ss.forget(state, "s")
            live = False
        assert vss.session_view(vs, "s") == _ref_view(req, state, live), f"op {n} {op}"
        if live:
            state.check_invariants({"s"})
            vr = sched.requests["s"]
            fresh = v["VRequest"](request_id="fresh", prompt_token_ids=list(vr.all_token_ids),
                                  sampling_params=v["SamplingParams"](max_tokens=1), pooling_params=None,
                                  block_hasher=vs._hasher)
            assert list(vr.block_hashes) == list(fresh.block_hashes), f"op {n} {op}: stale block hashes"


@pytest.mark.vllm
def test_generated_session_histories_match_vllm(vs_factory):
    @settings(max_examples=profile_examples(40, 120), deadline=None, database=None,
              suppress_health_check=list(HealthCheck))
    @given(OPS)
    def run(ops):
        run_history(vs_factory(), ops)

    run()


@pytest.mark.vllm
def test_derandomized_histories_reach_every_session_path(vs_factory):
    reached: dict = {}

    @settings(max_examples=80, derandomize=True, database=None, deadline=None,
              suppress_health_check=list(HealthCheck))
    @given(OPS)
    def run(ops):
        run_history(vs_factory(), ops, reached)

    run()
    for path in ("queued", "applied_at_once", "queued_applied", "waits", "finish_queued",
                 "finish_while_waiting", "abort_while_waiting"):
        assert reached.get(path), f"path {path} not reached"


class _KeepAll(list):
    """A block-hash list whose deletions do nothing (a planted fault)."""

    def __delitem__(self, key):
        return None


@contextmanager
def _patched(cls, name, wrapper):
    orig = getattr(cls, name)
    setattr(cls, name, wrapper(orig))
    try:
        yield
    finally:
        setattr(cls, name, orig)


# a history that stops a turn whose final sampled token completes a hash block, then updates
FAULT_HISTORY = [("gen", 1, 0, 0), ("stop",), ("update", [5, 6], 2, 1)]


@pytest.mark.vllm
def test_fault_update_keeps_the_dropped_tokens_hashes_diverges(vs_factory):
    from vllm.v1.core.sched.scheduler import Scheduler

    run_history(vs_factory(), FAULT_HISTORY)  # the healthy vLLM agrees

    def wrapper(orig):
        def fault(self, session, update):
            session.block_hashes = _KeepAll(session.block_hashes)
            try:
                return orig(self, session, update)
            finally:
                session.block_hashes = list(session.block_hashes)
        return fault

    with _patched(Scheduler, "_update_request_as_session", wrapper), pytest.raises(AssertionError, match="hash"):
        run_history(vs_factory(), FAULT_HISTORY)


@pytest.mark.vllm
def test_fault_stop_keeps_the_placeholders_diverges(vs_factory):
    from vllm.v1.core.sched.scheduler import Scheduler

    history = [("gen", 2, 1, 2), ("stop",)]
    run_history(vs_factory(), history)

    def wrapper(orig):
        def fault(self, request):
            placeholders = request.num_output_placeholders
            finished = orig(self, request)
            request.num_computed_tokens += placeholders  # forgets to drop the in-flight frontier
            return finished
        return fault

    with _patched(Scheduler, "_handle_stopped_request", wrapper), pytest.raises(AssertionError, match="op 1"):
        run_history(vs_factory(), history)
