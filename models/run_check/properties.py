"""Properties of a recorded run, checked from the trace alone (no reference needed).

They hold for any vLLM the trace came from, so they are checked even where the reference cannot
follow (a newer vLLM, a feature outside kvref's subset):

* **No starvation while idle.** A step that schedules nothing while nothing runs, nothing is in
  flight and requests wait cannot change anything by itself: the same decision repeats until
  something arrives or is aborted. That is the head-of-line hang of vLLM #39734 / #35541 (a
  waiting request whose admission gate can never pass on a pool startup accepted). Reported
  when it lasts ``starvation_steps`` schedule calls in a row; not counted while a waiting request
  uses an unmodelled feature (a structured-output grammar may still be compiling) nor on runs
  with a KV connector (remote loads make such waits legitimate).
* **No block shared by two requests unless it is a prefix-cache hit.** The blocks a step
  *allocates* (beyond the hit prefix of a new or resumed request, whose first
  ``num_computed_tokens // block_size`` blocks are the hit) must not be held by another live
  request, in any group: the pool is one id space. Sliding-window, chunked-local and Mamba groups
  free blocks behind the window without saying so in ``schedule()``'s output, so there a block
  counts as possibly freed once its start lies before its holder's computed tokens (a sound
  relaxation: it can miss a reuse, never report a false one).
* **Usage within the pool.** Every block id is below ``num_blocks``; a request's table per group
  never exceeds what ``max_model_len`` needs.
* **A summary** a developer pastes into a PR: steps, requests, finishes by reason, preemptions,
  prefix-cache hit rate, longest wait, peak running, peak blocks held.

State is bounded by the live requests and their blocks (finished requests are dropped, their
statistics folded into counters), so a trace of any length is checked in bounded memory.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

from kvref.impl.run_trace.format import sched_rows

_FREES_EARLY = ("SlidingWindowSpec", "ChunkedLocalAttentionSpec", "MambaSpec")


@dataclass
class Finding:
    kind: str  # "starvation", "shared_block", "block_out_of_pool", "table_too_long"
    line: int
    step: int
    message: str

    def to_json(self) -> dict:
        return {"kind": self.kind, "line": self.line, "step": self.step, "message": self.message}


def _num_tokens_b64(text: str) -> int:
    pad = 2 if text.endswith("==") else 1 if text.endswith("=") else 0
    return (len(text) * 3 // 4 - pad) // 4


@dataclass
class _Req:
    arrival_step: int
    prompt_len: int
    first_step: int = -1
    computed: int = 0  # after its last schedule
    tables: list = field(default_factory=list)  # per group: list of block ids (0 = null)
    running: bool = False


class RunProperties:
    """Feed records in trace order with :meth:`feed`; read :attr:`findings` and :meth:`summary`.

    Args:
        header: the trace header.
        starvation_steps: idle schedule calls in a row (nothing runs, nothing in flight, someone
            waits) that count as starvation.
        max_findings: findings kept (the count goes on).
    """

    def __init__(self, header: dict, starvation_steps: int = 3, max_findings: int = 20) -> None:
        pool = header["pool"]
        self.num_blocks = pool["num_blocks"]
        self.max_model_len = pool["max_model_len"]
        self.group_bs = [g["spec"]["block_size"] for g in pool["groups"]]
        self.frees_early = [g["spec"]["type"] in _FREES_EARLY or bool(g["spec"].get("sliding_window"))
                            or bool(g["spec"].get("attention_chunk_size")) for g in pool["groups"]]
        self.max_table = [-(-self.max_model_len // bs) + 1 for bs in self.group_bs]
        self.num_groups = len(self.group_bs)
        self.starvation_steps = starvation_steps
        # A request can legitimately wait while nothing runs when vLLM waits on something outside
        # the scheduler: a KV connector's remote load, a structured-output grammar compiling.
        # Those runs (header) and requests (their "x") do not count towards starvation.
        self.starvation_off = [u for u in header.get("unmodelled", [])
                               if u.startswith(("kv_connector", "ec_connector"))]
        self.exempt: set[str] = set()
        self.max_findings = max_findings
        self.findings: list[Finding] = []
        self.num_findings = 0
        self.reqs: dict[str, _Req] = {}
        self.waiting: dict[str, None] = {}  # insertion-ordered
        self.running: set[str] = set()
        self.owners: dict[int, dict] = {}  # block id -> {(rid, group): index}
        self.in_flight = 0
        self.idle_run = 0
        self.idle_reported = False
        self.stats: Counter = Counter()
        self.finish_reasons: Counter = Counter()
        self.longest_wait = (0, "")
        self.peak_running = 0
        self.peak_blocks = 0
        self.step = -1

    # ---- findings -------------------------------------------------------------------------------
    def _find(self, kind: str, line: int, message: str) -> None:
        self.num_findings += 1
        if len(self.findings) < self.max_findings:
            self.findings.append(Finding(kind, line, self.step, message))

    # ---- records --------------------------------------------------------------------------------
    def feed(self, line: int, rec: dict) -> None:
        t = rec["t"]
        if t == "sched":
            self._sched(line, rec)
        elif t == "update":
            self._update(rec)
        elif t == "add":
            rid = rec["id"]
            self.reqs[rid] = _Req(arrival_step=self.step + 1, prompt_len=_num_tokens_b64(rec["prompt"]))
            self.waiting[rid] = None
            if rec.get("x"):
                self.exempt.add(rid)
            self.stats["requests"] += 1
        elif t == "abort":
            for rid in rec["ids"]:
                self._finish(rid, "abort")

    def _release(self, rid: str) -> None:
        r = self.reqs.get(rid)
        if r is None:
            return
        for g, table in enumerate(r.tables):
            for b in table:
                if b:
                    holders = self.owners.get(b)
                    if holders is not None:
                        holders.pop((rid, g), None)
                        if not holders:
                            del self.owners[b]
        r.tables = []
        r.running = False
        self.running.discard(rid)

    def _finish(self, rid: str, reason: str) -> None:
        r = self.reqs.get(rid)
        if r is None:
            return
        self._release(rid)
        if r.first_step < 0:
            self._note_wait(rid, self.step - r.arrival_step)
        self.waiting.pop(rid, None)
        self.exempt.discard(rid)
        del self.reqs[rid]
        self.finish_reasons[reason] += 1

    def _note_wait(self, rid: str, steps: int) -> None:
        if steps > self.longest_wait[0]:
            self.longest_wait = (steps, rid)

    def _sched(self, line: int, rec: dict) -> None:
        self.step = step = rec["step"]
        st = self.stats
        st["steps"] += 1
        for rid in rec["pre"]:
            r = self.reqs.get(rid)
            if r is not None:
                self._release(rid)
                self.waiting[rid] = None
                st["preemptions"] += 1
        for rid in rec["fin"]:
            if rid in self.reqs:
                self._finish(rid, "finished")
        rows = sched_rows(rec)
        # starvation: nothing scheduled, nothing running, nothing else in flight, someone waiting
        if (not rows and not self.running and self.in_flight == 0 and self.waiting and not self.starvation_off
                and not (self.exempt and any(r in self.exempt for r in self.waiting))):
            self.idle_run += 1
            if self.idle_run >= self.starvation_steps and not self.idle_reported:
                head = next(iter(self.waiting))
                r = self.reqs[head]
                self._find("starvation", line,
                           f"{len(self.waiting)} request(s) wait while nothing runs and nothing is in flight, "
                           f"{self.idle_run} schedule calls in a row (since step {step - self.idle_run + 1}); "
                           f"first waiting: {head} ({r.prompt_len} prompt tokens, arrived before step "
                           f"{r.arrival_step}): the head-of-line hang of vLLM #39734 / #35541")
                self.idle_reported = True
        else:
            self.idle_run = 0
            self.idle_reported = False
        tokens = 0
        owners = self.owners
        for rid, kind, n, computed, blocks in rows:
            tokens += n
            r = self.reqs.get(rid)
            if r is None:  # scheduled without an arrival record (trace started mid-run)
                r = self.reqs[rid] = _Req(arrival_step=step, prompt_len=0)
            if kind != "c":
                if r.first_step < 0:
                    r.first_step = step
                    self._note_wait(rid, step - r.arrival_step)
                if kind == "n":
                    st["new_prompt_tokens"] += r.prompt_len
                    st["hit_tokens"] += computed
                    if computed:
                        st["prefix_hits"] += 1
                else:
                    st["resumes"] += 1
                self._release(rid)
                self.waiting.pop(rid, None)
                r.tables = [[] for _ in range(self.num_groups)]
            if not r.running:
                r.running = True
                self.running.add(rid)
            if blocks is not None:
                for g, ids in enumerate(blocks):
                    if g >= self.num_groups:
                        self._find("block_out_of_pool", line, f"{rid} got blocks for group {g}; the pool has "
                                   f"{self.num_groups} group(s)")
                        break
                    bs = self.group_bs[g]
                    table = r.tables[g]
                    num_hits = computed // bs if kind != "c" else 0
                    for b in ids:
                        idx = len(table)
                        table.append(b)
                        if not b:
                            continue
                        if b >= self.num_blocks:
                            self._find("block_out_of_pool", line,
                                       f"{rid} got block {b} in group {g}; the pool has {self.num_blocks} blocks")
                            continue
                        holders = owners.get(b)
                        if holders is None:
                            owners[b] = {(rid, g): idx}
                            continue
                        if idx >= num_hits:
                            for (orid, og), oidx in list(holders.items()):
                                other = self.reqs.get(orid)
                                freed = (self.frees_early[og] and other is not None
                                         and oidx * self.group_bs[og] < other.computed)
                                if freed:
                                    del holders[(orid, og)]
                                    if other is not None and oidx < len(other.tables[og]):
                                        other.tables[og][oidx] = 0
                                else:
                                    self._find("shared_block", line,
                                               f"block {b} allocated to {rid} (group {g}, position {idx}) while "
                                               f"{orid} holds it (group {og}, position {oidx}); not a prefix-cache hit")
                        holders[(rid, g)] = idx
                    if len(table) > self.max_table[g]:
                        self._find("table_too_long", line, f"{rid} holds {len(table)} blocks in group {g}; "
                                   f"max_model_len={self.max_model_len} needs at most {self.max_table[g] - 1}")
            r.computed = computed + n
        st["scheduled_tokens"] += tokens
        self.in_flight += 1
        self.peak_running = max(self.peak_running, len(self.running))
        self.peak_blocks = max(self.peak_blocks, len(owners))

    def _update(self, rec: dict) -> None:
        self.in_flight = max(0, self.in_flight - 1)
        for rid, reason in rec["fin"]:
            self._finish(rid, reason)

    def finish(self) -> None:
        """The trace ended: requests still waiting count towards the longest wait."""
        for rid in self.waiting:
            r = self.reqs.get(rid)
            if r is not None and r.first_step < 0:
                self._note_wait(rid, self.step - r.arrival_step)

    # ---- report ---------------------------------------------------------------------------------
    def summary(self) -> dict:
        st = self.stats
        hit_rate = st["hit_tokens"] / st["new_prompt_tokens"] if st["new_prompt_tokens"] else 0.0
        return {
            "steps": st["steps"], "requests": st["requests"], "finished": dict(self.finish_reasons),
            "still_live": len(self.reqs), "preemptions": st["preemptions"], "resumes": st["resumes"],
            "prefix_hits": st["prefix_hits"], "prefix_hit_rate": round(hit_rate, 4),
            "scheduled_tokens": st["scheduled_tokens"],
            "longest_wait_steps": self.longest_wait[0], "longest_wait_request": self.longest_wait[1],
            "peak_running": self.peak_running, "peak_blocks_held": self.peak_blocks,
            "num_blocks": self.num_blocks,
            "starvation_check": ("off: " + ", ".join(self.starvation_off)) if self.starvation_off else "on",
        }

    def check_invariants(self) -> None:
        assert self.running <= set(self.reqs), "a running request that is not live"
        assert not (set(self.waiting) & self.running), "a request both waiting and running"
        for b, holders in self.owners.items():
            assert holders and 0 < b, (b, holders)
            for (rid, g) in holders:
                assert rid in self.reqs, f"block {b} held by a dead request {rid}"
