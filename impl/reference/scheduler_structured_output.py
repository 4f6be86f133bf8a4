"""Structured output (JSON mode, grammars) in vLLM 0.33.0's scheduler: what it does to KV blocks.

A request whose ``SamplingParams.structured_outputs`` sets a constraint gets a
``StructuredOutputRequest`` (vllm/v1/structured_output/request.py), so ``Request.use_structured_output``
is True and the request starts in ``WAITING_FOR_STRUCTURED_OUTPUT_GRAMMAR`` (vllm/v1/request.py). Its
grammar compiles in the background; vLLM's scheduler (vllm/v1/core/sched/scheduler.py) only asks
about it, at four places, each of which decides when blocks are allocated or freed:

1. ``_handle_blocked_waiting_request``: while the grammar is not ready (``grammar is None``) the
   waiting loop skips the request (it goes to the step's skipped queue and ``deferred_waiting``,
   like a request waiting for remote KVs or for streaming input: it does not block the queue);
   a grammar that is an ``Exception`` records ``grammar_compile_error_reqs`` and skips it too; a
   ready one makes the request ``WAITING`` and the loop goes on with it at once.
2. ``update_from_output``: the recorded compile errors are finished as ``FINISHED_ERROR`` together
   with the encoder-cache mismatches (one set of ids, one ``finish_requests``): the request leaves
   the waiting queue without ever holding a block.
3. ``update_draft_token_ids`` / ``update_draft_token_ids_in_output``: drafts pass through
   ``StructuredOutputManager.validate_tokens`` (speculative padding stripped, then the longest
   prefix the grammar accepts): fewer drafts, fewer lookahead slots next step; in an in-flight
   step the rejected slots are padded with -1 and counted in ``num_invalid_spec_tokens`` (the
   stats leave them out).
4. ``update_from_output``: ``accept_tokens(request, new_token_ids)`` (the sampled tokens, cut at a
   stop) returning False makes the request ``FINISHED_ERROR``, not resumable, freed in that update.

The grammar itself (compilation, the token bitmask of ``get_grammar_bitmask``, reasoning parsers'
``_get_constraint_bounds``) is outside the KV cache and not modelled: an answer source, a
:class:`GrammarOracle`, says per request whether the grammar is pending, ready or failed, which
drafts it accepts and whether it accepts sampled tokens. :class:`ScriptedGrammarOracle` is the one
the state machines script (vLLM's scheduler consults the same object through kvref's adapter:
:mod:`kvref.impl.vllm.structured_output`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

from kvref.impl.request import Request
from kvref.impl.scheduler_types import DraftTokenIds
from kvref.spec.errors import InvalidFieldError, check_int

#: what :meth:`GrammarOracle.grammar_state` answers (vLLM: ``grammar`` None / an object / an Exception)
GRAMMAR_STATES = ("pending", "ready", "error")


@runtime_checkable
class GrammarOracle(Protocol):
    """The answers the scheduler needs about a structured-output request's grammar."""

    def grammar_state(self, request_id: str) -> str:
        """``"pending"`` (still compiling), ``"ready"`` or ``"error"`` (failed to compile)."""

    def validate_tokens(self, request_id: str, tokens: list[int]) -> list[int]:
        """The longest prefix of ``tokens`` (drafts, no padding) the grammar accepts."""

    def accept_tokens(self, request_id: str, tokens: list[int]) -> bool:
        """Whether the grammar accepts these sampled tokens (False: the request errors out)."""


@dataclass
class ScriptedGrammarOracle:
    """A :class:`GrammarOracle` answering from a script the caller edits between calls: every
    answer is a pure function of the script, so two schedulers asking the same question in lock
    step get the same answer.

    Attributes:
        states: request id -> grammar state (absent: ``"pending"``).
        draft_limits: request id -> how many leading drafts the grammar accepts (absent: all).
        rejecting: requests whose sampled tokens the grammar rejects.
    """

    states: dict[str, str] = field(default_factory=dict)
    draft_limits: dict[str, int] = field(default_factory=dict)
    rejecting: set[str] = field(default_factory=set)

    def set_state(self, request_id: str, state: str) -> None:
        if not isinstance(request_id, str):
            raise InvalidFieldError("request_id", request_id, "a request id (str)")
        if state not in GRAMMAR_STATES:
            raise InvalidFieldError("state", state, f"one of {GRAMMAR_STATES}")
        self.states[request_id] = state

    def limit_drafts(self, request_id: str, num_accepted: int) -> None:
        if not isinstance(request_id, str):
            raise InvalidFieldError("request_id", request_id, "a request id (str)")
        check_int("num_accepted", num_accepted, minimum=0)
        self.draft_limits[request_id] = num_accepted

    def reject_sampled(self, request_id: str) -> None:
        if not isinstance(request_id, str):
            raise InvalidFieldError("request_id", request_id, "a request id (str)")
        self.rejecting.add(request_id)

    def grammar_state(self, request_id: str) -> str:
        return self.states.get(request_id, "pending")

    def validate_tokens(self, request_id: str, tokens: list[int]) -> list[int]:
        return list(tokens[:self.draft_limits.get(request_id, len(tokens))])

    def accept_tokens(self, request_id: str, tokens: list[int]) -> bool:
        return request_id not in self.rejecting


def strip_padding(tokens) -> list[int]:
    """vLLM ``strip_speculative_padding``: everything from the first -1 (an empty draft slot) on
    is dropped before a grammar sees the drafts."""
    out = []
    for t in tokens:
        if t < 0:
            break
        out.append(t)
    return out


class StructuredOutputState:
    """The scheduler's structured-output bookkeeping: the requests whose grammar is not ready yet
    (vLLM status ``WAITING_FOR_STRUCTURED_OUTPUT_GRAMMAR``; kvref's status stays WAITING and the id
    is named here) and the compile errors found since the last ``update_from_output``."""

    def __init__(self, oracle: GrammarOracle | None) -> None:
        if oracle is not None and not isinstance(oracle, GrammarOracle):
            raise InvalidFieldError("grammar_oracle", oracle,
                                    "None or a GrammarOracle (grammar_state, validate_tokens, accept_tokens)")
        self.oracle = oracle
        self.waiting_for_grammar: set[str] = set()
        #: vLLM ``grammar_compile_error_reqs``: ids in the order the waiting loop found them
        self.compile_errors: dict[str, None] = {}

    def add(self, request: Request) -> None:
        """A new request: with structured output it waits for its grammar."""
        if request.use_structured_output:
            if self.oracle is None:
                raise InvalidFieldError("request.use_structured_output", True,
                                        "False unless the scheduler has a grammar_oracle")
            self.waiting_for_grammar.add(request.request_id)

    def ready_to_schedule(self, request: Request) -> bool:
        """vLLM ``_handle_blocked_waiting_request``'s grammar branch: False skips the request this
        step (a failed grammar is recorded for ``update_from_output`` to finish)."""
        rid = request.request_id
        if rid not in self.waiting_for_grammar:
            return True
        state = self.oracle.grammar_state(rid)
        if state not in GRAMMAR_STATES:
            raise InvalidFieldError("grammar_oracle.grammar_state", state, f"one of {GRAMMAR_STATES}")
        if state == "pending":
            return False
        if state == "error":
            self.compile_errors[rid] = None
            return False
        self.waiting_for_grammar.discard(rid)  # vLLM: promoted to WAITING, scheduled on at once
        return True

    def take_compile_errors(self) -> dict[str, None]:
        errors, self.compile_errors = self.compile_errors, {}
        return errors

    def validate(self, request: Request, drafts) -> list[int]:
        """vLLM ``StructuredOutputManager.validate_tokens``: unchanged without structured output;
        else padding stripped and the prefix the grammar accepts."""
        if not request.use_structured_output:
            return list(drafts)
        stripped = strip_padding(drafts)
        valid = list(self.oracle.validate_tokens(request.request_id, list(stripped)))
        if valid != stripped[:len(valid)]:
            raise InvalidFieldError("grammar_oracle.validate_tokens", valid, f"a prefix of {stripped}")
        return valid

    def filter_drafts(self, requests: dict[str, Request], draft_token_ids: DraftTokenIds, k: int,
                      scheduled: dict[str, tuple[int, ...]] | None = None) -> DraftTokenIds:
        """The drafts after ``validate_tokens``, for the requests vLLM validates: live, not
        finished; in ``update_draft_token_ids`` (``scheduled`` None) not a prefill chunk, in
        ``update_draft_token_ids_in_output`` with drafts scheduled, cut to their number first.
        Lists longer than ``k`` are left for the caller to refuse."""
        if self.oracle is None or not isinstance(draft_token_ids, DraftTokenIds):
            return draft_token_ids
        out = []
        for rid, drafts in zip(draft_token_ids.req_ids, draft_token_ids.draft_token_ids):
            request = requests.get(rid)
            if request is not None and request.use_structured_output and not request.is_finished \
                    and len(drafts) <= k:
                if scheduled is None and not request.is_prefill_chunk:
                    drafts = tuple(self.validate(request, drafts))
                elif scheduled is not None and scheduled.get(rid):
                    drafts = tuple(self.validate(request, drafts[:len(scheduled[rid])]))
            out.append(drafts)
        return DraftTokenIds(draft_token_ids.req_ids, tuple(out))

    def accepts(self, request: Request, new_token_ids: list[int]) -> bool:
        """vLLM ``StructuredOutputManager.accept_tokens``: True without structured output or tokens."""
        if not request.use_structured_output or not new_token_ids:
            return True
        return bool(self.oracle.accept_tokens(request.request_id, list(new_token_ids)))

    def forget(self, request_id: str) -> None:
        self.waiting_for_grammar.discard(request_id)

    def check_invariants(self, requests: dict[str, Request], waiting_ids: set[str]) -> None:
        """S1: a request waits for its grammar only while it is live, queued, uses structured
        output and has computed nothing (it was never scheduled)."""
        for rid in self.waiting_for_grammar:
            r = requests.get(rid)
            assert r is not None and rid in waiting_ids, f"S1: {rid} waits for its grammar but is not queued"
            assert r.use_structured_output, f"S1: {rid} waits for a grammar without structured output"
            assert r.num_computed_tokens == 0 and r.num_preemptions == 0, \
                f"S1: {rid} waits for its grammar after being scheduled"
