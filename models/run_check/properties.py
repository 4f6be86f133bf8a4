"""Properties of a recorded run, checked from the trace alone (no reference needed).

They hold for any vLLM the trace came from, so they are checked even where the reference cannot
follow (a newer vLLM, a feature outside kvref's subset, ``--properties-only``). Issue #28 made
them strong enough to stand alone:

* **No crash.** An ``error`` record (vLLM raised inside a recorded call) is a finding with its step.
* **No starvation.** ``starvation_steps`` schedule calls in a row that schedule nothing while
  requests wait, *whatever is in flight*: under async scheduling vLLM's batch queue always keeps a
  step in flight, so the old "nothing in flight" condition never held and a hung run of 20,000
  idle calls went unreported. Steps that preempt, and steps while a remote KV load is pending
  (``loading`` on KV-connector runs), do not count; the head-of-line hang of vLLM #39734 / #35541.
* **Block conservation per step.** ``free`` (vLLM's ``get_num_free_blocks()``, recorded after every
  call) ``+`` the distinct blocks live requests hold ``=`` ``num_blocks - 1`` (the null block).
  Blocks behind a sliding window / attention chunk are freed exactly as vLLM frees them, at the
  holder's own allocation (:mod:`.windows`); a refused admission that keeps blocks, or a block freed
  while its holder still holds it, breaks the equation at that step.
* **No block reused while its holder still needs it.** A block a step allocates fresh (beyond a new
  or resumed request's prefix-cache hit) must not sit at a position another live request still
  needs — inside that holder's window of settled tokens, per group — in any group (one pool, one id
  space). No blanket allowance for windowed groups.
* **Prefix-cache hits hold the hit's tokens.** A hit block must be one some request filled with
  exactly the same tokens (same salt, same prefix), and not evicted since; a hit never covers a
  request's last token. Catches a wrong hit length, a stale block served after its eviction, a
  preemption that did not reset a request's progress.
* **Admission within the startup bound.** The blocks a request holds in a group never exceed what
  startup sized a request for (``admission_cap`` / ``max_admission_blocks_per_request``, vLLM
  #40946; ``cdiv(max_model_len, block_size)`` for full attention).
* **Metrics agree with the trace.** The ``SchedulerStats`` each ``update_from_output`` returned (the
  metrics endpoint's ``kv_cache_usage``, prefix-cache ``queries``/``hits``, running/waiting counts)
  equal what the recorded steps imply (:mod:`.metrics`).
* **Nothing scheduled past a request's tokens** (session 17, #28). ``num_computed + scheduled``
  never exceeds the tokens the request has (prompt + outputs the trace delivered; a streaming
  session's kept outputs less its final sampled token) plus what vLLM schedules ahead of its output:
  one placeholder per step of it still in flight that samples, and its drafts. vLLM's
  ``num_new_tokens = num_tokens(+spec, +placeholders) - num_computed_tokens``.
* **Admissions in waiting-queue order** (session 17, #28). Under the FCFS policy vLLM's waiting loop
  admits from the head of ``waiting``: arrivals append, preemptions (for KV space, or all running
  requests for ``reset_prefix_cache``) put the preempted requests back at the head in their running
  order. A request is admitted past one ahead of it only if that one may be skipped (waiting for
  streaming input, stale output in flight, a LoRA, multimodal or other skippable feature).
* **A reset succeeds exactly when no block is in use** (session 17, #28). vLLM's
  ``BlockPool.reset_prefix_cache`` refuses while any block besides the null block is in use (after
  preempting the running requests when asked to); ``free`` then equals the usable pool.
* **Fresh blocks in free-queue order** (session 17, #28; vLLM 0.33.0 traces with exact bookkeeping
  on full-attention / chunked-local pools, no connector, no speculative decoding, no streaming
  sessions): a fresh allocation gets the head of vLLM's free block queue, as the trace's
  allocations, hits and frees build it (:mod:`.free_queue`).
* **Usage within the pool.** Every block id is below ``num_blocks``; a table never exceeds what
  ``max_model_len`` needs.
* **A summary** a developer pastes into a PR: steps, requests, finishes by reason, preemptions by
  reason, prefix-cache hit rate, longest wait, peak running, peak blocks held.

State is bounded by the live requests and the pool (finished requests are dropped, per-block
content is one entry per block id), so a trace of any length is checked in bounded memory.
"""

from __future__ import annotations

from collections import Counter, deque
from dataclasses import dataclass, field

from kvref.impl.run_trace.format import decode_embeds, decode_tokens, sched_rows, update_sampled
from kvref.spec.version import MODELLED_VLLM_VERSION

from .held import Fences, defers_frees, is_parked, parked_key

_PARKED_PREFIX = parked_key("", "")[:-1]  # "<prefix><kind>:<rid>": the part before the kind
from .free_queue import FreeQueue
from .metrics import PrefixCacheTally, compare_stats, hit_before_replay, usage, usage_differs
from .stops import StopRules
from .windows import group_rules

#: what ``kvref check-run`` lists when every property holds
PROPERTY_NAMES = ("no crash", "no starvation", "blocks conserved", "no block reused while needed",
                  "hits hold their tokens", "admission within the startup bound", "metrics agree with the trace",
                  "blocks within the pool", "blocks cover the step", "nothing scheduled against a pause",
                  "prefill chunks leave the MTP runway", "finishes follow the stop rules",
                  "nothing scheduled past a request's tokens", "admissions in waiting-queue order",
                  "a reset succeeds exactly when no block is in use", "fresh blocks in free-queue order",
                  "bounded replays start where the admission does", "HiSparse loads wait for their fence")
#: header features under which the block bookkeeping is not exact (blocks held outside requests, or
#: computed tokens rolled back): conservation, admission and hit content are then not checked
_INEXACT = ("kv_connector", "ec_connector", "spec_decode", "lookahead_tokens", "prefill_lookahead",
            "hash_lookahead_tokens", "prefix_replay", "deferred_block_free", "decode_context_parallel",
            "mamba_align_mode", "mamba_shared_prefix_checkpoint", "kv_cache_spec:", "eagle",
            # HiSparse's deferred async loads (vLLM defer_async_loads): a load admitted behind a step
            # in flight holds its blocks from admission, but the connector hears of it (the trace's
            # update_state_after_alloc entry) and the stats record it only when the step fence
            # passes; the trace does not show the blocks or the lookup until then (6 of 17 pristine
            # recorded HiSparse lifecycle runs had a false "leaked block" or stats finding, session 19)
            "deferred_async_loads")


@dataclass
class Finding:
    kind: str  # see PROPERTY_KINDS
    line: int
    step: int
    message: str

    def to_json(self) -> dict:
        return {"kind": self.kind, "line": self.line, "step": self.step, "message": self.message}


PROPERTY_KINDS = ("crash", "starvation", "conservation", "reused_while_needed", "wrong_hit", "admission_bound",
                  "metrics", "block_out_of_pool", "table_too_long", "table_too_short", "scheduled_while_paused",
                  "prefill_lookahead", "stop_rule", "past_tokens", "admission_order", "reset_result", "free_order",
                  "replay_start", "load_fence")


def _num_tokens_b64(text: str) -> int:
    pad = 2 if text.endswith("==") else 1 if text.endswith("=") else 0
    return (len(text) * 3 // 4 - pad) // 4


@dataclass
class _Req:
    arrival_step: int
    prompt_len: int
    tokens: list = field(default_factory=list)  # prompt + sampled outputs known so far
    salt: str | None = None
    first_step: int = -1
    computed: int = 0  # after its last schedule (optimistic, as vLLM advances it)
    processed: int = 0  # computed tokens of settled steps (what vLLM frees windows by)
    tables: list = field(default_factory=list)  # per group: block ids (0 = null or freed)
    running: bool = False
    chains: dict = field(default_factory=dict)  # block size -> chained content keys of full blocks
    filled: list = field(default_factory=list)  # per group: table positions whose content is registered
    skip_read: bool = False  # never reads the prefix cache (prompt logprobs): no lookup is counted
    async_held: bool = False  # holds blocks allocated for an asynchronous load, not yet scheduled
    preempted: bool = False  # preempted at least once (vLLM's num_preemptions > 0)
    #: what enters vLLM's block hashes beside the tokens and the salt (#28): the LoRA adapter's
    #: (name, path), and the multimodal items as (identifier, offset, length)
    lora: tuple | None = None
    mm: tuple = ()
    #: streaming-input sessions (format 6, #28): the updates queued for the next stopped turn
    #: (an ``add`` record, or None: the finishing update), outputs sampled this turn, and whether
    #: it waits holding its KV blocks (vLLM's kv_holding_waiting: no prefix-cache lookup at resume)
    pending: list = field(default_factory=list)
    num_out: int = 0
    session_held: bool = False
    #: prompt embeddings (format 6): one digest per prompt position, None without (their rows
    #: enter vLLM's block hashes: equal tokens with other embeddings are other content)
    embeds: tuple | None = None
    #: structured output (format 7, #28): the request has not been admitted yet, so it may still be
    #: waiting for its grammar (vLLM's WAITING_FOR_STRUCTURED_OUTPUT_GRAMMAR: skipped, not blocking)
    grammar_wait: bool = False
    #: an async load's end (its local hit + external tokens): vLLM caches the loaded blocks when the
    #: load lands, before a bounded replay rewinds the request's computed tokens (session 20)
    load_upto: int = 0
    #: per group: table positions whose block vLLM has given a block hash (the free queue's view)
    hashed_upto: list = field(default_factory=list)


class RunProperties:
    """Feed records in trace order with :meth:`feed`; read :attr:`findings` and :meth:`summary`.

    Args:
        header: the trace header.
        starvation_steps: schedule calls in a row that schedule nothing while requests wait.
        max_findings: findings kept (the count goes on).
    """

    def __init__(self, header: dict, starvation_steps: int = 3, max_findings: int = 20) -> None:
        pool = header["pool"]
        self.num_blocks = pool["num_blocks"]
        self.max_model_len = pool["max_model_len"]
        self.rules = group_rules(header)
        self.group_bs = [r.block_size for r in self.rules]
        # + a Mamba group's speculative state blocks (one per draft: EAGLE on Mamba "align" pools, #28)
        self.max_table = [-(-self.max_model_len // bs) + 1 + int(g["spec"].get("num_speculative_blocks", 0) or 0)
                          for bs, g in zip(self.group_bs, header["pool"]["groups"])]
        self.num_groups = len(self.group_bs)
        self.starvation_steps = starvation_steps
        unmodelled = list(header.get("unmodelled", []))
        # HiSparse's deferred async loads, replayed since session 20 (the header's connector says
        # hisparse_host_pool), still hide blocks and lookups from the trace until their fence
        # passes: the properties treat them as before, when the recorder named them
        #: vLLM's defer_async_loads (a HiSparse host pool beside deferred frees)
        self.defers_loads = bool(defers_frees(header) and (header.get("connector") or {}).get("hisparse_host_pool"))
        if self.defers_loads and "deferred_async_loads" not in unmodelled:
            unmodelled.append("deferred_async_loads")
        # a format-4 connector run keeps the block checks on: its answers say which blocks the
        # connector holds past their request (delayed frees, async loads) and the step fences say
        # when deferred frees return (held.py); an older connector trace names "kv_connector" in
        # unmodelled and stays inexact
        has_connector = header.get("connector") is not None
        # an EAGLE-like drafter (pool.use_eagle) needs no exemption: its lookahead slots are in the
        # recorded tables (and checked by "blocks cover the step"), its dropped hit block is simply
        # not in the hit; a lookahead vLLM sized otherwise is flagged "lookahead_tokens" (#28)
        spec = header.get("spec") or {}
        #: KV slots past the scheduled tokens every allocation reserves (an EAGLE-like drafter's)
        self.lookahead = int(spec.get("num_lookahead_tokens", 0) or 0) if spec.get("num_speculative_tokens") else 0
        #: drafts a step may schedule past a request's tokens (a decode padded to 1 + k included)
        self.num_spec = int(spec.get("num_speculative_tokens", 0) or 0)
        #: a multi-module MTP drafter's prefill runway (vLLM's num_prefill_lookahead_tokens): no
        #: prefill chunk may end within it of the prompt's end (_reserve_prefill_lookahead, #28)
        self.prefill_lookahead = int(spec.get("num_prefill_lookahead", 0) or 0)
        #: vLLM's V2 model runner: a resumed request is sent as a new one (#28)
        self.v2_runner = bool((header.get("scheduler") or {}).get("use_v2_model_runner", False))
        #: lookahead block hashes: a block's hash covers this many tokens after it (#28)
        self.hash_lookahead = int(header["pool"].get("num_hash_lookahead_tokens", 0) or 0)
        #: SWA bounded replay (DeepSeek-V4.1, #28): the replay window of a bounded-replay group (vLLM's
        #: prefix_replay_tokens; 0: none): an admission after a hit starts this many tokens before it
        self.replay_window = max((int(g["spec"].get("sliding_window") or 0) for g in header["pool"]["groups"]
                                  if g["spec"].get("bounded_replay")), default=0)
        self.replay_groups = [i for i, g in enumerate(header["pool"]["groups"]) if g["spec"].get("bounded_replay")]
        self.inexact = [u for u in unmodelled if u.startswith(_INEXACT)]
        # exact bookkeeping: every group's frees are known (Mamba outside "none" mode frees old
        # state blocks by rules the trace does not show)
        self.exact = not self.inexact and all(r.kind != "unknown" and r.frees_exactly for r in self.rules)
        self.connector = has_connector or any(u.startswith(("kv_connector", "ec_connector")) for u in unmodelled)
        #: vLLM's free block queue (free_queue.py), where every free is in the trace and its order
        #: known: exact bookkeeping, full-attention, chunked-local and sliding-window groups (the
        #: first two cache every full block; a sliding-window group only the blocks a later hit can
        #: reach, windows.GroupRule.caches, known from session 18's traces under dense retention;
        #: Mamba's frees follow its own rules), no connector (it holds blocks past their request), no
        #: lookahead hashes, no
        #: speculative decoding (which blocks a verification step leaves hashed depends on the
        #: drafts vLLM accepted and the outputs it trimmed at a stop, not all in the trace)
        #: The queue's policy is vLLM 0.33.0's (blocks without a hash to the front is recent): the
        #: check is on for traces of that version only, not on another vLLM's (--properties-only).
        same_vllm = str((header.get("producer") or {}).get("vllm", "")).split("+")[0] == MODELLED_VLLM_VERSION
        off = [why for why, cond in (
            (f"vLLM {(header.get('producer') or {}).get('vllm')} (the queue's policy is {MODELLED_VLLM_VERSION}'s)",
             not same_vllm), ("block checks off", not self.exact), ("kv_connector", self.connector),
            ("lookahead hashes", bool(self.hash_lookahead)), ("speculative decoding", bool(self.num_spec)),
            ("a Mamba group", any(r.kind not in ("full", "chunk", "window", "rswa", "ring") for r in self.rules)),
            ("a sliding-window group whose cached blocks the trace does not say (recorded since session 18)",
             any(r.kind == "window" and "cache_hit_alignment_tokens" not in g
                 for r, g in zip(self.rules, pool["groups"]))
             or (any(r.kind == "window" for r in self.rules) and "prefix_cache_retention_interval" not in pool)),
            ("a group of blocks smaller than the scheduler block without the coordinator's cache rounding "
             "(recorded since session 18)", "cache_round_tokens" not in pool
             and any(bs < pool["scheduler_block_size"] for bs in self.group_bs)),
            ("sparse prefix-cache retention on a sliding-window group (its shared-prefix junction is not in the "
             "trace)", any(r.kind == "window" for r in self.rules)
             and pool.get("prefix_cache_retention_interval") is not None)) if cond]
        self.fq = None if off else FreeQueue(self.num_blocks, bool(pool.get("enable_caching", True)))
        #: vLLM's hybrid coordinator caches only up to a multiple of the scheduler block
        #: (``_align_cacheable``): a group of smaller blocks leaves the last ones of a step unhashed
        self.cache_round = max(1, int(pool.get("cache_round_tokens", 1) or 1))
        #: why the free-queue check is off ("" while on), for the summary
        self.fq_why_off = "off: " + off[0] if off else ""
        #: this step preempted for KV space: its allocations interleave with those frees in an order
        #: the trace does not show (the queue's content stays exact: frees prepend or append, takes
        #: remove the block they name)
        self.fq_unordered = False
        #: update_from_output caches blocks too under async scheduling (vLLM: a request with output
        #: placeholders)
        self.fq_update_caches = (self.fq is not None and self.fq.caching
                                 and bool((header.get("scheduler") or {}).get("async_scheduling")))
        self.fences = Fences(defers_frees(header))
        #: finished requests whose connector delays the free (sending) -> the block ids per group it
        #: was handed: vLLM frees the blocks a windowed group skipped (null there) at the finish and
        #: keeps every other block, those past a table the connector got cut short included
        self.delayed: dict[str, list] = {}
        self.loading: set[str] = set()  # requests waiting for an asynchronous load into their blocks
        #: loading requests whose load failed with no valid token (failed_recving, or an invalid
        #: first block): vLLM frees their blocks when it promotes them
        self.load_zeroed: set[str] = set()
        #: requests whose async load failed whole under the recompute policy (failed_recving): vLLM
        #: 0.33.0 keeps them in _inflight_prefills, the self-reservation hang's precondition
        self.failed_whole: set[str] = set()
        #: requests given an asynchronous load and not scheduled since: vLLM 0.33.0 queued them in
        #: kv_holding_waiting, which PAUSED_NEW still drains, also after a load that failed whole
        #: freed their blocks (they stay queued there; generated connector pause runs, #28)
        self.remote_waited: set[str] = set()
        conn = header.get("connector") or {}
        self.recompute_failures = conn.get("kv_load_failure_policy", "recompute") == "recompute"
        #: request -> the table request_finished was handed (any finish): blocks a windowed group
        #: skipped show as null there and are freed at once, even when the rest is parked
        self.clipped: dict[str, list] = {}
        self.parked: dict[str, list] = {}  # pseudo-holder -> [(block, group, position)]
        self.local_hit: dict[str, int] = {}  # the block-aligned local hit the connector was asked with
        #: format-4 connector runs: vLLM records a request's prefix-cache lookup at its admission
        #: ("record at admission so unscheduled lookups are not counted"), which the trace shows as
        #: update_state_after_alloc after the lookup's connector question in the same call; async
        #: loads are admitted without being scheduled, so the stats are tallied from those entries
        self.lookup_tally = has_connector and "deferred_async_loads" not in unmodelled
        #: the reuse check follows every block's holders; under deferred async loads the holders of
        #: a load admitted behind a fence (and of one aborted before it started) are not in the
        #: trace until the fence passes, so the check is off there (see _INEXACT)
        self.reuse_checked = "deferred_async_loads" not in unmodelled
        self.seen_loading = False
        self.exempt: set[str] = set()
        #: streaming-input sessions (format 6): live ones, and those waiting for their next input
        #: (vLLM's WAITING_FOR_STREAMING_REQ: skipped by the waiting loop, never starvation)
        self.sessions: set[str] = set()
        self.awaiting_input: set[str] = set()
        #: session -> the last step scheduled when its turn stopped (that output is stale: dropped)
        self.session_stale: dict[str, int] = {}
        #: requests a prefix-cache reset preempted with steps in flight: vLLM preempts them in drop
        #: mode (drop_stale_output), so the output of those steps never joins their tokens
        self.drop_stale: set[str] = set()
        # every finish follows check_stop's rules (#28); not on a connector trace without the
        # worker's reports (format 3): a failed load's dropped output is not in it
        self.stops = StopRules(self.max_model_len, enabled=has_connector or "kv_connector" not in unmodelled)
        self.stops.sessions = self.sessions
        #: vLLM's pause state (``pause`` records): 1 PAUSED_NEW admits only requests holding KV
        #: blocks, 2 PAUSED_ALL schedules nothing; neither is starvation
        self.paused = 0
        self.priority = (header.get("scheduler") or {}).get("policy") == "priority"
        sched = header.get("scheduler") or {}
        #: vLLM's max_num_active_reqs (model-runner slots; sessions waiting for input hold theirs)
        self.max_active = int(sched.get("max_num_active_seqs") or sched.get("max_num_seqs") or 1 << 30)
        self.max_findings = max_findings
        self.findings: list[Finding] = []
        self.num_findings = 0
        self.kinds: Counter = Counter()
        self.reqs: dict[str, _Req] = {}
        self.waiting: dict[str, None] = {}  # insertion-ordered
        self.running: set[str] = set()
        #: vLLM's ``running`` list in its order (admissions append), and its FCFS ``waiting`` deque
        #: (arrivals append, preemptions prepend); requests holding KV blocks while they wait (a
        #: stopped session's turn, an async load) are in ``kv_holding_waiting``, not in it
        self.run_order: dict[str, None] = {}
        self.queue: list[str] = []
        #: the waiting-queue order is checked: FCFS, no connector (its async loads and "ask again"
        #: answers skip requests by what the trace shows only in part)
        self.check_order = not self.priority and not self.connector
        self.owners: dict[int, dict] = {}  # block id -> {(rid, group): table position}
        self.content: dict[int, int] = {}  # block id -> content key of the tokens it holds (if full)
        self.in_flight: deque = deque()  # (step, [(rid, computed after)]) not yet settled
        self.tally = PrefixCacheTally(bool(pool.get("enable_caching", True)))
        self.idle_run = 0
        self.idle_reported = False
        self.stats: Counter = Counter()
        self.finish_reasons: Counter = Counter()
        self.preempt_reasons: Counter = Counter()
        self.longest_wait = (0, "")
        self.peak_running = 0
        self.peak_blocks = 0
        self.step = -1

    # ---- findings -------------------------------------------------------------------------------
    def _find(self, kind: str, line: int, message: str, once: bool = False) -> None:
        if once and self.kinds[kind]:
            return
        self.kinds[kind] += 1
        self.num_findings += 1
        if len(self.findings) < self.max_findings:
            self.findings.append(Finding(kind, line, self.step, message))

    # ---- records --------------------------------------------------------------------------------
    def feed(self, line: int, rec: dict) -> None:
        t = rec["t"]
        if self.connector and "kv" in rec:
            self._connector_answers(rec)
            if self.defers_loads and t == "sched":
                self._load_fences(line, rec)
        if t == "sched":
            self.stops.sched(rec)
            self._sched(line, rec)
        elif t == "update":
            for message in self.stops.update(rec):
                self._find("stop_rule", line, message)
            self._update(line, rec)
        elif t == "add":
            if rec["id"] in self.sessions:
                self._session_update(rec)
            else:
                self._add(rec)
                self.stops.add(rec, self.reqs[rec["id"]].prompt_len)
        elif t == "abort":
            self.stops.abort(rec)
            for rid in rec["ids"]:
                self._finish(rid, "abort")
            self._conserve(line, rec, "finish_requests")
        elif t == "error":
            step = rec["step"]
            self._find("crash", line, f"vLLM raised {rec['type']} in {rec['call']} (step {step}): {rec['message']}")
            self._fq_off("a crash")  # what the failed call had freed or allocated is unknown
        elif t == "pause":
            self.paused = rec["state"]
        elif t == "reset":
            self.stops.reset(rec)
            if rec.get("running"):  # every running request was preempted at once (named at the next step)
                # vLLM pops them from the end of running and prepends each to waiting: back at its head
                # in their running order (the FIFO order its comment names)
                self._prepend([rid for rid in self.run_order if rid in self.running])
                # freed in that order too: the last running request first
                for rid in reversed([rid for rid in self.run_order if rid in self.running]):
                    r = self.reqs.get(rid)
                    if r is not None:
                        self._release(rid, park=True)
                        self._stale_in_flight(rid)
                        self.drop_stale.add(rid)  # vLLM drops (not appends) that in-flight output
                        r.computed = r.processed = 0
                        r.preempted = True
                        self.waiting[rid] = None
            self._reset_result(line, rec)
            if rec.get("ok"):
                self.content.clear()  # reset_prefix_cache forgets every cached block
                if self.fq is not None:
                    self.fq.hashed.clear()

    def _add(self, rec: dict) -> None:
        rid = rec["id"]
        prompt = rec["prompt"]
        tokens = decode_tokens(prompt) if self.exact else []
        self.reqs[rid] = _Req(arrival_step=self.step + 1, prompt_len=_num_tokens_b64(prompt), tokens=tokens,
                              salt=rec.get("salt"), skip_read=rec.get("skip_read") is True,
                              lora=(rec["lora"][0], rec["lora"][2]) if rec.get("lora") else None,
                              mm=tuple((e[0], e[1], e[2]) for e in rec.get("mm") or ()),
                              embeds=decode_embeds(rec["embeds"]) if rec.get("embeds") and self.exact else None,
                              grammar_wait=rec.get("so") is True)
        self.waiting[rid] = None
        self.queue.append(rid)
        if rec.get("x"):
            self.exempt.add(rid)
        elif rec.get("resumable"):
            self.sessions.add(rid)
            # a session's kept blocks re-hashed after its update: not modelled
            self._fq_off("streaming sessions")
        self.stats["requests"] += 1

    # ---- streaming-input sessions (format 6, #28) --------------------------------------------------
    def _session_update(self, rec: dict) -> None:
        """An ``add`` with a live session's id (vLLM ``add_request`` -> ``StreamingUpdate``): applied
        at once while the session waits for input, else queued for its next stopped turn. A
        finishing update (not ``resumable``) of a waiting session aborts it inside the call (the next
        step's ``fin`` names it); a queued one makes the next stop a finish."""
        rid = rec["id"]
        r = self.reqs[rid]
        self.stats["session_updates"] += 1
        if rid not in self.awaiting_input:
            r.pending.append(rec if rec.get("resumable") else None)
        elif rec.get("resumable"):
            self._apply_update(rid, r, rec)
        else:  # vLLM finish_requests(FINISHED_ABORTED) inside add_request: its blocks are free now
            self._finish(rid, "abort")

    def _apply_update(self, rid: str, r: _Req, rec: dict) -> None:
        """vLLM ``_update_request_as_session``: every output token but the final sampled one becomes
        prompt, the update's prompt follows; its stop rules apply from now on."""
        self.awaiting_input.discard(rid)
        prompt = decode_tokens(rec["prompt"]) if self.exact else None
        if self.exact:
            r.tokens = r.tokens[:-1] + list(prompt)
            r.prompt_len = len(r.tokens)
        else:
            r.prompt_len = r.prompt_len + r.num_out - 1 + _num_tokens_b64(rec["prompt"])
        r.num_out = 0
        r.chains = {}  # the dropped token's block (and those after it) hold other tokens now
        self.stops.begin_turn(rid, rec, r.prompt_len)

    def _turn_stopped(self, rid: str) -> None:
        """vLLM ``_handle_stopped_request`` for a session that is not finished: it leaves the running
        queue keeping its KV blocks (its in-flight work dropped: the computed tokens fall back to
        those settled), then takes its next queued update or waits for one."""
        r = self.reqs.get(rid)
        if r is None:
            return
        self.stats["session_turns"] += 1
        # vLLM: num_computed_tokens falls back to the settled frontier, but the turn's steps still in
        # flight keep counting in num_in_flight_tokens until their (stale) output returns, and
        # allocate_slots frees windows by computed - in flight: the frontier less those tokens
        frontier = r.processed
        r.processed = max(0, frontier - max(0, r.computed - frontier))
        for i, (step, settled) in enumerate(self.in_flight):
            if any(e[0] == rid for e in settled):
                self.in_flight[i] = (step, [(e[0], frontier, e[2]) if e[0] == rid else e for e in settled])
        self.session_stale[rid] = self.step
        r.computed = frontier
        r.running = False
        self.running.discard(rid)
        self.waiting[rid] = None
        r.session_held = frontier > 0
        self.run_order.pop(rid, None)
        # vLLM takes a stopped turn out of its queue (a preempted one's stale output can stop it) and
        # enqueues it again: at the back of waiting, or in kv_holding_waiting when it holds KV
        self._unqueue(rid)
        if not r.session_held:
            self.queue.append(rid)
        if r.pending and r.pending[0] is not None:
            self._apply_update(rid, r, r.pending.pop(0))
        else:
            self.awaiting_input.add(rid)

    def _refused_then_preempted(self, rec: dict, kv_pre: list) -> None:
        """A running request ``allocate_slots`` refused in this step and then preempted for KV space:
        vLLM freed its windowed groups' skipped blocks at the refusal (``remove_skipped_blocks``
        runs before the allocation fails), before any preemption's frees. With one refused request
        that order is known (its skipped blocks, then the preempted requests last running first);
        with several, each refusal's frees fall between other preemptions': the free-queue order is
        unknown from here (session 18, #28: a LoRA run on a sliding-window pool)."""
        refused = [rid for rid in rec.get("refused") or () if rid in kv_pre]
        for rid in refused:
            r = self.reqs.get(rid)
            if r is not None and r.running and self._free_skipped(rid, r) and len(rec.get("refused") or ()) > 1:
                self._fq_off("several refused requests freed blocks mid-step")

    def _release(self, rid: str, park: bool = False) -> None:
        """``rid`` lets go of its blocks; ``park``: vLLM frees them (finish, preemption), so a
        connector's delayed free or a step fence may keep them out of the pool (held.py)."""
        r = self.reqs.get(rid)
        if r is None:
            return
        key = None
        if park and rid in self.loading:  # aborted mid-load: freed once the load reports done
            key = parked_key("recving", rid)
        elif park and rid in self.delayed:
            key = parked_key("sending", rid)
        elif park and self.fences.must_park(rid):
            key = parked_key("fence", f"{rid}:{self.fences.sched_seq}:{len(self.fences.parked)}")
            self.fences.park(key)
        moved = self.parked.setdefault(key, []) if key is not None else None
        if key is not None:
            self.stats["parked_" + key[len(_PARKED_PREFIX):].split(":", 1)[0]] += 1
        kept = self.clipped.get(rid) if key is not None else None
        fq = self.fq
        for g, table in enumerate(r.tables):
            dropped = [] if fq is not None else None
            for idx, b in enumerate(table):
                if b:
                    holders = self.owners.get(b)
                    if holders is None or (rid, g) not in holders:
                        continue  # never owned (out of the pool: reported) or given up behind a window
                    if moved is not None and not (kept is not None and g < len(kept) and idx < len(kept[g])
                                                  and not kept[g][idx]):
                        holders.pop((rid, g), None)
                        holders[(key, g)] = idx
                        moved.append((b, g, idx))
                    else:
                        self._drop_owner(b, rid, g)
                        if dropped is not None:
                            dropped.append(b)
            if dropped:  # one free_blocks call per group, the table's tail first
                fq.free([b for b in reversed(dropped) if b not in self.owners])
        r.tables = []
        r.filled = []
        r.async_held = False
        r.running = False
        self.running.discard(rid)
        self.run_order.pop(rid, None)

    def _drop_owner(self, b: int, rid: str, g: int) -> None:
        holders = self.owners.get(b)
        if holders is not None:
            holders.pop((rid, g), None)
            if not holders:
                del self.owners[b]

    def _unpark(self, key: str) -> None:
        """The parked blocks go back to the pool (a send finished, a fence was reached)."""
        for b, g, _idx in self.parked.pop(key, ()):
            self._drop_owner(b, key, g)

    def _sent(self, rid: str, kind: str = "sending") -> None:
        """``finished_sending`` (``finished_recving`` for a request aborted mid-load) named ``rid``:
        vLLM frees its blocks now, or at a step fence."""
        key = parked_key(kind, rid)
        if kind == "recving":
            self.loading.discard(rid)
        if key not in self.parked:
            return
        self.delayed.pop(rid, None)
        if self.fences.must_park(rid):
            fence_key = parked_key("fence", f"{rid}:{self.fences.sched_seq}:{len(self.fences.parked)}")
            for b, g, idx in self.parked[key]:
                holders = self.owners[b]
                holders.pop((key, g), None)
                holders[(fence_key, g)] = idx
            self.parked.setdefault(fence_key, []).extend(self.parked.pop(key))
            self.stats["parked_fence"] += 1
            self.fences.park(fence_key)
        else:
            self._unpark(key)
        self.fences.forget(rid)

    def _async_loads(self, line: int, rec: dict, scheduled: set) -> None:
        """``update_state_after_alloc`` for a request this step did not schedule: its blocks were
        allocated for an asynchronous load (it waits for the remote KV, holding them); the blocks
        past its local hit are fresh ones the load fills."""
        for e in rec.get("kv") or ():
            if e[0] != "a" or e[1] in scheduled or e[1] not in self.reqs:
                continue
            rid, r = e[1], self.reqs[e[1]]
            self.loading.add(rid)
            self.remote_waited.add(rid)
            self._release(rid)
            r.tables = [[] for _ in range(self.num_groups)]
            r.filled = [0] * self.num_groups
            r.async_held = True
            r.load_upto = self.local_hit.get(rid, 0) + int(e[3] or 0)
            for g, ids in enumerate(e[2][: self.num_groups]):
                local = self.local_hit.get(rid, 0) // self.group_bs[g]
                table = r.tables[g]
                for b in ids:
                    idx = len(table)
                    table.append(b)
                    if not b or b >= self.num_blocks:
                        continue
                    if idx >= local:
                        self.content.pop(b, None)
                        self._check_reuse(line, rid, g, idx, b)
                    self.owners.setdefault(b, {})[(rid, g)] = idx

    def _load_fences(self, line: int, rec: dict) -> None:
        """HiSparse keeps reading a released page until the pool reuses it, so with a step in flight
        (a non-empty step scheduled and not yet processed) vLLM 0.33.0 defers an async load it
        admits (``defer_async_loads``): the connector hears of it (``update_state_after_alloc``) only
        in the update that processed that step. Handed over in the same ``schedule()`` that looked
        it up while a step was in flight, the load may overwrite a page a running step still reads
        (#28, session 20: the fault check-run replays and the properties now see too)."""
        fences = self.fences
        if fences.sched_seq <= fences.processed_seq:
            return
        loads = set()
        for e in rec.get("kv") or ():
            if e[0] == "m" and e[3] and e[4]:  # an async load of external tokens
                loads.add(e[1])
            elif e[0] == "a" and e[1] in loads:
                loads.discard(e[1])
                if not e[3]:  # the admission took no external token (vLLM dropped the load): nothing to defer
                    continue
                self._find("load_fence", line,
                           f"{e[1]}'s async load is handed to the connector in the schedule() that admitted it "
                           f"while {fences.sched_seq - fences.processed_seq} step(s) are in flight: with a HiSparse "
                           "host pool vLLM defers it until that step was processed (defer_async_loads)")

    def _connector_answers(self, rec: dict) -> None:
        """A record's connector log (format 4): delayed frees, the local hit each lookup saw, and
        the prefix-cache stats of each admission that followed a lookup."""
        asked: dict[str, int] = {}
        admitted_at: dict[str, int] | None = None  # computed tokens of the step's admissions
        carried: dict[str, bool] = {}  # SWA bounded replay: whether each load carries the window
        for e in rec.get("kv") or ():
            if e[0] == "w":  # the groups the load restores: all the replay groups, or not the window
                carried[e[1]] = bool(self.replay_groups) and set(self.replay_groups) <= set(e[2])
                continue
            if e[0] == "a":
                self.failed_whole.discard(e[1])  # admitted (or loading) again: not the hang's state
            if e[0] == "a" and self.lookup_tally and e[1] in asked:
                r = self.reqs.get(e[1])
                if r is not None and not r.skip_read:
                    num_tokens = len(r.tokens) if self.exact else r.prompt_len
                    if admitted_at is None:
                        admitted_at = ({row[0]: row[3] for row in sched_rows(rec) if row[1] != "c"}
                                       if rec["t"] == "sched" else {})
                    window = 0 if carried.get(e[1], False) else self.replay_window
                    self.tally.admitted(r.preempted, num_tokens,
                                        self._admitted_local_hit(e, asked.pop(e[1]), admitted_at, window))
                continue
            if e[0] == "m":
                asked[e[1]] = int(e[2] or 0)
            if e[0] == "f":
                self.clipped[e[1]] = [list(g) for g in e[2]]
                if e[3]:
                    self.delayed[e[1]] = self.clipped[e[1]]
            elif e[0] == "m":
                self.local_hit[e[1]] = int(e[2] or 0)
                r = self.reqs.get(e[1])
                if r is not None and r.async_held and e[1] in self.load_zeroed:
                    # asked again after its load: the load failed with no valid token, and vLLM's
                    # _update_waiting_for_remote_kv freed the blocks before this lookup. A load that
                    # succeeded keeps them, even when the request is asked again (its whole hit
                    # replayed: num_computed_tokens back to 0; generated connector runs, #28)
                    self.load_zeroed.discard(e[1])
                    self._release(e[1])

    def _prefill_runway(self, line: int, rid: str, r: "_Req", computed: int, n: int) -> None:
        """A first prefill's chunk ending short of the prompt must leave the drafter's whole runway:
        vLLM's ``_reserve_prefill_lookahead`` cuts a chunk that would end within
        ``num_prefill_lookahead`` tokens of the end (the MTP chain would fall back to sampled drafts
        and pollute its trailing modules' KV). Resumed requests are left out (their known tokens
        include outputs an async trace may not show yet), and so are requests that sampled already:
        their known tokens run past the prompt (a connector load's invalid blocks set a decoding
        request back to recompute from 0, and its chunk leaves the runway before its outputs'
        end, not the prompt's: a false finding on a recorded connector run with MTP, session 19)."""
        left = r.prompt_len - computed - n
        if not r.preempted and not r.num_out and 0 < left < self.prefill_lookahead:
            self._find("prefill_lookahead", line,
                       f"{rid}'s prefill chunk ({n} tokens from {computed}) ends {left} token(s) before the end "
                       f"of its {r.prompt_len}-token prompt, inside the multi-module MTP drafter's runway of "
                       f"{self.prefill_lookahead} (vLLM's _reserve_prefill_lookahead never ends a chunk there)")

    @staticmethod
    def _admitted_local_hit(alloc: list, asked: int, admitted_at: dict[str, int], window: int = 0) -> int:
        """The local hit vLLM records at an admission (``record_prefix_cache_stats(request,
        num_new_local_computed_tokens)``): for a request scheduled in the step, its computed tokens
        less the connector's external ones, since the block-aligned hit it asked the connector
        with is not always the one it kept -- a sub-block local tail the remote hit does not exceed
        stays, and a divergent hybrid hit with no external tokens behind it is reconciled to the
        hit every group agrees on (generated Mamba "align" connector runs, #28); an asynchronous
        load (not scheduled) keeps the hit it asked with. Under SWA bounded replay (``window``: the
        replay window, 0 where the load carried it) a scheduled admission starts a window before
        the hit vLLM counted (session 20)."""
        computed = admitted_at.get(alloc[1])
        return asked if computed is None else hit_before_replay(window, computed) - int(alloc[3] or 0)

    def _finish(self, rid: str, reason: str) -> None:
        r = self.reqs.get(rid)
        if r is None:
            return
        self._release(rid, park=True)
        if rid not in self.delayed and rid not in self.loading:
            self.fences.forget(rid)
        self.local_hit.pop(rid, None)
        self.clipped.pop(rid, None)
        if r.first_step < 0:
            self._note_wait(rid, self.step - r.arrival_step)
        self.waiting.pop(rid, None)
        self._unqueue(rid)
        self.exempt.discard(rid)
        self.sessions.discard(rid)
        self.awaiting_input.discard(rid)
        self.session_stale.pop(rid, None)
        self.drop_stale.discard(rid)
        self.stops.finished(rid)
        self.load_zeroed.discard(rid)
        self.failed_whole.discard(rid)
        self.remote_waited.discard(rid)
        del self.reqs[rid]
        self.finish_reasons[reason] += 1

    def _note_wait(self, rid: str, steps: int) -> None:
        if steps > self.longest_wait[0]:
            self.longest_wait = (steps, rid)

    # ---- one schedule() -------------------------------------------------------------------------
    def _sched(self, line: int, rec: dict) -> None:
        self.step = step = rec["step"]
        st = self.stats
        st["steps"] += 1
        why = rec.get("pre_why") or {}
        if rec["pre"]:
            # preempted for KV space in this call: popped from the end of running, each prepended to
            # waiting (those a reset preempted were queued at its record)
            pre = set(rec["pre"])
            self._prepend([rid for rid in self.run_order if rid in pre and why.get(rid) != "reset_prefix_cache"])
        kv_pre = [rid for rid in rec["pre"] if why.get(rid) != "reset_prefix_cache"]
        self.fq_unordered = bool(kv_pre)
        pre_order = rec["pre"]
        if self.fq is not None and len(kv_pre) > 1:
            if self.priority:  # preempted by (priority, arrival), which the checker does not keep
                self._fq_off("several KV preemptions in a step under the priority policy")
            else:  # vLLM's running loop pops the last running request first
                rank = {rid: i for i, rid in enumerate(self.run_order)}
                pre_order = sorted(rec["pre"], key=lambda rid: -rank.get(rid, -1))
        if self.exact and kv_pre:
            self._refused_then_preempted(rec, kv_pre)
        for rid in pre_order:
            r = self.reqs.get(rid)
            if r is not None:
                self._release(rid, park=True)
                self._stale_in_flight(rid)
                r.computed = r.processed = 0
                r.preempted = True
                self.waiting[rid] = None
                st["preemptions"] += 1
                self.preempt_reasons[why.get(rid, "unrecorded")] += 1
        for rid in rec["fin"]:
            if rid in self.reqs:
                if self.reqs[rid].tables:
                    # freed at a point the trace does not show
                    self._fq_off("a finish first named in sched.fin")
                self._finish(rid, "finished")
        if self.exact:
            # allocate_slots refused these (sched.refused): it had freed their windowed groups'
            # skipped blocks first, so a running request left unscheduled gave some up (#28)
            for rid in rec.get("refused") or ():
                r = self.reqs.get(rid)
                if r is not None and r.running and self._free_skipped(rid, r):
                    # freed mid-step (before the preemption the refusal led to), where the trace does
                    # not show: the queue's order is unknown from here
                    self._fq_off("a refused request freed blocks mid-step")
        rows = sched_rows(rec)
        spec = rec.get("spec") or {}
        self._starvation(line, rec, rows)
        if self.paused:
            self._paused(line, rows)
        self.remote_waited.difference_update(row[0] for row in rows)
        if self.check_order and not self.paused and self.queue:
            self._admission_order(line, rows)
        ahead = self._ahead() if self.in_flight else {}
        num_spec = self.num_spec
        tokens = 0
        settled = []
        for rid, kind, n, computed, blocks in rows:
            tokens += n
            r = self.reqs.get(rid)
            if r is None:  # scheduled without an arrival record (trace started mid-run)
                r = self.reqs[rid] = _Req(arrival_step=step, prompt_len=0)
            if kind == "n" and self.v2_runner and r.preempted:
                kind = "r"  # the V2 runner gets a resumed request as a new one
            hit = computed  # the admission's prefix hit (past computed under a bounded replay)
            if kind != "c":
                hit = self._admit(line, rid, r, kind, computed)
            # (a streaming session resuming on its kept blocks makes no lookup: vLLM keeps its old value)
            if kind == "n" and self.replay_window and not self.connector and rid not in self.sessions:
                self._replay_start(line, rid, computed, (rec.get("replay") or {}).get(rid, 0))
            elif self.exact and self._free_skipped(rid, r) and self.fq_unordered:
                # freed before or after this step's preemptions: unknown
                self._fq_off("skipped blocks freed in a step that preempted for KV space")
            r.grammar_wait = False  # admitted: its grammar was ready
            if not r.running:
                r.running = True
                self.running.add(rid)
                self.run_order[rid] = None  # vLLM appends an admitted request to running
            if blocks is not None:
                if self.fq is not None:
                    self._fq_allocate(line, rid, kind, hit, blocks)
                self._allocate(line, rid, r, kind, hit, blocks)
            if self.prefill_lookahead > 1:
                self._prefill_runway(line, rid, r, computed, n)
            if r.prompt_len and (rid not in self.sessions or rid in self.stops.reqs):
                have = r.prompt_len + r.num_out
                extra = ahead.get(rid, 0) + max(len(spec.get(rid, ())), num_spec)
                if computed + n > have + extra:
                    self._past_tokens(line, rid, r, computed, n, have, extra)
            r.computed = computed + n
            if self.fq is not None and self.fq.caching:
                self._fq_hash(r, r.computed)
            self._covers(line, rid, r)
            self._admission_bound(line, rid, r)
            self._register(rid, r)
            settled.append((rid, r.computed, len(spec.get(rid, ()))))
        if self.connector and self.exact:
            self._async_loads(line, rec, {row[0] for row in rows})
        if rows:
            self.fences.scheduled([row[0] for row in rows])
        self.in_flight.append((step, settled))
        st["scheduled_tokens"] += tokens
        self.peak_running = max(self.peak_running, len(self.running))
        self.peak_blocks = max(self.peak_blocks, len(self.owners))
        self._conserve(line, rec, "schedule")

    # ---- waiting-queue order, tokens scheduled, reset result (session 17, #28) ---------------------
    def _prepend(self, rids: list) -> None:
        """``rids`` (in this order) go back to the head of vLLM's FCFS waiting queue."""
        if rids:
            self.queue[:0] = [rid for rid in rids if rid in self.reqs and rid not in self.queue]

    def _unqueue(self, rid: str) -> None:
        try:
            self.queue.remove(rid)
        except ValueError:
            pass

    def _skippable(self, rid: str) -> str:
        """Why vLLM's waiting loop may pass over ``rid`` (``skip_request``) rather than stop at it, as
        far as the trace shows; "" when nothing lets it: it waits for a streaming input
        (``WAITING_FOR_STREAMING_REQ``), has deliverable stale output in flight (preempted for KV
        space under async scheduling), a LoRA adapter (``max_loras``), encoder inputs or a drafter
        runway (a chunk cut to 0 tokens), or a feature the reference does not model (``x``)."""
        r = self.reqs.get(rid)
        if r is None:
            return "unknown"
        if rid in self.awaiting_input:
            return "waiting for streaming input"
        if r.grammar_wait:
            return "waiting for its grammar"
        if rid in self.exempt or r.lora or r.mm or self.prefill_lookahead:
            return "a skippable feature"
        if r.session_held or r.async_held:
            return "holds KV blocks"
        if rid not in self.drop_stale and any(e[0] == rid and e[1] is None for _, settled in self.in_flight
                                              for e in settled):
            return "stale output in flight"
        return ""

    def _admission_order(self, line: int, rows: list) -> None:
        """The requests a step admits from ``waiting`` leave it in its order, passing over only
        requests vLLM's waiting loop may skip (FCFS; vLLM's ``FCFSRequestQueue``: arrivals append,
        preemptions prepend, skipped requests are put back in place). An admission past a request it
        may not skip, or in another order, means the queue vLLM kept is not the one its rules make --
        e.g. preempted requests put back in another order (reset_prefix_cache preempts last to first
        so they come back first to last)."""
        want = [row[0] for row in rows if row[1] != "c" and row[0] in self.reqs
                and not self.reqs[row[0]].session_held and not self.reqs[row[0]].async_held]
        if not want:
            return
        pending = set(want)
        pos: dict[str, int] = {}
        for i, q in enumerate(self.queue):
            if q in pending:
                pos[q] = i
                pending.discard(q)
                if not pending:
                    break
        order = [rid for rid in want if rid in pos]
        if not order:
            return
        for a, b in zip(order, order[1:]):
            if pos[a] > pos[b]:
                self._find("admission_order", line,
                           f"{a} is admitted before {b}, which is ahead of it in the waiting queue (FCFS: arrivals "
                           "join at the back, preempted requests go back to the front in their running order)",
                           once=True)
                return
        admitted = set(order)
        for q in self.queue[:max(pos.values())]:
            if q not in admitted and not self._skippable(q):
                late = next(rid for rid in order if pos[rid] > self.queue.index(q))
                r = self.reqs[q]
                self._find("admission_order", line,
                           f"{late} is admitted past {q}, which is ahead of it in the waiting queue and cannot be "
                           f"skipped ({'preempted' if r.preempted else 'arrived before step ' + str(r.arrival_step)}"
                           "; FCFS: vLLM's waiting loop stops at the first request it cannot schedule)", once=True)
                return

    def _ahead(self) -> dict[str, int]:
        """Tokens a step may schedule past a request's known tokens for its steps still in flight:
        one output placeholder per step that samples (its chunk reached the prompt's end) and its
        drafts (vLLM's ``num_output_placeholders``, async scheduling). Steps whose output vLLM drops
        (a stopped session turn, a reset's drop mode) or a preemption made stale hold none."""
        ahead: dict[str, int] = {}
        stale = self.session_stale
        for step, settled in self.in_flight:
            for rid, computed, drafts in settled:
                if computed is None or stale.get(rid, -1) >= step:
                    continue
                r = self.reqs.get(rid)
                if r is not None and computed >= r.prompt_len:
                    ahead[rid] = ahead.get(rid, 0) + 1 + drafts
        return ahead

    def _past_tokens(self, line: int, rid: str, r: _Req, computed: int, n: int, have: int, extra: int) -> None:
        session = " (a streaming session: its kept outputs, less the final sampled token, then the update's prompt)" \
            if rid in self.sessions else ""
        self._find("past_tokens", line,
                   f"{rid} is scheduled {n} tokens from {computed} (to {computed + n}), past the {have} tokens it "
                   f"has{session}" + (f" and {extra} placeholder/draft slots" if extra else "")
                   + ": vLLM schedules num_tokens - num_computed_tokens at most", once=True)

    def _reset_result(self, line: int, rec: dict) -> None:
        """``reset_prefix_cache`` succeeds exactly when every block but the null block is free (vLLM's
        ``BlockPool.reset_prefix_cache``; the running requests were preempted first when asked): the
        recorded ``free`` after the call decides, and on exact bookkeeping no block may be held. A
        connector reset asked for too may fail on its own."""
        ok = bool(rec.get("ok"))
        free = rec.get("free")
        if free is not None and (ok != (free == self.num_blocks - 1)) and (ok or not rec.get("connector")):
            self._find("reset_result", line,
                       f"reset_prefix_cache reported {'success' if ok else 'failure'} with {free} of "
                       f"{self.num_blocks - 1} usable blocks free: vLLM resets the prefix cache exactly when "
                       "no block is in use", once=True)
        elif ok and self.exact and self.owners:
            self._find("reset_result", line,
                       f"reset_prefix_cache reported success while live requests hold {len(self.owners)} block(s): "
                       "vLLM refuses a reset while any block is in use", once=True)
        self._conserve(line, rec, "reset_prefix_cache")

    def _fq_off(self, why: str) -> None:
        """The free-queue order leaves the trace (or was found broken) here: checked no further."""
        if self.fq is not None:
            self.fq = None
            self.fq_why_off = f"off from step {max(self.step, 0)}: {why}"

    def _fq_allocate(self, line: int, rid: str, kind: str, computed: int, blocks: list) -> None:
        """A row's allocation against vLLM's free queue: ``allocate_slots`` touches the hit blocks of
        every group first, then takes each group's fresh blocks from the queue's head (``computed``:
        the admission's hit; a group vLLM never caches has no hit blocks)."""
        fq = self.fq
        groups = blocks[: self.num_groups]
        hits = [computed // rule.block_size if kind != "c" and rule.cacheable else 0 for rule in self.rules]
        for g, ids in enumerate(groups):
            for b in ids[: hits[g]]:
                if b:
                    fq.touch(b)
        for g, ids in enumerate(groups):
            for b in ids[hits[g]:]:
                if not b or b >= self.num_blocks:
                    continue
                head, free = fq.head(), b in fq.order
                if fq.take(b) or self.fq_unordered:
                    continue
                if not free:
                    # not free here at all: conservation or reuse says what
                    self._fq_off("a fresh block that was not free")
                    return
                self._find("free_order", line,
                           f"{rid} gets block {b} fresh (group {g}) while block {head} heads vLLM's free block queue: "
                           "BlockPool.get_new_blocks takes the head (freed blocks without a prefix-cache hash go to "
                           "the front, a request's table tail first; cached ones to the back, evicted oldest first)",
                           once=True)
                # one finding: the queue vLLM kept is another from here on
                self._fq_off("after its finding")
                return

    def _fq_hash(self, r: _Req, computed: int) -> None:
        """Full blocks vLLM caches (``cache_blocks``) up to ``min(computed, num_tokens)`` tokens carry a
        block hash from now on: freed, they go to the back. ``allocate_slots`` caches up to the
        step's end; ``update_from_output`` up to the settled tokens under async scheduling or
        speculative decoding."""
        if not r.tables or not r.hashed_upto:
            return
        upto_tokens = min(computed, len(r.tokens)) // self.cache_round * self.cache_round
        hashed = self.fq.hashed
        for g, bs in enumerate(self.group_bs):
            table = r.tables[g]
            caches = self.rules[g].caches
            start, upto = r.hashed_upto[g], min(upto_tokens // bs, len(table))
            for idx in range(start, upto):
                if table[idx] and caches(idx):  # a sliding window caches each segment's tail only
                    hashed.add(table[idx])
            if upto > start:
                r.hashed_upto[g] = upto

    def _starvation(self, line: int, rec: dict, rows: list) -> None:
        """Nothing scheduled while requests wait, whatever is in flight (async keeps a step there)."""
        waiting = self.waiting
        loading = rec.get("loading")
        blind = self.connector and loading is None  # a connector run recorded before version 3
        if loading is not None:
            self.seen_loading = True
        # a connector that answered "ask again" (None) for a waiting request: the connector, not the
        # scheduler, holds it back (format 4 records the answer)
        asked_again = any(e[0] == "m" and e[3] is None for e in rec.get("kv") or ())
        # blocks a connector still holds past their request (a send in flight, a fence not reached)
        # may be what the waiting request needs: the transfer, not the scheduler, holds it back
        held_back = any(self.parked.values())
        if self.awaiting_input:  # sessions waiting for their next input: the engine idles on them,
            # and they keep their model-runner slots (vLLM's waiting loop admits nobody while
            # running + waiting-for-input sessions fill max_num_active_reqs)
            waiting = {rid: None for rid in waiting if rid not in self.awaiting_input}
            if len(self.running) + len(self.awaiting_input) >= self.max_active:
                waiting = {}
        if (not rows and waiting and not rec["pre"] and not loading and not blind and not asked_again
                and not held_back and not self.paused
                and not (self.exempt and any(r in self.exempt for r in waiting))
                and not any(self.reqs[r].grammar_wait for r in waiting if r in self.reqs)):
            self.idle_run += 1
            if self.idle_run >= self.starvation_steps and not self.idle_reported:
                head = next(iter(waiting))
                r = self.reqs[head]
                self._find("starvation", line,
                           f"{len(waiting)} request(s) wait while {self.idle_run} schedule calls in a row "
                           f"(since step {self.step - self.idle_run + 1}) schedule nothing ({len(self.running)} "
                           f"running, {len(self.in_flight)} step(s) in flight); first waiting: {head} "
                           f"({r.prompt_len} prompt tokens, arrived before step {r.arrival_step}): "
                           + (self._self_reservation(rec) or self._sessions_hold(head, r)
                              or "the head-of-line hang of vLLM #39734 / #35541"))
                self.idle_reported = True
        elif rows:
            self.idle_run = 0
            self.idle_reported = False

    def _paused(self, line: int, rows: list) -> None:
        """What a pause lets run (vLLM's ``set_pause_state``): under PAUSED_ALL nothing, under
        PAUSED_NEW running requests and the waiting ones that already hold KV blocks (a finished
        asynchronous load), never a request admitted without blocks. vLLM 0.33.0 decides by queue,
        not by blocks: a request whose asynchronous load failed whole (recompute policy) had its
        blocks freed but stays in ``kv_holding_waiting``, which PAUSED_NEW drains, so it is admitted
        and recomputes its prompt under the pause; allowed here (``remote_waited``) as vLLM does
        it (a generated connector pause run, seed 6, #28)."""
        if self.paused == 2 and rows:
            self._find("scheduled_while_paused", line, f"PAUSED_ALL, yet the step schedules {len(rows)} request(s) "
                       f"({', '.join(row[0] for row in rows[:4])}): a paused scheduler schedules nothing")
        elif self.paused == 1:
            for rid, kind, _n, _computed, _blocks in rows:
                r = self.reqs.get(rid)
                # (an inexact connector run does not track which waiting requests hold blocks)
                held = r is not None and (r.async_held or rid in self.remote_waited or r.session_held)
                if kind != "c" and not held and (self.exact or not self.connector):
                    self._find("scheduled_while_paused", line,
                               f"PAUSED_NEW, yet {rid} is admitted ({'resumed' if kind == 'r' else 'new'}, holding no "
                               "KV blocks): only running requests and requests holding KV blocks may run")

    def _sessions_hold(self, head: str, r: _Req) -> str:
        """Nothing runs and waiting streaming-input sessions hold KV blocks: vLLM 0.33.0 keeps a
        stopped session's blocks while it waits (kv_holding_waiting), drains that queue first and
        preempts nobody from the waiting loop, so once the waiting sessions hold the blocks the
        first of them needs, nothing frees them and nothing behind them runs either (generated
        session runs, #28; the conform-scheduler session machine's teardown meets it too). "" when
        not."""
        holders = [rid for rid in self.waiting if rid in self.sessions and self.reqs[rid].session_held
                   and self.reqs[rid].tables]
        if self.running or not holders:
            return ""
        return (f"waiting streaming-input sessions ({', '.join(holders[:4])}) hold KV blocks: vLLM 0.33.0 keeps a "
                "stopped session's blocks while it waits (kv_holding_waiting), drains that queue first and "
                "preempts nobody from the waiting loop, so nothing frees them")

    def _self_reservation(self, rec: dict) -> str:
        """The idle step asked the connector about a request whose async load had failed whole and
        got an async load again, with no allocation: vLLM 0.33.0's self-reservation hang
        (docs/coverage.md, findings): the request stays in ``_inflight_prefills``, whose reserved
        blocks count its own remaining blocks against its admission. "" when not that."""
        kv = rec.get("kv") or ()
        allocated = {e[1] for e in kv if e[0] == "a"}
        for e in kv:
            if e[0] == "m" and e[1] in self.failed_whole and e[3] and e[4] and e[1] not in allocated:
                return (f"vLLM 0.33.0's self-reservation hang: {e[1]}'s async load failed whole (recompute "
                        "policy), it stays in _inflight_prefills, and the async load the connector offers "
                        "again is refused against its own reservation (docs/coverage.md)")
        return ""

    def _admit(self, line: int, rid: str, r: _Req, kind: str, computed: int) -> int:
        """A new or resumed request leaves the waiting queue with ``computed`` hit tokens; returns
        the prefix hit its blocks were adopted for (``computed``, or a window more where a bounded
        replay rewound the hit: vLLM's ``allocate_slots`` adopts the whole hit)."""
        st = self.stats
        # a session resuming on the KV blocks it kept: vLLM makes no prefix-cache lookup (a session
        # the stop rules lost track of shows it by a second first admission with computed tokens)
        resumed_session = r.session_held or (kind == "n" and computed > 0 and rid in self.stops.lost
                                             and r.first_step >= 0)
        r.session_held = False
        if r.first_step < 0:
            r.first_step = self.step
            self._note_wait(rid, self.step - r.arrival_step)
        # SWA bounded replay: the admission starts a window before its hit; vLLM counts the hit
        hit = computed if resumed_session else hit_before_replay(self.replay_window, computed)
        if resumed_session:
            st["session_resumes"] += 1
        elif kind == "n":
            st["new_prompt_tokens"] += r.prompt_len
            st["hit_tokens"] += hit
            if computed:
                st["prefix_hits"] += 1
        else:
            st["resumes"] += 1
        num_tokens = len(r.tokens) if self.exact else r.prompt_len + r.computed  # (tokens known when exact)
        # vLLM counts no lookup for a request that skipped it, nor for a session resuming on its blocks
        if not r.skip_read and not self.lookup_tally and not resumed_session:
            # vLLM counts a lookup as a preempted one by num_preemptions > 0, which a session keeps
            # across its turns (a later turn is admitted as new)
            self.tally.admitted(kind == "r" or (rid in self.sessions and r.preempted), num_tokens, hit)
        if self.exact and r.tokens and computed > len(r.tokens) - 1:
            self._find("wrong_hit", line, f"{rid} is admitted with {computed} computed tokens of its {len(r.tokens)}: "
                       "a prefix-cache hit never covers the last token (its logits must be computed)")
        self._release(rid)
        self.waiting.pop(rid, None)
        self._unqueue(rid)
        r.tables = [[] for _ in range(self.num_groups)]
        r.filled = [0] * self.num_groups
        r.hashed_upto = [0] * self.num_groups
        # a session resuming on its blocks may still have its stopped turn's steps in flight
        r.processed = min(r.processed, computed) if resumed_session else computed
        r.computed = computed
        return hit

    def _replay_start(self, line: int, rid: str, computed: int, replay_start: int) -> None:
        """SWA bounded replay without a KV connector (#28, session 20): a new request's
        ``replay_start`` (vLLM's ``NewRequestData.replay_start``, recorded as ``sched.replay``) is
        where its computation starts: the hit less the window when a hit was kept, 0 when none was
        (``_mark_prefix_replay``). Anything else makes the workers rebuild the wrong range of the
        window's KV while the scheduled tokens look right."""
        if replay_start != computed:
            self._find("replay_start", line,
                       f"{rid} is admitted at {computed} computed tokens with replay_start {replay_start}: a "
                       f"bounded replay (window {self.replay_window}) starts where the admission's computation "
                       "does (the hit less the window; 0 without a hit)")

    def _free_skipped(self, rid: str, r: _Req, admission: bool = False) -> int:
        """What ``remove_skipped_blocks`` frees at this request's allocation (settled tokens); the
        number of blocks it let go of. vLLM frees them per group, the last skipped one first.
        ``admission``: after an admission's hit was added, where only groups whose hit vLLM pads
        with nulls count (an R-SWA hit inside the gap stays until the next allocation)."""
        n = 0
        for g, rule in enumerate(self.rules):
            if g >= len(r.tables) or not rule.frees_exactly or (admission and rule.kind == "rswa"):
                continue
            table = r.tables[g]
            freed = []
            for idx in rule.skipped_range(r.processed, r.prompt_len):
                if idx >= len(table):
                    break
                b = table[idx]
                if b:
                    self._drop_owner(b, rid, g)
                    table[idx] = 0
                    freed.append(b)
            if freed:
                n += len(freed)
                if self.fq is not None:
                    self.fq.free([b for b in reversed(freed) if b not in self.owners])
        return n

    def _allocate(self, line: int, rid: str, r: _Req, kind: str, computed: int, blocks: list) -> None:
        owners = self.owners
        for g, ids in enumerate(blocks):
            if g >= self.num_groups:
                self._find("block_out_of_pool", line, f"{rid} got blocks for group {g}; the pool has "
                           f"{self.num_groups} group(s)")
                break
            rule = self.rules[g]
            table = r.tables[g]
            # (a group vLLM never caches, a bounded-replay window, adopts no hit block)
            num_hits = computed // rule.block_size if kind != "c" and rule.cacheable else 0
            # a connector's external tokens sit past the local hit in fresh blocks the load filled
            local = min(num_hits, self.local_hit.get(rid, computed) // rule.block_size) if self.connector else num_hits
            for b in ids:
                idx = len(table)
                table.append(b)
                if not b:
                    continue
                if b >= self.num_blocks:
                    self._find("block_out_of_pool", line,
                               f"{rid} got block {b} in group {g}; the pool has {self.num_blocks} blocks")
                    continue
                if idx < local:
                    if self.exact and rule.holds_tokens:
                        self._check_hit(line, rid, r, g, idx, b)
                else:
                    self.content.pop(b, None)  # a fresh block: whatever it held was evicted
                    self._check_reuse(line, rid, g, idx, b)
                holders = owners.get(b)
                if holders is None:
                    owners[b] = {(rid, g): idx}
                else:
                    holders[(rid, g)] = idx
            if len(table) > self.max_table[g]:
                self._find("table_too_long", line, f"{rid} holds {len(table)} blocks in group {g}; "
                           f"max_model_len={self.max_model_len} needs at most {self.max_table[g] - 1} (with its "
                           "speculative state blocks)")
        if kind != "c" and self.exact:
            if self._free_skipped(rid, r, admission=True):  # a hit's blocks behind the window are freed at admission
                # (vLLM pads those with nulls: never seen in a vLLM trace)
                self._fq_off("a hit's skipped blocks freed at admission")

    def _check_reuse(self, line: int, rid: str, g: int, idx: int, b: int) -> None:
        holders = self.owners.get(b)
        if not holders or not self.reuse_checked:
            return
        for (orid, og), oidx in list(holders.items()):
            other = self.reqs.get(orid)
            rule = self.rules[og]
            if other is not None and og < len(other.tables) and (
                    not rule.needs(oidx, other.processed, len(other.tables[og]), other.prompt_len)
                    # a Mamba "align" request's own state block moving to a later slot of its table:
                    # vLLM's MambaManager hands its speculative state blocks on as the request
                    # advances (EAGLE on Mamba align pools, #28)
                    or (orid == rid and og == g and rule.kind == "mamba" and rule.keep_last > 1 and oidx < idx)):
                # behind the holder's window: vLLM may have freed it at a point the trace does not show
                self._fq_off("a block taken behind a window")
                del holders[(orid, og)]
                other.tables[og][oidx] = 0
                continue
            self._find("reused_while_needed", line,
                       f"block {b} allocated to {rid} (group {g}, position {idx}) while {orid} still needs it "
                       f"(group {og}, position {oidx}, inside its window of "
                       f"{other.processed if other is not None else '?'} settled tokens); not a prefix-cache hit")

    # ---- prefix-cache content ---------------------------------------------------------------------
    def _chain(self, r: _Req, bs: int, upto: int) -> list:
        """Content keys of ``r``'s first ``upto`` full blocks of ``bs`` tokens (chained like vLLM's
        block hashes: a key covers the whole prefix and the cache salt)."""
        keys = r.chains.get(bs)
        if keys is None:
            keys = r.chains[bs] = []
        toks = r.tokens
        ahead = self.hash_lookahead
        while len(keys) < upto:
            i = len(keys)
            lo, hi = i * bs, (i + 1) * bs
            # as vLLM's hashes (#28): the LoRA adapter with the salt, the identifiers of the
            # multimodal items the block overlaps, the lookahead tokens past the block
            items = tuple(e[0] for e in r.mm if e[1] < hi and e[1] + e[2] > lo)
            embeds = None if r.embeds is None else r.embeds[lo:hi]  # past the prompt: () (vLLM: no rows)
            keys.append(hash((keys[-1] if keys else hash(("salt", r.salt, r.lora)), tuple(toks[lo:hi]),
                              items, tuple(toks[hi:hi + ahead]), embeds)))
        return keys

    def _check_hit(self, line: int, rid: str, r: _Req, g: int, idx: int, b: int) -> None:
        bs = self.group_bs[g]
        if (idx + 1) * bs > len(r.tokens):
            self._find("wrong_hit", line, f"{rid}'s prefix-cache hit covers block {b} at position {idx} of group {g}, "
                       f"past its {len(r.tokens)} known tokens")
            return
        if (idx + 1) * bs + self.hash_lookahead > len(r.tokens):
            return  # its lookahead tokens are not in the trace yet: the key cannot be formed
        want = self._chain(r, bs, idx + 1)[idx]
        have = self.content.get(b)
        if have != want:
            what = "was never filled (or was evicted since)" if have is None else "holds other tokens"
            why = ""
            if have is None and self.priority and self.stats["preemptions"]:
                why = ("; under the priority policy vLLM 0.33.0 may preempt a request it already scheduled in the "
                       "same step, after allocate_slots cached that step's blocks, whose KV is then never computed "
                       "(docs/record.md, Findings)")
            self._find("wrong_hit", line, f"{rid}'s prefix-cache hit of {r.computed} tokens uses block {b} (group {g}, "
                       f"position {idx}), which {what}: the hit is not its own prefix{why}")

    def _register(self, rid: str, r: _Req) -> None:
        """Full blocks whose tokens are all known and computed now hold those tokens (vLLM caches
        them at allocation, up to ``min(computed, num_tokens)``)."""
        load_upto, r.load_upto = r.load_upto, 0  # a landed load's blocks: once, at its promotion
        if not self.exact or not r.tables:
            return
        # a lookahead hash needs the tokens past the block: a block is cached once they are known
        upto_tokens = min(max(r.computed, load_upto), len(r.tokens) - self.hash_lookahead)
        for g, rule in enumerate(self.rules):
            if not rule.holds_tokens:
                continue
            bs = rule.block_size
            table = r.tables[g]
            upto = min(upto_tokens // bs, len(table))
            start = r.filled[g]
            if upto <= start:
                continue
            keys = self._chain(r, bs, upto)
            content = self.content
            for idx in range(start, upto):
                b = table[idx]
                if b:
                    content.setdefault(b, keys[idx])
            r.filled[g] = upto

    # ---- bounds and conservation ------------------------------------------------------------------
    def _admission_bound(self, line: int, rid: str, r: _Req) -> None:
        if not self.exact:
            return
        for g, rule in enumerate(self.rules):
            if rule.bound is None or g >= len(r.tables):
                continue
            held = sum(1 for b in r.tables[g] if b)
            # an EAGLE-like drafter's lookahead slots lie past a window's admission cap (full
            # attention stops at max_model_len): vLLM allocates them there too (#28)
            extra = -(-self.lookahead // rule.block_size) if rule.kind in ("window", "chunk") else 0
            if held > rule.bound + extra:
                self._find("admission_bound", line,
                           f"{rid} holds {held} blocks in group {g} ({rule.kind}); startup sized a request for at "
                           f"most {rule.bound + extra} (max_admission_blocks_per_request, vLLM #40946"
                           + (", with the drafter's lookahead slots" if extra else "") + ")", once=True)

    def _covers(self, line: int, rid: str, r: _Req) -> None:
        """A scheduled request's table has a slot for every token of the step and for the drafter's
        lookahead slots past them: ``allocate_slots`` sizes it for ``min(computed + new + lookahead,
        max_model_len)`` tokens in every attention group (windowed groups keep null entries in
        front, so their table length counts the same). Fewer blocks means the model (or an
        EAGLE-like drafter) writes KV past the request's blocks: an under-allocation no other
        property sees (issue #28)."""
        if not self.exact or not r.tables:
            return
        need = min(r.computed + self.lookahead, self.max_model_len)
        for g, rule in enumerate(self.rules):
            if not rule.holds_tokens or g >= len(r.tables):
                continue
            want = -(-need // rule.block_size)
            if len(r.tables[g]) < want:
                self._find("table_too_short", line,
                           f"{rid} has {len(r.tables[g])} blocks in group {g} after this step's allocation; its "
                           f"{r.computed} tokens" + (f" and {self.lookahead} lookahead slots" if self.lookahead else "")
                           + f" need {want} blocks of {rule.block_size}", once=True)
                return

    def _conserve(self, line: int, rec: dict, call: str) -> None:
        """free + distinct held blocks = num_blocks - 1 (the null block), after every recorded call."""
        free = rec.get("free")
        if free is None or not self.exact:
            return
        used = self.num_blocks - 1 - free
        held = len(self.owners)
        if used != held:
            what = ("more blocks in use than live requests hold (a leaked block)" if used > held
                    else "fewer blocks in use than live requests hold (a block freed while held)")
            self._find("conservation", line,
                       f"after {call}: {free} free + {held} held by live requests != {self.num_blocks - 1} usable "
                       f"blocks: {what}", once=True)

    # ---- one update_from_output ---------------------------------------------------------------------
    def _update(self, line: int, rec: dict) -> None:
        step = rec["step"]
        sampled = update_sampled(rec)
        dropped: set = set()  # this step's output vLLM discards (drop-mode stale output)
        if self.in_flight and (step < 0 or self.in_flight[0][0] == step):
            _, settled = self.in_flight.popleft()
            if self.drop_stale:
                dropped = {e[0] for e in settled if e[1] is None and e[0] in self.drop_stale}
                self.drop_stale.difference_update(
                    rid for rid in list(self.drop_stale)
                    if not any(e[0] == rid and e[1] is None for _, later in self.in_flight for e in later))
            if settled:  # a non-empty step processed: deferred frees whose fence it reached return
                for key in self.fences.processed():
                    self._unpark(key)
            got = {rid: len(toks) for rid, toks in zip(rec["ids"], sampled)}
            for rid, computed, drafts in settled:
                r = self.reqs.get(rid)
                # None: stale (preempted since); a session whose turn stopped settles its dropped
                # steps to its frontier (vLLM's num_in_flight_tokens falls as their output returns)
                if r is None or computed is None or not (r.running or rid in self.session_stale):
                    continue
                if drafts and got.get(rid):
                    # speculative decoding: the drafts it rejected are rolled back (vLLM's verification)
                    rejected = max(0, drafts - (got[rid] - 1))
                    computed -= rejected
                    r.computed -= rejected
                    if rejected:
                        self._roll_back_in_flight(rid, rejected)
                if computed > r.processed:
                    r.processed = computed
        stale = self.session_stale
        for rid, toks in zip(rec["ids"], sampled):
            r = self.reqs.get(rid)
            if r is not None and toks and not (stale and stale.get(rid, -1) >= step) and rid not in dropped:
                r.num_out += len(toks)
                if self.exact:
                    r.tokens.extend(toks)
                # vLLM caches a running request's settled full blocks when its output returns under
                # async scheduling (before it frees a finished one)
                if self.fq_update_caches and self.fq is not None and r.running and r.tables:
                    self._fq_hash(r, r.processed)
        for rid in self.stops.turn_stopped:  # sessions whose turn stopped (not finished)
            self._turn_stopped(rid)
        for rid, reason in rec["fin"]:
            self._finish(rid, reason)
        kvo = rec.get("kvo") or {}
        self._failed_loads(kvo)
        for rid in kvo.get("r", ()):
            self._sent(rid, "recving")
        for rid in kvo.get("s", ()):
            self._sent(rid)
        if self.exact:
            for rid, toks in zip(rec["ids"], sampled):
                r = self.reqs.get(rid)
                if r is not None and toks and r.running:
                    self._register(rid, r)
        self._conserve(line, rec, "update_from_output")
        self._metrics(line, rec)

    def _failed_loads(self, kvo: dict) -> None:
        """Loading requests left with no valid token by the worker's report: named in
        ``failed_recving`` (vLLM's ``_handle_failed_recving`` zeroes ``num_computed_tokens``) or
        with their first block invalid (``_update_requests_with_invalid_blocks`` truncates at the
        first invalid block; one group, as vLLM requires there)."""
        failed, invalid = kvo.get("f") or (), set(kvo.get("i") or ())
        if self.recompute_failures:
            self.failed_whole.update(rid for rid in failed if rid in self.loading)
        for rid in self.loading:
            r = self.reqs.get(rid)
            if r is None or not r.async_held:
                continue
            if rid in failed or (invalid and r.tables and r.tables[0] and r.tables[0][0] in invalid):
                self.load_zeroed.add(rid)
            if rid in failed or (invalid and any(b in invalid for t in r.tables for b in t)):
                r.load_upto = 0  # only the valid prefix is cached: what the request computes from

    def _stale_in_flight(self, rid: str) -> None:
        """``rid`` was preempted with steps in flight (async scheduling): their output is stale
        (vLLM's ``_preempt_request`` keeps ``num_in_flight_tokens`` and marks that share stale), so
        settling them must not raise what the resumed request has processed. vLLM frees windows by
        ``num_computed_tokens - num_in_flight_tokens``; counting a stale step as processed freed a
        sliding-window block vLLM still held (a resumed request's first windowed block after a
        reset_prefix_cache that preempted it: generated connector runs, seeds 5 and 9, #28)."""
        for i, (step, settled) in enumerate(self.in_flight):
            if any(e[0] == rid for e in settled):
                self.in_flight[i] = (step, [(e[0], None, e[2]) if e[0] == rid else e for e in settled])

    def _roll_back_in_flight(self, rid: str, rejected: int) -> None:
        """Async scheduling: a step of ``rid`` already scheduled behind the settled one counted the
        rejected drafts among its computed tokens; vLLM's rollback lowers ``num_computed_tokens``
        under it too, so its end (what the request has processed once it settles, which windowed
        groups free by) is that much lower. Without this a sliding-window request's settled count
        ran ahead and a block vLLM still held was counted free (found by the EAGLE demo run, #28)."""
        for i, (step, settled) in enumerate(self.in_flight):
            if any(e[0] == rid for e in settled):
                self.in_flight[i] = (step, [(e[0], e[1] - rejected, e[2]) if e[0] == rid and e[1] is not None else e
                                            for e in settled])

    def _metrics(self, line: int, rec: dict) -> None:
        expected = self.tally.take()
        stats = rec.get("stats")
        if stats is None:
            return
        # a connector's external hits and skipped waiting requests are not in the prefix-cache and
        # waiting counts the trace implies (the replay compares them: it knows the answers)
        # (a connector run's resumed queries can differ by one token: "pq" is left to the replay)
        bad = [] if self.connector and not self.lookup_tally else compare_stats(
            stats, expected, ("req", "q", "h", "preq", "ph") + (("pq",) if self.exact and not self.connector else ()))
        free = rec.get("free")
        if free is not None and "usage" in stats and usage_differs(stats["usage"], usage(free, self.num_blocks)):
            bad.insert(0, f"usage: reported {stats['usage']!r}, 1 - free/(num_blocks - 1) = "
                          f"{usage(free, self.num_blocks)!r}")
        # a session whose turn stops the trace no longer shows (stop_rules lost its output count)
        # may have left the running queue unseen: the counts are not compared while one lives
        lost = bool(self.stops.lost)
        if "run" in stats and stats["run"] != len(self.running) and not lost:
            bad.append(f"running: reported {stats['run']}, the trace has {len(self.running)}")
        # vLLM leaves the requests its waiting loop skipped (deferred_waiting) out of num_waiting_reqs
        # and reports them as num_skipped_waiting_reqs ("skip", recorded since #28's LoRA replay)
        if ("wait" in stats and not self.connector and not lost
                and stats["wait"] + stats.get("skip", 0) != len(self.waiting)):
            bad.append(f"waiting: reported {stats['wait']} (+ {stats.get('skip', 0)} skipped), the trace has "
                       f"{len(self.waiting)}")
        if bad:
            self._find("metrics", line, "the SchedulerStats of this step disagree with the trace: " + "; ".join(bad),
                       once=True)

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
            "preemption_reasons": dict(self.preempt_reasons),
            "prefix_hits": st["prefix_hits"], "prefix_hit_rate": round(hit_rate, 4),
            "scheduled_tokens": st["scheduled_tokens"],
            "longest_wait_steps": self.longest_wait[0], "longest_wait_request": self.longest_wait[1],
            "peak_running": self.peak_running, "peak_blocks_held": self.peak_blocks,
            "num_blocks": self.num_blocks,
            **({"connector_holds": {k: st["parked_" + k] for k in ("sending", "recving", "fence")}}
               if self.connector else {}),
            "starvation_check": ("on" if not self.connector else "on (except while a remote KV load is pending)"
                                 if self.seen_loading else "off: kv_connector (the trace records no pending loads)"),
            "free_order_check": self.fq_why_off or "on",
            "block_checks": "on" if self.exact else "off: " + ", ".join(
                self.inexact or [f"group {g} ({r.kind})" for g, r in enumerate(self.rules)
                                 if r.kind == "unknown" or not r.frees_exactly]),
        }

    def check_invariants(self) -> None:
        assert self.running <= set(self.reqs), "a running request that is not live"
        self.stops.check_invariants()
        assert not (set(self.waiting) & self.running), "a request both waiting and running"
        assert not (set(self.queue) & self.running), "a running request in the waiting queue"
        assert len(set(self.queue)) == len(self.queue) and set(self.queue) <= set(self.waiting), "waiting queue"
        assert set(self.run_order) == self.running, "running order out of step with the running set"
        if self.fq is not None:
            self.fq.check_invariants(self.owners)
        for b, holders in self.owners.items():
            assert holders and 0 < b, (b, holders)
            for (rid, g), idx in holders.items():
                if is_parked(rid):
                    assert (b, g, idx) in self.parked.get(rid, ()), f"block {b} parked by {rid!r} unknown to it"
                    continue
                r = self.reqs.get(rid)
                assert r is not None, f"block {b} held by a dead request {rid}"
                assert r.tables[g][idx] == b, f"block {b}: {rid}'s table disagrees at group {g} position {idx}"
        for key, blocks in self.parked.items():
            assert is_parked(key) and all(self.owners.get(b, {}).get((key, g)) == idx for b, g, idx in blocks), key
        self.fences.check_invariants()
