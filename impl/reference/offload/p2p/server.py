"""A session's server role: serving stored blocks to the peer (vLLM ``session/server.py``).

Per kv_request_id and fetch round the server matches **supply** (blocks this engine stored, each
carried by a store job that pins its primary slots) against **demand** (the peer's ``fetch``: keys
and the peer's block indexes). A key present on both sides becomes a block write on the data
plane; a round succeeds when all its demanded blocks are written, and ``transfer_done`` tells the
peer. A store job's pin is released — its result reported — only when no pending write still
reads its blocks (a WRITE in flight cannot be stopped):

* a round ends with success when its last write lands (``remaining == 0``), or fails when a write
  fails, a store job times out (:data:`STORE_TIMEOUT_S`), the request finishes locally with demand
  unmet, or the write could not be submitted;
* a failed round is *cancelled*: its jobs fail, but those carried by a pending write wait for it;
* ``abort_fetch`` cancels a round; ``abort_ack`` goes back only once none of its writes is pending
  (asked again at most every :data:`CANCEL_RETRY_INTERVAL_S`);
* a second ``fetch`` for a round that already has demand is a protocol violation (ValueError:
  the session disconnects); the empty ``fetch`` ends every round of the id without a reply.

Submit-store batches always join round 0 (vLLM's PD producer), so only a consumer's first fetch
round of an id can be served by stores; later rounds wait for timeouts or finish.

**Inbound lookups** (a symmetric consumer's ``lookup``) are queued at dispatch and resolved at the
engine's next ``serve_external_requests`` against its tiering manager (the ``parent``): each
lookup opens a synthetic request (``parent.on_new_request``), asks ``parent.lookup`` per distinct
key, pins the hits at once (``parent.create_store_job``, whose job supplies the lookup's round,
marked *lookup-supplied*), keeps HIT_PENDING/RETRY keys for later serves until
:data:`LOOKUP_PENDING_TIMEOUT_S` after it arrived (then MISS), and answers one ``lookup_resp``
with every key in wire order before ``parent.on_request_finished``. A fetch that demands a key a
lookup-supplied round holds no supply for fails at once. The terminal empty fetch, a local finish
or the session's close drop the id's parked lookups; their synthetic requests are finished at the
next serve (the manager's, after a close).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

from . import messages as m
from .transport import DataPlane

STORE_TIMEOUT_S = 30.0
CANCEL_RETRY_INTERVAL_S = 0.1
LOOKUP_PENDING_TIMEOUT_S = 5.0


@dataclass
class Round:
    lookup_supplied: bool = False  # supply came from lookup pins: unmatched demand fails at once
    demand_received: bool = False
    available: dict[bytes, tuple[int, int]] = field(default_factory=dict)  # key -> (job, local idx)
    demanded: dict[bytes, int] = field(default_factory=dict)  # key -> remote idx
    remaining: int = 0
    finishing: bool = False
    inflight: int = 0
    cancelled: bool = False
    last_cancel_at: float | None = None
    pending_jobs: set[int] = field(default_factory=set)


@dataclass
class Xfer:
    kv: str
    blocks: int
    jobs: set[int]
    rnd: Round
    round_key: int


@dataclass
class ActiveLookup:
    lookup_id: int
    kv: str
    ctx: str  # the synthetic request id the parent sees
    round_seq: int
    keys: list[bytes]
    deadline: float
    resolved: dict[bytes, bool] = field(default_factory=dict)
    pending: set[bytes] = field(default_factory=set)


@dataclass
class ServerRequest:
    outbound: dict[int, Round] = field(default_factory=dict)
    inflight_tids: set[int] = field(default_factory=set)
    pending_lookups: list[tuple[list[bytes], float, int]] = field(default_factory=list)  # (keys, at, round)
    lookups: dict[int, ActiveLookup] = field(default_factory=dict)


class ServerRole:
    def __init__(self, peer_id: str, plane: DataPlane, send: Callable[[dict], None]) -> None:
        self.peer_id = peer_id
        self.plane = plane
        self._send = send
        self.requests: dict[str, ServerRequest] = {}
        self.inflight: dict[int, Xfer] = {}
        self.store_jobs: dict[int, float] = {}
        self.pending_results: list[tuple[int, bool]] = []
        self.pending_aborts: dict[tuple[str, int], float] = {}
        self.peer_fault: str | None = None
        self.serve_pending: set[str] = set()
        self.finished_lookup_ctxs: list[str] = []
        self._lookup_ids = 0

    # -- bookkeeping ------------------------------------------------------------------------------

    def _prune(self, kv: str) -> None:
        st = self.requests.get(kv)
        if st is not None and not st.outbound and not st.inflight_tids and not st.lookups and \
                not st.pending_lookups and not any(k == kv for k, _ in self.pending_aborts):
            del self.requests[kv]

    def _round(self, kv: str, rnd: int) -> Round:
        st = self.requests.setdefault(kv, ServerRequest())
        return st.outbound.setdefault(rnd, Round())

    def _registered(self, kv: str, key: int, rnd: Round) -> bool:
        st = self.requests.get(kv)
        return st is not None and st.outbound.get(key) is rnd

    def _pop_xfer(self, tid: int) -> Xfer | None:
        x = self.inflight.pop(tid, None)
        if x is None:
            return None
        x.rnd.inflight -= 1
        st = self.requests.get(x.kv)
        if st is not None:
            st.inflight_tids.discard(tid)
        return x

    def _read_jobs(self, rnd: Round | None = None) -> set[int]:
        """Jobs whose blocks a pending write (of ``rnd``) still reads: their pins are held."""
        return {j for x in self.inflight.values() if rnd is None or x.rnd is rnd for j in x.jobs}

    @property
    def has_inflight(self) -> bool:
        return bool(self.inflight)

    # -- supply and demand ------------------------------------------------------------------------

    def add_stored_blocks(self, kv: str, keys: list[bytes], block_ids: list[int], job: int, now: float,
                          round_seq: int = 0, from_lookup: bool = False) -> None:
        self.store_jobs[job] = now
        rnd = self._round(kv, round_seq)
        if rnd.cancelled:
            self.store_jobs.pop(job)
            self.pending_results.append((job, False))
            return
        if from_lookup:
            rnd.lookup_supplied = True
        rnd.pending_jobs.add(job)
        local, remote = [], []
        for key, idx in zip(keys, block_ids):
            if key in rnd.demanded:
                local.append(idx)
                remote.append(rnd.demanded.pop(key))
            else:
                rnd.available[key] = (job, idx)
        if local and rnd.demand_received:
            self._submit(kv, local, remote, {job}, rnd, round_seq)

    def on_fetch(self, kv: str, keys: list[bytes], indexes: list[int], key: int) -> None:
        st = self.requests.get(kv)
        old = st.outbound.get(key) if st is not None else None
        if old is not None and old.demand_received:
            raise ValueError(f"duplicate fetch for kv_request_id={kv} round={key}")
        rnd = self._round(kv, key)
        rnd.demand_received = True
        rnd.remaining = len(keys)
        local, remote, jobs = [], [], set()
        for k, ridx in zip(keys, indexes):
            if k in rnd.available:
                job, lidx = rnd.available.pop(k)
                local.append(lidx)
                remote.append(ridx)
                jobs.add(job)
            else:
                rnd.demanded[k] = ridx
        if not keys:  # the terminal empty fetch: lookups and every round of the id end, no reply
            self._finish_inbound_lookups(kv)
            for r in list(self.requests[kv].outbound):
                self._finalize(kv, r, send_done=False)
            return
        if rnd.lookup_supplied and rnd.demanded:  # no late store can supply a symmetric round
            self._finalize(kv, key, success=False)
            return
        if local:
            self._submit(kv, local, remote, jobs, rnd, key)
        elif rnd.finishing and rnd.inflight == 0:
            self._finalize(kv, key)

    def _submit(self, kv: str, local: list[int], remote: list[int], jobs: set[int], rnd: Round, key: int) -> None:
        tid = self.plane.write_blocks(self.peer_id, local, remote) if self.peer_fault is None else None
        if tid is not None:
            rnd.inflight += 1
            self.inflight[tid] = Xfer(kv, len(local), jobs, rnd, key)
            self.requests[kv].inflight_tids.add(tid)
            return
        # the matched blocks left supply/demand but no write will land: the round cannot succeed
        rnd.finishing = True
        if self._registered(kv, key, rnd) and rnd.inflight == 0:
            self._finalize(kv, key, success=False)

    # -- ends of rounds ---------------------------------------------------------------------------

    def _fail_round_jobs(self, rnd: Round, success: bool) -> None:
        for job in rnd.pending_jobs:
            if self.store_jobs.pop(job, None) is not None:
                self.pending_results.append((job, success))
        rnd.pending_jobs.clear()

    def _fail_unwritten(self, rnd: Round) -> list[tuple[int, bool]]:
        written = self._read_jobs(rnd)
        out = []
        for job in list(rnd.pending_jobs):
            if job in written:
                continue
            rnd.pending_jobs.discard(job)
            if self.store_jobs.pop(job, None) is not None:
                out.append((job, False))
        return out

    def _settle(self, x: Xfer, success: bool) -> list[tuple[int, bool]]:
        pinned = self._read_jobs() if x.rnd.cancelled else set()
        out = []
        for job in x.jobs:
            if job in pinned or self.store_jobs.pop(job, None) is None:
                continue
            out.append((job, success))
            x.rnd.pending_jobs.discard(job)
        return out

    def _finalize(self, kv: str, key: int, success: bool | None = None, send_done: bool = True) -> None:
        st = self.requests[kv]
        rnd = st.outbound[key]
        if rnd.cancelled and rnd.inflight:
            return
        del st.outbound[key]
        if rnd.cancelled:
            success = False
        if success is None:
            success = rnd.demand_received and rnd.remaining == 0
        self._fail_round_jobs(rnd, bool(success))
        if send_done and rnd.demand_received:
            self._send(m.transfer_done(kv, bool(success), key))
        self._prune(kv)

    def _finalize_cancelled(self, kv: str, key: int) -> None:
        self._finalize(kv, key, success=False, send_done=(kv, key) not in self.pending_aborts)

    def finish(self, kv: str) -> None:
        """The request finished locally: no more stores will come for it."""
        self._finish_inbound_lookups(kv)
        st = self.requests.get(kv)
        if st is None:
            return
        self._prune(kv)
        if kv not in self.requests:
            return
        for key, rnd in list(st.outbound.items()):
            rnd.finishing = True
            if rnd.demand_received and not rnd.inflight:
                self._finalize(kv, key)

    # -- inbound lookups ---------------------------------------------------------------------------

    def on_lookup(self, kv: str, keys: list[bytes], round_seq: int, now: float) -> None:
        self.requests.setdefault(kv, ServerRequest()).pending_lookups.append((list(keys), now, round_seq))
        self.serve_pending.add(kv)

    def serve_external_requests(self, parent, now: float) -> None:
        """Resolve queued and parked lookups against ``parent``, then finish closed lookups' requests."""
        for kv in list(self.serve_pending):
            st = self.requests.get(kv)
            if st is None:
                self.serve_pending.discard(kv)
                continue
            if st.pending_lookups:
                pending, st.pending_lookups = st.pending_lookups, []
                for keys, at, rnd in pending:
                    self._process_inbound_lookup(kv, keys, at, rnd, parent, now)
            self._resolve_pending_lookups(kv, parent, now)
            st = self.requests.get(kv)
            if st is None or (not st.pending_lookups and not st.lookups):
                self.serve_pending.discard(kv)
                self._prune(kv)
        for ctx in self.finished_lookup_ctxs:
            parent.on_request_finished(ctx)
        self.finished_lookup_ctxs = []

    def _poll_lookup_keys(self, lookup: ActiveLookup, keys, parent, now: float) -> None:
        hits = []
        for key in keys:
            if key in lookup.resolved:
                continue
            result = parent.lookup(key, lookup.ctx)
            if result in ("HIT", "MISS"):
                lookup.resolved[key] = result == "HIT"
                lookup.pending.discard(key)
                if result == "HIT":
                    hits.append(key)
            else:  # HIT_PENDING / RETRY: asked again at the next serve
                lookup.pending.add(key)
        if hits:  # pinned at once: the whole serve runs under one hold of the tiering manager's lock
            job, pinned_keys, chunk_ids = parent.create_store_job(hits, lookup.ctx)
            self.add_stored_blocks(lookup.kv, pinned_keys, chunk_ids, job, now, round_seq=lookup.round_seq,
                                   from_lookup=True)

    def _process_inbound_lookup(self, kv: str, keys: list[bytes], at: float, round_seq: int, parent,
                                now: float) -> None:
        self._lookup_ids += 1
        lookup = ActiveLookup(self._lookup_ids, kv, f"p2p:{self.peer_id}:{kv}:lu{self._lookup_ids}", round_seq,
                              list(keys), at + LOOKUP_PENDING_TIMEOUT_S)
        parent.on_new_request(lookup.ctx)
        self._poll_lookup_keys(lookup, dict.fromkeys(lookup.keys), parent, now)
        if lookup.pending:
            self.requests.setdefault(kv, ServerRequest()).lookups[lookup.lookup_id] = lookup
        else:
            self._finalize_lookup(lookup, parent)

    def _resolve_pending_lookups(self, kv: str, parent, now: float) -> None:
        st = self.requests.get(kv)
        if st is None or not st.lookups:
            return
        done = []
        for lookup_id, lookup in st.lookups.items():
            self._poll_lookup_keys(lookup, list(lookup.pending), parent, now)
            if lookup.pending and now >= lookup.deadline:  # a stuck producer: the stragglers miss
                for key in lookup.pending:
                    lookup.resolved[key] = False
                lookup.pending.clear()
            if not lookup.pending:
                done.append(lookup_id)
        for lookup_id in done:
            self._finalize_lookup(st.lookups.pop(lookup_id), parent)

    def _finalize_lookup(self, lookup: ActiveLookup, parent) -> None:
        if lookup.keys:
            self._send(m.lookup_resp(lookup.kv, lookup.keys, [lookup.resolved[k] for k in lookup.keys]))
        parent.on_request_finished(lookup.ctx)

    def _finish_inbound_lookups(self, kv: str) -> None:
        st = self.requests.get(kv)
        if st is None:
            return
        st.pending_lookups.clear()
        self.finished_lookup_ctxs += [lu.ctx for lu in st.lookups.values()]
        st.lookups.clear()
        self.serve_pending.discard(kv)
        self._prune(kv)

    # -- aborts -----------------------------------------------------------------------------------

    def _cancel_due(self, rnd: Round, now: float) -> bool:
        if rnd.last_cancel_at is not None and now - rnd.last_cancel_at < CANCEL_RETRY_INTERVAL_S:
            return False
        rnd.last_cancel_at = now
        return True

    def on_abort_fetch(self, kv: str, key: int, now: float) -> None:
        self.requests.setdefault(kv, ServerRequest())
        self.pending_aborts.setdefault((kv, key), now)
        self._drain_abort(kv, key, now)

    def _drain_abort(self, kv: str, key: int, now: float) -> None:
        st = self.requests[kv]
        rnd = st.outbound.get(key)
        if rnd is not None and not rnd.cancelled:
            rnd.cancelled = True
            self.pending_results.extend(self._fail_unwritten(rnd))
        ids = [t for t, x in self.inflight.items() if x.kv == kv and x.round_key == key]
        if ids:
            if not self._cancel_due(self.inflight[ids[0]].rnd, now):
                return
            still = self.plane.cancel(ids, mode="wait")
            for t in ids:
                if t not in still:
                    self._pop_xfer(t)
            if still:
                return
        if rnd is not None and st.outbound.get(key) is rnd:
            self._finalize(kv, key, success=False, send_done=False)
        self.pending_aborts.pop((kv, key), None)
        self._send(m.abort_ack(kv, key))
        self._prune(kv)

    def drain_pending_aborts(self, now: float) -> None:
        for kv, key in list(self.pending_aborts):
            self._drain_abort(kv, key, now)

    # -- the poll ---------------------------------------------------------------------------------

    def _timeout_store_jobs(self, now: float) -> list[tuple[int, bool]]:
        if not self.store_jobs:
            return []
        timed_out = [j for j, t in self.store_jobs.items() if t <= now - STORE_TIMEOUT_S]
        if not timed_out and not any(x.rnd.cancelled for x in self.inflight.values()):
            return []
        expired = set(timed_out)
        out: list[tuple[int, bool]] = []
        rounds = {(x.kv, x.round_key): x.rnd for x in self.inflight.values()
                  if x.rnd.cancelled or expired & x.jobs}
        for (kv, key), rnd in rounds.items():
            rnd.cancelled = True
            if not self._cancel_due(rnd, now):
                continue
            tids = [t for t, x in self.inflight.items() if x.rnd is rnd]
            still = set(self.plane.cancel(tids, mode="wait"))
            for t in tids:
                if t not in still:
                    out.extend(self._settle(self._pop_xfer(t), False))
            if rnd.inflight == 0 and self._registered(kv, key, rnd):
                self._finalize_cancelled(kv, key)
        reading = self._read_jobs()
        for job in timed_out:
            if job not in reading and self.store_jobs.pop(job, None) is not None:
                out.append((job, False))
        for st in self.requests.values():  # an expired job's slots are unpinned: no longer supply
            for rnd in st.outbound.values():
                if rnd.pending_jobs & expired:
                    rnd.pending_jobs -= expired
                    rnd.available = {k: e for k, e in rnd.available.items() if e[0] not in expired}
        return out

    def collect_results(self, now: float) -> list[tuple[int, bool]]:
        out = self._timeout_store_jobs(now)
        done, failed, fault = self.plane.poll(self.peer_id)
        if fault is not None:
            self.peer_fault = fault
        for tid in done:
            x = self._pop_xfer(tid)
            if x is None:
                continue
            out.extend(self._settle(x, not x.rnd.cancelled))
            rnd = x.rnd
            if self._registered(x.kv, x.round_key, rnd):
                rnd.remaining -= x.blocks
                if rnd.cancelled:
                    if rnd.inflight == 0:
                        self._finalize_cancelled(x.kv, x.round_key)
                elif rnd.remaining == 0:
                    self._finalize(x.kv, x.round_key, success=True)
                elif rnd.finishing and rnd.inflight == 0:
                    self._finalize(x.kv, x.round_key, success=False)
            self._prune(x.kv)
        for tid in failed:
            x = self._pop_xfer(tid)
            if x is None:
                continue
            rnd = x.rnd
            in_round = self._registered(x.kv, x.round_key, rnd)
            if in_round and not rnd.cancelled:
                rnd.cancelled = True
                out.extend(self._fail_unwritten(rnd))
            out.extend(self._settle(x, False))
            if in_round and rnd.inflight == 0:
                self._finalize_cancelled(x.kv, x.round_key)
            self._prune(x.kv)
        out.extend(self.pending_results)
        self.pending_results.clear()
        return out

    def close(self) -> tuple[list[int], list[str]]:
        """``(failed store jobs, synthetic lookup requests still owing on_request_finished)``;
        pending writes are dropped."""
        failed = list(self.store_jobs)
        serves = [lu.ctx for st in self.requests.values() for lu in st.lookups.values()] + self.finished_lookup_ctxs
        self.finished_lookup_ctxs = []
        self.serve_pending.clear()
        self.store_jobs.clear()
        if self.inflight:
            self.plane.cancel(list(self.inflight))
        self.inflight.clear()
        self.pending_results.clear()
        self.requests.clear()
        self.pending_aborts.clear()
        return failed, serves

    def check_invariants(self) -> None:
        for kv, st in self.requests.items():
            assert st.inflight_tids == {t for t, x in self.inflight.items() if x.kv == kv}, \
                f"P2: request {kv}'s in-flight transfer ids disagree with the transfers"
            for rnd in st.outbound.values():
                assert rnd.inflight == sum(1 for x in self.inflight.values() if x.rnd is rnd) >= 0, \
                    f"P2: request {kv}: a round counts {rnd.inflight} in-flight transfers"
                assert rnd.remaining >= 0, f"P2: request {kv}: a round has {rnd.remaining} remaining"
                assert not (rnd.available.keys() & rnd.demanded.keys()), "P2: a key is supply or demand, not both"
        assert all(x.kv in self.requests for x in self.inflight.values()), "P2: a transfer of an unknown request"
        assert all(kv in self.requests for kv, _ in self.pending_aborts), "P2: an abort of an unknown request"
