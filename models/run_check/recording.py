"""What every generated recording run needs (the pause runs and the feature runs): vLLM's scheduler
built through kvref's recording class with ``KVREF_RECORD`` pointing at a fresh trace file, and a
teardown that closes every recorded target (the engine core's shutdown writes the end record)."""

from __future__ import annotations

import os
from pathlib import Path

from .connector_runs import RecordedRun


def scheduler_recorder(env_holder: dict, directory: Path, runs: list[RecordedRun], prefix: str, **engine):
    """``(pool, config) -> target``: vLLM's scheduler through the recording class, writing
    ``{prefix}-run-N.kvtrace.gz`` under ``directory``; ``engine`` (the encoder budget, max_loras, the
    V2 runner) set as the model's engine sets them. Each built target appends its run to ``runs``."""
    from kvref.impl.vllm.record import recorded_vllm_scheduler
    from kvref.impl.vllm.scheduler import VllmEnv

    def build(pool, config):
        if env_holder.get("env") is None:
            env_holder["env"] = VllmEnv()
        path = directory / f"{prefix}-run-{len(runs)}.kvtrace.gz"
        saved = os.environ.get("KVREF_RECORD")
        os.environ["KVREF_RECORD"] = str(path)
        try:
            target = recorded_vllm_scheduler(pool, config, env_holder["env"], **engine)
        finally:
            if saved is None:
                os.environ.pop("KVREF_RECORD", None)
            else:
                os.environ["KVREF_RECORD"] = saved
        runs.append(RecordedRun(path))
        return target

    return build


def closing_targets(machine: type) -> type:
    """``machine`` whose teardown also closes every recorded target, even when its own fails."""
    base_teardown = machine.teardown

    def teardown(self):
        try:
            base_teardown(self)
        finally:
            driver = getattr(self, "driver", None)
            if driver is not None:
                for t in driver.targets.values():
                    t.close()

    machine.teardown = teardown
    return machine
