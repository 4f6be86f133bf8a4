"""Two engines sharing KV chunks peer to peer: a producer ``P`` and a consumer ``D``.

The reference world the conformance machine drives beside vLLM's (:mod:`kvref.impl.vllm.p2p`):
each engine is a :class:`~.manager.P2PTierManager` over its own primary buffer, control plane
and data plane; the network delivers every message in order to the receiver's listening socket,
where its next poll picks it up; a message to an engine that has gone is lost. Time is one
virtual clock both engines read. The calls and the observables (:meth:`P2PWorld.snapshot`,
:meth:`P2PWorld.messages`, the job results, the buffers) are the same as the vLLM world's.
"""

from __future__ import annotations

from kvref.spec.errors import InvalidFieldError, check_int

from . import messages as m
from .control import ControlPlane
from .manager import IDLE_TIMEOUT_S, MAX_PEERS, ROLES, UNBOUND_STORE_TIMEOUT_S, P2PTierManager, unbound_store_timeout
from .parent import ScriptedParent, ctx_key
from .transport import BREAK_STATUS, SUBMIT_ERRORS, DataPlane

NODES = ("P", "D")
MAX_BUFFER_BYTES = 1 << 26
PORT = 1  # every reference engine "listens" on port 1 of a host named after it: ids "P:1", "D:1"
#: poll sweeps a drain may take in a world (vLLM's has no limit; one engine alone could wait forever
#: for the other's writes)
DRAIN_POLLS = 3
#: ``kv_transfer_params`` beyond the three well-formed roles: none at all, and each role's block
#: missing what makes it usable. vLLM reads these as "not a P2P request" (lookups MISS, stores
#: succeed locally, loads fail), except a ``remote_decoder`` block without an id: still a producer,
#: whose stores must fail rather than succeed locally (vLLM ``P2PDestInfo``).
MALFORMED = ("no_params", "remote_decoder_without_id", "remote_prefiller_without_address",
             "remote_kv_source_without_id")
#: the hash seed every engine starts with, and the one a reseeded engine announces instead
HASH_SEEDS = ("kvref", "kvref-reseeded")
#: the config fingerprint every engine of a world announces (one model config; vLLM hashes it)
FINGERPRINT = "kvref-model"
#: a third engine that only speaks the control protocol (no tier, no data plane): it dials the
#: engines with handshakes they must refuse, and never answers what they send it
STRANGER = "X"
#: how the stranger's ``connect`` is incompatible (vLLM ``ConnectMsg.validate`` and ``_on_connect``):
#: another block length, no blocks, a peer id that is not a str, another model config, another seed
STRANGER_CONNECTS = ("block_len", "num_blocks", "peer_id", "fingerprint", "seed")


def stranger_hello(kind: str, peer_id: str, num_blocks: int, block_len: int) -> dict:
    """The stranger's ``connect`` of :data:`STRANGER_CONNECTS` kind ``kind`` (otherwise what a world's
    own engines announce): every kind is one an engine must refuse at the handshake."""
    if not isinstance(kind, str) or kind not in STRANGER_CONNECTS:
        raise InvalidFieldError("kind", kind, f"one of {STRANGER_CONNECTS}")
    check_int("num_blocks", num_blocks, minimum=1)
    check_int("block_len", block_len, minimum=1)
    msg = m.connect(_str("peer_id", peer_id), num_blocks, block_len, FINGERPRINT, HASH_SEEDS[0])
    msg.update({"block_len": {"block_len": 2 * block_len}, "num_blocks": {"num_blocks": 0},
                "peer_id": {"peer_id": 7}, "fingerprint": {"config_fingerprint": "another-model"},
                "seed": {"hash_seed": "another-seed"}}[kind])
    return msg


def malformed_params(role: str, kv_request_id: str, host: str, port: int) -> dict | None:
    """The ``kv_transfer_params`` of a :data:`MALFORMED` role (the other engine at ``host:port``)."""
    if not isinstance(role, str) or role not in MALFORMED:
        raise InvalidFieldError("role", role, f"one of {MALFORMED}")
    return {"no_params": None,
            "remote_decoder_without_id": {"remote_decoder": {}},
            "remote_prefiller_without_address": {"remote_prefiller": {"kv_request_id": kv_request_id}},
            "remote_kv_source_without_id": {"remote_kv_source": {"remote_host": host, "remote_port": port}},
            }[role]


def _name(engine_id: str) -> str:
    return engine_id.rsplit(":", 1)[0]


def _node(node: object) -> str:
    if not isinstance(node, str) or node not in NODES:
        raise InvalidFieldError("node", node, f"one of {NODES}")
    return node


#: most refusals armed at once (a model world: a handful of WRITEs or handshakes per trace)
MAX_ARMED = 64


def _count(count: object) -> None:
    check_int("count", count, minimum=0)
    if count > MAX_ARMED:
        raise InvalidFieldError("count", count, f"at most {MAX_ARMED} refusals armed at once")


def _str(field: str, value: object) -> str:
    if not isinstance(value, str) or not value:
        raise InvalidFieldError(field, value, "a non-empty str")
    return value


class P2PWorld:
    def __init__(self, num_blocks: int = 8, block_len: int = 16, max_peers: int = MAX_PEERS,
                 idle_timeout_s: int = IDLE_TIMEOUT_S, unbound_store_timeout_s: object = UNBOUND_STORE_TIMEOUT_S,
                 backpressure: bool = False) -> None:
        """``max_peers`` and ``idle_timeout_s`` are vLLM's ``VLLM_P2P_MAX_PEERS`` and
        ``VLLM_P2P_IDLE_TIMEOUT_S`` (0 disables idle eviction) for both engines; the tier options
        ``unbound_store_timeout_s`` and a ``backpressure`` detector are resolved or refused as
        vLLM's tier does (:func:`~.manager.unbound_store_timeout`)."""
        check_int("num_blocks", num_blocks, minimum=1)
        check_int("block_len", block_len, minimum=1)
        check_int("max_peers", max_peers, minimum=1)
        check_int("idle_timeout_s", idle_timeout_s, minimum=0)
        unbound_s = unbound_store_timeout(unbound_store_timeout_s, backpressure)
        if num_blocks * block_len > MAX_BUFFER_BYTES:
            raise InvalidFieldError("num_blocks * block_len", num_blocks * block_len,
                                    f"at most {MAX_BUFFER_BYTES} bytes per engine (a model world, not a cache)")
        self.num_blocks, self.block_len = num_blocks, block_len
        self.now = 1000.0
        self.log: list[tuple[str, str, tuple]] = []
        self.alive = {n: True for n in NODES}
        self.planes = {n: DataPlane(n, bytearray(num_blocks * block_len), block_len) for n in NODES}
        # the stranger (:data:`STRANGER`) never goes away: a dial to it never fails
        self.controls = {n: ControlPlane(f"{n}:{PORT}", self._deliver,
                                         lambda pid: not self.alive.get(_name(pid), True)) for n in NODES}
        self.managers = {n: P2PTierManager(f"{n}:{PORT}", self.planes[n], self.controls[n],
                                           m.connect(f"{n}:{PORT}", num_blocks, block_len, FINGERPRINT, HASH_SEEDS[0]),
                                           self._resolve, max_peers=max_peers, idle_timeout_s=idle_timeout_s,
                                           unbound_store_timeout_s=unbound_s)
                         for n in NODES}
        self.parents = {n: ScriptedParent() for n in NODES}  # each engine's tiering manager, as its tier sees it
        #: the parked-store timeout each engine resolved from its tier option
        self.unbound_store_timeout_s = {n: self.managers[n].unbound_store_timeout_s for n in NODES}

    def _resolve(self, connect_msg: dict) -> DataPlane | None:
        peer = _name(connect_msg["peer_id"])
        return self.planes[peer] if self.alive.get(peer) else None

    def _deliver(self, src: str, dst: str, msg: dict) -> None:
        self.log.append((_name(src), _name(dst), m.summarize(msg)))
        if _name(dst) in self.controls and self.alive[_name(dst)]:  # the stranger reads nothing
            self.controls[_name(dst)].arrived.append((src, msg))

    # -- the world's calls ------------------------------------------------------------------------

    def peer_params(self, node: str, role: str, kv_request_id: str) -> dict:
        """The ``kv_transfer_params`` of a request on ``node`` in ``role`` toward the other engine."""
        other = NODES[1 - NODES.index(_node(node))]
        _str("kv_request_id", kv_request_id)
        if role not in ROLES + MALFORMED:
            raise InvalidFieldError("role", role, f"one of {ROLES + MALFORMED}")
        if role in MALFORMED:
            return malformed_params(role, kv_request_id, other, PORT)
        if role == "remote_decoder":
            return {role: {"kv_request_id": kv_request_id}}
        return {role: {"kv_request_id": kv_request_id, "remote_host": other, "remote_port": PORT}}

    def new_request(self, node: str, req_id: str, role: str, kv_request_id: str) -> str:
        """Open a request on ``node`` (``remote_decoder``: a producer; ``remote_prefiller``: a
        consumer of the other engine; or one of :data:`MALFORMED`); returns the offload policy the
        tier asks for."""
        mgr = self._live(node)
        if _str("req_id", req_id) in mgr.requests:
            raise InvalidFieldError("req_id", req_id, f"a request id not open on {node}")
        params = self.peer_params(node, role, _str("kv_request_id", kv_request_id))
        return mgr.on_new_request(req_id, params, self.now)

    def stranger_request(self, node: str, req_id: str, kv_request_id: str) -> str:
        """Open a consumer request on ``node`` whose source is the stranger (:data:`STRANGER`): the
        engine dials it unless its peer slots are all taken (vLLM ``_get_or_create_session``'s
        limit), and the stranger never completes the handshake."""
        mgr = self._live(node)
        if _str("req_id", req_id) in mgr.requests:
            raise InvalidFieldError("req_id", req_id, f"a request id not open on {node}")
        params = {"remote_prefiller": {"kv_request_id": _str("kv_request_id", kv_request_id),
                                       "remote_host": STRANGER, "remote_port": PORT}}
        return mgr.on_new_request(req_id, params, self.now)

    def stranger_connects(self, node: str, kind: str) -> None:
        """The stranger sends ``node`` a ``connect`` of :data:`STRANGER_CONNECTS` kind ``kind``: at its
        peer limit the engine refuses the connection (vLLM ``_accept_new_peers``), otherwise the
        session it opens refuses the handshake."""
        self._live(node)
        msg = stranger_hello(kind, f"{STRANGER}:{PORT}", self.num_blocks, self.block_len)
        self._deliver(f"{STRANGER}:{PORT}", f"{node}:{PORT}", msg)

    def _live(self, node: object) -> P2PTierManager:
        mgr = self.managers[_node(node)]
        if not self.alive[node]:
            raise InvalidFieldError("node", node, "an engine that has not shut down")
        return mgr

    def _request(self, node: object, req_id: object) -> P2PTierManager:
        mgr = self._live(node)
        if not isinstance(req_id, str) or req_id not in mgr.requests:
            raise InvalidFieldError("req_id", req_id, f"a request open on {node}: {sorted(mgr.requests)}")
        return mgr

    def _job(self, job_id: object, keys: object, chunk_ids: object) -> tuple[list[bytes], list[int]]:
        check_int("job_id", job_id, minimum=0)
        if not isinstance(keys, (list, tuple)) or not all(isinstance(k, bytes) and k for k in keys):
            raise InvalidFieldError("keys", keys, "a list of non-empty bytes keys")
        if not isinstance(chunk_ids, (list, tuple)) or len(chunk_ids) != len(keys):
            raise InvalidFieldError("chunk_ids", chunk_ids, f"a list of {len(keys)} slot ids, one per key")
        for c in chunk_ids:
            check_int("chunk_ids", c, minimum=0)
            if c >= self.num_blocks:
                raise InvalidFieldError("chunk_ids", chunk_ids, f"slot ids below num_blocks={self.num_blocks}")
        return list(keys), list(chunk_ids)

    def lookup(self, node: str, req_id: str, key: bytes) -> str:
        """The tier's answer for ``key``: HIT / MISS, or RETRY while a symmetric probe is unanswered."""
        if not isinstance(key, bytes) or not key:
            raise InvalidFieldError("key", key, "non-empty bytes")
        return self._request(node, req_id).lookup(req_id, key)

    def hold(self, node: str, key: bytes, chunk_id: int, pending: int) -> None:
        """``node``'s tiering manager holds ``key`` at primary slot ``chunk_id`` (answering
        HIT_PENDING to the next ``pending`` lookups), or no longer holds it (``pending < 0``)."""
        self._live(node)
        self._slots([chunk_id])
        self.parents[node].hold(key, chunk_id, pending)

    def serve(self, node: str) -> None:
        """``serve_external_requests``: the tier answers its peers' lookups against its parent."""
        self._live(node).serve_external_requests(self.parents[node], self.now)

    def schedule_end(self, node: str) -> None:
        """``on_schedule_end``: the lookups registered in this step go out."""
        self._live(node).on_schedule_end(self.now)

    def parent_log(self, node: str) -> list[tuple]:
        """Every call ``node``'s tier made to its parent, in order; then the synthetic requests
        still open (``("open", kv, lookup)``, sorted)."""
        parent = self.parents[_node(node)]
        return list(parent.log) + [("open", *ctx_key(c)) for c in sorted(parent.open, key=ctx_key)]

    def submit_store(self, node: str, req_id: str, job_id: int, keys: list[bytes], chunk_ids: list[int]) -> None:
        mgr = self._request(node, req_id)
        mgr.submit_store(req_id, job_id, *self._job(job_id, keys, chunk_ids), self.now)

    def submit_load(self, node: str, req_id: str, job_id: int, keys: list[bytes], chunk_ids: list[int]) -> None:
        mgr = self._request(node, req_id)
        mgr.submit_load(req_id, job_id, *self._job(job_id, keys, chunk_ids), self.now)

    def finish(self, node: str, req_id: str) -> None:
        self._request(node, req_id).on_request_finished(req_id, self.now)

    def poll(self, node: str) -> list[tuple[int, bool]]:
        return self._live(node).get_finished_jobs(self.now)

    def drain(self, node: str) -> bool:
        """``drain_jobs`` on ``node`` (a reset's first step), its patience :data:`DRAIN_POLLS` poll
        sweeps (the other engine does not act meanwhile); True when it drained."""
        self.now, drained = self._live(node).drain_jobs(self.now, DRAIN_POLLS)
        return drained

    def complete_transfers(self, node: str, count: int, ok: bool) -> int:
        self._live(node)
        check_int("count", count, minimum=0)
        if not isinstance(ok, bool):
            raise InvalidFieldError("ok", ok, "a bool")
        return self.planes[node].complete(count, ok)

    def break_transfers(self, node: str, count: int, error: str) -> int:
        """The oldest ``count`` pending writes of ``node`` break: their state check raises NIXL's
        ``error`` (``remote_disconnect``: terminal; ``not_found``: they stay in flight)."""
        self._live(node)
        check_int("count", count, minimum=0)
        if not isinstance(error, str) or error not in BREAK_STATUS:
            raise InvalidFieldError("error", error, f"one of {sorted(BREAK_STATUS)}")
        return self.planes[node].break_transfers(count, error)

    def fail_submissions(self, node: str, count: int, kind: str, after: int = 0) -> None:
        """NIXL lets ``node``'s next ``after`` WRITE submissions through, then refuses ``count`` as
        ``kind`` (``SUBMIT_ERRORS``)."""
        self._live(node)
        _count(count)
        if not isinstance(kind, str) or kind not in SUBMIT_ERRORS:
            raise InvalidFieldError("kind", kind, f"one of {sorted(SUBMIT_ERRORS)}")
        check_int("after", after, minimum=0)
        if after > MAX_ARMED:
            raise InvalidFieldError("after", after, f"at most {MAX_ARMED}")
        self.planes[node].fail_submissions(count, kind, after)

    def fail_registrations(self, node: str, count: int) -> None:
        """``node``'s next ``count`` peer registrations fail (the handshake is refused)."""
        self._live(node)
        _count(count)
        self.planes[node].registration_failures += count

    def fail_releases(self, node: str, count: int, kind: str) -> None:
        """NIXL refuses ``node``'s next ``count`` releases of a peer's ``kind`` handle when the peer is
        removed (``dlist``: its descriptor list, ``agent``: its remote agent, which stays loaded)."""
        self._live(node)
        _count(count)
        if kind not in ("dlist", "agent"):
            raise InvalidFieldError("kind", kind, 'one of ("dlist", "agent")')
        self.planes[node].release_failures[kind] += count

    def reseed(self, node: str, differs: bool) -> None:
        """``node``'s hash seed for the sessions it opens from now on: the shared one, or another
        (a peer whose seed differs is rejected at the handshake: its block hashes would not match)."""
        mgr = self._live(node)
        if not isinstance(differs, bool):
            raise InvalidFieldError("differs", differs, "a bool")
        mgr._hello = {**mgr._hello, "hash_seed": HASH_SEEDS[differs]}

    def advance(self, seconds: float) -> None:
        if isinstance(seconds, bool) or not isinstance(seconds, (int, float)) or not 0 <= seconds < float("inf"):
            raise InvalidFieldError("seconds", seconds, "a non-negative number")
        self.now += seconds

    def inject(self, node: str, msg: object) -> bool:
        """``node`` sends a raw control message to the other engine on its session's connection,
        bypassing the roles (a peer out of protocol): a dict, or ``"connect"`` for a second
        handshake. False when ``node`` holds no live connection to the other engine."""
        mgr = self._live(node)
        if msg != "connect" and not isinstance(msg, dict):
            raise InvalidFieldError("msg", msg, 'a message dict or "connect"')
        s = mgr.sessions.get(f"{NODES[1 - NODES.index(node)]}:{PORT}")
        if s is None or s.conn is None or not s.conn.alive:
            return False
        s.conn.send(dict(s._hello) if msg == "connect" else dict(msg))
        return True

    def fault(self, node: str) -> None:
        """The data plane judges the other engine unusable (``PollResult.peer_fault``)."""
        self._live(node)
        self.planes[node].set_peer_fault(f"{NODES[1 - NODES.index(node)]}:{PORT}", "injected data-plane fault")

    def shutdown(self, node: str) -> list[tuple[int, bool]]:
        """The engine goes away: its writes drain (up to 3 s), its sessions disconnect."""
        mgr = self._live(node)
        self.now = mgr.shutdown(self.now)
        self.alive[node] = False
        for other in NODES:
            if self.alive[other]:
                self.controls[other].peer_went_away(f"{node}:{PORT}")
        out, mgr.finished = mgr.finished, []
        return out

    def _slots(self, chunk_ids: object) -> list[int]:
        if not isinstance(chunk_ids, (list, tuple)):
            raise InvalidFieldError("chunk_ids", chunk_ids, "a list of slot ids")
        for c in chunk_ids:
            check_int("chunk_ids", c, minimum=0)
            if c >= self.num_blocks:
                raise InvalidFieldError("chunk_ids", chunk_ids, f"slot ids below num_blocks={self.num_blocks}")
        return list(chunk_ids)

    def read(self, node: str, chunk_ids: list[int]) -> list[bytes]:
        """The bytes of ``node``'s buffer slots."""
        buf, n = self.planes[_node(node)].buffer, self.block_len
        chunk_ids = self._slots(chunk_ids)
        return [bytes(buf[c * n:(c + 1) * n]) for c in chunk_ids]

    def write(self, node: str, chunk_ids: list[int], blocks: list[bytes]) -> None:
        """Fill ``node``'s buffer slots (what a store's primary slots hold)."""
        buf, n = self.planes[_node(node)].buffer, self.block_len
        chunk_ids = self._slots(chunk_ids)
        if not isinstance(blocks, (list, tuple)) or len(blocks) != len(chunk_ids) or \
                not all(isinstance(b, bytes) and len(b) == n for b in blocks):
            raise InvalidFieldError("blocks", blocks, f"{len(chunk_ids)} bytes blocks of block_len={n}")
        for c, data in zip(chunk_ids, blocks):
            buf[c * n:(c + 1) * n] = data

    def messages(self) -> list[tuple[str, str, tuple]]:
        return list(self.log)

    def snapshot(self, node: str) -> dict:
        mgr = self.managers[_node(node)]
        sessions = {}
        for pid, s in mgr.sessions.items():
            client = {kv: sorted((r, ld.job_id, ld.aborted_at is not None) for r, ld in st.loads.items())
                      for kv, st in s.client.requests.items() if st.loads}
            srv = s.server
            rounds = {kv: sorted((r, rnd.demand_received, rnd.inflight, rnd.remaining, rnd.cancelled,
                                  rnd.finishing, tuple(sorted(rnd.pending_jobs)), rnd.lookup_supplied)
                                 for r, rnd in st.outbound.items())
                      for kv, st in srv.requests.items() if st.outbound}
            probes = {kv: sorted(st.probes.items()) for kv, st in s.client.requests.items() if st.probes}
            lookups = {kv: (len(st.pending_lookups), sorted((i, lu.round_seq, sorted(lu.pending))
                                                           for i, lu in st.lookups.items()))
                       for kv, st in srv.requests.items() if st.lookups or st.pending_lookups}
            sessions[_name(pid)] = dict(ready=s.send_ready, alive=s.alive, client=client, rounds=rounds,
                                 probes=probes, lookups=lookups,
                                 store_jobs=sorted(srv.store_jobs), inflight=len(srv.inflight),
                                 aborts=sorted(srv.pending_aborts), fault=srv.peer_fault)
        plane = self.planes[node]
        return dict(
            sessions=sessions,
            unbound={kv: [b[0] for b in bs] for kv, bs in sorted(mgr.unbound.items())},
            bound=sorted(mgr.kv_to_session), reaped=sorted(mgr.reaped), failed=sorted(mgr.failed),
            transfers=[(t.transfer_id, _name(t.peer_id), t.local_idxs, t.remote_idxs) for t in plane.pending],
            peers=sorted(_name(p) for p in plane.peers),
            # NIXL holds one remote agent per registered peer, and those whose removal it refused
            agents=sorted(_name(p) for p in set(plane.peers) | plane.leaked),
            strikes={_name(p): n for p, n in sorted(plane.strikes.items())},
            broken=sorted(t.transfer_id for t in plane.broken),
            faults={_name(p): c for p, c in sorted(plane.faults.items())})

    def check_invariants(self) -> None:
        for n in NODES:
            if self.alive[n]:
                self.managers[n].check_invariants()

    def close(self) -> None:
        for n in NODES:
            self.alive[n] = False
