"""vLLM's file-system tier (``tiering/fs/manager.py`` with ``fs/io.py`` and ``fs/thread_pool.py``).

One file per chunk, named from its key. A store writes each key's file unless it exists already
(file names are content hashes, so the first writer's bytes are the chunk's); a promotion reads
the job's files in order into the reserved primary slots and stops at the first file it cannot
read: the chunks before it are kept (``successful_keys``), the rest fail and their cached lookup
verdicts become "absent" (vLLM #49176: otherwise the lookup keeps answering "present" and the
scheduler re-issues a promotion that cannot succeed). Lookups go through the tier's
:class:`AsyncLookupManager`, whose worker asks "does the file exist?".

vLLM runs jobs on a thread pool; here a job stays in flight until ``finish_job`` (the trace says
when, and whether the I/O fails), and the lookup worker runs on ``run_lookup_worker``. ``lose_file``
is a file disappearing under the tier (removed by another process or by the short-read cleanup).
"""

from __future__ import annotations

from kvref.spec.errors import InvalidFieldError

from ..keys import LookupResult, OffloadKey
from .async_lookup import AsyncLookupManager
from .tier_base import MEDIUM_STORAGE, JobResult, SecondaryTier, TierEvent, TransferJob


class FileSystemTier(SecondaryTier):
    medium = MEDIUM_STORAGE

    def __init__(self, tier_type: str, primary, clock, bp_detector=None, enable_events: bool = False) -> None:
        """``clock``: monotonic seconds; a job's transfer time runs from its submission (a pool
        thread takes it at once) to ``finish_job``."""
        super().__init__(tier_type, primary, bp_detector)
        self.clock = clock
        self.files: dict[OffloadKey, bytes] = {}
        self.rename_races = 0  # stored blocks whose rename met EEXIST (another writer published them first)
        self.jobs: dict[int, TransferJob] = {}
        self.store_keys: dict[int, tuple[OffloadKey, ...]] = {}  # finished stores not yet collected
        # keys of finished, failed promotions not yet collected: their verdicts turn "absent" when
        # the manager collects the result (vLLM #49176), not when the I/O ends
        self.failed_loads: dict[int, tuple[OffloadKey, ...]] = {}
        self.finished: list[JobResult] = []
        self.events: list[TierEvent] | None = [] if enable_events else None
        self.lookups = AsyncLookupManager(self._has_file)

    def _has_file(self, key: OffloadKey) -> bool:
        return key in self.files

    # -- scheduler-side calls ----------------------------------------------------------------

    def lookup(self, key: OffloadKey, req_id: str) -> LookupResult:
        found = self.lookups.lookup(key, req_id)
        if found is None:
            return LookupResult.RETRY
        return LookupResult.HIT if found else LookupResult.MISS

    def submit_store(self, job: TransferJob) -> None:
        self.jobs[job.job_id] = job

    def submit_load(self, job: TransferJob) -> None:
        self.jobs[job.job_id] = job

    def get_finished_jobs(self) -> list[JobResult]:
        """Collected results; only now is a successful store announced (KV event) and a failed
        promotion's keys marked absent, as in vLLM."""
        out, self.finished = self.finished, []
        for res in out:
            keys = self.store_keys.pop(res.job_id, None)
            if self.events is not None and res.success and keys:
                self.events.append(TierEvent(keys, self.medium, False))
            self.lookups.mark_miss(self.failed_loads.pop(res.job_id, ()))
        return out

    def on_request_finished(self, req_id: str) -> None:
        self.lookups.cleanup(req_id)

    def on_schedule_end(self) -> None:
        self.lookups.flush()

    def take_events(self) -> list[TierEvent]:
        if self.events is None:
            return []
        out, self.events = self.events, []
        return out

    def stored_keys(self) -> set[OffloadKey]:
        return set(self.files)

    def in_flight(self) -> list[int]:
        return sorted(self.jobs)

    def known_jobs(self) -> set[int]:
        return set(self.jobs) | {r.job_id for r in self.finished}

    # -- what the trace decides ---------------------------------------------------------------

    def finish_job(self, job_id: int, io_error: bool = False, rename_race: bool = False) -> JobResult:
        """The pool finishes job ``job_id``; ``io_error`` makes its I/O fail before it starts.

        ``rename_race`` (a store only, without ``io_error``): another writer publishes each block
        of the job between the tier's "file exists?" check and its rename, and the rename fails
        with ``EEXIST`` (some shared filesystems do that instead of replacing). File names are
        content hashes, so the file in place is this block: the store still succeeds, as in
        vLLM 0.33.0's ``fs/io.py::_store_block`` (the temporary file is removed, no error)."""
        if rename_race and io_error:
            raise InvalidFieldError("rename_race", rename_race, "False when io_error is set")
        if rename_race and job_id in self.jobs and self.jobs[job_id].is_promotion:
            raise InvalidFieldError("rename_race", rename_race, "False for a promotion (load) job")
        job = self.jobs.pop(job_id, None)
        if job is None:
            raise InvalidFieldError("job_id", job_id, f"a job in flight on this tier ({sorted(self.jobs)})")
        nbytes = len(job.keys) * self.block_size_bytes if job.keys else None
        elapsed = self.clock() - job.submit_time
        if job.is_promotion:
            loaded = 0
            if not io_error:
                for key, cid in zip(job.keys, job.chunk_ids):
                    data = self.files.get(key)
                    if data is None:
                        break
                    if len(data) < self.block_size_bytes:
                        # a short read: what was read is in the slot, and the corrupt file is removed
                        self.primary.write(cid, data + self.primary.read(cid)[len(data):])
                        del self.files[key]
                        break
                    self.primary.write(cid, data)
                    loaded += 1
            if io_error or loaded < len(job.keys):
                self.failed_loads[job_id] = tuple(job.keys[loaded:])
                result = JobResult(job_id, False, tuple(job.keys[:loaded]) or None, elapsed, nbytes)
            else:
                result = JobResult(job_id, True, None, elapsed, nbytes)
        else:
            if not io_error:
                for key, cid in zip(job.keys, job.chunk_ids):
                    if rename_race and key not in self.files:
                        self.files[key] = self.primary.read(cid)  # the other writer's file: the same block
                        self.rename_races += 1
                    self.files.setdefault(key, self.primary.read(cid))
            self.store_keys[job_id] = tuple(job.keys)
            result = JobResult(job_id, not io_error, None, elapsed, nbytes)
        self.finished.append(result)
        return result

    def lose_file(self, key: OffloadKey) -> bool:
        return self.files.pop(key, None) is not None

    def truncate_file(self, key: OffloadKey, size: int) -> bool:
        """The file of ``key`` is cut to ``size`` bytes (a torn write by another process)."""
        if key not in self.files or not 0 <= size < self.block_size_bytes:
            return False
        self.files[key] = self.files[key][:size]
        return True

    def run_lookup_worker(self) -> bool:
        return self.lookups.run_worker()

    def check_invariants(self) -> None:
        super().check_invariants()
        self.lookups.check_invariants()
        assert all(len(v) <= self.block_size_bytes for v in self.files.values()), "T4: a file larger than a chunk"
        for job in self.jobs.values():
            assert len(job.keys) == len(job.chunk_ids), f"T4: job {job.job_id}: keys and chunks differ in length"
