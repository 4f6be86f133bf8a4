"""What the tiering manager and a secondary tier exchange (vLLM ``tiering/base.py``).

A secondary tier never touches GPU memory: a *cascade* (store job) copies chunks out of pinned
primary-tier slots, a *promotion* (load job) copies into primary slots reserved for it. Jobs are
submitted without blocking and reported later by ``get_finished_jobs``; a promotion that failed
part-way names the keys that did arrive (``successful_keys``), which stay in the primary tier.
"""

from __future__ import annotations

from abc import ABC, abstractmethod

from dataclasses import dataclass
from typing import Iterable

from ..keys import LookupResult, OffloadKey

MEDIUM_CPU = "CPU"
MEDIUM_STORAGE = "STORAGE"
#: cache-hit source reported for a hit served by a tier of this medium (vLLM ``CacheHitSource``)
HIT_SOURCE = {MEDIUM_CPU: "HOST", MEDIUM_STORAGE: "DISK"}


@dataclass
class TransferJob:
    job_id: int
    keys: tuple[OffloadKey, ...]
    chunk_ids: tuple[int, ...]
    is_promotion: bool
    req_id: str
    submit_time: float


@dataclass(frozen=True)
class JobResult:
    job_id: int
    success: bool
    successful_keys: tuple[OffloadKey, ...] | None = None
    transfer_time: float | None = None
    transfer_bytes: int | None = None


@dataclass(frozen=True)
class TierEvent:
    """A chunk set this tier now holds (``removed=False``) or dropped (vLLM ``OffloadingEvent``)."""

    keys: tuple[OffloadKey, ...]
    medium: str
    removed: bool


class TierShutdownError(RuntimeError):
    """A tier's ``shutdown`` failed (a trace sets ``fail_shutdown`` on an out-of-tree tier)."""


class SecondaryTier(ABC):
    """Base of the reference tiers: the calls vLLM's ``SecondaryTierManager`` answers.

    Args:
        tier_type: "fs", "example", ... (labels metrics as ``"{index+1}:{tier_type}"``).
        primary: the primary tier's byte buffer, one row per chunk (what transfers read/write).
        bp_detector: an :class:`EMABackpressureDetector` or None.
    """

    medium: str = MEDIUM_CPU
    #: serviced between steps by the manager's tier-poll thread too (vLLM's class attribute)
    tolerates_off_thread_polling: bool = False

    def __init__(self, tier_type: str, primary: "PrimaryBuffer", bp_detector=None) -> None:
        self.tier_type = tier_type
        self.primary = primary
        self.bp_detector = bp_detector

    @property
    def cache_hit_source(self) -> str:
        return HIT_SOURCE[self.medium]

    @property
    def declared_medium(self) -> str | None:
        """The medium vLLM's tier class declares (``medium``), which a request's load tier filter
        matches against; None (a tier that declares none) matches every filter."""
        return self.medium

    @property
    def block_size_bytes(self) -> int:
        return self.primary.row_bytes

    @abstractmethod
    def lookup(self, key: OffloadKey, req_id: str) -> LookupResult:
        """Each tier (fs, obj, example) answers this itself, as vLLM's secondary tiers do."""

    @abstractmethod
    def submit_store(self, job: TransferJob) -> None:
        """Each tier (fs, obj, example) answers this itself, as vLLM's secondary tiers do."""

    @abstractmethod
    def submit_load(self, job: TransferJob) -> None:
        """Each tier (fs, obj, example) answers this itself, as vLLM's secondary tiers do."""

    @abstractmethod
    def get_finished_jobs(self) -> list[JobResult]:
        """Each tier (fs, obj, example) answers this itself, as vLLM's secondary tiers do."""

    def on_new_request(self, req_id: str) -> str:
        """The tier's offload policy for the request: "chunk" (the default) or "request"."""
        return "chunk"

    def on_request_finished(self, req_id: str) -> None:
        return

    def on_schedule_end(self) -> None:
        return

    def has_pending_work(self) -> bool:
        return False

    def take_events(self) -> list[TierEvent]:
        return []

    def serve_external_requests(self, parent, tier_idx: int) -> None:
        """Serve what a peer asked for through ``parent`` (the tiering manager, told to skip tier
        ``tier_idx``: vLLM's ``_SecondaryTierFacingParent``); most tiers have no peers."""
        return

    def take_stats(self) -> dict[str, float]:
        """The tier's own metrics (vLLM ``SecondaryTierManager.get_stats``); most tiers have none."""
        return {}

    #: this tier's shutdown raises :class:`TierShutdownError` (what a trace says of a third-party tier)
    fail_shutdown: bool = False

    def shutdown(self) -> None:
        """Release the tier's resources (vLLM ``SecondaryTierManager.shutdown``); nothing to release
        in the reference, but a tier can be made to fail here."""
        if self.fail_shutdown:
            raise TierShutdownError(f"tier {self.tier_type}: shutdown failed")

    def drain_jobs(self) -> None:
        """Block until every submitted job has finished (vLLM ``drain_jobs``, before a reset);
        tiers whose jobs the trace finishes explicitly have nothing to wait for here."""
        return

    @abstractmethod
    def stored_keys(self) -> set[OffloadKey]:
        """Each tier (fs, obj, example) answers this itself, as vLLM's secondary tiers do."""

    def in_flight(self) -> Iterable[int]:
        return ()

    @abstractmethod
    def known_jobs(self) -> set[int]:
        """Jobs submitted to this tier and not yet collected by ``get_finished_jobs`` (each tier
        answers this itself)."""

    def check_invariants(self) -> None:
        if self.bp_detector is not None:
            self.bp_detector.check_invariants()


class PrimaryBuffer:
    """The primary tier's CPU KV buffer: ``num_chunks`` rows of ``row_bytes`` (vLLM's
    ``SharedOffloadRegion`` seen through ``get_kv_memoryview``); starts zeroed."""

    def __init__(self, num_chunks: int, row_bytes: int) -> None:
        self.row_bytes = row_bytes
        self.data = bytearray(num_chunks * row_bytes)

    def read(self, chunk_id: int) -> bytes:
        return bytes(self.data[chunk_id * self.row_bytes:(chunk_id + 1) * self.row_bytes])

    def write(self, chunk_id: int, payload: bytes) -> None:
        assert len(payload) == self.row_bytes
        self.data[chunk_id * self.row_bytes:(chunk_id + 1) * self.row_bytes] = payload
