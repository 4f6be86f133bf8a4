"""Multi-module MTP's prefill lookahead in the scheduler (vLLM 0.33.0 ``_reserve_prefill_lookahead``).

A multi-module MTP drafter (``speculative_config.use_multi_module_mtp()``: method ``mtp`` with more
than one next-n predict layer and as many speculative tokens) reads, at a chunked-prefill boundary,
the next ``num_prefill_lookahead`` prompt tokens as its draft inputs -- each module one token
further ahead than the one before it (``VllmConfig.num_prefill_lookahead_tokens`` =
``num_speculative_tokens``; 1 for the other EAGLE-family drafters, 0 without EAGLE). A chunk ending
closer than that to the prefill end would make the drafter fall back to sampled drafts and pollute
the trailing modules' KV caches for good, so vLLM's scheduler never ends a chunk there: it either
finishes the prefill or leaves at least ``num_prefill_lookahead`` tokens for the next chunk. Both
the running loop and the waiting loop apply it after the Mamba split (and the encoder cut); a
chunk cut to nothing is skipped without blocking the queue (running: the next request is tried;
waiting: the request is requeued behind the others).

The KV cache manager's side of the same number -- the last ``num_prefill_lookahead - 1`` computed
tokens are re-prefilled, never published -- is :class:`~kvref.impl.reference.kv_cache_coordinator`'s
``num_reprefillable_tokens``. Both read ``PoolConfig.num_prefill_lookahead``, as vLLM's scheduler
and manager both read ``num_prefill_lookahead_tokens``, so they cannot drift apart.
"""

from __future__ import annotations

from kvref.impl.request import Request
from kvref.spec.errors import InvalidFieldError, check_int


def reserve_prefill_lookahead(num_prefill_lookahead: int, request: Request, num_computed_tokens: int,
                              num_new_tokens: int) -> int:
    """vLLM ``Scheduler._reserve_prefill_lookahead``: ``num_new_tokens`` cut so that the chunk either
    reaches the end of the request's known tokens or leaves at least ``num_prefill_lookahead`` of
    them for the next chunk (never negative). A no-op for a lookahead of 0 or 1 (no chunk can end
    within one token of the end and leave fewer than one), and for decodes with drafts (nothing
    known is left past them)."""
    if not isinstance(request, Request):
        raise InvalidFieldError("request", request, "a kvref.impl.request.Request")
    check_int("num_prefill_lookahead", num_prefill_lookahead, minimum=0)
    check_int("num_computed_tokens", num_computed_tokens, minimum=0)
    check_int("num_new_tokens", num_new_tokens)
    remaining = request.num_tokens - num_computed_tokens - num_new_tokens
    if 0 < remaining < num_prefill_lookahead:
        num_new_tokens -= num_prefill_lookahead - remaining
    return max(num_new_tokens, 0)


__all__ = ["reserve_prefill_lookahead"]
