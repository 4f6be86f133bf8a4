"""vLLM's object-store tier (``tiering/obj/manager.py``): S3 objects through NIXL's OBJ plugin.

Like the fs tier it answers lookups through an :class:`AsyncLookupManager` (one existence query per
batch), announces successful stores, and marks a failed promotion's keys absent (vLLM #49176).
What differs: a store writes every object of the job (a PUT replaces; there is no "already there"
check), and a promotion is one transfer that succeeds or fails as a whole: a missing object fails
it, nothing is kept (no ``successful_keys``); finished transfers are reported in the order they
were submitted. Results carry no byte count (the manager counts
``len(keys) * chunk`` for back-pressure) and the transfer time the agent's telemetry gives (none
with kvref's in-memory store: 0.0).
"""

from __future__ import annotations

from kvref.spec.errors import InvalidFieldError

from ..keys import OffloadKey
from .fs_tier import FileSystemTier
from .tier_base import JobResult


class ObjectStoreTier(FileSystemTier):
    """The bucket is ``files`` (key -> object bytes)."""

    def finish_job(self, job_id: int, io_error: bool = False) -> JobResult:
        job = self.jobs.pop(job_id, None)
        if job is None:
            raise InvalidFieldError("job_id", job_id, f"a transfer in flight on this tier ({sorted(self.jobs)})")
        ok = not io_error and (not job.is_promotion or all(k in self.files for k in job.keys))
        if ok:
            for key, cid in zip(job.keys, job.chunk_ids):
                if job.is_promotion:
                    self.primary.write(cid, self.files[key])
                else:
                    self.files[key] = self.primary.read(cid)
        if job.is_promotion and not ok:
            self.failed_loads[job_id] = tuple(job.keys)
        if not job.is_promotion:
            self.store_keys[job_id] = tuple(job.keys)
        result = JobResult(job_id, ok, None, 0.0 if ok else None, None)
        self.finished.append(result)
        return result

    def get_finished_jobs(self) -> list[JobResult]:
        """Finished transfers in submission order (vLLM polls its transfers in the order it
        started them), not in the order they ended."""
        self.finished.sort(key=lambda r: r.job_id)
        return super().get_finished_jobs()

    def truncate_file(self, key: OffloadKey, size: int) -> bool:
        return False  # an object is replaced whole
