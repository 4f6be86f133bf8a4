"""P2P secondary tier: the reference world and vLLM's, driven with the same generated operations.

Two engines — producer ``P`` (requests with ``remote_decoder``) and consumer ``D`` (requests
with ``remote_prefiller``) — share a few kv_request_ids. The machine draws request arrivals on
both sides, stores on ``P`` (any subset of the id's keys, in any order), lookups and loads on
``D`` (subsets that may not match what was stored), request finishes in any order, polls of
either engine, data-plane writes completing or failing, virtual time passing every protocol
timeout, a data-plane fault (once, or again right after the reconnect, so the next dial waits
out vLLM's reconnect backoff), an engine going away, WRITE submissions and peer registrations NIXL
refuses, an engine whose hash seed differs (its handshakes are refused) and requests whose
``kv_transfer_params`` are missing or malformed. After every step it compares everything
both worlds can observe: the call's result, each engine's bookkeeping
(:meth:`~kvref.impl.reference.offload.p2p.world.P2PWorld.snapshot`), every control message in
order per direction, and both engines' buffers byte for byte. Beside the comparison an
independent property holds: a load job reported successful leaves, in ``D``'s buffer, exactly
the bytes ``P`` stored for each of its keys (bytes through the tier).
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Any

from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from kvref.impl.reference.offload.p2p.transport import SUBMIT_ERRORS
from kvref.impl.reference.offload.p2p.world import MALFORMED, STRANGER_CONNECTS, P2PWorld

KV_IDS = ("kv0", "kv1")
#: ids of symmetric requests (their own: a PD id's failures would turn every probe into a MISS)
SYM_IDS = ("sym0",)
#: the id of requests whose kv_transfer_params are missing or malformed (their own slots)
ODD_IDS = ("odd0",)
KEYS_PER_KV = 2
NUM_BLOCKS = 8
BLOCK_LEN = 16
ADVANCES = (0.05, 1.0, 5.0, 10.0, 31.0, 61.0)
#: (VLLM_P2P_MAX_PEERS, VLLM_P2P_IDLE_TIMEOUT_S): vLLM's defaults, or scarce slots (idle eviction on)
LIMITS = ((2, 10), (128, 300), (1, 31))
#: job numbers of the stranger's requests start above every drawn job's
STRANGER_JOBS = 1_000_000
KEY_LISTS = st.lists(st.integers(0, KEYS_PER_KV - 1), min_size=1, max_size=KEYS_PER_KV, unique=True)


def key_of(kv: str, i: int) -> bytes:
    return f"{kv}/{i}".encode()


def slot_of(kv: str, i: int) -> int:
    """Each key has its own slot in both engines' buffers (a stored slot is never reused)."""
    return (KV_IDS + SYM_IDS + ODD_IDS).index(kv) * KEYS_PER_KV + i


def content_of(key: bytes) -> bytes:
    return hashlib.sha256(key).digest()[:BLOCK_LEN]


class Divergence(AssertionError):
    """The worlds disagree on an observable (its name, each world's value)."""

    def __init__(self, what: str, values: dict[str, Any]) -> None:
        super().__init__(f"{what} diverged: " + "; ".join(f"{k}={v!r}" for k, v in values.items()))
        self.signature = f"p2p:{what.split('(')[0]}"


@dataclass
class Coverage:
    """Which rare paths the generated runs reached (asserted by the tests)."""

    loads_ok: int = 0
    loads_failed: int = 0
    stores_ok: int = 0
    stores_failed: int = 0
    bytes_checked: int = 0
    aborts: int = 0
    reaped: int = 0
    shutdowns: int = 0
    faults: int = 0
    idle_reaps: int = 0
    probe_hits: int = 0
    probe_misses: int = 0
    probe_retries: int = 0
    symmetric_loads: int = 0
    broken: int = 0
    drains: int = 0
    shutdown_drains: int = 0
    drains_cut: int = 0
    malformed_requests: int = 0
    refaults: int = 0
    refused_post_err: int = 0  # WRITE submissions NIXL refused, per kind (transport.SUBMIT_ERRORS)
    refused_prep_error: int = 0
    refused_remote_disconnect: int = 0
    refused_not_found: int = 0
    rejected_peers: int = 0  # handshakes refused (a hash seed that differs, a registration that failed)
    refused_registrations: int = 0
    release_failures: int = 0  # a removed peer's handle release NIXL refused (its agent may stay loaded)
    strangers: int = 0  # handshakes of the third engine (every one refused)
    limit_refusals: int = 0  # connections refused and dials not made for want of a peer slot


COVERAGE = Coverage()


def make_machine(world_factories: dict[str, Any]) -> type[RuleBasedStateMachine]:
    """A machine over the named worlds (the first is the one the bytes property reads)."""

    class P2PMachine(RuleBasedStateMachine):
        def __init__(self) -> None:
            super().__init__()
            self.worlds: dict[str, Any] = {}
            self.reqs: dict[str, dict[str, str]] = {"P": {}, "D": {}}  # req id -> kv id
            self.next_req = 0
            self.next_job = 0
            self.loads: dict[int, list[bytes]] = {}
            self.forged: set[str] = set()  # ids a forged transfer_done may have ended a load of
            self.symmetric: set[str] = set()  # D's requests that probe P (``remote_kv_source``)
            self.strangers = 0  # the stranger's requests so far (ids and job numbers of their own)

        def _start(self, limits: tuple[int, int]) -> None:
            max_peers, idle_timeout_s = limits
            self.idle_timeout_s = idle_timeout_s
            for name, factory in world_factories.items():
                self.worlds[name] = factory(max_peers=max_peers, idle_timeout_s=idle_timeout_s)
            for w in self.worlds.values():
                for kv in KV_IDS + SYM_IDS:
                    for i in range(KEYS_PER_KV):
                        w.write("P", [slot_of(kv, i)], [content_of(key_of(kv, i))])
                        w.hold("P", key_of(kv, i), slot_of(kv, i), 0)  # P's tiering manager has every key

        def teardown(self) -> None:
            ref = self.worlds.get("ref")
            if ref is not None:
                COVERAGE.idle_reaps += sum(m.idle_reaped for m in ref.managers.values())
                COVERAGE.rejected_peers += sum(m.rejected_peers for m in ref.managers.values())
                COVERAGE.limit_refusals += sum(m.refused_at_limit for m in ref.managers.values())
                for plane in ref.planes.values():
                    for kind, n in plane.refused.items():
                        name = {"registration": "refused_registrations", "release": "release_failures"}.get(
                            kind, f"refused_{kind}")
                        setattr(COVERAGE, name, getattr(COVERAGE, name) + n)
            for w in self.worlds.values():
                w.close()

        # -- comparing --------------------------------------------------------------------------

        def _all(self, call: str, *args: Any) -> Any:
            results = {name: getattr(w, call)(*args) for name, w in self.worlds.items()}
            values = list(results.values())
            if any(v != values[0] for v in values[1:]):
                raise Divergence(f"{call}{args}", results)
            return values[0]

        def _writes_in_flight(self) -> bool:
            """P's sessions have WRITEs in flight (the reference world says; the worlds agree on it)."""
            ref = self.worlds.get("ref")
            return ref is not None and any(s.server.inflight for s in ref.managers["P"].sessions.values())

        def _alive(self, node: str) -> bool:
            return all(w.alive[node] for w in self.worlds.values())

        def _jobs(self, finished: list[tuple[int, bool]]) -> None:
            first = next(iter(self.worlds.values()))
            for job, ok in finished:
                if job in self.loads:
                    keys = self.loads.pop(job)
                    if ok and keys and keys[0].decode().split("/")[0] in self.forged:
                        COVERAGE.loads_ok += 1
                    elif ok:
                        COVERAGE.loads_ok += 1
                        slots = [slot_of(k.decode().split("/")[0], int(k.decode().split("/")[1])) for k in keys]
                        got = first.read("D", slots)
                        want = [content_of(k) for k in keys]
                        assert got == want, f"load job {job} succeeded but D holds {got} for {keys}"
                        COVERAGE.bytes_checked += len(keys)
                    else:
                        COVERAGE.loads_failed += 1
                elif ok:
                    COVERAGE.stores_ok += 1
                else:
                    COVERAGE.stores_failed += 1

        @invariant()
        def same_observables(self) -> None:
            if not self.worlds:
                return
            for node in ("P", "D"):
                if self._alive(node):
                    snap = self._all("snapshot", node)
                    COVERAGE.reaped += bool(snap["reaped"])
                self._all("read", node, list(range(NUM_BLOCKS)))
            for node in ("P", "D"):
                self._all("parent_log", node)
            msgs = {name: w.messages() for name, w in self.worlds.items()}
            first = next(iter(msgs.values()))
            for name, log in msgs.items():
                if log != first:
                    i = next((j for j, (a, b) in enumerate(zip(log, first)) if a != b), min(len(log), len(first)))
                    raise Divergence(f"message #{i}", {n: lg[i:i + 3] for n, lg in msgs.items()})
            for w in self.worlds.values():
                check = getattr(w, "check_invariants", None)
                if check is not None:
                    check()

        # -- operations -------------------------------------------------------------------------

        @precondition(lambda self: self._alive("P") and len(self.reqs["P"]) < 4)
        @rule(kv=st.sampled_from(KV_IDS))
        def producer_request(self, kv: str) -> None:
            req = f"p{self.next_req}"
            self.next_req += 1
            self._all("new_request", "P", req, "remote_decoder", kv)
            self.reqs["P"][req] = kv

        @precondition(lambda self: self._alive("D") and self._alive("P") and len(self.reqs["D"]) < 4)
        @rule(kv=st.sampled_from(KV_IDS))
        def consumer_request(self, kv: str) -> None:
            """A consumer request dials P: only while P runs. A dial to a port nobody listens on is
            refused by loopback TCP either at once or a moment later, and only the later refusal
            gives ZMQ's monitor the fatal event vLLM watches for (the first retries quietly until the
            handshake timeout): a race the traces must not depend on (the harness's WireTimeout)."""
            req = f"d{self.next_req}"
            self.next_req += 1
            self._all("new_request", "D", req, "remote_prefiller", kv)
            self.reqs["D"][req] = kv

        @initialize(kv=st.sampled_from(KV_IDS), stored=KEY_LISTS, loaded=KEY_LISTS, load_first=st.booleans(),
                    consume=st.booleans(), limits=st.sampled_from(LIMITS), symmetric=st.booleans(),
                    pending=st.sampled_from((0, 1, -1)))
        def opening(self, kv: str, stored: list[int], loaded: list[int], load_first: bool, consume: bool,
                    limits: tuple[int, int], symmetric: bool, pending: int) -> None:
            """Every trace opens with one shared request and a tick, so even a handful of examples
            moves bytes; half of them then probe P symmetrically (a key P's manager may still be
            promoting, or not hold) and fetch what P confirmed; the rules then go anywhere. The
            engines' peer limit and idle timeout are drawn: vLLM's defaults, or a scarce peer
            budget under which idle sessions are evicted. Without draws of their own (the traces stay
            those drawn before): with one peer slot a third engine (a bare control socket, no tier) is
            dialled by an engine and sends it a handshake it must refuse (:meth:`_stranger`); with two,
            NIXL refuses the next release of a removed peer's descriptor list or remote agent (vLLM
            ``_release_remote_handles``: the other handle is still released; a remote agent whose
            removal was refused stays loaded until the peer registers again)."""
            self._start(limits)
            self.share(kv, stored, loaded, not load_first, not consume)
            self.tick()
            if limits[0] == 1:  # one peer slot: a third engine finds it taken (no draw of its own)
                kind = STRANGER_CONNECTS[(2 * len(stored) + len(loaded) + KV_IDS.index(kv)) % len(STRANGER_CONNECTS)]
                self._stranger("D" if consume else "P", kind, dial=load_first)
            elif limits[0] == 2:  # idle sessions are evicted: NIXL refuses a removed peer's next release
                self._all("fail_releases", "P" if consume else "D", 1, "dlist" if load_first else "agent")
            if symmetric:
                self.catalogue(SYM_IDS[0], 1, pending)
                self.symmetric_request(SYM_IDS[0])
                self._probe(max(self.symmetric), list(range(KEYS_PER_KV)), 4, lambda: True)

        @precondition(lambda self: self._alive("P") and self._alive("D"))
        @rule(kv=st.sampled_from(KV_IDS), stored=KEY_LISTS, loaded=KEY_LISTS, load_first=st.booleans(),
              consume=st.booleans())
        def share(self, kv: str, stored: list[int], loaded: list[int], load_first: bool, consume: bool) -> None:
            """One request shared: both sides' requests for ``kv`` (opened if none), a store on P and
            a load on D, in either order (the fetch may find the blocks parked, or wait for them);
            without ``consume`` only P's side (its stores park until a fetch, or are reaped)."""
            ends = {}
            for node, role in (("P", "remote_decoder"), ("D", "remote_prefiller"))[:2 if consume else 1]:
                req = next((r for r, k in self.reqs[node].items() if k == kv), None)
                if req is None:
                    req = f"{node.lower()}{self.next_req}"
                    self.next_req += 1
                    self._all("new_request", node, req, role, kv)
                    self.reqs[node][req] = kv
                ends[node] = req
            steps = [("P", "submit_store", stored), ("D", "submit_load", loaded)][:2 if consume else 1]
            for node, call, idx in (steps[::-1] if load_first else steps):
                self.next_job += 1
                keys = [key_of(kv, i) for i in idx]
                if node == "D":
                    self._all("lookup", "D", ends["D"], keys[0])
                    self.loads[self.next_job] = keys
                self._all(call, node, ends[node], self.next_job, keys, [slot_of(kv, i) for i in idx])

        @precondition(lambda self: self._alive("P") and self.reqs["P"])
        @rule(data=st.data())
        def store(self, data: st.DataObject) -> None:
            req = data.draw(st.sampled_from(sorted(self.reqs["P"])), label="request")
            kv = self.reqs["P"][req]
            idx = data.draw(st.lists(st.integers(0, KEYS_PER_KV - 1), min_size=1, max_size=KEYS_PER_KV, unique=True),
                            label="keys")
            self.next_job += 1
            self._all("submit_store", "P", req, self.next_job, [key_of(kv, i) for i in idx],
                      [slot_of(kv, i) for i in idx])

        @precondition(lambda self: self._alive("D") and self._alive("P") and len(self.reqs["D"]) < 4)
        @rule(kv=st.sampled_from(SYM_IDS))
        def symmetric_request(self, kv: str) -> None:
            """A symmetric-P2P consumer (``remote_kv_source``): its lookups probe P (it dials P: only
            while P runs, see :meth:`consumer_request`)."""
            req = f"s{self.next_req}"
            self.next_req += 1
            self._all("new_request", "D", req, "remote_kv_source", kv)
            self.reqs["D"][req] = kv
            self.symmetric.add(req)

        @precondition(lambda self: self._alive("D") and self.symmetric)
        @rule(data=st.data())
        def probe(self, data: st.DataObject) -> None:
            """The scheduler asks the tier about a symmetric request's keys (RETRY until P answers)."""
            req = data.draw(st.sampled_from(sorted(self.symmetric)), label="request")
            idx = data.draw(KEY_LISTS, label="keys")
            steps = data.draw(st.integers(1, 3), label="steps")
            self._probe(req, idx, steps, lambda: data.draw(st.booleans(), label="fetch"))

        def _probe(self, req: str, idx: list[int], steps: int, fetch) -> None:
            kv = self.reqs["D"][req]
            for step in range(steps):  # the scheduler asks again each step
                if step:
                    self.tick()
                if req not in self.symmetric or not self._alive("D"):
                    return
                for i in idx:
                    result = self._all("lookup", "D", req, key_of(kv, i))
                    if result == "HIT":
                        COVERAGE.probe_hits += 1
                    elif result == "MISS":
                        COVERAGE.probe_misses += 1
                    else:
                        COVERAGE.probe_retries += 1
            confirmed = self._confirmed(req) if req in self.symmetric and self._alive("D") else []
            if confirmed and fetch():  # load what the peer confirmed
                self._load_confirmed(req, confirmed)

        def _confirmed(self, req: str) -> list[int]:
            """The keys of ``req``'s id that the peer answered HIT in the current lookup round: all
            the scheduler may fetch (vLLM asserts it). The round is per id and ends with any fetch,
            finish or session loss, so it is read from the tier's state (equal in every world)."""
            kv = self.reqs["D"][req]
            snap = next(iter(self.worlds.values())).snapshot("D")
            probes = snap["sessions"].get("P", {}).get("probes", {}).get(kv, [])
            return sorted(int(k.decode().split("/")[1]) for k, hit in probes if hit is True)

        def _load_confirmed(self, req: str, idx: list[int]) -> None:
            kv = self.reqs["D"][req]
            keys = [key_of(kv, i) for i in idx]
            self.next_job += 1
            self.loads[self.next_job] = keys
            COVERAGE.symmetric_loads += bool(keys)
            self._all("submit_load", "D", req, self.next_job, keys, [slot_of(kv, i) for i in idx])

        @precondition(lambda self: self._alive("P"))
        @rule(kv=st.sampled_from(SYM_IDS), i=st.integers(0, KEYS_PER_KV - 1), pending=st.sampled_from((-1, 0, 1, 3)))
        def catalogue(self, kv: str, i: int, pending: int) -> None:
            """P's tiering manager drops a key (-1), holds it, or is still promoting it (HIT_PENDING
            for the next ``pending`` lookups)."""
            self._all("hold", "P", key_of(kv, i), slot_of(kv, i), pending)

        @precondition(lambda self: self._alive("D") and self.reqs["D"])
        @rule(data=st.data())
        def load(self, data: st.DataObject) -> None:
            req = data.draw(st.sampled_from(sorted(self.reqs["D"])), label="request")
            kv = self.reqs["D"][req]
            if req in self.symmetric:  # the scheduler loads only keys the peer confirmed (vLLM asserts it)
                confirmed = self._confirmed(req)
                idx = data.draw(st.lists(st.sampled_from(confirmed or [0]), unique=True, min_size=min(1, len(confirmed)),
                                         max_size=len(confirmed)), label="keys")
                self._load_confirmed(req, idx)
                return
            idx = data.draw(st.lists(st.integers(0, KEYS_PER_KV - 1), max_size=KEYS_PER_KV, unique=True), label="keys")
            keys = [key_of(kv, i) for i in idx]
            self._all("lookup", "D", req, keys[0] if keys else key_of(kv, 0))
            self.next_job += 1
            self.loads[self.next_job] = keys
            self._all("submit_load", "D", req, self.next_job, keys, [slot_of(kv, i) for i in idx])

        @precondition(lambda self: any(self.reqs[n] and self._alive(n) for n in ("P", "D")))
        @rule(data=st.data())
        def finish(self, data: st.DataObject) -> None:
            node = data.draw(st.sampled_from([n for n in ("P", "D") if self.reqs[n] and self._alive(n)]), label="node")
            req = data.draw(st.sampled_from(sorted(self.reqs[node])), label="request")
            self._all("finish", node, req)
            del self.reqs[node][req]
            self.symmetric.discard(req)

        @rule(node=st.sampled_from(("P", "D")), twice=st.booleans())
        def poll(self, node: str, twice: bool) -> None:
            """One poll, or a drain and two polls (``drain_jobs``, a reset's first step: poll sweeps
            until the engine has no load or write outstanding, cut after a few as the other engine
            does not act meanwhile; what it collects the polls report). The drain takes no draw of
            its own, so the traces are those drawn before drains were modelled."""
            if twice and self._alive(node):
                drained = self._all("drain", node)
                COVERAGE.drains += drained
                COVERAGE.drains_cut += not drained
            for _ in range(2 if twice else 1):
                if self._alive(node):
                    self._jobs(self._all("poll", node))

        @rule()
        def tick(self) -> None:
            """Each engine serves its peer's lookups and ends its step (its own lookups go out); writes
            land and both engines poll; twice: what a healthy pair does between steps."""
            self._tick("ok")

        @rule(land=st.sampled_from(("fail", "remote_disconnect", "not_found")))
        def rough_tick(self, land: str) -> None:
            """A tick whose WRITEs do not land: they fail (ERR, a strike each), or their state check
            raises NIXL's ``land`` error (:meth:`break_transfers`). Writes are only in flight
            between P's poll that submits them and the next tick, so a tick is where they fail."""
            self._tick(land)

        def _tick(self, land: str) -> None:
            for _ in range(2):
                for node in ("P", "D"):
                    if self._alive(node):
                        self._all("serve", node)
                        self._all("schedule_end", node)
                if self._alive("P"):
                    if land in ("ok", "fail"):
                        self._all("complete_transfers", "P", NUM_BLOCKS, land == "ok")
                    else:
                        COVERAGE.broken += self._all("break_transfers", "P", NUM_BLOCKS, land)
                for node in ("P", "D"):
                    if self._alive(node):
                        self._jobs(self._all("poll", node))

        @precondition(lambda self: self._alive("P"))
        @rule(count=st.integers(1, 2), ok=st.booleans())
        def complete_transfers(self, count: int, ok: bool) -> None:
            self._all("complete_transfers", "P", count, ok)

        @precondition(lambda self: self._alive("P"))
        @rule(count=st.integers(1, 2), error=st.sampled_from(("remote_disconnect", "not_found")))
        def break_transfers(self, count: int, error: str) -> None:
            """NIXL fails P's oldest writes by raising from their state check: a remote disconnect
            (terminal), or a handle it no longer knows (the write may still land: kept in flight)."""
            COVERAGE.broken += self._all("break_transfers", "P", count, error)

        @precondition(lambda self: self._alive("P") and self._alive("D"))
        @rule(data=st.data())
        def out_of_protocol(self, data: st.DataObject) -> None:
            """A peer sends what its roles would not: a fetch for any round (a duplicate is a
            protocol error), unsolicited or late acks, a second connect, malformed or unknown
            messages. Each engine must answer as vLLM's does (warn, ack, or disconnect)."""
            kv = data.draw(st.sampled_from(KV_IDS), label="kv")
            rnd = data.draw(st.integers(0, 1), label="round")
            idx = data.draw(KEY_LISTS, label="keys")
            keys = [key_of(kv, i) for i in idx]
            node, msg = data.draw(st.sampled_from([
                ("D", {"type": "fetch", "kv_request_id": kv, "keys": keys,
                       "block_indexes": [slot_of(kv, i) for i in idx], "round_seq": rnd}),
                ("D", {"type": "fetch", "kv_request_id": kv, "keys": keys, "block_indexes": [], "round_seq": rnd}),
                ("D", {"type": "abort_fetch", "kv_request_id": kv, "round_seq": rnd}),
                ("P", {"type": "transfer_done", "kv_request_id": kv, "success": True, "round_seq": rnd}),
                ("P", {"type": "abort_ack", "kv_request_id": kv, "round_seq": rnd}),
                ("P", {"type": "transfer_done", "kv_request_id": 7, "success": True, "round_seq": rnd}),
                ("D", {"type": "no-such-message"}),
                ("D", {"type": "lookup", "kv_request_id": kv, "keys": keys, "round_seq": rnd}),
                ("P", {"type": "lookup_resp", "kv_request_id": kv, "keys": keys, "hits": [True] * len(keys)}),
                ("P", {"type": "lookup_resp", "kv_request_id": kv, "keys": keys, "hits": []}),
                ("D", "connect"), ("P", "connect"),
                ("D", {"type": "fetch", "kv_request_id": kv, "keys": keys, "block_indexes": [-1] * len(keys),
                       "round_seq": rnd}),
                ("P", {"type": "lookup_resp", "kv_request_id": kv, "keys": keys, "hits": [1] * len(keys)}),
                ("D", {"type": "abort_fetch", "kv_request_id": kv, "round_seq": -1}),
                ("D", {"type": "lookup", "kv_request_id": kv, "keys": kv, "round_seq": rnd}),
            ]), label="message")
            if self._all("inject", node, msg) and isinstance(msg, dict) and msg["type"] == "transfer_done":
                # the consumer trusts its peer: a forged success ends a load with nothing written
                self.forged.add(kv)

        @precondition(lambda self: any(self._alive(n) and len(self.reqs[n]) < 4 for n in ("P", "D")))
        @rule(data=st.data(), role=st.sampled_from(MALFORMED))
        def malformed_request(self, data: st.DataObject, role: str) -> None:
            """A request whose kv_transfer_params are missing or lack what its role needs: not a P2P
            request to vLLM (lookups MISS, stores succeed, loads fail), or a producer without an id
            (its stores fail). The store, load and finish rules then use it like any other."""
            node = data.draw(st.sampled_from([n for n in ("P", "D") if self._alive(n) and len(self.reqs[n]) < 4]),
                             label="node")
            req = f"m{self.next_req}"
            self.next_req += 1
            self._all("new_request", node, req, role, ODD_IDS[0])
            self._all("lookup", node, req, key_of(ODD_IDS[0], 0))
            self.reqs[node][req] = ODD_IDS[0]
            COVERAGE.malformed_requests += 1

        @rule(data=st.data(), node=st.sampled_from(("P", "D")),
              what=st.sampled_from(("writes", "registration", "seed")))
        def refuse(self, data: st.DataObject, node: str, what: str) -> None:
            """What the engines' setup can refuse, armed for what comes next (one rule, so the
            other rules keep their share of the draws):

            * ``writes``: NIXL refuses P's next WRITE submissions (vLLM ``write_blocks``'s except
              path) as a post that reports ERR or raises a remote disconnect, a transfer that
              cannot be prepared, or one whose error names NIXL_ERR_NOT_FOUND: a strike each (three
              in a row fault the peer), or a peer fault at once;
            * ``registration``: ``node``'s next peer registration fails (the peer's descriptors
              cannot be prepared): that handshake is refused and the session reaped;
            * ``seed``: ``node`` opens its next sessions with another hash seed (or the shared one
              again): a peer whose seed differs is refused at the handshake (vLLM ``_on_connect``)."""
            if what == "writes":
                node = "P"
            if not self._alive(node):
                return
            if what == "writes":
                count = data.draw(st.integers(1, 3), label="count")
                self._all("fail_submissions", "P", count, data.draw(st.sampled_from(sorted(SUBMIT_ERRORS)), label="kind"))
            elif what == "registration":
                self._all("fail_registrations", node, 1)
            else:
                self._all("reseed", node, data.draw(st.booleans(), label="differs"))

        def _stranger(self, node: str, kind: str, dial: bool) -> None:
            """A third engine appears: where ``node``'s peer slots are all taken and with ``dial``,
            ``node`` opens a consumer request whose source is the stranger: no dial is made, its
            lookup MISSes and its load fails (vLLM ``_get_or_create_session``'s limit); then the
            stranger sends ``node`` a handshake of :data:`STRANGER_CONNECTS` kind ``kind`` (another
            block length or model config, no blocks, a bad peer id, another hash seed), refused
            before any session exists at the limit (``_accept_new_peers``), else by the session it
            opens. The request is finished here, under ids and job numbers of its own, and no session
            to the stranger outlives the call: the rest of the trace is the one drawn before."""
            COVERAGE.strangers += 1
            ref = self.worlds.get("ref")
            scarce = ref is not None and len(ref.managers[node].sessions) >= ref.managers[node].max_peers
            req = None
            if dial and scarce:
                self.strangers += 1
                req, job = f"x{self.strangers}", STRANGER_JOBS + self.strangers
                self._all("stranger_request", node, req, ODD_IDS[0])
                self._all("lookup", node, req, key_of(ODD_IDS[0], 0))
                self.loads[job] = [key_of(ODD_IDS[0], 0)]
                self._all("submit_load", node, req, job, [key_of(ODD_IDS[0], 0)], [slot_of(ODD_IDS[0], 0)])
            self._all("stranger_connects", node, kind)
            self._jobs(self._all("poll", node))
            if req is not None:
                self._all("finish", node, req)

        @rule()
        def pause(self) -> None:
            """The engines go quiet for longer than the idle timeout, then a healthy tick: a session
            with no pending work is evicted where peer slots are scarce (vLLM ``_reap_idle_sessions``)."""
            self._all("advance", self.idle_timeout_s + 1)
            self.tick()

        @rule(seconds=st.sampled_from(ADVANCES))
        def advance(self, seconds: float) -> None:
            self._all("advance", seconds)
            if seconds >= 31:
                COVERAGE.aborts += 1

        @precondition(lambda self: self._alive("P"))
        @rule(now=st.integers(0, 7))
        def fault(self, now: int) -> None:
            if now:  # rare: one draw in eight
                return
            self._all("fault", "P")
            COVERAGE.faults += 1

        @precondition(lambda self: self._alive("P") and self._alive("D") and len(self.reqs["D"]) < 3)
        @rule(node=st.sampled_from(("P", "D")), kv=st.sampled_from(KV_IDS))
        def refault(self, node: str, kv: str) -> None:
            """A peer that keeps faulting: ``node``'s data plane judges the other engine unusable, the
            session is torn down, D dials P again for a new request; twice. The second teardown
            follows the first within the backoff window, so the next dial waits it out (vLLM
            ``_schedule_reconnect_backoff``): D refuses to dial (its request fails), or P refuses D's
            connection with a DisconnectMsg."""
            for _ in range(2):
                self._all("fault", node)
                self.tick()
                if not (self._alive("D") and self._alive("P")):
                    return
                self.consumer_request(kv)
                self.tick()
            COVERAGE.refaults += 1

        @precondition(lambda self: self._alive("P") and self._alive("D"))
        @rule(node=st.sampled_from(("P", "D")), now=st.integers(0, 7))
        def shutdown(self, node: str, now: int) -> None:
            if now:  # rare: one draw in eight
                return
            COVERAGE.shutdown_drains += node == "P" and self._writes_in_flight()
            self._jobs(self._all("shutdown", node))
            self.reqs[node].clear()
            if node == "D":
                self.symmetric.clear()
            COVERAGE.shutdowns += 1

    return P2PMachine


def run_p2p_machine(with_vllm: bool, examples: int, steps: int = 30, reproducible: bool = False,
                    shrink: bool = True, seed: int | None = None) -> tuple[bool, str, str | None]:
    """Run the machine once outside pytest: ``(ok, failure, signature)``."""
    from kvref.models.machines.scheduler import run_lockstep_machine

    factories: dict[str, Any] = {"ref": P2PWorld}
    if with_vllm:
        from kvref.impl.vllm.p2p import VllmP2PWorld

        factories = {"vllm": VllmP2PWorld, **factories}
    machine = make_machine(factories)
    return run_lockstep_machine(machine, examples=examples, steps=steps, min_steps=min(steps, 10), seed=seed,
                                reproducible=reproducible, shrink=shrink)


#: ``unbound_store_timeout_s`` options a deployment may write: numbers of every kind, numeric and
#: other strings, None, bools and a list (vLLM converts with ``float()`` and wants a positive result)
TIER_TIMEOUTS = st.one_of(
    st.floats(allow_nan=True, allow_infinity=True), st.integers(-3, 10**6),
    st.sampled_from(["60", " 2.5 ", "nan", "inf", "-1", "0", "1e-9", "abc", "", "1_0"]),
    st.none(), st.booleans(), st.just([1]))


def run_p2p_config_cases(examples: int, seed: int | None = None) -> tuple[bool, str]:
    """vLLM's P2P tier built with generated tier options (``unbound_store_timeout_s``, a back-pressure
    detector) beside the reference world: refused by both (vLLM's ValueError, the reference's
    InvalidFieldError), or accepted by both with the same resolved timeout on each engine.
    ``(ok, failure)``; derandomized under ``seed`` (the same options every run)."""
    import math

    from hypothesis import HealthCheck, given, settings

    from kvref.impl.vllm.p2p import VllmP2PWorld

    def outcome(factory, timeout: object, backpressure: bool) -> tuple:
        try:
            world = factory(unbound_store_timeout_s=timeout, backpressure=backpressure)
        except Exception as exc:  # noqa: BLE001 - vLLM's refusal must be a ValueError, as the reference's
            return ("refused", isinstance(exc, ValueError))
        try:
            return ("accepted", {n: ("nan" if math.isnan(v) else v) for n, v in world.unbound_store_timeout_s.items()})
        finally:
            world.close()

    @settings(max_examples=examples, derandomize=seed is None, database=None, deadline=None,
              suppress_health_check=list(HealthCheck))
    @given(timeout=TIER_TIMEOUTS, backpressure=st.booleans())
    def case(timeout: object, backpressure: bool) -> None:
        got = {name: outcome(f, timeout, backpressure) for name, f in (("vllm", VllmP2PWorld), ("ref", P2PWorld))}
        if got["vllm"] != got["ref"]:
            raise Divergence(f"tier options (unbound_store_timeout_s={timeout!r}, backpressure={backpressure})", got)

    import hypothesis.core as hcore

    saved = hcore.global_force_seed
    if seed is not None:
        hcore.global_force_seed = seed
    try:
        case()
        return True, ""
    except Divergence as exc:
        return False, str(exc)
    finally:
        hcore.global_force_seed = saved
