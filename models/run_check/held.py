"""Blocks a KV-connector run keeps out of the pool after their request let go of them (issue #28).

On a KV-connector run vLLM 0.33.0 holds a request's blocks past the point where it stops using
them in two ways the run properties must count, or block conservation (free + held = pool) breaks
on every such run:

* **delayed frees**: ``request_finished`` answered ``delay_free_blocks`` (the connector is still
  sending them: a P/D producer, an offload store). The blocks stay allocated until a later
  ``update_from_output`` names the request in ``kv_connector_output.finished_sending``; only then
  does the scheduler free them (``_update_from_kv_xfer_finished``);
* **fenced frees**: with more than one batch in flight (async scheduling) and a consumer role,
  ``defer_block_free`` makes ``_free_request_blocks`` park the blocks of a request whose last
  scheduled step is still in flight (``last_sched_seq > processed_step_seq``) in
  ``deferred_frees`` with the current scheduled-step fence; ``update_from_output`` of a non-empty
  step advances ``processed_step_seq`` and returns every batch whose fence it reached
  (``_drain_deferred_frees``).

A parked block is held by nobody who may write it: allocating it to a request before its release
point is the early-reuse bug class these mechanisms exist to prevent, so the run properties keep it
as a block *owned* by a pseudo-holder (:func:`parked_key`) that no request can be: the reuse check
reports it like any block still needed.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

#: request ids never start with this (the recorder writes them as JSON strings from vLLM)
_PARKED = "\x00parked:"


def parked_key(kind: str, rid: str) -> str:
    """The pseudo-holder of blocks parked for ``rid`` (``kind``: "sending" or "fence")."""
    return f"{_PARKED}{kind}:{rid}"


def is_parked(holder: str) -> bool:
    return holder.startswith(_PARKED)


@dataclass
class Fences:
    """vLLM's step fences for deferred frees (``sched_step_seq`` / ``processed_step_seq``)."""

    enabled: bool
    sched_seq: int = 0
    processed_seq: int = 0
    #: request id -> the scheduled-step sequence of its last non-empty step
    last_sched: dict = field(default_factory=dict)
    #: (fence, pseudo-holder key) batches not yet returned, in fence order
    parked: deque = field(default_factory=deque)

    def scheduled(self, rids) -> None:
        """A non-empty ``schedule()`` (its rows' ids): the fence advances, each request's last step is it."""
        if not self.enabled:
            return
        self.sched_seq += 1
        for rid in rids:
            self.last_sched[rid] = self.sched_seq

    def must_park(self, rid: str) -> bool:
        """vLLM ``_request_blocks_can_be_freed`` is False: a step that may write them is in flight."""
        return self.enabled and self.last_sched.get(rid, 0) > self.processed_seq

    def park(self, key: str) -> None:
        self.parked.append((self.sched_seq, key))

    def processed(self) -> list[str]:
        """A non-empty step's ``update_from_output``: the keys whose fence it reached, in order."""
        if not self.enabled:
            return []
        self.processed_seq += 1
        out = []
        while self.parked and self.parked[0][0] <= self.processed_seq:
            out.append(self.parked.popleft()[1])
        return out

    def forget(self, rid: str) -> None:
        self.last_sched.pop(rid, None)

    def check_invariants(self) -> None:
        assert self.processed_seq <= self.sched_seq, "more steps processed than scheduled"
        fences = [f for f, _ in self.parked]
        assert fences == sorted(fences), "parked batches out of fence order"
        assert all(f > self.processed_seq for f in fences[:1]), "a parked batch past its fence"


def defers_frees(header: dict) -> bool:
    """vLLM's ``defer_block_free``: a KV consumer (``kv_consumer`` / ``kv_both``) with more than one
    batch in flight (``async_scheduling``: ``max_concurrent_batches`` 2)."""
    conn = header.get("connector")
    sched = header.get("scheduler") or {}
    return (conn is not None and str(conn.get("kv_role")) in ("kv_consumer", "kv_both")
            and bool(sched.get("async_scheduling", sched.get("async_class", False))))


__all__ = ["Fences", "defers_frees", "is_parked", "parked_key"]
