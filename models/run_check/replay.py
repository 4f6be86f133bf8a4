"""Lock-step replay of a recorded run on the reference scheduler and KV cache manager.

The recorded engine's calls are replayed in their order (arrivals, outside aborts, ``schedule()``,
``update_from_output`` with the *recorded* sampled tokens). After every ``schedule()`` the
reference's decision is compared with the recorded one: the requests in batch order, their kind
(new / resumed / running), token counts, computed tokens and block ids per
group — exactly, not up to renaming, since vLLM's free-queue order is defined — and the preempted
and finished ids. After every ``update_from_output`` the requests each side finished, and why.
This is the etcd-raft / CCF way of validating implementation traces against a spec: the
implementation's trace drives the model, and the first step where the model could not have done
what the implementation did is the finding.

Version 3 traces also carry what the KV cache *showed*: the free-block count after every call and
the ``SchedulerStats`` the metrics endpoint reported (usage, prefix-cache queries and hits); both
are compared with the reference's (the KV cache manager's ``make_prefix_cache_stats``, recorded at
admission as vLLM's scheduler records them; :mod:`.metrics` for usage), so a refused admission
that leaks a block, or a hit-rate counter that miscounts, is a divergence at the step it happens
(issue #28). A recorded
``error`` (vLLM raised inside a call) is replayed as the same call on the reference: the
:class:`~.crash.Crash` says whether the reference raises too or what it would have done.

Where the run uses something the reference does not model (named in the header, on an arrival
or on a step), the replay *stops following* at that point and says why; the run properties
(:mod:`.properties`) go on to the end. Memory is bounded by the live requests: finished
requests are dropped, steps are settled first-in first-out.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field

from kvref.impl.reference.scheduler import Scheduler
from kvref.impl.scheduler_types import ModelOutput, SchedulerOutput
from kvref.impl.request import (LoRARequest, MultiModalFeatureSpec, PlaceholderRange, RepetitionDetectionParams, Request,
                                RequestStatus)
from kvref.impl.run_trace.format import decode_embeds, decode_tokens, sched_rows, update_sampled
from kvref.spec.errors import InvalidFieldError

from .connector import ConnectorMismatch, TraceConnector, kv_output, multi_violation
from .crash import Crash
from .grammar import GrammarMismatch, TraceGrammarOracle
from .metrics import PrefixCacheTally, compare_stats, hit_before_replay, usage, usage_differs
from .setup import RunSetup

_KIND = {"new": "n", "resumed": "r", "running": "c"}
#: the connector prefix-cache stats keys of an update's ``stats`` (format 4)
_CONN_STATS = ("creq", "cq", "ch", "cpreq", "cpq", "cph", "creset")
_CALLS = {"sched": "schedule", "update": "update_from_output", "abort": "finish_requests", "add": "add_request",
          "reset": "reset_prefix_cache", "error": "the crashed call"}


def _norm_blocks(blocks) -> list | None:
    """Recorded or reference block ids per group as lists; None when no group got any."""
    if blocks is None or not any(len(g) for g in blocks):
        return None
    return [list(g) for g in blocks]


def reference_rows(out: SchedulerOutput) -> list[list]:
    """The reference's ``SchedulerOutput`` as rows ``[id, kind, tokens, computed, block ids]``."""
    return [[s.request_id, _KIND[s.kind], s.num_scheduled_tokens, s.num_computed_tokens, _norm_blocks(s.block_ids)]
            for s in out.scheduled]


def recorded_rows(rec: dict) -> list[list]:
    """A recorded ``sched`` record as the same rows (block ids normalised the same way)."""
    return [[r[0], r[1], r[2], r[3], _norm_blocks(r[4])] for r in sched_rows(rec)]


@dataclass
class Divergence:
    """The first point where the reference could not have done what the recorded engine did."""

    line: int
    step: int
    call: str  # "schedule", "update_from_output", "add_request", "finish_requests"
    message: str
    recorded: list = field(default_factory=list)
    reference: list = field(default_factory=list)
    recorded_extra: dict = field(default_factory=dict)
    reference_extra: dict = field(default_factory=dict)

    def table(self) -> str:
        """A step table, recorded vs reference, differing rows marked ``*``."""
        head = f"divergence at {self.call} of step {self.step} (trace line {self.line}): {self.message}"
        if self.call != "schedule":
            lines = [head]
            for k in sorted(set(self.recorded_extra) | set(self.reference_extra)):
                lines.append(f"  {k}: recorded {self.recorded_extra.get(k)!r}, reference {self.reference_extra.get(k)!r}")
            return "\n".join(lines)
        rec = {r[0]: r for r in self.recorded}
        ref = {r[0]: r for r in self.reference}
        order = [r[0] for r in self.recorded] + [r[0] for r in self.reference if r[0] not in rec]
        cols = ("request", "side", "kind", "tokens", "computed", "block ids per group")
        rows = []
        for rid in order:
            a, b = rec.get(rid), ref.get(rid)
            mark = "*" if a != b else " "
            for side, r in (("recorded", a), ("reference", b)):
                if r is None:
                    rows.append((mark + rid, side, "-", "-", "-", "(not scheduled)"))
                else:
                    rows.append((mark + rid, side, {"n": "new", "r": "resumed", "c": "running"}[r[1]], str(r[2]),
                                 str(r[3]), str(r[4]) if r[4] is not None else "-"))
        widths = [max(len(c), *(len(r[i]) for r in rows)) if rows else len(c) for i, c in enumerate(cols)]
        fmt = "  ".join("{:<%d}" % w for w in widths)
        out = [head, "  " + fmt.format(*cols), "  " + fmt.format(*("-" * w for w in widths))]
        out += ["  " + fmt.format(*r) for r in rows]
        if not rows:
            out.append("  (both scheduled nothing)")
        for k in sorted(set(self.recorded_extra) | set(self.reference_extra)):
            a, b = self.recorded_extra.get(k), self.reference_extra.get(k)
            out.append(f"  {'*' if a != b else ' '}{k}: recorded {a}, reference {b}")
        return "\n".join(out)

    def to_json(self) -> dict:
        return {"line": self.line, "step": self.step, "call": self.call, "message": self.message,
                "recorded": self.recorded, "reference": self.reference,
                "recorded_extra": self.recorded_extra, "reference_extra": self.reference_extra}


def _request(rec: dict) -> Request:
    """A reference request from an ``add`` record (its multimodal items and LoRA adapter, #28)."""
    mm = tuple(MultiModalFeatureSpec(str(i), PlaceholderRange(int(off), int(n)), str(kind))
               for i, off, n, kind in rec.get("mm") or ())
    lora = rec.get("lora")
    rep = rec.get("rep")
    # check_stop's inputs (format 5, #28): a version-4 trace's ``stop`` already holds the EOS id, and
    # min_tokens only holds back the repetition rule, which a version-4 recorder named unmodelled
    stop = dict(eos_token_id=rec.get("eos"), min_tokens=rec.get("min", 0),
                repetition_detection=None if rep is None else RepetitionDetectionParams(*rep))
    return Request(rec["id"], decode_tokens(rec["prompt"]), max_tokens=rec["max_tokens"], cache_salt=rec["salt"],
                   priority=rec["priority"], arrival_time=float(rec["arrival"]), stop_token_ids=tuple(rec["stop"]),
                   **stop,
                   skip_reading_prefix_cache=rec.get("skip_read") is True, mm_features=mm,
                   resumable=rec.get("resumable") is True,
                   # kv_transfer_params.do_remote_prefill (#28): the decode side of a P/D split
                   do_remote_prefill=rec.get("remote") is True,
                   # prompt embeddings (format 6): a digest per row stands for the row
                   prompt_embeds=decode_embeds(rec["embeds"]) if rec.get("embeds") else None,
                   lora_request=None if lora is None else LoRARequest(str(lora[0]), int(lora[1]), str(lora[2])),
                   # structured output (format 7): the grammar's answers come from the records' "gr"
                   use_structured_output=rec.get("so") is True)


def recorded_encoder(rec: dict) -> dict:
    """A ``sched`` record's encoder inputs, evictions and V2 updates, as the reference's
    ``encoder_view()`` shows them (absent keys: none)."""
    return {"scheduled_encoder_inputs": {r: tuple(i) for r, i in (rec.get("enc") or {}).items()},
            "free_encoder_mm_hashes": tuple(rec.get("efree") or ()),
            "encoder_input_updates": {r: {int(i): k for i, k in u.items()} for r, u in (rec.get("eupd") or {}).items()}}


class LockstepReplay:
    """Replays one trace's records on the reference; :attr:`divergence` holds the first finding.

    Feed records in trace order with :meth:`feed`; once it diverged or stopped following, further
    records are ignored (``following`` is False, ``stopped_because`` says why).
    """

    def __init__(self, setup: RunSetup) -> None:
        self.setup = setup
        self.following = setup.followable
        self.stopped_because = "; ".join(setup.unmodelled) if setup.unmodelled else ""
        self.stopped_at_line = 1 if not self.following else 0
        self.divergence: Divergence | None = None
        self.steps_compared = 0
        #: the replay's KV connector (format-4 connector runs): answers from the trace
        self.connector = TraceConnector(setup.connector) if self.following and setup.connector is not None else None
        # on a connector run the reference records its prefix-cache and connector stats itself, where
        # vLLM does (at admission, before a bounded replay rewinds the hit; a deferred HiSparse load's
        # connector stats when the update hands it over): compared with vLLM by the lifecycle machine
        #: the replay's grammar oracle (format 7): structured-output answers from the trace; the
        #: reference models structured output without a KV connector (the recorder names it beside one)
        self.grammar = TraceGrammarOracle() if self.following and self.connector is None else None
        self.scheduler = (Scheduler(setup.pool, setup.config, connector=self.connector,
                                    record_prefix_cache_stats=self.connector is not None,
                                    grammar_oracle=self.grammar, **setup.scheduler_kwargs())
                          if self.following else None)
        self._in_flight: OrderedDict[int, SchedulerOutput] = OrderedDict()
        self._live: dict[str, Request] = {}
        self.crash: Crash | None = None
        self._tally = PrefixCacheTally(bool(setup.pool is not None and setup.pool.enable_caching))
        self._num_blocks = setup.pool.num_blocks if setup.pool is not None else 0
        self._reset_replayed = False  # a replayed reset's preemptions are the reference's too

    def _stop(self, line: int, why: str) -> None:
        self.following = False
        self.stopped_because = why
        self.stopped_at_line = line
        self.scheduler = None
        self._in_flight.clear()
        self._live.clear()

    def _diverge(self, d: Divergence) -> None:
        self.divergence = d
        self.following = False
        self.scheduler = None

    def feed(self, line: int, rec: dict) -> None:
        t = rec["t"]
        if t == "error" and self.crash is None:
            self._error(line, rec)
            return
        if not self.following:
            return
        if self.connector is not None and not self._expect_kv(line, rec):
            return
        if self.grammar is None:
            self._feed(line, rec)
            return
        self.grammar.expect(rec.get("gr"), f"{_CALLS.get(t, t)} (trace line {line})")
        try:
            self._feed(line, rec)
            if self.following:
                self.grammar.leftover()
        except GrammarMismatch as exc:
            self._diverge(Divergence(line, rec.get("step", -1), _CALLS.get(t, t),
                                     "the grammars were asked differently: " + exc.message,
                                     recorded_extra={"grammar": exc.recorded},
                                     reference_extra={"grammar": exc.reference}))

    def _feed(self, line: int, rec: dict) -> None:
        t = rec["t"]
        if t == "sched":
            self._schedule(line, rec)
        elif t == "update":
            self._update(line, rec)
        elif t == "add":
            self._add(line, rec)
        elif t == "abort":
            ids = [i for i in rec["ids"] if i in self._live]
            if not self._kv_call(line, -1, "finish_requests", lambda: self.scheduler.finish_requests(ids)):
                return
            for i in ids:
                del self._live[i]
            self._check_free(line, -1, "finish_requests", rec)
        elif t == "reset":  # through the reference's scheduler, with or without a connector (#28)
            self._reset(line, rec)
        elif t == "pause":
            self.scheduler.set_pause_state(rec["state"])  # vLLM's pause states, modelled (#28)
        elif t == "drafts":
            from kvref.impl.scheduler_types import DraftTokenIds

            self.scheduler.update_draft_token_ids(DraftTokenIds(tuple(rec["ids"]), tuple(map(tuple, rec["tokens"]))))

    # ---- KV connector runs (format 4): the connector answers from the trace ----------------------
    def _expect_kv(self, line: int, rec: dict) -> bool:
        """Load the record's connector answers; a MultiConnector entry whose children's answers break
        the composition rules is a divergence (False)."""
        kv = rec.get("kv")
        for e in kv or ():
            bad = multi_violation(e)
            if bad:
                self._diverge(Divergence(line, rec.get("step", -1), _CALLS.get(rec["t"], rec["t"]), bad,
                                         recorded_extra={"connector call": e}))
                return False
        self.connector.expect(kv, f"{_CALLS.get(rec['t'], rec['t'])} (trace line {line})")
        return True

    def _kv_call(self, line: int, step: int, call: str, fn) -> bool:
        """Make a reference call whose connector questions must be vLLM's; False on a divergence."""
        try:
            fn()
            if self.connector is not None:
                self.connector.leftover()
        except ConnectorMismatch as exc:
            self._diverge(Divergence(line, step, call, "the connector was driven differently: " + exc.message,
                                     recorded_extra={"connector": exc.recorded},
                                     reference_extra={"connector": exc.reference}))
            return False
        except ValueError as exc:  # the reference refuses the call vLLM made (e.g. a step never settled)
            self._diverge(Divergence(line, step, call, f"the reference refuses the call: {exc}"))
            return False
        except AssertionError as exc:  # e.g. a recorded hit longer than the request: vLLM asserts too
            self._diverge(Divergence(line, step, call, "the reference cannot take what vLLM's connector answered: "
                                     f"{exc or 'an internal check failed'}"))
            return False
        return True

    def _reset(self, line: int, rec: dict) -> None:
        """``reset_prefix_cache`` through the reference's scheduler (vLLM ``Scheduler.reset_prefix_cache``:
        with ``running`` every running request is preempted first, its in-flight output dropped; the
        preemptions show in the next step's ``pre``). On a connector run the connector's cache reset
        answers from the trace."""
        got: list = []

        def reset() -> None:
            try:
                got.append(self.scheduler.reset_prefix_cache(bool(rec.get("running")), bool(rec.get("connector"))))
            except RuntimeError as exc:  # vLLM raises too where it cannot reset after preempting
                got.append(f"{type(exc).__name__}: {exc}")

        if not self._kv_call(line, -1, "reset_prefix_cache", reset):
            return
        want = "raises RuntimeError" if rec.get("raised") else bool(rec.get("ok"))
        have = "raises RuntimeError" if isinstance(got[0], str) else bool(got[0])
        if want != have:
            self._diverge(Divergence(line, -1, "reset_prefix_cache", "a different reset result",
                                     recorded_extra={"result": rec.get("raised") or rec.get("ok")},
                                     reference_extra={"result": got[0]}))
            return
        self._reset_replayed = True
        self._check_free(line, -1, "reset_prefix_cache", rec)

    def _ref_free(self) -> int:
        return self.scheduler.kv_cache_manager.get_num_free_blocks()

    def _check_free(self, line: int, step: int, call: str, rec: dict) -> bool:
        """The recorded free-block count (version 3) against the reference's; False on a divergence."""
        free = rec.get("free")
        if free is None or self.divergence is not None:
            return True
        ref = self._ref_free()
        if free != ref:
            self._diverge(Divergence(line, step, call, "a different free-block count (a block leaked or freed "
                                     "that the reference keeps)", recorded_extra={"free blocks": free},
                                     reference_extra={"free blocks": ref}))
            return False
        return True

    def _error(self, line: int, rec: dict) -> None:
        """vLLM raised in a recorded call: make the same call on the reference (if it follows)."""
        call, step = rec["call"], rec["step"]
        crash = self.crash = Crash(line, step, call, rec["type"], rec["message"])
        if not self.following:
            crash.reference = ("not replayed: " + self.stopped_because if self.divergence is None and self.stopped_because
                               else "not replayed: the reference had already diverged" if self.divergence is not None
                               else "not replayed")
            return
        if self.connector is not None:
            self.connector.expect(rec.get("kv"), f"{call} (trace line {line}, the crashed call)")
        if self.grammar is not None:
            self.grammar.expect(rec.get("gr"), f"{call} (trace line {line}, the crashed call)")
        try:
            if call == "schedule":
                out = self.scheduler.schedule()
                crash.reference_rows = reference_rows(out)
                crash.reference = (f"schedules {len(out.scheduled)} request(s) "
                                   f"({sum(s.num_scheduled_tokens for s in out.scheduled)} tokens), preempts "
                                   f"{sorted(out.preempted_req_ids) or 'none'}: it does not raise")
            elif call == "update_from_output":
                upd = rec.get("update")
                if upd is None or step not in self._in_flight:
                    crash.reference = "not replayed: the update's inputs or its step are not in the trace"
                else:
                    out = self._in_flight.pop(step)
                    sampled = {rid: toks for rid, toks in zip(upd["ids"], update_sampled(upd)) if toks}
                    kvo = kv_output(upd.get("kvo")) if self.connector is not None else None
                    self.scheduler.update_from_output(out, ModelOutput(sampled), kvo)
                    crash.reference = "settles the step without raising"
            elif call == "add_request":
                a = rec.get("add")
                if a is None:
                    crash.reference = "not replayed: the request could not be recorded"
                else:
                    self.scheduler.add_request(_request(a))
                    crash.reference = f"accepts request {a['id']}"
            else:
                done = self.scheduler.finish_requests([i for i in rec.get("ids") or [] if i in self._live])
                crash.reference = f"finishes {sorted(r.request_id for r in done)} without raising"
        except ConnectorMismatch as exc:
            crash.reference = "not comparable: the connector was driven differently: " + exc.message
        except GrammarMismatch as exc:
            crash.reference = "not comparable: the grammars were asked differently: " + exc.message
        except Exception as exc:  # noqa: BLE001 - the reference raising is the answer
            crash.reference_raised = True
            crash.reference = f"raises too: {type(exc).__name__}: {exc}"
        self._stop(line, f"vLLM raised in {call} (a crash: nothing after it is replayed)")

    def _add(self, line: int, rec: dict) -> None:
        if rec.get("x"):
            self._stop(line, f"request {rec['id']} uses {', '.join(rec['x'])}")
            return
        if rec.get("mm") and self.connector is not None:
            self._stop(line, f"request {rec['id']} has multimodal items on a KV-connector run (kvref models "
                       "encoder inputs without a connector)")
            return
        session = self._live.get(rec["id"])  # an add with a live session's id: its next input or its end
        try:
            r = _request(rec)
            self.scheduler.add_request(r)
        except InvalidFieldError as exc:
            if exc.field == "request.resumable":  # a session where the reference does not model one
                self._stop(line, f"request {rec['id']} is a streaming-input session the reference does not model "
                           f"here ({exc.allowed})")
                return
            self._diverge(Divergence(line, -1, "add_request", f"the reference rejects request {rec['id']}: {exc}"))
            return
        except ValueError as exc:
            self._diverge(Divergence(line, -1, "add_request", f"the reference rejects request {rec['id']}: {exc}"))
            return
        if session is None:
            self._live[r.request_id] = r
        elif session.status == RequestStatus.FINISHED:  # the finishing update of a session waiting for input
            del self._live[session.request_id]

    def _schedule(self, line: int, rec: dict) -> None:
        if rec.get("x") or rec.get("throttle"):
            why = ", ".join(rec.get("x") or []) or "DP prefill throttling"
            self._stop(line, f"step {rec['step']} uses {why}")
            return
        odd = sorted({w for w in (rec.get("pre_why") or {}).values()
                      if w != "kv" and not (w == "reset_prefix_cache" and self._reset_replayed)})
        if odd:
            self._stop(line, f"step {rec['step']} preempts for {', '.join(odd)} (not modelled by the reference)")
            return
        # sessions that kept their KV blocks resume on them without a prefix-cache lookup (vLLM
        # looks up only a request with no computed tokens), so no lookup is recorded for them
        resuming = {r.request_id for r in self.scheduler.sessions.kv_holding_waiting}
        got_out: list = []
        if not self._kv_call(line, rec["step"], "schedule", lambda: got_out.append(self.scheduler.schedule())):
            return
        out = got_out[0]
        self._in_flight[rec["step"]] = out
        got, want = reference_rows(out), recorded_rows(rec)
        ref_pre, ref_fin = sorted(out.preempted_req_ids), sorted(out.finished_req_ids)
        rec_pre, rec_fin = sorted(rec["pre"]), sorted(rec["fin"])
        ref_spec = {k: list(v) for k, v in out.scheduled_spec_decode_tokens.items()}
        rec_spec = rec.get("spec") or {}
        if got == want and ref_pre == rec_pre and ref_fin == rec_fin and (
                ref_spec != rec_spec or bool(out.skip_drafts) != bool(rec.get("skip_drafts"))):
            self._diverge(Divergence(line, rec["step"], "schedule", "different drafts scheduled for verification",
                                     want, got, {"drafts": rec_spec, "skip_drafts": bool(rec.get("skip_drafts"))},
                                     {"drafts": ref_spec, "skip_drafts": bool(out.skip_drafts)}))
            return
        if got != want or ref_pre != rec_pre or ref_fin != rec_fin:
            what = []
            if [r[0] for r in got] != [r[0] for r in want]:
                what.append("a different batch")
            elif got != want:
                bad = next(a[0] for a, b in zip(want, got) if a != b)
                what.append(f"request {bad} scheduled differently")
            if ref_pre != rec_pre:
                what.append("different preemptions")
            if ref_fin != rec_fin:
                what.append("different finished ids")
            self._diverge(Divergence(line, rec["step"], "schedule", "; ".join(what), want, got,
                                     {"preempted": rec_pre, "finished": rec_fin},
                                     {"preempted": ref_pre, "finished": ref_fin}))
            return
        if not self._check_encoder(line, rec):
            return
        if not self._check_free(line, rec["step"], "schedule", rec):
            return
        if getattr(self.scheduler, "prefix_replay_tokens", 0) and not self._check_replay(line, rec, want, got):
            return
        live = self._live
        kv = self.scheduler.kv_cache_manager
        record = getattr(kv, "record_prefix_cache_stats", None)  # the reference's own stats (issue #23)
        if self.connector is not None:  # the reference recorded its admissions' stats itself
            self.steps_compared += 1
            return
        window = getattr(self.scheduler, "prefix_replay_tokens", 0)
        for s in out.scheduled:
            if s.kind != "running" and s.request_id not in resuming:
                # vLLM records at admission ("unscheduled lookups are not counted"); the reference
                # scheduler does not call it itself, so the replay does, at the same point, with
                # the hit before a bounded replay rewound it (as vLLM counts it)
                hit = hit_before_replay(window, s.num_computed_tokens)
                if record is not None:
                    record(live[s.request_id], hit)
                else:
                    self._tally.admitted(s.kind == "resumed", live[s.request_id].num_tokens, hit)
        self.steps_compared += 1

    def _check_replay(self, line: int, rec: dict, want: list, got: list) -> bool:
        """SWA bounded replay (#28, session 20): each new request's ``replay_start`` as recorded
        (vLLM's ``NewRequestData.replay_start``: where the workers rebuild the window's KV from,
        so a wrong one corrupts attention while the scheduled tokens still agree); False on a
        divergence."""
        ours = {r[0]: self._live[r[0]].replay_start for r in got if r[1] == "n" and self._live[r[0]].replay_start}
        theirs = {k: v for k, v in (rec.get("replay") or {}).items() if v}
        if ours == theirs:
            return True
        self._diverge(Divergence(line, rec["step"], "schedule", "a different replay_start for a new request",
                                 want, got, {"replay_start": theirs}, {"replay_start": ours}))
        return False

    def _check_encoder(self, line: int, rec: dict) -> bool:
        """The step's encoder inputs, encoder-cache evictions and (V2 runner) the workers' item
        installs and releases, recorded against the reference's (#28); False on a divergence."""
        view = getattr(self.scheduler, "encoder_view", None)
        if view is None:
            return True
        v = view()
        ref = {k: v[k] for k in ("scheduled_encoder_inputs", "free_encoder_mm_hashes", "encoder_input_updates")}
        ref["scheduled_encoder_inputs"] = {r: tuple(i) for r, i in ref["scheduled_encoder_inputs"].items()}
        ref["free_encoder_mm_hashes"] = tuple(ref["free_encoder_mm_hashes"])
        want = recorded_encoder(rec)
        if ref == want:
            return True
        keys = [k for k in want if want[k] != ref[k]]
        self._diverge(Divergence(line, rec["step"], "schedule", "different encoder inputs (" + ", ".join(keys) + ")",
                                 recorded_rows(rec), reference_rows(self._in_flight[rec["step"]]),
                                 {k: want[k] for k in keys}, {k: ref[k] for k in keys}))
        return False

    def _connector_stats(self) -> dict:
        """The reference's ``connector_prefix_cache_stats`` of the update just replayed (vLLM's
        make_stats at the end of update_from_output), under the trace's ``stats`` keys."""
        cs = self.scheduler.connector_state.output_connector_prefix_cache_stats or {}
        return {"creq": cs.get("requests", 0), "cq": cs.get("queries", 0), "ch": cs.get("hits", 0),
                "cpreq": cs.get("preempted_requests", 0), "cpq": cs.get("preempted_queries", 0),
                "cph": cs.get("preempted_hits", 0), "creset": int(bool(cs.get("reset", False)))}

    def _update(self, line: int, rec: dict) -> None:
        step = rec["step"]
        if step not in self._in_flight or next(iter(self._in_flight)) != step:
            self._diverge(Divergence(line, step, "update_from_output",
                                     "settles a step that is not the oldest in flight",
                                     recorded_extra={"step": step},
                                     reference_extra={"oldest in flight": next(iter(self._in_flight), None)}))
            return
        out = self._in_flight.pop(step)
        sampled = {rid: toks for rid, toks in zip(rec["ids"], update_sampled(rec)) if toks}
        kvo = kv_output(rec.get("kvo"), rec["fin"]) if self.connector is not None else None
        # vLLM freed this update's errors in its process's set order, which the trace keeps
        hint_owner = self.scheduler if hasattr(self.scheduler, "finish_order_hint") else None
        if hint_owner is not None:
            hint_owner.finish_order_hint = tuple(rid for rid, _ in rec["fin"])
        try:
            if not self._kv_call(line, step, "update_from_output",
                                 lambda: self.scheduler.update_from_output(out, ModelOutput(sampled), kvo)):
                return
        except ValueError as exc:
            self._diverge(Divergence(line, step, "update_from_output", f"the reference rejects the output: {exc}"))
            return
        finally:
            if hint_owner is not None:
                hint_owner.finish_order_hint = None
        live = self._live
        ref_fin = {}
        # with a connector a request may finish unscheduled (a failed load under "fail"); without
        # one, a request the encoder-cache mismatch rejected (it scheduled nothing: vLLM finishes it
        # as an error in this update), which the reference's finished set names since its schedule()
        if self.connector is not None:
            candidates = list(live)
        else:
            candidates = [s.request_id for s in out.scheduled]
            candidates += [rid for rid in self.scheduler.finished_req_ids if rid in live]
        for rid in candidates:
            r = live.get(rid)
            if r is not None and r.status == RequestStatus.FINISHED:
                ref_fin[rid] = r.finish_reason
                del live[rid]
        rec_fin = {rid: why for rid, why in rec["fin"]}
        if ref_fin != rec_fin:
            self._diverge(Divergence(line, step, "update_from_output", "the requests it finishes differ",
                                     recorded_extra={"finished": dict(sorted(rec_fin.items()))},
                                     reference_extra={"finished": dict(sorted(ref_fin.items()))}))
            return
        if not self._check_free(line, step, "update_from_output", rec):
            return
        expected = self._tally.take()
        made = getattr(self.scheduler.kv_cache_manager, "make_prefix_cache_stats", None)
        ps = made() if made is not None else None
        if ps is not None:  # a PrefixCacheStats, or its plain dict (the adapter's view)
            d = ps if isinstance(ps, dict) else vars(ps)
            expected = {"req": d["requests"], "q": d["queries"], "h": d["hits"], "preq": d["preempted_requests"],
                        "pq": d["preempted_queries"], "ph": d["preempted_hits"]}
        stats = rec.get("stats")
        if stats is None:
            return
        sched = self.scheduler
        wait = len(sched.waiting)
        if self.connector is not None:  # vLLM: waiting + kv_holding_waiting - deferred_waiting
            # the reference's own deferred_waiting (what its make_stats reports): the replay kept a
            # set of its own from the connector's answers, which took a "not yet" answer to a
            # request that skips the prefix cache for a skip (vLLM zeroes that answer first: a
            # false divergence on 3 of 17 recorded lifecycle runs, session 19)
            holding = sched.connector_state.kv_holding_waiting
            deferred = sched.connector_state.deferred_waiting
            skip = sum(1 for q in (sched.waiting, holding) for r in q if r.request_id in deferred)
            wait += len(holding)
        else:  # vLLM's deferred_waiting: requests its waiting loop skipped (one LoRA adapter too many,
            # encoder limits that leave no token, stale async output, a session waiting for input)
            # until admitted (#28); sessions keeping their KV blocks wait in kv_holding_waiting
            holding = sched.sessions.kv_holding_waiting
            wait += len(holding)
            skip = len(sched.cadence.skipped_ids & {r.request_id for q in (sched.waiting, holding) for r in q})
        expected.update(usage=usage(self._ref_free(), self._num_blocks), run=len(sched.running), wait=wait - skip,
                        skip=skip)
        keys = ("req", "q", "h", "preq", "pq", "ph", "run", "wait", "skip")
        if self.connector is not None:
            expected.update(self._connector_stats())
            keys += _CONN_STATS
        bad = compare_stats(stats, expected, keys)
        if "usage" in stats and usage_differs(stats["usage"], expected["usage"]):
            bad.insert(0, f"usage: recorded {stats['usage']!r}, expected {expected['usage']!r}")
        if bad:
            self._diverge(Divergence(line, step, "update_from_output",
                                     "the metrics it reports differ (SchedulerStats: " + "; ".join(bad) + ")",
                                     recorded_extra={"stats": stats}, reference_extra={"stats": expected}))

    def check_invariants(self) -> None:
        if self.scheduler is not None:
            self.scheduler.check_invariants()
            # a finished request stays in the scheduler while its connector still sends its blocks
            assert set(self._live) == {rid for rid, r in self.scheduler.requests.items()
                                       if r.status != RequestStatus.FINISHED}, "replay's live set out of step"
        if self.connector is not None:
            self.connector.check_invariants()
        assert len(self._in_flight) <= 2
