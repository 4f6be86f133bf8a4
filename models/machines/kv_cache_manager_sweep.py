"""Every group set, every run: the KV cache manager machine once per group set (issue #22).

One Hypothesis run draws the group set of each trace like any other input, and a short run (the
default profile's 25 examples) mutates the first traces it finds: seeded runs of
``conform-kv-manager`` met five of the eleven group sets, so whole managers of vLLM (the circular
buffer's ring block, the sliding-window hit search off the alignment grid, Mamba prefix caching)
ran in one run and not in the next. The sweep runs the same machine, with the same options, on each
group set in turn for a few traces, so every manager kind is compared with vLLM on every run,
whatever the main run drew.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from kvref.models.machines.kv_cache_manager import MachineRun, run_machine
from kvref.models.strategies.pools import GROUP_SETS
from kvref.spec.errors import InvalidFieldError, check_int


@dataclass
class SweepRun:
    """What :func:`run_group_set_sweep` saw: traces per group set, and the first failing run."""

    traces: dict[str, int] = field(default_factory=dict)
    ops: int = 0
    prefix_hits: int = 0
    failure: MachineRun | None = None

    @property
    def ok(self) -> bool:
        return self.failure is None


def run_group_set_sweep(kinds: tuple[str, ...], examples_per_set: int, *, group_sets: tuple[str, ...] = GROUP_SETS,
                        seed: int | None = None, **run_kwargs) -> SweepRun:
    """:func:`run_machine` on each of ``group_sets`` alone, ``examples_per_set`` examples each;
    stops at the first failing run (its :class:`MachineRun`, with the saved trace, is ``failure``).
    ``run_kwargs`` go to :func:`run_machine` (``out_dir``, ``shrink``, machine options)."""
    check_int("examples_per_set", examples_per_set, minimum=1)
    if (not isinstance(group_sets, tuple) or not group_sets
            or not all(isinstance(g, str) and g in GROUP_SETS for g in group_sets)):
        raise InvalidFieldError("group_sets", group_sets, f"a non-empty tuple of group sets from {GROUP_SETS}")
    sweep = SweepRun()
    for group_set in group_sets:
        run = run_machine(kinds, examples_per_set, seed=seed, group_sets=(group_set,), **run_kwargs)
        sweep.traces[group_set] = len(run.stats.steps)
        sweep.ops += run.stats.ops_applied
        sweep.prefix_hits += run.stats.prefix_hits
        if not run.ok:
            sweep.failure = run
            break
    return sweep
