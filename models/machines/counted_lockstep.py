"""One lock-step run that counts its traces, for every scheduler-level machine's runner.

``kvref verify`` reports how many generated traces (and operations) a scheduler-level check ran
and what its coverage counters reached. Each runner used to restate the same steps: a driver
subclass that records itself, clearing the coverage counters, the run, and the tally of the
drivers long enough to count (#26: the duplicates tool's D3). This module owns those steps; the
run itself (``run_lockstep_machine``: seed, derandomizing, failure and signature) and the
counters are the caller's, passed in, so the module imports no machine and no machine module
imports it back (tests/test_import_cycles.py).
"""

from __future__ import annotations

from collections import Counter
from typing import Any, Callable


def run_counted(machine_for: Callable[[type], type], driver_base: type,
                run: Callable[[type], tuple[bool, str, str | None]], *coverages: Counter,
                min_ops: int = 30) -> dict[str, Any]:
    """Build the machine around a counting subclass of ``driver_base``, clear ``coverages``, run it
    and return the keyword arguments of the caller's run record (``SchedulerRun``): ``ok``,
    ``failure``, ``signature``, ``traces`` and ``ops`` over the drivers with at least ``min_ops``
    steps (shorter ones are Hypothesis' shrinking and setup probes), and ``coverage``, the
    counters merged in the order given."""
    drivers: list[Any] = []

    class Counting(driver_base):  # type: ignore[misc, valid-type]
        def __init__(self, *a: Any, **k: Any) -> None:
            super().__init__(*a, **k)
            drivers.append(self)

    machine = machine_for(Counting)
    for counter in coverages:
        counter.clear()
    ok, failure, sig = run(machine)
    valid = [d for d in drivers if d.num_steps >= min_ops]
    coverage: dict[str, int] = {}
    for counter in coverages:
        coverage.update(counter)
    return dict(ok=ok, traces=len(valid), ops=sum(d.num_steps for d in valid), coverage=coverage,
                failure=failure, signature=sig)
