"""check-run replays SWA bounded replay beside a KV connector (issue #28, session 20).

vLLM 0.33.0 asks the connector which groups its load restores (``get_loaded_kv_cache_group_ids``,
through ``_load_restores_replay_window``): a load that carries every replay group is taken whole,
any other is cut to whole blocks, dropped with a short hit, or rewound by the window (at a sync
admission, or once an async load landed). The recorder named such runs unmodelled; now the
connector log holds each answer (``["w", id, group ids]``) and the reference decides from it, so
generated runs of the bounded-replay connector machine (loads with and without the window, sync and
async) agree step by step, and a vLLM that decides the other way from the same answer is flagged.
"""

from __future__ import annotations

import pytest
from kvref.models.run_check import check_trace
from kvref.models.run_check.connector_runs import record_connector_runs

from kvref.spec.errors import InvalidFieldError
from tests.record.traces import assert_agrees_and_holds, read_lines
from tests.vllm_env import require_vllm

pytestmark = pytest.mark.vllm

SEED, EXAMPLES = 1, 10


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Pristine runs, and the same draws on a vLLM whose ``_load_restores_replay_window`` reads the
    connector's answer the wrong way round (a load without the window taken whole, one with it cut)."""
    require_vllm()
    from vllm.v1.core.sched.scheduler import Scheduler

    d = tmp_path_factory.mktemp("replay-connector")
    pristine = record_connector_runs(d / "pristine", EXAMPLES, seed=SEED, replay=True)
    real = Scheduler._load_restores_replay_window
    Scheduler._load_restores_replay_window = lambda self, request: not real(self, request)
    try:
        faulty = record_connector_runs(d / "faulty", EXAMPLES, seed=SEED, replay=True, strict=False)
    finally:
        Scheduler._load_restores_replay_window = real
    return pristine, faulty


def _shows(path) -> tuple[int, int]:
    """(connector answers on the window, admissions rewound by it) in a trace."""
    lines = read_lines(path)[1:]
    return (sum(1 for rec in lines for e in rec.get("kv") or () if e[0] == "w"),
            sum(len(rec.get("replay") or {}) for rec in lines if rec["t"] == "sched"))


def test_replay_connector_runs_are_replayed_step_by_step(runs):
    pristine, _ = runs
    followed = asked = rewound = 0
    for run in pristine:
        header = read_lines(run.path)[0]
        assert header["unmodelled"] == [] and header["connector"] is not None, header["unmodelled"]
        r = check_trace(run.path, check_invariants_every=1)
        if r.empty or run.known_hang or run.lost_update:
            continue
        assert_agrees_and_holds(run.path, r)
        followed += 1
        w, rep = _shows(run.path)
        asked += w
        rewound += rep
    assert followed >= 6 and asked >= 20 and rewound >= 5, (followed, asked, rewound)


def test_a_window_decided_the_other_way_is_flagged(runs):
    _, faulty = runs
    diverged = [run for run in faulty if not run.known_hang and not run.lost_update
                and check_trace(run.path).divergence is not None]
    assert len(diverged) >= 3, [r.path for r in faulty]


def test_replay_recording_draws_its_own_setups(tmp_path):
    with pytest.raises(InvalidFieldError, match="replay"):
        record_connector_runs(tmp_path, 1, replay=True, lifecycle=True)
