"""When a sampled token finishes a request: vLLM 0.33.0's ``check_stop`` (v1/core/sched/utils.py).

``update_from_output`` appends a step's sampled tokens one by one and asks, after each, whether
the request is done; a finished request frees its KV blocks in the same update, so every rule
here decides when blocks go back to the pool. The rules, in vLLM's order (the order matters:
vLLM PRs #47489, #49521 and #51299 moved ``min_tokens`` after the length caps):

1. the token is the request's ``eos_token_id`` -> ``"stop"``;
2. the token is one of its ``stop_token_ids`` -> ``"stop"``;
3. the request reached ``max_model_len`` tokens or ``max_tokens`` outputs -> ``"length"``;
4. fewer than ``min_tokens`` outputs -> not finished (only the repetition rule is held back:
   the logits processors, not ``check_stop``, keep stop tokens from being sampled early);
5. the output ends in ``min_count`` repetitions of one n-gram, for some n between
   ``min_pattern_size`` (0 meaning 1) and ``max_pattern_size`` -> ``"repetition"`` (vLLM's
   ``FINISHED_REPETITION``, ``stop_reason="repetition_detected"``).
"""

from __future__ import annotations

from typing import Sequence

from kvref.impl.request import RepetitionDetectionParams, Request
from kvref.spec.errors import InvalidFieldError, check_int


def ends_in_repetition(token_ids: Sequence[int], params: RepetitionDetectionParams) -> bool:
    """True when ``token_ids`` ends in ``params.min_count`` copies of one n-gram, ``n`` between the
    pattern sizes. Detection is off with ``max_pattern_size`` 0 (or ``min_count`` below 2); an
    n-gram whose copies need more tokens than there are is not a repetition."""
    if not isinstance(params, RepetitionDetectionParams):
        raise InvalidFieldError("params", params, "a RepetitionDetectionParams")
    if not isinstance(token_ids, (list, tuple)):
        raise InvalidFieldError("token_ids", token_ids, "a list of token ids")
    count = params.min_count
    smallest = max(1, params.min_pattern_size)
    if params.max_pattern_size <= 0 or count < 2:
        return False
    total = len(token_ids)
    for n in range(smallest, params.max_pattern_size + 1):
        if n * count > total:
            return False  # longer n-grams need even more tokens
        tail = list(token_ids[total - n:])
        if all(list(token_ids[total - (k + 1) * n:total - k * n]) == tail for k in range(1, count)):
            return True
    return False


def stop_reason(request: Request, max_model_len: int) -> str | None:
    """The reason the request's last output token finishes it (``"stop"``, ``"length"``,
    ``"repetition"``), or None: vLLM ``check_stop`` without the status change."""
    if not isinstance(request, Request):
        raise InvalidFieldError("request", request, "a kvref Request")
    check_int("max_model_len", max_model_len, minimum=1)
    if not request.output_token_ids:
        raise InvalidFieldError("request.output_token_ids", request.output_token_ids,
                                "at least one sampled token (check_stop looks at the last one)")
    last = request.output_token_ids[-1]
    if request.eos_token_id is not None and last == request.eos_token_id:
        return "stop"
    if last in request.stop_token_ids:
        return "stop"
    if request.num_tokens >= max_model_len or request.num_output_tokens >= request.max_tokens:
        return "length"
    if request.num_output_tokens < request.min_tokens:
        return None
    if request.repetition_detection is not None and ends_in_repetition(request.output_token_ids,
                                                                       request.repetition_detection):
        return "repetition"
    return None
