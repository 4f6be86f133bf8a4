"""The stop-rule property of ``kvref check-run`` (issue #28): every finish follows the stop rules.

Independent of the reference scheduler: from the trace alone (the ``add`` record's ``max_tokens``,
stop ids, ``eos``, ``min`` and ``rep``, format 5; the header's ``max_model_len``; the tokens each
``update`` carries) it walks vLLM's ``check_stop`` rules over the sampled tokens one by one, as
``update_from_output`` appends them, and compares where the request must stop with the ``fin`` the
update recorded: a request that sampled its EOS or a stop id and went on, one that stopped at a
token no rule names, or with another reason, is a ``stop_rule`` finding. The rules (vLLM 0.33.0
``v1/core/sched/utils.py``), in order: the EOS id, then a stop id (``stop``); ``max_model_len``
tokens or ``max_tokens`` outputs (``length``); fewer than ``min_tokens`` outputs hold back only
the last rule: the output ends in ``min_count`` copies of one n-gram of ``min_pattern_size`` (0
meaning 1) to ``max_pattern_size`` tokens (``repetition``). Their order has been wrong before
(vLLM PRs #47489, #49521, #51299 moved ``min_tokens`` after the length caps).

A streaming-input session (``add.resumable``, format 6) is judged turn by turn: a turn that meets a
stop rule without finishing is the session's stopped turn (vLLM's ``_handle_stopped_request`` keeps
the request), named in :attr:`StopRules.turn_stopped` for the run properties, which start the next
turn with :meth:`StopRules.begin_turn` when its update is applied; output of the turn's steps still
in flight when it stopped is stale (vLLM drops it) and not judged.

Not judged: requests the recorder named unmodelled (``x``: pooling, structured output, a streaming
input session the reference does not model); an update the recorder did not place (step -1); a request's output once a step of it came
back stale (it was preempted while that step was in flight: vLLM may drop such output), since its
output count is then unknown; likewise the outputs of an update whose KV connector reported failed
loads (vLLM drops the output of the requests it reschedules for them); finishes with other reasons
(abort, error).
"""

from __future__ import annotations

from kvref.impl.run_trace.format import update_sampled

#: the finish reasons a stop rule gives
RULE_REASONS = ("stop", "length", "repetition")


def repeats(tokens: list, rule: tuple) -> bool:
    """``tokens`` ends in ``min_count`` copies of one n-gram, ``n`` in the pattern sizes."""
    max_size, min_size, count = rule
    if max_size <= 0 or count < 2:
        return False
    for n in range(max(1, min_size), max_size + 1):
        if n * count > len(tokens):
            break
        tail = tokens[-n:]
        if all(tokens[-(k + 1) * n:len(tokens) - k * n] == tail for k in range(1, count)):
            return True
    return False


class _Stops:
    """One request's stop inputs and its outputs so far."""

    __slots__ = ("stop", "max_tokens", "min_tokens", "rule", "prompt_len", "outputs", "num_outputs")

    def __init__(self, rec: dict, prompt_len: int) -> None:
        self.stop = set(rec["stop"])
        if rec.get("eos") is not None:
            self.stop.add(rec["eos"])
        self.max_tokens = rec["max_tokens"]
        self.min_tokens = rec.get("min", 0)
        self.rule = tuple(rec["rep"]) if rec.get("rep") else None
        self.prompt_len = prompt_len
        self.outputs: list = []  # kept only under repetition detection (bounded by max_tokens)
        self.num_outputs = 0

    def append(self, token: int, max_model_len: int) -> str | None:
        """vLLM ``check_stop`` after appending ``token``: the reason it stops, or None."""
        self.num_outputs += 1
        if self.rule is not None:
            self.outputs.append(token)
        if token in self.stop:
            return "stop"
        if self.prompt_len + self.num_outputs >= max_model_len or self.num_outputs >= self.max_tokens:
            return "length"
        if self.num_outputs < self.min_tokens:
            return None
        if self.rule is not None and repeats(self.outputs, self.rule):
            return "repetition"
        return None


class StopRules:
    """Feed records in trace order; :meth:`update` returns the findings' messages."""

    def __init__(self, max_model_len: int, enabled: bool = True) -> None:
        self.max_model_len = max_model_len
        self.enabled = enabled  # False: nothing is judged (a connector trace without worker reports)
        self.reqs: dict[str, _Stops] = {}
        #: request -> the step whose schedule() preempted it (a reset: after the last step): the
        #: output of any earlier step still in flight is stale
        self.preempted_at: dict[str, int] = {}
        self.last_step = -1
        self.judged = 0  # finishes (and non-finishes at a stop token) compared
        #: streaming-input sessions (shared with the run properties, which add and drop them)
        self.sessions: set[str] = set()
        #: sessions whose turn stopped in the last :meth:`update` (not finished: vLLM keeps them)
        self.turn_stopped: list[str] = []
        #: session -> the last step scheduled when its turn stopped: output of steps up to it is stale
        self.stale_until: dict[str, int] = {}
        #: requests whose last preemption was for KV space (``pre_why`` "kv"): vLLM appends their
        #: stale output (not drop mode), so a session's stop rules go on judging it
        self.kv_preempted: set[str] = set()
        #: sessions whose output count is unknown (stale output vLLM may have dropped): their turn
        #: stops cannot be told from the trace any more
        self.lost: set[str] = set()

    def add(self, rec: dict, prompt_len: int) -> None:
        if rec.get("x") or not self.enabled:
            self.reqs.pop(rec["id"], None)
            return
        self.reqs[rec["id"]] = _Stops(rec, prompt_len)

    def begin_turn(self, rid: str, rec: dict, prompt_len: int) -> None:
        """A session's update was applied: its next turn stops by the update's rules (vLLM replaces
        the session's ``sampling_params`` and ``max_tokens``), counting outputs from 0."""
        if self.enabled and not rec.get("x"):
            self.reqs[rid] = _Stops(rec, prompt_len)

    def sched(self, rec: dict) -> None:
        self.last_step = rec["step"]
        why = rec.get("pre_why") or {}
        for rid in rec.get("pre") or ():
            self.preempted_at[rid] = rec["step"]
            if why.get(rid) == "kv":
                self.kv_preempted.add(rid)
            else:
                self.kv_preempted.discard(rid)

    def reset(self, rec: dict) -> None:
        if rec.get("running"):
            for rid in self.reqs:
                self.preempted_at[rid] = self.last_step + 1
                self.kv_preempted.discard(rid)

    def abort(self, rec: dict) -> None:
        for rid in rec["ids"]:
            self._forget(rid)

    def _forget(self, rid: str) -> None:
        self.reqs.pop(rid, None)
        self.preempted_at.pop(rid, None)

    def finished(self, rid: str) -> None:
        """``rid`` is gone (any finish): nothing of it is judged again."""
        self._forget(rid)
        self.stale_until.pop(rid, None)
        self.kv_preempted.discard(rid)
        self.lost.discard(rid)

    def update(self, rec: dict) -> list[str]:
        step = rec["step"]
        fin = {rid: why for rid, why in rec["fin"]}
        # a KV load that failed in some blocks: vLLM drops the output of the requests it reschedules
        # (failed_kv_load_req_ids), which the trace does not name
        load_failed = bool((rec.get("kvo") or {}).get("i") or (rec.get("kvo") or {}).get("f"))
        found = []
        self.turn_stopped = []
        for rid, toks in zip(rec["ids"], update_sampled(rec)):
            r = self.reqs.get(rid)
            if r is None or not toks or self.stale_until.get(rid, -1) >= step:
                continue
            if step < 0 or load_failed or self.preempted_at.get(rid, -1) > step:
                if not (rid in self.sessions and step >= 0 and not load_failed and rid in self.kv_preempted):
                    self._forget(rid)  # stale (or unplaced) output: its count is unknown from here
                    if rid in self.sessions:
                        self.lost.add(rid)
                    continue
            want, at = None, 0
            for at, token in enumerate(toks, 1):
                want = r.append(token, self.max_model_len)
                if want is not None:
                    break
            got = fin.get(rid)
            if got is not None and got not in RULE_REASONS:
                continue  # finished for another reason (error, abort inside the update)
            self.judged += 1
            if got is None and want is not None and rid in self.sessions:
                # a session's turn stopped: vLLM keeps the request (it waits for its next input)
                self.turn_stopped.append(rid)
                self.stale_until[rid] = self.last_step
                del self.reqs[rid]
                continue
            if got != want:
                self._forget(rid)  # one finding per request: its output count is off from here
                what = (f"stops with {want!r} at its output token {r.num_outputs} (token {toks[at - 1]}; "
                        f"{self._inputs(r)})" if want is not None else
                        f"has no stop rule met after {r.num_outputs} output tokens ({self._inputs(r)})")
                found.append(f"request {rid} finished {got!r} at step {step}, but it {what}"
                             if got is not None else f"request {rid} did not finish at step {step}, but it {what}")
        for rid in fin:
            self._forget(rid)
        return found

    @staticmethod
    def _inputs(r: _Stops) -> str:
        return (f"stop ids incl. EOS {sorted(r.stop)}, max_tokens {r.max_tokens}, min_tokens {r.min_tokens}, "
                f"repetition {list(r.rule) if r.rule else None}")

    def check_invariants(self) -> None:
        for rid, r in self.reqs.items():  # a live request never went past its caps unnoticed
            assert r.num_outputs < r.max_tokens and r.prompt_len + r.num_outputs < self.max_model_len, rid
            assert r.rule is not None or not r.outputs, rid


__all__ = ["RULE_REASONS", "StopRules", "repeats"]
