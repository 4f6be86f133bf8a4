"""vLLM's in-memory example tier (``tiering/example/manager.py``): a set of keys, jobs done at once.

It copies no bytes: a store only records the key, a promotion completes without writing the
primary slot (the slot keeps what it held). vLLM ships it as a template and for tests; kvref
models it as it is (docs/differences.md does not list it: nothing differs).
"""

from __future__ import annotations

from ..keys import LookupResult, OffloadKey
from .tier_base import MEDIUM_CPU, JobResult, SecondaryTier, TransferJob


class ExampleTier(SecondaryTier):
    medium = MEDIUM_CPU

    def __init__(self, tier_type: str, primary, bp_detector=None, level: str = "chunk") -> None:
        """``level="request"``: the tier asks for request-level offloading (kvref's out-of-tree
        ``RequestLevelTier`` on the vLLM side, ``kvref.impl.vllm.tiering_tiers``)."""
        super().__init__(tier_type, primary, bp_detector)
        self.level = level
        self.chunks: dict[OffloadKey, bool] = {}
        self.completed: list[JobResult] = []

    def on_new_request(self, req_id: str) -> str:
        return self.level

    def lookup(self, key: OffloadKey, req_id: str) -> LookupResult:
        return LookupResult.HIT if key in self.chunks else LookupResult.MISS

    def submit_store(self, job: TransferJob) -> None:
        for key in job.keys:
            self.chunks[key] = True
        self.completed.append(JobResult(job.job_id, True, transfer_time=0.0))

    def submit_load(self, job: TransferJob) -> None:
        if any(key not in self.chunks for key in job.keys):
            self.completed.append(JobResult(job.job_id, False))
            return
        self.completed.append(JobResult(job.job_id, True, transfer_time=0.0))

    def get_finished_jobs(self) -> list[JobResult]:
        out, self.completed = self.completed, []
        return out

    def known_jobs(self) -> set[int]:
        return {r.job_id for r in self.completed}

    def stored_keys(self) -> set[OffloadKey]:
        return set(self.chunks)
