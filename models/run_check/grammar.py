"""The replay's grammar oracle: the structured-output answers a recorded run's grammars gave (format 7).

The reference scheduler asks a :class:`~kvref.impl.reference.scheduler_structured_output.GrammarOracle`
whether a request's grammar is ready, which drafts it keeps and whether it accepts sampled tokens
(:mod:`kvref.impl.reference.scheduler_structured_output`). In a replay the answers are the ones vLLM's
scheduler got during the same call (each record's ``gr`` list, :mod:`kvref.impl.vllm.record_grammar`):
:class:`TraceGrammarOracle` hands them out in order, and a question that is not the next recorded
one (another request, another kind of question, or one more than vLLM asked) is a
:class:`GrammarMismatch`: the reference drove the grammars differently, which the replay reports as a
divergence, as it does for a KV connector's answers.
"""

from __future__ import annotations

from collections import deque

from kvref.spec.errors import InvalidFieldError

_KINDS = {"g": "grammar_state", "v": "validate_tokens", "x": "accept_tokens"}


class GrammarMismatch(Exception):
    """The reference asked a grammar something vLLM did not ask at this point."""

    def __init__(self, message: str, recorded, reference) -> None:
        super().__init__(message)
        self.message, self.recorded, self.reference = message, recorded, reference


class TraceGrammarOracle:
    """A :class:`~kvref.impl.reference.scheduler_structured_output.GrammarOracle` answering from a
    record's ``gr`` list (:meth:`expect` before each replayed call, :meth:`leftover` after it)."""

    def __init__(self) -> None:
        self._pending: deque = deque()
        self._where = ""

    def expect(self, log, where: str) -> None:
        """The answers recorded for the call about to be replayed (``log``: a record's ``gr``)."""
        if log is not None and not isinstance(log, list):
            raise InvalidFieldError("gr", log, "a list of grammar answers")
        for e in log or ():
            if not (isinstance(e, list) and len(e) == 3 and e[0] in _KINDS and isinstance(e[1], str)):
                raise InvalidFieldError("gr[i]", e, '["g"|"v"|"x", request id, answer]')
        self._pending = deque(log or ())
        self._where = where

    def _next(self, kind: str, request_id: str):
        if not self._pending or self._pending[0][0] != kind or self._pending[0][1] != request_id:
            raise GrammarMismatch(f"the reference asks {_KINDS[kind]}({request_id}) in {self._where}",
                                  list(self._pending)[:1] or "no further question",
                                  [kind, request_id])
        return self._pending.popleft()[2]

    def grammar_state(self, request_id: str) -> str:
        return self._next("g", request_id)

    def validate_tokens(self, request_id: str, tokens: list[int]) -> list[int]:
        return list(tokens[:int(self._next("v", request_id))])

    def accept_tokens(self, request_id: str, tokens: list[int]) -> bool:
        return bool(self._next("x", request_id))

    def leftover(self) -> None:
        """Every recorded answer was asked for (else a :class:`GrammarMismatch`)."""
        if self._pending:
            raise GrammarMismatch(f"vLLM asked its grammars more in {self._where}", list(self._pending),
                                  "no further question")


__all__ = ["GrammarMismatch", "TraceGrammarOracle"]
