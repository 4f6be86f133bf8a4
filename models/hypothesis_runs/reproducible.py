"""Derandomized Hypothesis runs that give the same inputs in every process.

``settings(derandomize=True)`` fixes Hypothesis's random seed, but since 6.1xx Hypothesis also
mixes into its generation the constants it finds in the source of every *local* module loaded so
far (``hypothesis.internal.conjecture.providers._get_local_constants``). Which kvref modules a
process has imported before a run then changes the inputs from a few dozen draws on: the mutant
campaign's ``scheduler-vllm`` check killed a mutant in a fresh process and missed it inside the
full test suite. :func:`same_inputs_in_every_process` switches that source off for the duration
of a run (an empty constant pool), so a derandomized run depends on its seed alone.
:func:`seeded` adds the seed itself: the runners of the machines take ``seed`` and force it on
Hypothesis for their run (#26: five runners kept a copy of that block).

It patches a Hypothesis internal; where the internal is missing (another Hypothesis version) it
does nothing, and the run is as reproducible as that version makes it.
"""

from __future__ import annotations

from contextlib import contextmanager, nullcontext
from typing import Iterator

__all__ = ["same_inputs_in_every_process", "seeded"]


@contextmanager
def same_inputs_in_every_process() -> Iterator[bool]:
    """Within the block, Hypothesis draws no constants from loaded modules. Yields whether the
    patch applied."""
    try:
        from hypothesis.internal.conjecture import providers
        from hypothesis.internal.conjecture.providers import Constants

        original = providers._get_local_constants
        cache = providers.CONSTANTS_CACHE
    except (ImportError, AttributeError):  # pragma: no cover - another Hypothesis version
        yield False
        return
    empty = Constants()
    providers._get_local_constants = lambda: empty
    cache.cache.clear()  # values chosen with the old pool must not be reused
    try:
        yield True
    finally:
        providers._get_local_constants = original
        cache.cache.clear()


@contextmanager
def seeded(seed: int | None, same_inputs: bool = False) -> Iterator[None]:
    """Within the block Hypothesis' global seed is ``seed`` (what ``--hypothesis-seed`` sets:
    ``@given`` tests and ``run_state_machine_as_test`` take no seed of their own; None keeps the
    current one), restored after; with a seed, or ``same_inputs`` (a derandomized run), the block
    also runs under :func:`same_inputs_in_every_process`, so the seed alone fixes the inputs in
    any process (a Ray worker, the full test suite)."""
    import hypothesis.core as hcore

    saved = hcore.global_force_seed
    if seed is not None:
        hcore.global_force_seed = seed
    try:
        with same_inputs_in_every_process() if same_inputs or seed is not None else nullcontext():
            yield
    finally:
        hcore.global_force_seed = saved
