"""Speculative decoding in vLLM 0.33.0's scheduler: the rules, apart from the scheduling loop.

:class:`~kvref.impl.reference.scheduler.Scheduler` calls these at small hooks; they read and write
one :class:`SpecDecodeState` (the drafts of live requests, this step's scheduled drafts, the stats of
the last update). The facts, from ``vllm/v1/core/sched/scheduler.py`` and ``async_scheduler.py``:

* **Drafts arrive** after a step: synchronously through ``update_draft_token_ids`` (ignored for a
  request whose last step was a prefill chunk, which also loses any drafts it had); under async
  scheduling the scheduler itself gives every request that samples ``num_speculative_tokens``
  placeholder drafts (``-1``) when the step is scheduled, and the runner fills them in.
* **Scheduling** (``num_tokens_with_spec``): a running request asks for its drafts too; whatever
  part of the drafts fits the token budget and ``max_model_len - num_computed_tokens - 1`` is
  scheduled for verification (``scheduled_spec_decode_tokens``), and the drafts are cleared.
  Every allocation reserves ``num_lookahead_tokens`` extra slots (EAGLE-like drafters).
* **Padding**: a request admitted with exactly one token to compute (a prefix hit up to its last
  token, or a resumed request), when the running batch holds no prefill and is not empty (or the
  request already has computed tokens), is padded to ``1 + num_speculative_tokens`` tokens with
  ``-1`` drafts so the batch stays uniform; when the padded span does not fit the budget the
  waiting loop stops.
* **Verification**: a step that verified ``d`` drafts and returned ``n >= 1`` tokens accepted
  ``a = n - 1``; the ``d - a`` rejected positions are rolled back from ``num_computed_tokens`` (and
  from async placeholders), unless the output is stale (the request was preempted meanwhile).
  ``SpecDecodingStats`` counts drafts, draft tokens and accepted tokens per position.
* **skip_drafts** (``can_skip_drafts``): a step none of whose requests can use the drafts proposed
  after it — a non-final prefill chunk, or a step sure to reach ``max_tokens`` even if every draft
  is rejected (``_drafts_unused``) — tells the runner to propose none.
* Preemption clears a request's drafts (recompute has no use for them).
* **Per-request metrics** (``spec_decode_metrics_level`` ``"summary"`` / ``"detailed"``: vLLM's
  ``per_request_spec_decode_metrics``): every arrival gets a ``RequestSpecDecodeMetrics``; each
  verification above, stale or not, adds one to ``histogram[accepted]`` and the drafts proposed
  (less the grammar-invalid ones) to ``num_draft_tokens``, and ``"detailed"`` also appends both
  per step. They survive preemption and go out with the request's finishing output.
"""

from __future__ import annotations

from kvref.impl.request import Request, RequestStatus
from kvref.impl.scheduler_types import DraftTokenIds, RequestSpecDecodeMetrics, SchedulerConfig, SpecDecodingStats
from kvref.spec.errors import InvalidFieldError

#: vLLM's placeholder draft id (padding, async placeholders, grammar-invalid drafts)
PLACEHOLDER = -1


class SpecDecodeState:
    """The scheduler's speculative-decoding state.

    Attributes:
        spec_token_ids: drafts of live requests awaiting verification (vLLM ``Request.spec_token_ids``).
        step_spec_tokens: drafts scheduled in the step being built (``scheduled_spec_decode_tokens``).
        drafts_needed: some request of the step being built can use the drafts proposed after it.
        last_stats: the ``SpecDecodingStats`` of the last ``update_from_output`` (None: no draft verified).
        metrics: live requests' per-request metrics (empty with ``spec_decode_metrics_level="none"``).
        finished_metrics: the metrics of the requests freed since the last ``update_from_output``
            began (those it finished are what vLLM reports with their finishing output).
    """

    def __init__(self, config: SchedulerConfig) -> None:
        self.config = config
        self.k = config.num_speculative_tokens
        self.spec_token_ids: dict[str, list[int]] = {}
        self.step_spec_tokens: dict[str, tuple[int, ...]] = {}
        self.drafts_needed = True
        self.last_stats: SpecDecodingStats | None = None
        self.metrics: dict[str, RequestSpecDecodeMetrics] = {}
        self.finished_metrics: dict[str, RequestSpecDecodeMetrics] = {}

    # ---- add_request() / freeing ----------------------------------------------------------------
    def add(self, request_id: str) -> None:
        """A new request gets empty per-request metrics when they are on (vLLM ``add_request``)."""
        if self.config.spec_decode_metrics_level != "none":
            self.metrics[request_id] = RequestSpecDecodeMetrics((0,) * (self.k + 1))

    def freed(self, request_id: str) -> None:
        """A finished request's metrics leave with it (reported with its finishing output)."""
        m = self.metrics.pop(request_id, None)
        if m is not None:
            self.finished_metrics[request_id] = m

    # ---- schedule() ---------------------------------------------------------------------------
    def start_step(self) -> None:
        self.step_spec_tokens = {}
        self.drafts_needed = not self.config.can_skip_drafts

    def num_spec(self, request: Request) -> int:
        return len(self.spec_token_ids.get(request.request_id, ()))

    def note_scheduled(self, request: Request, num_computed_tokens: int, num_new_tokens: int) -> None:
        """Every scheduled request: can it use the drafts proposed after this step?"""
        self.drafts_needed = self.drafts_needed or not drafts_unused(request, num_computed_tokens, num_new_tokens)

    def take_running_drafts(self, request: Request, num_new_tokens: int) -> None:
        """A running request was scheduled ``num_new_tokens``: the part of its drafts inside them is
        verified this step; the drafts are cleared either way (new ones arrive after the step)."""
        drafts = self.spec_token_ids.pop(request.request_id, None)
        if not drafts:
            return
        n = (num_new_tokens + request.num_computed_tokens - request.num_tokens
             - request.num_output_placeholders)
        if n > 0:
            self.step_spec_tokens[request.request_id] = tuple(drafts[:n])

    def unschedule(self, request_id: str) -> None:
        """A request scheduled earlier in the step was preempted (PRIORITY): its drafts leave the step."""
        self.step_spec_tokens.pop(request_id, None)

    def pad_new_decode(self, num_new_tokens: int, num_computed_tokens: int, prefill_scheduled: bool,
                       running_scheduled: bool, token_budget: int, max_model_len: int) -> int | None:
        """vLLM's uniform-decode padding of an admission with one token left.

        Returns the tokens to schedule (``1 + k`` when padded), or None when the padded span does
        not fit the budget ("prefer to not schedule than schedule un-padded": the waiting loop stops).
        """
        if (self.k > 0 and num_new_tokens == 1 and not prefill_scheduled
                and (running_scheduled or num_computed_tokens > 0)):
            padded = 1 + self.k
            if num_computed_tokens + padded + 1 <= max_model_len:  # room for the sampled token
                if padded > token_budget:
                    return None
                return padded
        return num_new_tokens

    def mark_padded(self, request_id: str) -> None:
        self.step_spec_tokens[request_id] = (PLACEHOLDER,) * self.k

    # ---- after schedule() ---------------------------------------------------------------------
    def after_schedule(self, request: Request, spec_tokens: tuple[int, ...]) -> int:
        """``AsyncScheduler._update_after_schedule`` for a request that samples this step: its
        placeholders grow by the sampled token and its scheduled drafts, and it gets ``k``
        placeholder drafts for the next step. Returns the placeholders to add."""
        self.spec_token_ids[request.request_id] = [PLACEHOLDER] * self.k
        if not self.k:
            del self.spec_token_ids[request.request_id]
        return 1 + len(spec_tokens)

    def forget(self, request_id: str) -> None:
        """Preempted or finished: the drafts are dropped."""
        self.spec_token_ids.pop(request_id, None)

    # ---- update_from_output() -----------------------------------------------------------------
    def start_update(self) -> None:
        self.last_stats = None
        self.finished_metrics = {}

    def verify(self, request: Request, spec_tokens: tuple[int, ...], num_generated: int, stale: bool,
               num_invalid: int = 0) -> None:
        """Roll back rejected drafts and count the verification (``make_spec_decoding_stats``;
        ``num_invalid`` drafts the runner did not fill are left out of the stats, not the rollback)."""
        num_draft = len(spec_tokens)
        num_accepted = max(num_generated - 1, 0)
        num_rejected = num_draft - num_accepted
        if not stale:
            # A stale rejection count predates the preemption's rollback and must not apply.
            if request.num_computed_tokens > 0:
                request.num_computed_tokens -= num_rejected
            if request.num_output_placeholders > 0:
                request.num_output_placeholders -= num_rejected
        s = self.last_stats or SpecDecodingStats(self.k, num_accepted_tokens_per_pos=(0,) * self.k,
                                                 num_draft_tokens_per_pos=(0,) * self.k)
        num_draft -= num_invalid
        self.last_stats = SpecDecodingStats(
            self.k, s.num_drafts + 1, s.num_draft_tokens + num_draft, s.num_accepted_tokens + num_accepted,
            tuple(c + (i < num_accepted) for i, c in enumerate(s.num_accepted_tokens_per_pos)),
            tuple(c + (i < num_draft) for i, c in enumerate(s.num_draft_tokens_per_pos)))
        m = self.metrics.get(request.request_id)
        if m is not None:  # vLLM RequestSpecDecodeMetrics.observe
            detailed = self.config.spec_decode_metrics_level == "detailed"
            self.metrics[request.request_id] = RequestSpecDecodeMetrics(
                tuple(c + (j == num_accepted) for j, c in enumerate(m.histogram)),
                m.num_draft_tokens + num_draft,
                m.per_step_accepted + ((num_accepted,) if detailed else ()),
                m.per_step_drafted + ((num_draft,) if detailed else ()))

    def check_sampled(self, rid: str, ids: list, spec_tokens: tuple[int, ...]) -> None:
        """A step verifying ``d`` drafts samples at most ``d + 1`` tokens (vLLM asserts at most
        ``num_speculative_tokens`` accepted)."""
        if self.k and len(ids) > 1 + len(spec_tokens):
            raise InvalidFieldError(f"model_output.sampled_token_ids[{rid!r}]", ids,
                                    f"at most 1 + {len(spec_tokens)} scheduled drafts tokens")

    # ---- update_draft_token_ids() -------------------------------------------------------------
    def update_draft_token_ids(self, requests: dict[str, Request], draft_token_ids: DraftTokenIds) -> None:
        """vLLM ``Scheduler.update_draft_token_ids``: finished or unknown requests are skipped; a
        request whose last step was a prefill chunk loses its drafts (they were proposed from no
        sampled token)."""
        if not isinstance(draft_token_ids, DraftTokenIds):
            raise InvalidFieldError("draft_token_ids", draft_token_ids, "a DraftTokenIds")
        for rid, drafts in zip(draft_token_ids.req_ids, draft_token_ids.draft_token_ids):
            if len(drafts) > self.k:
                raise InvalidFieldError(f"draft_token_ids[{rid!r}]", drafts,
                                        f"at most num_speculative_tokens={self.k} drafts")
        for rid, drafts in zip(draft_token_ids.req_ids, draft_token_ids.draft_token_ids):
            request = requests.get(rid)
            if request is None or request.status == RequestStatus.FINISHED:
                continue
            if request.is_prefill_chunk:
                self.spec_token_ids.pop(rid, None)
                continue
            if drafts:
                self.spec_token_ids[rid] = list(drafts)
            else:
                self.spec_token_ids.pop(rid, None)

    def invalid_in_output(self, requests: dict[str, Request], draft_token_ids: DraftTokenIds,
                          scheduled_spec_tokens: dict[str, tuple[int, ...]]) -> dict[str, int]:
        """vLLM ``Scheduler.update_draft_token_ids_in_output`` (async scheduling, a step whose
        sampling waits for structured output): the runner's drafts replace a step's placeholder
        drafts, cut to the scheduled count; a slot left empty is padded with -1 and counted as an
        invalid draft, which the step's stats leave out. Returns the invalid count per request
        (vLLM's ``num_invalid_spec_tokens``, replacing any earlier one of that step)."""
        if not isinstance(draft_token_ids, DraftTokenIds):
            raise InvalidFieldError("draft_token_ids", draft_token_ids, "a DraftTokenIds")
        invalid: dict[str, int] = {}
        for rid, drafts in zip(draft_token_ids.req_ids, draft_token_ids.draft_token_ids):
            request = requests.get(rid)
            if request is None or request.status == RequestStatus.FINISHED:
                continue
            placeholders = scheduled_spec_tokens.get(rid)
            if not placeholders:
                continue
            n = len(placeholders) - len(drafts[:len(placeholders)])
            if n:
                invalid[rid] = n
        return invalid

    # ---- invariants ---------------------------------------------------------------------------
    def check_invariants(self, requests: dict[str, Request]) -> None:
        assert set(self.spec_token_ids) <= set(requests), "Q9: drafts of a request that is not live"
        for rid, drafts in self.spec_token_ids.items():
            assert drafts, f"Q9: empty drafts stored for {rid}"
            assert len(drafts) <= self.k, f"Q9: request {rid} holds {len(drafts)} drafts, k={self.k}"
            assert requests[rid].status != RequestStatus.FINISHED, f"Q9: drafts of finished request {rid}"
        if not self.k:
            assert not self.spec_token_ids, "Q9: drafts stored without speculative decoding"


def drafts_unused(request: Request, num_computed_tokens: int, num_new_tokens: int) -> bool:
    """vLLM ``Scheduler._drafts_unused``: the drafts proposed after this step are sure to go unused.

    1. a non-final prefill chunk samples nothing (its drafts are dropped);
    2. the step samples the request's last output token even if every draft is rejected (one
       more token, plus one for a sampling step still in flight under async scheduling).
    Stop tokens cannot be known in advance, so they never count.
    """
    if num_computed_tokens + num_new_tokens < request.num_tokens:
        return True
    min_num_output_tokens = request.num_output_tokens + 1
    if request.num_output_placeholders > 0:
        min_num_output_tokens += 1
    return min_num_output_tokens >= request.max_tokens
