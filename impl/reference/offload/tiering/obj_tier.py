"""vLLM's object-store tier (``tiering/obj/manager.py``): S3 objects through NIXL's OBJ plugin.

Like the fs tier it answers lookups through an :class:`AsyncLookupManager` (one existence query per
batch), announces successful stores, and marks a failed promotion's keys absent (vLLM #49176).
What differs: a store writes every object of the job (a PUT replaces; there is no "already there"
check), and a promotion is one transfer that succeeds or fails as a whole: a missing object fails
it, nothing is kept (no ``successful_keys``). Results carry no byte count (the manager counts
``len(keys) * chunk`` for back-pressure) and the transfer time the agent's telemetry gives (none
with kvref's in-memory store: 0.0).

How results reach the manager follows vLLM's bookkeeping: a transfer NIXL refused at submission
(``register_memory`` gives nothing, ``prep_xfer_dlist`` or ``make_prepped_xfer`` no handle,
``transfer`` "ERR") is a failed result at once, queued *before* what the next poll finds; a poll
walks the transfers in submission order and reports each that ended (the order they ended in does
not matter). A NIXL call can fail (:meth:`ObjectStoreTier.arm`): ``check_xfer_state`` raising fails
the transfer it was asked about, even one that already moved its bytes or is still running (its
handle is released: nothing more moves); ``release_xfer_handle`` raising keeps the transfer and its
result back until a later poll releases it (the transfer may still touch primary memory, so
publishing it would let the slot be reused); ``release_dlist_handle`` / ``deregister_memory``
raising after that leak NIXL metadata but do not hold the result back. ``drain_jobs`` (before a
reset) polls until no transfer is left; its results wait for the next ``get_finished_jobs``.
"""

from __future__ import annotations

from kvref.spec.errors import InvalidFieldError

from ..keys import OffloadKey
from .fs_tier import FileSystemTier
from .tier_base import JobResult, TransferJob

#: NIXL calls of a submission that can refuse it (in the order vLLM makes them)
SUBMIT_FAULTS = ("register", "prep", "make", "transfer")
#: NIXL calls of a poll that can raise: the state query, then the handle release
POLL_FAULTS = ("check", "release_xfer")
#: NIXL metadata releases after a transfer's handle is gone (a failure leaks, nothing else)
CLEANUP_FAULTS = ("release_dlist", "deregister")
FAULTS = SUBMIT_FAULTS + POLL_FAULTS + CLEANUP_FAULTS


class ObjectStoreTier(FileSystemTier):
    """The bucket is ``files`` (key -> object bytes); ``jobs`` are the transfers NIXL still runs."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        # vLLM's _transfers: job -> [job, None while NIXL runs it, else whether it moved its bytes]
        self.transfers: dict[int, list] = {}
        self.pending: list[JobResult] = []  # vLLM's _pending_results: refused submissions, drained polls
        self.armed: str | None = None  # the NIXL call that fails next (one at a time)
        self.fired: dict[str, int] = {f: 0 for f in FAULTS}

    def arm(self, stage: str) -> None:
        """The next NIXL call of kind ``stage`` (one of :data:`FAULTS`) fails."""
        if stage not in FAULTS:
            raise InvalidFieldError("stage", stage, f"one of {FAULTS}")
        if self.armed is not None:
            raise InvalidFieldError("stage", stage, f"no other armed fault ({self.armed!r} is)")
        self.armed = stage

    def _take(self, *stages: str) -> bool:
        if self.armed in stages:
            self.fired[self.armed] += 1
            self.armed = None
            return True
        return False

    def _submit(self, job: TransferJob) -> None:
        if not job.is_promotion:
            self.store_keys[job.job_id] = tuple(job.keys)  # announced only if it succeeds
        if self._take(*SUBMIT_FAULTS):
            self._result(job, False)
            return
        self.jobs[job.job_id] = job
        self.transfers[job.job_id] = [job, None]

    submit_store = _submit
    submit_load = _submit

    def _result(self, job: TransferJob, ok: bool) -> None:
        if job.is_promotion and not ok:
            self.failed_loads[job.job_id] = tuple(job.keys)
        self.pending.append(JobResult(job.job_id, ok, None, 0.0 if ok else None, None))

    def _poll(self) -> None:
        """vLLM's ``_poll_active_transfers``: every transfer, in submission order, once."""
        for job_id, (job, ok) in list(self.transfers.items()):
            if self._take("check"):
                ok = False
                self.jobs.pop(job_id, None)  # a running transfer's handle is released: it stops
            elif ok is None:
                continue
            if self._take("release_xfer"):
                continue  # kept, unpublished, until a later poll releases its handle
            self._take(*CLEANUP_FAULTS)
            del self.transfers[job_id]
            self._result(job, ok)

    def get_finished_jobs(self) -> list[JobResult]:
        """Refused submissions and drained results first, then what this poll finds."""
        self._poll()
        self.finished, self.pending = self.pending, []
        return super().get_finished_jobs()

    def drain_jobs(self) -> None:
        if self.jobs:
            raise InvalidFieldError("jobs", sorted(self.jobs), "no transfer still running at a drain "
                                                               "(finish them first: nothing else ends them)")
        while self.transfers:
            self._poll()

    def known_jobs(self) -> set[int]:
        return set(self.transfers) | {r.job_id for r in self.pending}

    def finish_job(self, job_id: int, io_error: bool = False) -> JobResult:
        """NIXL ends transfer ``job_id`` (with an error, or, for a READ, a missing object: nothing
        moves); it is reported at the next poll."""
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
        self.transfers[job_id][1] = ok
        return JobResult(job_id, ok, None, 0.0 if ok else None, None)

    def truncate_file(self, key: OffloadKey, size: int) -> bool:
        return False  # an object is replaced whole

    def check_invariants(self) -> None:
        super().check_invariants()
        assert set(self.jobs) <= set(self.transfers), "T5: a running transfer vLLM does not track"
        assert all((ok is None) == (j in self.jobs) for j, (_, ok) in self.transfers.items()), \
            "T5: a transfer is running exactly while it has no outcome"
        assert not set(self.transfers) & {r.job_id for r in self.pending}, "T5: a job both tracked and reported"
