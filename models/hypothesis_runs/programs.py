"""The search loop of the op-sequence programs (vLLM's free block queue, its prefix-cache index):
``examples`` generated programs under a seed, each run beside the reference until the first
difference the baseline does not accept. One loop for every program family, so a family only
says how to draw a program and how to run one."""

from __future__ import annotations

from typing import Callable

from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import seed as hypothesis_seed
from hypothesis import strategies as st

from kvref.models.hypothesis_runs.reproducible import same_inputs_in_every_process


def first_unaccepted_difference(programs: st.SearchStrategy, run_one: Callable[[object], "str | None"],
                                examples: int, seed: int) -> "str | None":
    """The first difference ``run_one`` reports on a program drawn from ``programs`` that the
    baseline (kvref verify --baseline / --update-baseline) does not accept, or None. A difference
    the baseline accepts discards its program and the search goes on, as in the machines."""
    from kvref.models.conformance.accepted import is_accepted, signature

    found: list[str] = []

    @hypothesis_seed(seed)
    @settings(max_examples=examples, database=None, deadline=None, derandomize=False,
              suppress_health_check=list(HealthCheck), phases=(Phase.generate,))
    @given(program=programs)
    def body(program) -> None:
        if found:
            return
        failure = run_one(program)
        if failure and not is_accepted(signature(failure)):
            found.append(failure)

    with same_inputs_in_every_process():
        body()
    return found[0] if found else None
