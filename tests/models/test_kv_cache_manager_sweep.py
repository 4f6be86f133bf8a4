"""The group-set sweep of conform-kv-manager (#22): every group set gets its own traces, whatever
a short main run draws; a failing set stops the sweep with its run; bad arguments are named."""

from __future__ import annotations

import pytest

from kvref.models.machines import kv_cache_manager_sweep as sweep_mod
from kvref.models.machines.kv_cache_manager_sweep import SPARSE_GROUP_SETS, run_group_set_sweep, sweep_every_group_set
from kvref.models.strategies.pools import GROUP_SETS
from kvref.spec.errors import InvalidFieldError


def test_every_group_set_gets_traces(tmp_path):
    """All passes: every group set with drawn options, then the windowed/Mamba sets with EAGLE and
    sparse retention on every pool, then the fine-grained Mamba set with the shared-prefix
    checkpoint asked for on every pool."""
    sweep = sweep_every_group_set(("reference",), 2, seed=0, out_dir=str(tmp_path), shrink=False)
    assert sweep.ok
    want = set(GROUP_SETS) | {f"{g} (EAGLE, sparse)" for g in SPARSE_GROUP_SETS} \
        | {"fa+mamba_fine (shared-prefix checkpoint)", "fa+mamba_fine (junction programs)"}
    assert set(sweep.traces) == want and all(n >= 1 for n in sweep.traces.values()), sweep.traces
    assert sweep.ops >= 30 * len(want) and sweep.prefix_hits > 0


def test_a_failing_group_set_stops_the_sweep(monkeypatch, tmp_path):
    real = sweep_mod.run_machine

    def failing_on_swa(kinds, examples, group_sets, **kw):
        run = real(kinds, examples, group_sets=group_sets, **kw)
        if group_sets == ("fa+swa",):
            run.failure = "planted"
        return run

    monkeypatch.setattr(sweep_mod, "run_machine", failing_on_swa)
    sweep = run_group_set_sweep(("reference",), 1, group_sets=("fa", "fa+swa", "swa"), seed=0,
                                out_dir=str(tmp_path), shrink=False)
    assert not sweep.ok and sweep.failure.failure == "planted"
    assert list(sweep.traces) == ["fa", "fa+swa"]


@pytest.mark.parametrize("kwargs, field", [
    (dict(examples_per_set=0), "examples_per_set"),
    (dict(examples_per_set=True), "examples_per_set"),
    (dict(examples_per_set=1, group_sets=("fa", "mla")), "group_sets"),
    (dict(examples_per_set=1, group_sets=()), "group_sets"),
])
def test_bad_arguments_are_named(kwargs, field):
    with pytest.raises(InvalidFieldError, match=field):
        run_group_set_sweep(("reference",), **kwargs)
