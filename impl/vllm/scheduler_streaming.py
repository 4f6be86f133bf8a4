"""Streaming-input sessions on vLLM 0.33.0's real ``Scheduler`` (see
:mod:`kvref.impl.reference.scheduler_streaming` for the rules).

A session is a vLLM ``Request`` built with ``resumable=True``; an update is a second
``Scheduler.add_request`` with the same id (``StreamingUpdate.from_request`` takes its prompt,
``max_tokens`` and ``arrival_time``); a finishing update is a second request with
``resumable=False`` (``from_request`` gives ``None``). These helpers drive a
:class:`kvref.impl.vllm.scheduler.VllmScheduler`'s scheduler and read the session's observables.
"""

from __future__ import annotations

from typing import Any

from kvref.impl.request import Request
from kvref.spec.errors import InvalidFieldError

from .scheduler import VllmScheduler
from .vrequest import vllm_request, vllm_sampling_params


def _vrequest(vs: VllmScheduler, request_id: str, prompt: list[int], max_tokens: int, arrival_time: float,
              resumable: bool) -> Any:
    return vllm_request(request_id, list(prompt), vllm_sampling_params(max_tokens=max_tokens, ignore_eos=True),
                        arrival_time=arrival_time, resumable=resumable,
                        block_hasher=vs._hasher if vs.pool.enable_caching else None)


def add_session(vs: VllmScheduler, request: Request) -> None:
    """Add ``request`` as a new streaming session (``resumable=True``)."""
    if not isinstance(vs, VllmScheduler):
        raise InvalidFieldError("vs", vs, "a VllmScheduler")
    if not isinstance(request, Request):
        raise InvalidFieldError("request", request, "a kvref Request")
    if request.request_id in vs.scheduler.requests:
        raise InvalidFieldError("request.request_id", request.request_id, "an id not already live")
    vr = _vrequest(vs, request.request_id, request.prompt_token_ids, request.max_tokens, request.arrival_time, True)
    vs._reqs[request.request_id] = vr
    vs.scheduler.add_request(vr)


def add_update(vs: VllmScheduler, request_id: str, update) -> None:
    """A second ``add_request`` for a live session: ``update`` is a
    :class:`~kvref.impl.reference.scheduler_streaming.StreamingUpdate`, or None to finish it."""
    from kvref.impl.reference.scheduler_streaming import StreamingUpdate

    if not isinstance(vs, VllmScheduler):
        raise InvalidFieldError("vs", vs, "a VllmScheduler")
    if request_id not in vs.scheduler.requests:
        raise InvalidFieldError("request_id", request_id, "a live streaming session")
    if update is None:
        vs.scheduler.add_request(_vrequest(vs, request_id, [0], 1, 0.0, False))
        return
    if not isinstance(update, StreamingUpdate):
        raise InvalidFieldError("update", update, "a StreamingUpdate or None")
    vs.scheduler.add_request(_vrequest(vs, request_id, list(update.prompt_token_ids), update.max_tokens,
                                       update.arrival_time, True))


def session_view(vs: VllmScheduler, request_id: str) -> dict:
    """The session's observables (None fields once it is no longer live)."""
    sched = vs.scheduler
    vr = sched.requests.get(request_id)
    base = {"live": vr is not None, "num_waiting_for_streaming_input": sched.num_waiting_for_streaming_input}
    if vr is None:
        return base
    return {**base, "prompt_token_ids": tuple(vr.prompt_token_ids), "output_token_ids": tuple(vr.output_token_ids),
            "num_computed_tokens": vr.num_computed_tokens,
            "num_output_placeholders": vr.num_output_placeholders,
            "num_stale_output_tokens": vr.num_stale_output_tokens, "drop_stale_output": vr.drop_stale_output,
            "max_tokens": vr.max_tokens, "arrival_time": vr.arrival_time,
            "waiting_for_input": vr.status.name == "WAITING_FOR_STREAMING_REQ",
            "num_queued_updates": len(vr.streaming_queue or ())}
