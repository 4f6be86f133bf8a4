"""A monotonic clock that moves only when told (the tiering model's ``time.monotonic``).

vLLM's tiering code reads ``time.monotonic()`` for store latencies (backpressure), cool-downs and
metrics. Driving the reference and vLLM with one virtual clock makes those decisions part of the
generated trace instead of the machine's load.
"""

from __future__ import annotations

from kvref.spec.errors import InvalidFieldError


class VirtualClock:
    """``monotonic()`` returns ``now``; ``advance(dt)`` moves it forward (``dt >= 0``)."""

    def __init__(self, start: float = 1000.0) -> None:
        if isinstance(start, bool) or not isinstance(start, (int, float)) or start < 0:
            raise InvalidFieldError("start", start, "a non-negative number of seconds")
        self.now = float(start)

    def monotonic(self) -> float:
        return self.now

    def advance(self, dt: float) -> None:
        if isinstance(dt, bool) or not isinstance(dt, (int, float)) or not dt >= 0:
            raise InvalidFieldError("dt", dt, "a non-negative number of seconds")
        self.now += float(dt)
