"""The waiting queue alone: vLLM 0.33.0's ``FCFSRequestQueue`` / ``PriorityRequestQueue`` against
the reference :class:`kvref.impl.reference.scheduler_queue.WaitingQueue` on generated operation
sequences (#22).

The scheduler drives only a few of the queue's methods, and never on an empty queue or with a
request the queue does not hold; this run drives every one of them on both policies (and an
unknown policy, which both refuse), including the refusals: an empty ``pop_request`` /
``peek_request``, removing a request not queued. After every operation it compares the result
(the request returned, or *that* the operation was refused), the iteration order, ``len`` and
``bool`` of the two queues, and checks their invariants; a refused operation must leave the order
unchanged.
"""

from __future__ import annotations

from collections import Counter

from hypothesis import strategies as st

from kvref.impl.request import Request
from kvref.models.machines.scheduler import SchedulerRun, run_generated_histories

#: what the last run reached (ops refused on an empty queue, removals, ...)
COVERAGE: Counter = Counter()

#: one operation: (name, argument); arguments index into the requests made so far
_ARGS = {
    "add": st.tuples(st.integers(0, 2), st.integers(0, 3)),  # (priority, arrival)
    "pop": st.none(), "peek": st.none(),
    "prepend": st.integers(0, 15), "remove": st.integers(0, 15),
    "prepend_many": st.lists(st.integers(0, 15), max_size=3), "remove_many": st.lists(st.integers(0, 15), max_size=3),
}
#: arrivals weigh most: the other operations need a populated queue
_NAMES = ("add",) * 5 + ("pop", "pop", "peek", "prepend", "prepend_many", "prepend_many", "remove", "remove", "remove_many")
_OPS = st.sampled_from(_NAMES).flatmap(lambda name: st.tuples(st.just(name), _ARGS[name]))
OPS = st.lists(_OPS, min_size=8, max_size=30)
POLICY = st.sampled_from(("fcfs", "priority"))
#: policies vLLM's ``SchedulingPolicy`` does not name (case matters): both refuse each, every run
UNKNOWN_POLICIES = ("lifo", "FCFS", "")


def _call(queue, name: str, *args):
    """``("ok", result)`` or ``("refused", None)`` for any exception (vLLM: ``IndexError`` /
    ``ValueError``; the reference: ``InvalidFieldError``)."""
    try:
        return "ok", getattr(queue, name)(*args)
    except Exception:  # noqa: BLE001 - the refusal itself is what is compared
        return "refused", None


def _make(queue_class, policy: str):
    """``("ok", queue)`` or ``("refused", None)`` (an unknown policy)."""
    try:
        return "ok", queue_class(policy)
    except Exception:  # noqa: BLE001 - vLLM raises ValueError, the reference InvalidFieldError
        return "refused", None


def _ids(queue) -> list[str]:
    return [r.request_id for r in queue]


def run_queue_history(policy: str, ops: list) -> None:
    """Drive both queues through ``ops``; an ``AssertionError`` names the first divergence."""
    from kvref.impl.reference.scheduler_queue import WaitingQueue
    from kvref.impl.vllm.scheduler_queue import VllmWaitingQueue

    made = {"ref": _make(WaitingQueue, policy), "vllm": _make(VllmWaitingQueue, policy)}
    assert made["ref"][0] == made["vllm"][0], \
        f"policy {policy!r}: vLLM {made['vllm'][0]}, kvref {made['ref'][0]}"
    if made["ref"][0] == "refused":
        COVERAGE["unknown_policy_refused"] += 1
        return
    ref, vq = made["ref"][1], made["vllm"][1]
    requests: list[Request] = []
    queued: set[int] = set()  # indexes of requests the queues hold

    def pick(i: int) -> Request | None:
        return requests[i % len(requests)] if requests else None

    for n, (name, arg) in enumerate(ops):
        before = _ids(ref)
        if name == "add":
            # a new arrival: vLLM's scheduler adds each request once
            r = Request(f"q{len(requests)}", prompt_token_ids=(1, 2), max_tokens=1, priority=arg[0],
                        arrival_time=float(arg[1]))
            requests.append(r)
            got = (_call(ref, "add_request", r), _call(vq, "add_request", r))
            queued.add(len(requests) - 1)
        elif name in ("pop", "peek"):
            got = (_call(ref, name + "_request"), _call(vq, name + "_request"))
            if got[0][0] == "ok" and name == "pop":
                queued.discard(requests.index(got[0][1]))
            COVERAGE[f"{name}_empty_refused"] += got[0][0] == "refused"
        elif name == "prepend":
            # a popped request put back (preemption), never one still queued
            idle = [i for i in range(len(requests)) if i not in queued]
            if not idle:
                continue
            i = idle[arg % len(idle)]
            got = (_call(ref, "prepend_request", requests[i]), _call(vq, "prepend_request", requests[i]))
            queued.add(i)
        elif name == "prepend_many":
            idle = [i for i in range(len(requests)) if i not in queued]
            chosen = list(dict.fromkeys(idle[a % len(idle)] for a in arg)) if idle else []
            batch = [requests[i] for i in chosen]
            got = (_call(ref, "prepend_requests", batch), _call(vq, "prepend_requests", batch))
            queued.update(chosen)
            COVERAGE["prepended_several"] += len(batch) > 1
        elif name == "remove":
            r = pick(arg)
            if r is None:
                continue
            got = (_call(ref, "remove_request", r), _call(vq, "remove_request", r))
            COVERAGE["remove_absent_refused" if got[0][0] == "refused" else "removed_one"] += 1
            queued.discard(requests.index(r))
        else:  # remove_many: any known requests, queued or not (vLLM ignores those not queued)
            batch = [pick(a) for a in arg if requests]
            got = (_call(ref, "remove_requests", batch), _call(vq, "remove_requests", batch))
            queued.difference_update(requests.index(r) for r in batch)
        (rs, rv), (vs, vv) = got
        what = f"op {n} {name}({arg!r}) on {policy}"
        assert rs == vs, f"{what}: vLLM {vs}, kvref {rs}"
        if rs == "ok" and name in ("pop", "peek"):
            assert rv is vv, f"{what}: vLLM returned {vv.request_id}, kvref {rv.request_id}"
        if rs == "refused":
            assert _ids(ref) == before, f"{what}: the refused operation changed the reference queue"
        assert _ids(vq) == _ids(ref), f"{what}: queue order vLLM {_ids(vq)}, kvref {_ids(ref)}"
        assert (len(vq), bool(vq)) == (len(ref), bool(ref)), \
            f"{what}: len/bool vLLM {(len(vq), bool(vq))}, kvref {(len(ref), bool(ref))}"
        ref.check_invariants()
        vq.check_invariants()


def run_queue_machine(examples: int, reproducible: bool = False, shrink: bool = True,
                      seed: int | None = None) -> SchedulerRun:
    """``examples`` generated operation sequences on both queues, compared after every operation."""
    from hypothesis import HealthCheck, Phase, given, settings

    counted = {"traces": 0, "ops": 0}
    COVERAGE.clear()

    @settings(max_examples=examples, deadline=None, database=None, derandomize=reproducible,
              suppress_health_check=list(HealthCheck), phases=list(Phase) if shrink else [Phase.generate])
    @given(POLICY, OPS)
    def run(policy, ops):
        counted["traces"] += 1
        counted["ops"] += len(ops)
        run_queue_history(policy, ops)

    def unknown_policies_then_run():
        for policy in UNKNOWN_POLICIES:
            run_queue_history(policy, [])
        run()

    return run_generated_histories(unknown_policies_then_run, counted, COVERAGE, seed, reproducible)
