"""vLLM 0.33.0's scheduler pause states (``vllm.v1.core.sched.interface.PauseState``).

The engine pauses its scheduler to drain it (weight updates, RL rollouts: ``pause_generation``).
What a pause does to KV blocks is the point: no state frees, preempts or resets anything. Running
requests keep their blocks (under ``PAUSED_ALL`` they are simply not scheduled: ``schedule()``
runs with a token budget of zero), waiting requests stay queued holding none, and
``PAUSED_NEW`` still lets running requests grow (allocating, and preempting on a dry pool) while
only requests that already hold KV blocks (a KV connector's ``kv_holding_waiting``) may be
admitted. ``get_num_unfinished_requests`` counts only what the state lets run, so an engine loop
that waits for "no unfinished requests" returns while requests are parked.
"""

from __future__ import annotations

import enum

from kvref.spec.errors import InvalidFieldError


class PauseState(enum.IntEnum):
    """vLLM's values: UNPAUSED schedules normally, PAUSED_NEW admits no new request, PAUSED_ALL
    schedules nothing."""

    UNPAUSED = 0
    PAUSED_NEW = 1
    PAUSED_ALL = 2


def as_pause_state(value) -> PauseState:
    """A ``PauseState`` (or its int value) checked, for ``Scheduler.set_pause_state``."""
    if type(value) is bool or not isinstance(value, int) or value not in tuple(PauseState):
        raise InvalidFieldError("pause_state", value, "a PauseState: 0 UNPAUSED, 1 PAUSED_NEW, 2 PAUSED_ALL")
    return PauseState(value)
