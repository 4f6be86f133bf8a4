"""vLLM's scheduler asking a kvref :class:`~kvref.impl.reference.scheduler_structured_output.GrammarOracle`
about structured-output requests (issue #22).

vLLM 0.33.0's ``Scheduler`` reads a request's grammar in two ways: ``request.structured_output_request.grammar``
(None while compiling, an ``Exception`` when compilation failed, a grammar object once ready:
``_handle_blocked_waiting_request``) and its ``structured_output_manager`` (``validate_tokens`` for
drafts, ``accept_tokens`` for sampled tokens; ``grammar_bitmask`` only in ``get_grammar_bitmask``,
which the engine core calls, not ``schedule``). Here both answer from the same oracle the
reference scheduler asks, so the two can run in lock step on scripted grammars:

* :func:`scripted_structured_output_request` replaces the ``StructuredOutputRequest`` vLLM's
  ``Request`` built from ``SamplingParams.structured_outputs`` (so ``use_structured_output`` and
  the initial ``WAITING_FOR_STRUCTURED_OUTPUT_GRAMMAR`` status are vLLM's own derivation) with one
  whose ``grammar`` follows the oracle;
* :class:`ScriptedStructuredOutputManager` has the manager's scheduler-facing methods with the
  manager's own framing (requests without structured output pass unchanged, drafts lose their
  speculative padding by vLLM's ``strip_speculative_padding``, empty token lists are accepted);
  reasoning parsers (``_get_constraint_bounds``) are not modelled: the grammar constrains from the
  first token.

vLLM is imported inside the functions.
"""

from __future__ import annotations

from typing import Any

from kvref.spec.errors import InvalidFieldError


class _ReadyGrammar:
    """Stands for a compiled grammar: the scheduler only tests that it is not None and not an
    Exception; every question to it goes through :class:`ScriptedStructuredOutputManager`."""

    def __repr__(self) -> str:
        return "<scripted grammar>"


class GrammarCompileError(Exception):
    """What the oracle's ``"error"`` state becomes: vLLM keeps the compile exception as the grammar."""


def scripted_structured_output_request(vr: Any, oracle: Any) -> Any:
    """Give vLLM request ``vr`` (built with ``structured_outputs``) a ``StructuredOutputRequest``
    whose ``grammar`` answers from ``oracle.grammar_state(request_id)``; returns ``vr``."""
    from vllm.v1.structured_output.request import StructuredOutputRequest

    if vr.structured_output_request is None:
        raise InvalidFieldError("vr.structured_output_request", None,
                                "a vLLM request built with SamplingParams.structured_outputs")

    class ScriptedStructuredOutputRequest(StructuredOutputRequest):
        @property
        def grammar(self):
            state = oracle.grammar_state(vr.request_id)
            if state == "pending":
                return None
            if state == "error":
                return GrammarCompileError(f"scripted compile error of {vr.request_id}")
            if state == "ready":
                return _READY
            raise InvalidFieldError("grammar_oracle.grammar_state", state, "'pending', 'ready' or 'error'")

    old = vr.structured_output_request
    new = ScriptedStructuredOutputRequest(params=old.params)
    new.reasoning_ended, new.reasoning_parser_kwargs = old.reasoning_ended, old.reasoning_parser_kwargs
    vr.structured_output_request = new
    return vr


_READY = _ReadyGrammar()


class ScriptedStructuredOutputManager:
    """The ``structured_output_manager`` vLLM's ``Scheduler`` is built with: its scheduler-facing
    methods (``validate_tokens``, ``accept_tokens``, ``grammar_bitmask``) answered by ``oracle``."""

    def __init__(self, oracle: Any) -> None:
        from kvref.impl.reference.scheduler_structured_output import GrammarOracle

        if not isinstance(oracle, GrammarOracle):
            raise InvalidFieldError("grammar_oracle", oracle, "a GrammarOracle")
        self.oracle = oracle

    def validate_tokens(self, request: Any, spec_tokens: list[int]) -> list[int]:
        from vllm.v1.structured_output.utils import strip_speculative_padding

        if not request.use_structured_output:
            return spec_tokens
        return list(self.oracle.validate_tokens(request.request_id, list(strip_speculative_padding(spec_tokens))))

    def accept_tokens(self, request: Any, new_token_ids: list[int]) -> bool:
        if not request.use_structured_output or not new_token_ids:
            return True
        return bool(self.oracle.accept_tokens(request.request_id, list(new_token_ids)))

    def grammar_bitmask(self, requests, structured_output_request_ids, scheduled_spec_decode_tokens):
        return None  # the bitmask is outside the KV cache (docs/differences.md)
