"""Record a real vLLM run on a laptop: vLLM's own scheduler, a fake model, a realistic workload.

:func:`record_demo` is what ``kvref demo record OUT.kvtrace.gz`` runs: it plans the workload's pool
(:mod:`kvref.models.run_check.demo`), builds vLLM's ``Scheduler`` / ``AsyncScheduler`` through
``scheduler_cls`` from the recording class's qualified name (``kvref.record.RecordingAsyncScheduler``
or ``kvref.record.RecordingScheduler``), exactly as a server's engine core does, with
``log_stats`` on as a server has it, and serves the workload with a seeded fake model. With
``fault`` one behaviour class is planted into vLLM's KV-cache code for the run
(:mod:`kvref.impl.vllm.demo_faults`). When vLLM raises, the run ends as an engine's does: the
exception is recorded, ``shutdown()`` closes the trace, and the result says so (``kvref check-run``
then reports the crash with its step).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from kvref.models.run_check.demo import DemoEngine, plan_pool, workload as get_workload
from kvref.spec.errors import InvalidFieldError

DEFAULT_TICKS = 200


@dataclass
class DemoRun:
    """What one recorded demo run did."""

    path: str
    workload: str
    fault: str | None
    async_scheduling: bool
    scheduler_cls: str
    num_blocks: int
    schedules: int
    requests: int
    #: ``"ValueError: Cannot get 3 free blocks from the pool"`` when vLLM raised (the run ended there)
    crashed: str | None = None

    def to_json(self) -> dict:
        return dict(self.__dict__)


def _check(seed: int, ticks: int, async_scheduling: bool) -> None:
    if type(seed) is not int or not 0 <= seed < 2**32:
        raise InvalidFieldError("--seed", seed, "an int in [0, 2**32)")
    if type(ticks) is not int or not 1 <= ticks <= 100_000:
        raise InvalidFieldError("--ticks", ticks, "an int in [1, 100000]")
    if type(async_scheduling) is not bool:
        raise InvalidFieldError("async_scheduling", async_scheduling, "True or False")


def record_demo(path: str | os.PathLike, workload: str = "prefix-sharing", fault: str | None = None,
                async_scheduling: bool = True, seed: int = 0, ticks: int = DEFAULT_TICKS, env=None) -> DemoRun:
    """Serve ``workload`` on vLLM's own scheduler with the recorder on; the trace goes to ``path``.

    Args:
        path: the trace (``*.gz``: gzip).
        workload: a name from :data:`kvref.models.run_check.demo.WORKLOADS`.
        fault: a name from :data:`kvref.impl.vllm.demo_faults.FAULTS` or
            :data:`kvref.impl.vllm.record_faults.FEATURE_FAULTS` (a fault in the multimodal, LoRA,
            lookahead-hash or Mamba-checkpoint path, #28), or None.
        async_scheduling: ``RecordingAsyncScheduler`` (vLLM's default) or ``RecordingScheduler``.
        seed: draws the workload's arrivals and the fake model's tokens.
        ticks: engine iterations with arrivals (the run then drains).
        env: a :class:`kvref.impl.vllm.scheduler.VllmEnv` to reuse (one per process is enough).

    Raises:
        InvalidFieldError: an unknown workload or fault, a bad seed or tick count, an unwritable path.
    """
    w = get_workload(workload)
    _check(seed, ticks, async_scheduling)
    from kvref.impl.run_trace.writer import _fspath, compression_for
    from kvref.impl.vllm.demo_faults import FAULTS, plant
    from kvref.impl.vllm.record_faults import FEATURE_FAULTS, plant_feature_fault

    path = _fspath(path)
    compression_for(path)
    if fault is not None and fault not in FAULTS and fault not in FEATURE_FAULTS:
        raise InvalidFieldError("--fault", fault, "one of " + ", ".join((*FAULTS, *FEATURE_FAULTS)))
    from kvref.impl.vllm.record import ENV_ANONYMIZE, ENV_PATH, recorded_vllm_scheduler
    from kvref.impl.vllm.scheduler import VllmEnv

    pool, cfg = plan_pool(w, async_scheduling)
    env = env or VllmEnv()
    cls = "kvref.record.RecordingAsyncScheduler" if async_scheduling else "kvref.record.RecordingScheduler"
    saved = {k: os.environ.get(k) for k in (ENV_PATH, ENV_ANONYMIZE)}
    os.environ[ENV_PATH] = path
    os.environ.pop(ENV_ANONYMIZE, None)
    crashed = None
    # planted before the scheduler is built: vLLM's objects then bind the faulty methods, as they
    # would in a vLLM with the bug compiled in
    with plant_feature_fault(fault) if fault in FEATURE_FAULTS else plant(fault):
        try:
            target = recorded_vllm_scheduler(pool, cfg, env, scheduler_cls=cls, log_stats=True,
                                             encoder_budget=w.encoder_budget, max_loras=w.max_loras)
        finally:
            for k, v in saved.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v
        engine = DemoEngine(target, pool, cfg, seed=seed)
        try:
            engine.serve(w, ticks)
        except Exception as exc:  # noqa: BLE001 - vLLM raised: the engine dies, the trace says why
            crashed = f"{type(exc).__name__}: {exc}"
        finally:
            target.close()  # the engine core's shutdown(): writes the end record
    return DemoRun(path=path, workload=w.name, fault=fault, async_scheduling=async_scheduling, scheduler_cls=cls,
                   num_blocks=pool.num_blocks, schedules=engine.num_schedules, requests=engine.num_added,
                   crashed=crashed)


__all__ = ["DEFAULT_TICKS", "DemoRun", "record_demo"]
