"""check-run replays vLLM's prefill cadence, adaptive long-prefill threshold and
``max_num_active_seqs`` (issue #28): the recorder used to name all three "unmodelled", so a run with
any of them fell back to the properties from line 1. Now the header's scheduler section carries
them, the reference scheduler (``impl/reference/scheduler_cadence.py``) follows every step, and a
cadence that vLLM misapplies is a divergence at its step."""

from __future__ import annotations

import contextlib

import pytest
from kvref.models.run_check import check_trace

from tests.record.traces import read_lines
from tests.vllm_env import require_vllm

pytestmark = pytest.mark.vllm


@pytest.fixture(scope="module")
def env():
    require_vllm()
    from kvref.impl.vllm.scheduler import VllmEnv

    return VllmEnv()


def _record(env, tmp_path, async_scheduling: bool, seed: int = 0, ticks: int = 120):
    from kvref.demo import record_demo

    path = tmp_path / f"cadence-{async_scheduling}-{seed}.kvtrace.gz"
    return record_demo(path, "cadence", None, async_scheduling, seed=seed, ticks=ticks, env=env)


@contextlib.contextmanager
def _cadence_never_stamped():
    """A planted vLLM bug of the class vLLM's own comment warns about ("a misapplied cadence is hard
    to diagnose"): the step that carried prefill is never stamped, so prefill is never held."""
    from vllm.v1.core.sched.scheduler import Scheduler

    orig = Scheduler.schedule

    def schedule(self, *args, **kwargs):
        out = orig(self, *args, **kwargs)
        self.last_prefill_step = -self.local_prefill_interval
        return out

    Scheduler.schedule = schedule
    try:
        yield
    finally:
        Scheduler.schedule = orig


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_a_cadence_run_is_replayed_step_by_step(env, tmp_path, async_scheduling):
    run = _record(env, tmp_path, async_scheduling)
    assert run.crashed is None
    header = read_lines(run.path)[0]
    s = header["scheduler"]
    assert header["unmodelled"] == []
    assert (s["prefill_schedule_interval"], s["long_prefill_token_threshold_adaptive"],
            s["max_num_active_seqs"], s["max_num_seqs"]) == (3, True, 4, 8)
    r = check_trace(run.path, check_invariants_every=1)
    assert r.ok and r.followed and r.verdict == "agrees", (r.findings, r.divergence and r.divergence.table())
    assert r.steps_compared == r.summary["steps"] > 100


def test_the_replay_uses_the_recorded_settings(env, tmp_path):
    """The same trace with its header saying "no cadence, every slot active" diverges: the replay
    really follows the recorded settings, it does not merely agree with anything."""
    import gzip
    import json

    run = _record(env, tmp_path, False)
    lines = read_lines(run.path)
    lines[0]["scheduler"].update(prefill_schedule_interval=1, max_num_active_seqs=8,
                                 long_prefill_token_threshold_adaptive=False)
    edited = tmp_path / "edited.kvtrace.gz"
    with gzip.open(edited, "wt") as f:
        f.writelines(json.dumps(rec) + "\n" for rec in lines)
    r = check_trace(str(edited))
    assert not r.ok and r.divergence is not None and r.divergence.call == "schedule"


def test_a_cadence_that_never_holds_prefill_is_caught_at_its_step(env, tmp_path):
    with _cadence_never_stamped():
        run = _record(env, tmp_path, False)
    assert run.crashed is None
    r = check_trace(run.path)
    assert not r.ok and r.divergence is not None and r.divergence.call == "schedule", r.findings
    assert r.divergence.step > 0
