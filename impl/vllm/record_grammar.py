"""What a recording scheduler's structured-output grammars answered: the ``gr`` lists of a run trace
(format 7, issue #28).

A run with structured output (JSON mode, grammars) cannot be replayed from the scheduler's calls
alone: when a request's grammar finished compiling, whether it failed, which drafts it accepted and
whether it accepted the sampled tokens — only the grammar knew. :class:`GrammarTap` logs, in call
order, each answer vLLM's scheduler got for a request with ``use_structured_output``:

* ``_handle_blocked_waiting_request`` on a request in ``WAITING_FOR_STRUCTURED_OUTPUT_GRAMMAR`` ->
  ``["g", id, state]``: ``"ready"`` (the scheduler went on with it), ``"error"`` (it recorded a
  compile error), ``"pending"`` (it skipped it); a grammar that is not ready where the scheduler went
  on anyway is logged as what the grammar was (``pending`` / ``error``: the replay then disagrees);
* ``StructuredOutputManager.validate_tokens`` in ``update_draft_token_ids`` -> ``["v", id, number of
  drafts kept]`` (the calls inside ``update_draft_token_ids_in_output``, which the trace does not
  record, are not logged);
* ``StructuredOutputManager.accept_tokens`` with tokens -> ``["x", id, accepted]``.

The manager's methods are wrapped on the instance (vLLM's code and the grammar backends run
unchanged); the recorder attaches the log to the record of the scheduler call during which the
answers were given (:meth:`GrammarTap.take`).
"""

from __future__ import annotations

from typing import Any

from kvref.spec.errors import InvalidFieldError

#: vLLM's status of a request whose grammar is not ready
WAITING_FOR_GRAMMAR = "WAITING_FOR_STRUCTURED_OUTPUT_GRAMMAR"


class GrammarTap:
    """Logs the structured-output answers of a vLLM ``Scheduler`` (see the module docstring).

    Args:
        scheduler: vLLM's scheduler (its ``structured_output_manager`` is wrapped).
        rename: maps a request id to the one the trace writes (the anonymizer's, or identity).
    """

    def __init__(self, scheduler: Any, rename=None) -> None:
        manager = getattr(scheduler, "structured_output_manager", None)
        if manager is None:
            raise InvalidFieldError("scheduler.structured_output_manager", None, "vLLM's StructuredOutputManager")
        self.rename = rename or (lambda rid: rid)
        self.log: list[list] = []
        #: inside update_draft_token_ids_in_output (not recorded): validate_tokens is not logged
        self.in_output = False
        tap = self
        validate, accept = manager.validate_tokens, manager.accept_tokens

        def validate_tokens(request, spec_tokens):
            out = validate(request, spec_tokens)
            if request.use_structured_output and not tap.in_output:
                tap.log.append(["v", tap.rename(request.request_id), len(out)])
            return out

        def accept_tokens(request, new_token_ids):
            ok = accept(request, new_token_ids)
            if request.use_structured_output and new_token_ids:
                tap.log.append(["x", tap.rename(request.request_id), bool(ok)])
            return ok

        manager.validate_tokens = validate_tokens
        manager.accept_tokens = accept_tokens

    def checked(self, scheduler: Any, request: Any, went_on: bool) -> None:
        """``_handle_blocked_waiting_request`` returned ``went_on`` for a request that waited for
        its grammar: log what the scheduler saw (see the module docstring)."""
        rid = request.request_id
        if went_on:
            sor = request.structured_output_request
            grammar = sor.grammar if sor is not None else None
            state = "pending" if grammar is None else "error" if isinstance(grammar, Exception) else "ready"
        else:
            state = "error" if rid in getattr(scheduler, "grammar_compile_error_reqs", {}) else "pending"
        self.log.append(["g", self.rename(rid), state])

    def take(self) -> list[list]:
        """The log since the last take (and a fresh one)."""
        log, self.log = self.log, []
        return log


__all__ = ["GrammarTap", "WAITING_FOR_GRAMMAR"]
