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


class PolledTier(ExampleTier):
    """The example tier as a tier that serves a peer and opts into the tier-poll thread
    (kvref's out-of-tree ``PolledTier`` on the vLLM side, ``kvref.impl.vllm.tiering_tiers``).

    A peer asks for keys (:meth:`peer_request`); the next serving round (a tier-poll round or the
    end of the step) opens a request ``peer:<n>`` through the parent, told to skip this tier,
    looks each key up, pins each HIT in the primary tier at once with ``create_store_job`` and
    finishes the request. The peer reads the pinned chunks at once: the job is reported finished at
    the next poll, which releases the pins. (vLLM's KVCR tier serves its peers' pins this way, but
    looks every key up before pinning the HITs together: a later key's promotion can evict an
    earlier HIT, and ``prepare_read`` then fails part-way, the keys before it left pinned.)
    """

    tolerates_off_thread_polling = True

    def __init__(self, tier_type: str, primary, bp_detector=None) -> None:
        super().__init__(tier_type, primary, bp_detector)
        self.peer_requests: list[tuple[OffloadKey, ...]] = []
        self.served = 0

    def peer_request(self, keys) -> None:
        self.peer_requests.append(tuple(keys))

    def serve_external_requests(self, parent, tier_idx: int) -> None:
        from ..keys import RequestContext

        pending, self.peer_requests = self.peer_requests, []
        for keys in pending:
            ctx = RequestContext(f"peer:{self.served}")
            self.served += 1
            parent.on_new_request(ctx, exclude_tier_idx=tier_idx)
            for key in keys:  # pinned at once: the promotion a later key starts may evict an unpinned HIT
                if parent.lookup(key, ctx, exclude_tier_idx=tier_idx) is LookupResult.HIT:
                    job = parent.create_store_job([key], ctx, tier_idx)
                    self.completed.append(JobResult(job.job_id, True))
            parent.on_request_finished(ctx, exclude_tier_idx=tier_idx)
