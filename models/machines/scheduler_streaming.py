"""Streaming-input sessions (issue #22): generated session histories run on vLLM 0.33.0's real
``Scheduler`` (``add_request`` with a live id, ``_handle_stopped_request``,
``_update_request_as_session``, ``finish_requests``) and on kvref's session rules
(:mod:`kvref.impl.reference.scheduler_streaming`), compared after every operation.

A history is a list of steps on one session: a turn generates tokens (leaving output placeholders
and in-flight tokens as async scheduling does; skipped while the session waits for input), then
one action: the turn stops, an update arrives (queued while the session runs, applied at once
while it waits for input), a finishing update arrives, or the session is aborted. Compared: prompt,
outputs, computed tokens, placeholders, stale output, ``max_tokens``, ``arrival_time``, waiting for
input, queued updates, ``num_waiting_for_streaming_input``, liveness, and (an independent oracle)
vLLM's block hashes against a fresh request's over the same tokens, so a dropped token's hash may
not survive an update.

Sessions inside whole scheduler steps (re-enqueue into ``kv_holding_waiting``, the active-request
limit, request counts) are compared by :mod:`kvref.models.machines.scheduler_sessions`.
"""

from __future__ import annotations

from collections import Counter, deque
from typing import Any

from hypothesis import strategies as st

from kvref.impl.reference import scheduler_streaming as ss
from kvref.impl.request import Request
from kvref.models.machines.scheduler import SchedulerRun, run_generated_histories

COVERAGE: Counter = Counter()

TOKENS = st.lists(st.integers(1, 9), min_size=1, max_size=5)
GEN = st.tuples(st.just("gen"), st.integers(1, 4), st.integers(0, 2), st.integers(0, 3))
STOP = st.tuples(st.just("stop"))
UPDATE = st.tuples(st.just("update"), TOKENS, st.integers(1, 4), st.integers(0, 5))
# each step: a turn generates, then one action; the ending actions are drawn less often, so
# histories get to the paths after a wait
ACTION = st.one_of(STOP, UPDATE, STOP, UPDATE, STOP, UPDATE, st.tuples(st.just("finish")), st.tuples(st.just("abort")))
OPS = st.lists(st.tuples(GEN, ACTION), min_size=1, max_size=8).map(lambda steps: [op for s in steps for op in s])


def _ref_view(req: Request, state: ss.SessionState, live: bool) -> dict:
    base = {"live": live, "num_waiting_for_streaming_input": state.num_waiting_for_streaming_input}
    if not live:
        return base
    return {**base, "prompt_token_ids": tuple(req.prompt_token_ids), "output_token_ids": tuple(req.output_token_ids),
            "num_computed_tokens": req.num_computed_tokens, "num_output_placeholders": req.num_output_placeholders,
            "num_stale_output_tokens": req.num_stale_output_tokens, "drop_stale_output": req.drop_stale_output,
            "max_tokens": req.max_tokens, "arrival_time": req.arrival_time,
            "waiting_for_input": req.request_id in state.waiting_for_input,
            "num_queued_updates": len(state.queues.get(req.request_id, ()))}


def _note_block_end(req: Request, applies: bool, hash_block_size: int = 2) -> None:
    """Count updates applied where the dropped final token ends a hash block: the block's hash
    must go with it (the rare case of ``_update_request_as_session``'s hash trimming)."""
    if applies and (len(req.prompt_token_ids) + len(req.output_token_ids)) % hash_block_size == 0:
        COVERAGE["update_drops_a_full_blocks_hash"] += 1


def _stop(sched, v, vr, req, state, n) -> bool:
    """The turn stops: both sides handle it; True while the session lives on."""
    queue = state.queues["s"]
    _note_block_end(req, queue and queue[0] is not None)
    COVERAGE["stop_applied_queued_update" if queue and queue[0] is not None
             else "stop_finished_by_queued_none" if queue else "stop_waits_for_input"] += 1
    finished_v = sched._handle_stopped_request(vr)
    finished_r = ss.handle_stopped_request(req, state)
    assert finished_v == finished_r, f"op {n}: stopped session finished: vLLM {finished_v}, kvref {finished_r}"
    if finished_v:
        sched.finish_requests("s", v["VStatus"].FINISHED_STOPPED)
        ss.forget(state, "s")
    return not finished_v


def run_history(vs: Any, ops: list[tuple], prompt: tuple[int, ...] = (1, 2, 3)) -> None:
    """Drive one session through ``ops`` on ``vs`` (a VllmScheduler) and on kvref's rules; raise
    AssertionError at the first observable that differs."""
    from kvref.impl.vllm import scheduler_streaming as vss
    from kvref.impl.vllm.vrequest import vllm_request, vllm_sampling_params

    sched, v = vs.scheduler, vs._v
    req = Request("s", list(prompt), max_tokens=4)
    state = ss.SessionState(queues={"s": deque()})
    vss.add_session(vs, req)
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
            num_tokens = len(req.prompt_token_ids) + len(req.output_token_ids)
            for r in (vr, req):
                r.num_computed_tokens = num_tokens - 1  # the final sampled token is never computed
                r.num_output_placeholders = min(p, num_tokens - 1)
                r.num_in_flight_tokens = f
        elif kind == "stop":
            if waiting or not req.output_token_ids:
                continue
            live = _stop(sched, v, vr, req, state, n)
        elif kind == "update":
            _, prompt, mt, at = op
            upd = ss.StreamingUpdate(tuple(prompt), mt, float(at))
            COVERAGE["update_applied_at_once" if waiting else "update_queued"] += 1
            _note_block_end(req, waiting)
            vss.add_update(vs, "s", upd)
            assert ss.add_update(state, req, upd) == ("applied" if waiting else "queued")
        elif kind == "finish":
            vss.add_update(vs, "s", None)
            if ss.add_update(state, req, None) == "finish":
                COVERAGE["finish_while_waiting"] += 1
                ss.forget(state, "s")
                live = False
            else:
                COVERAGE["finish_queued"] += 1
        else:  # abort
            COVERAGE["abort_while_waiting" if waiting else "abort_while_queued"] += 1
            sched.finish_requests("s", v["VStatus"].FINISHED_ABORTED)
            ss.forget(state, "s")
            live = False
        got, want = vss.session_view(vs, "s"), _ref_view(req, state, live)
        assert got == want, f"op {n} {op[0]}: session differs: " + ", ".join(
            f"{k}: vLLM {got.get(k)!r}, kvref {want.get(k)!r}" for k in sorted(set(got) | set(want))
            if got.get(k) != want.get(k))
        if live:
            state.check_invariants({"s"})
            vr = sched.requests["s"]
            fresh = vllm_request("fresh", list(vr.all_token_ids), vllm_sampling_params(max_tokens=1),
                                 block_hasher=vs._hasher)
            assert list(vr.block_hashes) == list(fresh.block_hashes), \
                f"op {n} {op[0]}: the session's block hashes are not those of its tokens (stale block hashes)"


def streaming_scheduler_factory():
    """A factory of fresh vLLM schedulers for one session (FA pool, prefix caching on)."""
    from kvref.impl.interface import PoolConfig
    from kvref.impl.scheduler_types import SchedulerConfig
    from kvref.impl.vllm.scheduler import VllmEnv, VllmScheduler
    from kvref.models.machines.scheduler import _attn
    from kvref.spec.kv_cache_interface import FullAttentionSpec, KVCacheGroupSpec

    env = VllmEnv()
    cfg = SchedulerConfig(max_num_batched_tokens=16, max_num_seqs=4)
    pool = PoolConfig.off_plan("one streaming session: 31 usable blocks, fewer than a 256-token request needs "
                               "(startup would refuse the pool); the session never grows that long", num_blocks=32,
                               groups=(KVCacheGroupSpec(("full",), _attn(FullAttentionSpec, 2)),), max_model_len=256,
                               scheduler_block_size=2, hash_block_size=2,
                               max_in_flight_tokens=cfg.max_in_flight_tokens, enable_caching=True)
    return lambda: VllmScheduler(pool, cfg, env)


def run_streaming_sessions(examples: int, reproducible: bool = False, shrink: bool = True,
                           seed: int | None = None) -> SchedulerRun:
    """``examples`` generated session histories, each compared after every operation."""
    from hypothesis import HealthCheck, Phase, given, settings

    make = streaming_scheduler_factory()
    counted = {"traces": 0, "ops": 0}
    COVERAGE.clear()

    @settings(max_examples=examples, deadline=None, database=None, derandomize=reproducible,
              suppress_health_check=list(HealthCheck), phases=list(Phase) if shrink else [Phase.generate])
    @given(TOKENS, OPS)
    def run(prompt, ops):
        counted["traces"] += 1
        counted["ops"] += len(ops)
        run_history(make(), ops, tuple(prompt))

    return run_generated_histories(run, counted, COVERAGE, seed, reproducible)
