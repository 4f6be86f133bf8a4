"""vLLM's P2P secondary tier, two engines in one process: real managers, sessions and ZMQ.

:class:`VllmP2PWorld` answers the calls of :class:`kvref.impl.reference.offload.p2p.world.P2PWorld`
with two of vLLM 0.33.0's ``P2PSecondaryTierManager`` (``vllm/v1/kv_offload/tiering/p2p/``), a
producer ``P`` and a consumer ``D``, each with its real ``ZmqTransport`` bound on loopback TCP and
its real ``P2PSession``/``ClientRole``/``ServerRole`` objects, and its real ``NixlTransport`` over
NIXL agents with the UCX backend (the tier's default, ``backends=None``), registering each
engine's primary buffer as DRAM: a WRITE the trace lets land (``complete_transfers``) moves the
bytes over UCX on loopback into the peer's buffer, so what one engine stored is what the other
reads back. The harness holds each posted WRITE at the NIXL agent until the trace resolves it, and
reuses one NIXL agent per engine across worlds (:mod:`kvref.impl.vllm.p2p_nixl`).

Determinism, without sleeps that race:

* **Time** is virtual: the ``time`` module the p2p modules see is a namespace whose ``monotonic``
  is the world's clock (``advance``), so load, abort, store, unbound-store and handshake timeouts
  fire exactly when the trace says. vLLM's ``_UnboundStoreBatch`` takes its timestamp from
  ``time.monotonic`` bound at import; the harness restamps a parked batch with the virtual clock.
* **Messages** are counted: every ZMQ DEALER send is counted per (sender, receiver), and before a
  manager polls, its ROUTER is pre-read until it holds every message sent to it (a bounded wait,
  :data:`WIRE_TIMEOUT_S`, failing with :class:`WireTimeout` naming the pair). A poll therefore
  sees exactly the messages the reference's FIFO network delivers.
* **Reconnects** are never refused: a closing DEALER waits until the peer's ROUTER has read what it
  sent and no longer routes to its identity (``_CountingDealer.close``).
* **Teardown** releases everything: :meth:`VllmP2PWorld.close` destroys every ZMQ context with
  linger 0, so no context is left for the garbage collector to ``term()`` mid-run (issue #22).
"""

from __future__ import annotations

import itertools
import logging
import time as _real_time
from collections import deque
from dataclasses import dataclass, field
from functools import lru_cache
from types import SimpleNamespace
from typing import Any

from kvref.impl.vllm.loopback_port import free_loopback_port
from kvref.impl.reference.offload.p2p.messages import summarize
from kvref.impl.reference.offload.p2p.parent import ScriptedParent, ctx_key
from kvref.impl.reference.offload.p2p.world import MALFORMED, STRANGER, malformed_params, stranger_hello
from kvref.impl.vllm import p2p_nixl
from kvref.spec.errors import InvalidFieldError

#: longest a manager's poll waits for a counted message to reach its ROUTER socket
WIRE_TIMEOUT_S = 5.0
HOST = "127.0.0.1"
NODES = ("P", "D")


class WireTimeout(RuntimeError):
    """A message counted as sent on loopback did not arrive within :data:`WIRE_TIMEOUT_S`."""


class VirtualClock:
    """The world's monotonic clock (seconds), advanced only by the trace."""

    def __init__(self, start: float = 1000.0) -> None:
        self.now = start

    def monotonic(self) -> float:
        return self.now

    #: sleeps a drain may still take (None: any number); see :meth:`VllmP2PWorld.drain`
    sleeps_left: int | None = None

    def sleep(self, seconds: float) -> None:
        """A drain loop's sleep passes virtual time (vLLM's shutdown drain waits up to 3 s); past
        ``sleeps_left`` it raises :class:`DrainCut` instead (the caller's patience ran out)."""
        if self.sleeps_left is not None:
            if self.sleeps_left <= 0:
                raise DrainCut("drain_jobs still had work after its poll sweeps")
            self.sleeps_left -= 1
        self.now += seconds


class DrainCut(RuntimeError):
    """A ``drain_jobs`` the world cut short (:data:`~kvref.impl.reference.offload.p2p.world.DRAIN_POLLS`)."""


@dataclass
class Wire:
    """Counts and logs every control message between the engines (by their ``host:port`` ids)."""

    sent: dict[tuple[str, str], int] = field(default_factory=dict)
    received: dict[tuple[str, str], int] = field(default_factory=dict)
    log: list[tuple[str, str, tuple]] = field(default_factory=list)
    closed: set[str] = field(default_factory=set)
    routers: dict[str, Any] = field(default_factory=dict)
    #: every ZMQ context the world's transports made (:meth:`VllmP2PWorld.close` destroys each)
    contexts: list = field(default_factory=list)
    #: set by :meth:`VllmP2PWorld.close`: the trace is over, a closing socket waits for nothing
    closing: bool = False


@lru_cache(maxsize=1)
def _classes() -> SimpleNamespace:
    """vLLM-facing classes, built on first use (this module imports vLLM lazily)."""
    import msgspec
    import zmq
    from vllm.v1.kv_offload.tiering.p2p.control.zmq import ZmqTransport

    class _CountingDealer:
        """A DEALER socket that counts and logs what it sends (for the settle wait)."""

        def __init__(self, sock, wire: Wire, src: str, dst: str) -> None:
            self._sock, self._wire, self._src, self._dst = sock, wire, src, dst
            self._connected = False

        def send(self, data, flags=0):
            self._sock.send(data, flags)
            self._connected = True
            key = (self._src, self._dst)
            self._wire.sent[key] = self._wire.sent.get(key, 0) + 1
            self._wire.log.append((self._src, self._dst, summarize(msgspec.msgpack.decode(data))))

        def close(self, *args):
            """Close so that a reconnect under the same identity is never refused.

            A ROUTER refuses a second connection whose identity it still routes to (no
            ``ROUTER_HANDOVER``), silently dropping what it carries: a race between two loopback
            sockets that the traces must not depend on. So, while the peer's ROUTER is open: first
            every message counted as sent here is read ahead there (the connection is registered,
            and nothing it carries, such as a ``DisconnectMsg``, is still on the way), then the
            socket closes, then the harness waits until that ROUTER no longer routes to this
            identity (:meth:`_PrefetchingRouter.await_release`). Both waits end on an observed
            condition, each capped by :data:`WIRE_TIMEOUT_S` with a :class:`WireTimeout`."""
            router = self._wire.routers.get(self._dst)
            live = router is not None and self._dst not in self._wire.closed and not self._wire.closing
            if live and self._connected:
                router.settle()
            elif live:  # it sent nothing (a connection refused at once): its dial may still be registering
                router.await_registration(self._src)
            self._sock.close(*args)
            if live:
                router.await_release(self._src)

        def __getattr__(self, name):
            return getattr(self._sock, name)

    class _PrefetchingRouter:
        """A ROUTER socket whose messages the harness can read ahead into a queue."""

        def __init__(self, sock, wire: Wire, me: str) -> None:
            self._sock, self._wire, self._me = sock, wire, me
            self._ahead: deque = deque()
            # vLLM's ROUTER only receives; the harness's probe sends (to a closed DEALER that never
            # reads) and needs an unknown identity to raise instead of being dropped silently
            sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
            # and a probe still queued must never hold up the context's term() (vLLM sets 0 at close)
            sock.setsockopt(zmq.LINGER, 0)
            wire.routers[me] = self

        def routes_to(self, peer: str) -> bool:
            """Whether this ROUTER still holds a connection under ``peer``'s identity."""
            try:
                self._sock.send_multipart([peer.encode(), b""], zmq.NOBLOCK)
            except zmq.ZMQError as exc:
                if exc.errno == zmq.EHOSTUNREACH:
                    return False
                if exc.errno == zmq.EAGAIN:  # the pipe exists but is terminating
                    return True
                raise
            return True

        def await_release(self, peer: str) -> None:
            """Wait until the ROUTER has dropped the closed connection under ``peer``'s identity.

            libzmq releases it in several command round trips between the I/O thread and this
            socket; each probe processes the socket's pending commands. The wait ends when the
            probe says so (never on elapsed time alone), capped by :data:`WIRE_TIMEOUT_S`."""
            deadline = _real_time.monotonic() + WIRE_TIMEOUT_S
            while self.routes_to(peer):
                if _real_time.monotonic() > deadline:
                    raise WireTimeout(f"{self._me} still routes to {peer}'s closed connection")
                _real_time.sleep(0.0002)  # yield to libzmq's I/O thread; the loop re-checks the condition

        def await_registration(self, peer: str) -> None:
            """Wait until this ROUTER holds the connection a DEALER under ``peer``'s identity dialled,
            so the DEALER's close releases it (:meth:`await_release`) instead of the registration
            landing after the close and refusing the identity's next connection. The dial is on
            loopback to a bound socket, so the wait ends on the probe; past :data:`WIRE_TIMEOUT_S` it
            stops waiting (the release wait then sees whatever was registered)."""
            deadline = _real_time.monotonic() + WIRE_TIMEOUT_S
            while not self.routes_to(peer) and _real_time.monotonic() <= deadline:
                _real_time.sleep(0.0002)  # yield to libzmq's I/O thread; the loop re-checks the condition

        def close(self, *args):
            self._wire.routers.pop(self._me, None)
            self._sock.close(*args)

        def _read(self) -> bool:
            try:
                frames = self._sock.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return False
            if len(frames) == 2:
                key = (frames[0].decode(), self._me)
                self._wire.received[key] = self._wire.received.get(key, 0) + 1
            self._ahead.append(frames)
            return True

        def settle(self) -> None:
            """Read ahead until every message counted as sent here has arrived (bounded)."""
            deadline = _real_time.monotonic() + WIRE_TIMEOUT_S
            while True:
                while self._read():
                    pass
                missing = {k: n - self._wire.received.get(k, 0) for k, n in self._wire.sent.items()
                           if k[1] == self._me and n > self._wire.received.get(k, 0)}
                if not missing:
                    return
                left = deadline - _real_time.monotonic()
                if left <= 0:
                    recent = [m for m in self._wire.log if m[1] == self._me][-3:]
                    raise WireTimeout(f"messages sent to {self._me} never arrived: {missing}; the last sent "
                                      f"there: {recent}")
                self._sock.poll(min(50, int(left * 1000) + 1))

        def recv_multipart(self, flags=0):
            if self._ahead:
                return self._ahead.popleft()
            raise zmq.Again()

        def __getattr__(self, name):
            return getattr(self._sock, name)

    class CountingZmqTransport(ZmqTransport):
        """vLLM's ``ZmqTransport`` with counted sends and a read-ahead ROUTER (no other change)."""

        wire: Wire

        def __init__(self, local_id: str, host: str, port: int) -> None:
            super().__init__(local_id, host, port)
            self.wire.contexts.append(self._zmq_ctx)
            self._router = _PrefetchingRouter(self._router, self.wire, local_id)

        def _open_connection(self, peer_id: str, direction: str = "outbound"):
            conn = super()._open_connection(peer_id, direction)
            conn._sockets.dealer = _CountingDealer(conn._sockets.dealer, self.wire, self._local_id, peer_id)
            return conn

        def close(self) -> None:
            self.wire.closed.add(self._local_id)
            super().close()

    return SimpleNamespace(CountingZmqTransport=CountingZmqTransport, CountingDealer=_CountingDealer,
                           PrefetchingRouter=_PrefetchingRouter)


@lru_cache(maxsize=1)
def _parent_class() -> type:
    """vLLM's ``ParentManager`` over a :class:`ScriptedParent` (the producer's tiering manager)."""
    import numpy as np
    from vllm.v1.kv_offload.base import LookupResult, RequestOffloadingContext
    from vllm.v1.kv_offload.tiering.base import ParentManager, TransferJob

    class ScriptedParentManager(ParentManager):
        def __init__(self, scripted: ScriptedParent) -> None:
            self.scripted = scripted

        def on_new_request(self, req_context):
            self.scripted.on_new_request(req_context.req_id)
            return RequestOffloadingContext()

        def lookup(self, key, req_context):
            return LookupResult[self.scripted.lookup(bytes(key), req_context.req_id)]

        def create_store_job(self, keys, req_context):
            job, pinned, slots = self.scripted.create_store_job([bytes(k) for k in keys], req_context.req_id)
            return TransferJob(job_id=job, keys=pinned, chunk_ids=np.asarray(slots, dtype=np.int64),
                               is_promotion=False, req_context=req_context)

        def on_request_finished(self, req_context) -> None:
            self.scripted.on_request_finished(req_context.req_id)

    return ScriptedParentManager


def _offloading_spec(block_len: int) -> Any:
    """A normalized ``OffloadingConfig`` for one scheduler-side engine (rank 0, DP index 0).

    The P2P manager reads only ``config`` (its parallel index and, through ``FileMapper``, the
    model fields whose fingerprint peers compare) and ``blocks_per_chunk``; vLLM's
    ``OffloadingSpec`` base class takes exactly that ``config``."""
    from vllm.v1.kv_offload.base import OffloadingSpec
    from vllm.v1.kv_offload.config import (OffloadingCacheConfig, OffloadingConfig, OffloadingGroupConfig,
                                           OffloadingModelConfig, OffloadingParallelConfig)

    cfg = OffloadingConfig(
        groups=(OffloadingGroupConfig(tokens_per_block=16, layer_names=("layers.0",), group_id=0),),
        worker_kv_bytes_per_block=block_len, enable_kv_cache_events=False, extra_config={}, engine_id="kvref",
        model=OffloadingModelConfig(name="kvref-p2p", dtype="float16"),
        cache=OffloadingCacheConfig(tokens_per_hash=16, blocks_per_chunk=1),
        parallel=OffloadingParallelConfig(rank=0, world_size=1, tp_size=1, pp_size=1, pcp_size=1, dcp_size=1,
                                          data_parallel_index=0, data_parallel_size=1,
                                          data_parallel_rank_local=None, is_parallelism_agnostic=False))
    class P2PTierSpec(OffloadingSpec):
        """The spec a secondary tier is handed: only its normalized config is read."""

        def get_manager(self):
            raise NotImplementedError("the P2P world drives the secondary tier alone, not a connector manager")

        def get_worker(self, kv_caches):
            raise NotImplementedError("the P2P world has no GPU worker: the tier moves host memory only")

    return P2PTierSpec(cfg)


class _EnvOverrides:
    """``vllm.envs`` as one module sees it, with a few values set by the world."""

    def __init__(self, real: Any, **values: Any) -> None:
        self._real, self._values = real, values

    def __getattr__(self, name: str) -> Any:
        return self._values[name] if name in self._values else getattr(self._real, name)


_P2P_MODULES = ("vllm.v1.kv_offload.tiering.p2p.manager", "vllm.v1.kv_offload.tiering.p2p.session.session",
                "vllm.v1.kv_offload.tiering.p2p.session.client", "vllm.v1.kv_offload.tiering.p2p.session.server")


class VllmP2PWorld:
    """Two vLLM P2P tier managers (``P``, ``D``) over real ZMQ and the in-memory data plane."""

    def __init__(self, num_blocks: int = 8, block_len: int = 16, max_peers: int = 128,
                 idle_timeout_s: int = 300, unbound_store_timeout_s: object = 60.0, backpressure: bool = False) -> None:
        """``max_peers`` and ``idle_timeout_s`` are what the managers read as ``VLLM_P2P_MAX_PEERS`` and
        ``VLLM_P2P_IDLE_TIMEOUT_S`` (vLLM's defaults here), for this world only; each engine's control
        address comes from ``VLLM_P2P_SIDE_CHANNEL_HOST``/``_PORT`` (a free loopback port each). The
        tier options ``unbound_store_timeout_s`` and ``backpressure`` (a detector handed to the tier)
        go to vLLM's constructor as the tiering factory passes them; a refusal raises vLLM's
        ValueError after the world is released."""
        import importlib

        import vllm.envs as real_envs
        from vllm.v1.kv_offload.tiering.p2p import manager as manager_module

        for name, value, least in (("num_blocks", num_blocks, 1), ("block_len", block_len, 1),
                                   ("max_peers", max_peers, 1), ("idle_timeout_s", idle_timeout_s, 0)):
            if isinstance(value, bool) or not isinstance(value, int) or value < least:
                raise InvalidFieldError(name, value, f"an int >= {least}")
        cls = _classes()
        p2p_nixl.recycle_agents()
        self.clock = VirtualClock()
        self.wire = Wire()
        self.num_blocks, self.block_len = num_blocks, block_len
        self.agents: dict[str, Any] = {}  # node -> its HeldAgent (the NIXL agent under its transport)
        self._saved_time = {}
        fake_time = SimpleNamespace(monotonic=self.clock.monotonic, sleep=self.clock.sleep, time=_real_time.time)
        for name in _P2P_MODULES:
            mod = importlib.import_module(name)
            self._saved_time[mod] = mod.time
            mod.time = fake_time
        # the manager reads its peer limit and idle timeout from vllm.envs at each use
        self._saved_envs = manager_module, manager_module.envs
        manager_module.envs = _EnvOverrides(real_envs, VLLM_P2P_MAX_PEERS=max_peers,
                                            VLLM_P2P_IDLE_TIMEOUT_S=idle_timeout_s)
        # the tier logs every timeout, peer loss and protocol error: traces make hundreds of them on purpose
        self._logger = logging.getLogger("vllm.v1.kv_offload.tiering.p2p")
        self._saved_level = self._logger.level
        self._logger.setLevel(logging.CRITICAL)
        transport_cls = type("WorldZmqTransport", (cls.CountingZmqTransport,), {"wire": self.wire})
        nixl = p2p_nixl.nixl_module()
        saved = manager_module.NixlTransport, manager_module.ZmqTransport, nixl._NixlAgent
        self.buffers: dict[str, bytearray] = {}
        self.managers: dict[str, Any] = {}
        self.ids: dict[str, str] = {}
        self._reqs: dict[tuple[str, str], Any] = {}
        try:
            for node in NODES:
                buf = bytearray(num_blocks * block_len)
                view = memoryview(buf).cast("B", (num_blocks, block_len))
                manager_module.NixlTransport = p2p_nixl.settled_transport_class()
                nixl._NixlAgent = lambda name, cfg, _node=node: p2p_nixl.HeldAgent(_node, self.agents)
                manager_module.ZmqTransport = transport_cls
                manager_module.envs = _EnvOverrides(real_envs, VLLM_P2P_MAX_PEERS=max_peers,
                                                    VLLM_P2P_IDLE_TIMEOUT_S=idle_timeout_s,
                                                    VLLM_P2P_SIDE_CHANNEL_HOST=HOST,
                                                    VLLM_P2P_SIDE_CHANNEL_PORT=free_loopback_port(HOST))
                options = {"backpressure_detector": object()} if backpressure else {}
                mgr = manager_module.P2PSecondaryTierManager(_offloading_spec(block_len), view,
                                                             unbound_store_timeout_s=unbound_store_timeout_s,
                                                             **options)
                self.buffers[node], self.managers[node], self.ids[node] = buf, mgr, mgr._local_id
        except Exception:
            self.close()
            raise
        finally:
            manager_module.NixlTransport, manager_module.ZmqTransport, nixl._NixlAgent = saved
        self.alive = {n: True for n in NODES}
        #: the parked-store timeout vLLM's engines resolved (both take the same option)
        self.unbound_store_timeout_s = {n: self.managers[n]._unbound_store_timeout_s for n in NODES}
        self._stranger: Any = None  # the stranger's ROUTER, bound on first use (:meth:`_stranger_router`)
        self._stranger_dealers: dict[str, Any] = {}  # node -> the stranger's DEALER to it
        self.parents = {n: _parent_class()(ScriptedParent()) for n in NODES}
        self._seeds = {n: self.managers[n]._get_hash_seed() for n in NODES}  # the seed both engines share

    # -- the world's calls (same as the reference world) ------------------------------------------

    def peer_params(self, node: str, role: str, kv_request_id: str) -> dict:
        """``kv_transfer_params`` naming the other engine: ``remote_prefiller`` (a PD consumer),
        ``remote_decoder`` (a producer) or ``remote_kv_source`` (a symmetric consumer)."""
        other = NODES[1 - NODES.index(node)]
        host, port = self.ids[other].rsplit(":", 1)
        if role in MALFORMED:  # none, or a role block missing what makes it usable
            return malformed_params(role, kv_request_id, host, int(port))
        if role == "remote_decoder":
            return {role: {"kv_request_id": kv_request_id}}
        return {role: {"kv_request_id": kv_request_id, "remote_host": host, "remote_port": int(port)}}

    def new_request(self, node: str, req_id: str, role: str, kv_request_id: str) -> str:
        from vllm.v1.kv_offload.base import ReqContext

        ctx = ReqContext(req_id=req_id, kv_transfer_params=self.peer_params(node, role, kv_request_id))
        self._reqs[(node, req_id)] = ctx
        out = self.managers[node].on_new_request(ctx)
        self._settle()
        return out.policy.name

    def lookup(self, node: str, req_id: str, key: bytes) -> str:
        return self.managers[node].lookup(key, self._reqs[(node, req_id)]).name

    # -- the stranger: a third engine that only speaks the control protocol -------------------------

    def _stranger_router(self) -> Any:
        """The stranger's ROUTER on loopback (bound on first use, in a context of its own that
        :meth:`close` destroys): it reads what the engines send it (counted like any delivery, so a
        closing DEALER's wait ends) and never answers."""
        if self._stranger is None:
            import zmq

            ctx = zmq.Context()
            self.wire.contexts.append(ctx)
            self._stranger_ctx = ctx
            sock = ctx.socket(zmq.ROUTER)
            port = sock.bind_to_random_port(f"tcp://{HOST}")
            self.ids[STRANGER] = f"{HOST}:{port}"
            self._stranger = _classes().PrefetchingRouter(sock, self.wire, self.ids[STRANGER])
        return self._stranger

    def stranger_request(self, node: str, req_id: str, kv_request_id: str) -> str:
        """A consumer request on ``node`` whose source is the stranger (see the reference world)."""
        from vllm.v1.kv_offload.base import ReqContext

        self._stranger_router()
        host, port = self.ids[STRANGER].rsplit(":", 1)
        params = {"remote_prefiller": {"kv_request_id": kv_request_id, "remote_host": host, "remote_port": int(port)}}
        ctx = ReqContext(req_id=req_id, kv_transfer_params=params)
        self._reqs[(node, req_id)] = ctx
        out = self.managers[node].on_new_request(ctx)
        self._settle()
        return out.policy.name

    def stranger_connects(self, node: str, kind: str) -> None:
        """The stranger sends ``node`` an incompatible ``connect`` (the reference's ``stranger_hello``,
        with the NIXL fields vLLM's validation wants) on its one DEALER to ``node``."""
        import msgspec
        import zmq

        self._stranger_router()
        sid = self.ids[STRANGER]
        dealer = self._stranger_dealers.get(node)
        if dealer is None:
            sock = self._stranger_ctx.socket(zmq.DEALER)
            sock.identity = sid.encode()
            sock.setsockopt(zmq.LINGER, 0)
            sock.connect(f"tcp://{self.ids[node]}")
            dealer = self._stranger_dealers[node] = _classes().CountingDealer(sock, self.wire, sid, self.ids[node])
        msg = stranger_hello(kind, sid, self.num_blocks, self.block_len)
        dealer.send(msgspec.msgpack.encode({**msg, "agent_metadata": b"stranger", "base_addr": 0}))
        self._settle()

    def hold(self, node: str, key: bytes, chunk_id: int, pending: int) -> None:
        self.parents[node].scripted.hold(key, chunk_id, pending)

    def serve(self, node: str) -> None:
        self.managers[node].serve_external_requests(self.parents[node])
        self._settle()

    def schedule_end(self, node: str) -> None:
        from vllm.v1.kv_offload.base import ScheduleEndContext

        self.managers[node].on_schedule_end(ScheduleEndContext(new_req_ids=(), preempted_req_ids=()))
        self._settle()

    def parent_log(self, node: str) -> list[tuple]:
        parent = self.parents[node].scripted
        return list(parent.log) + [("open", *ctx_key(c)) for c in sorted(parent.open, key=ctx_key)]

    def _job(self, node: str, req_id: str, job_id: int, keys: list[bytes], chunk_ids: list[int]) -> Any:
        import numpy as np
        from vllm.v1.kv_offload.tiering.base import TransferJob

        return TransferJob(job_id=job_id, keys=list(keys), chunk_ids=np.asarray(chunk_ids, dtype=np.int64),
                           is_promotion=False, req_context=self._reqs[(node, req_id)])

    def submit_store(self, node: str, req_id: str, job_id: int, keys: list[bytes], chunk_ids: list[int]) -> None:
        mgr = self.managers[node]
        mgr.submit_store(self._job(node, req_id, job_id, keys, chunk_ids))
        for batches in mgr._unbound_stores.values():  # restamp with the virtual clock (module docstring)
            for b in batches:
                if b.job_id == job_id:
                    b.submitted_at = self.clock.now
        self._settle()

    def submit_load(self, node: str, req_id: str, job_id: int, keys: list[bytes], chunk_ids: list[int]) -> None:
        self.managers[node].submit_load(self._job(node, req_id, job_id, keys, chunk_ids))
        self._settle()

    def finish(self, node: str, req_id: str) -> None:
        self.managers[node].on_request_finished(self._reqs.pop((node, req_id)))
        self._settle()

    def poll(self, node: str) -> list[tuple[int, bool]]:
        """One ``get_finished_jobs`` (the manager's poll sweep): the finished jobs, in order."""
        out = [(r.job_id, r.success) for r in self.managers[node].get_finished_jobs()]
        self._settle()
        return out

    def drain(self, node: str) -> bool:
        """``drain_jobs`` on ``node``, cut after ``DRAIN_POLLS`` poll sweeps as the reference world's
        (the other engine does not act meanwhile): True when it drained."""
        from kvref.impl.reference.offload.p2p.world import DRAIN_POLLS

        self.clock.sleeps_left = DRAIN_POLLS - 1
        try:
            self.managers[node].drain_jobs()
            drained = True
        except DrainCut:
            drained = False
        finally:
            self.clock.sleeps_left = None
        self._settle()
        return drained

    def complete_transfers(self, node: str, count: int, ok: bool) -> int:
        return self.agents[node].complete(count, ok)

    def break_transfers(self, node: str, count: int, error: str) -> int:
        return self.agents[node].break_writes(count, error)

    def fail_submissions(self, node: str, count: int, kind: str, after: int = 0) -> None:
        """NIXL lets ``node``'s next ``after`` WRITE submissions through, then refuses ``count`` as
        ``kind`` (at the agent)."""
        self.agents[node].fail_submissions(count, kind, after)

    def fail_registrations(self, node: str, count: int) -> None:
        """``node``'s next ``count`` peer registrations fail: preparing the peer's descriptors raises."""
        self.agents[node].registration_failures += count

    def fail_releases(self, node: str, count: int, kind: str) -> None:
        """``node``'s NIXL agent refuses the next ``count`` releases of a peer's ``kind`` handle."""
        self.agents[node].release_failures[kind] += count

    def reseed(self, node: str, differs: bool) -> None:
        """The hash seed ``node``'s manager gives the sessions it opens from now on (vLLM resolves
        it once, ``_get_hash_seed``): the shared one, or another."""
        mgr = self.managers[node]
        mgr._hash_seed = self._seeds[node] + ("-reseeded" if differs else "")

    def advance(self, seconds: float) -> None:
        self.clock.now += seconds

    def inject(self, node: str, msg: object) -> bool:
        """``node`` sends a raw control message to the other engine on its session's connection,
        bypassing the roles: a dict, or ``"connect"`` for a second handshake (``_send_connect``)."""
        s = self.managers[node]._sessions.get(self.ids[NODES[1 - NODES.index(node)]])
        if s is None or s._conn is None or not s._conn.alive:
            return False
        if msg == "connect":
            s._send_connect()
        else:
            s._conn.send(dict(msg))
        self._settle()
        return True

    def fault(self, node: str) -> None:
        """The data plane judges the other engine unusable (``PollResult.peer_fault``)."""
        other = self.ids[NODES[1 - NODES.index(node)]]
        self.managers[node]._data._set_peer_fault(other, "injected data-plane fault")

    def shutdown(self, node: str) -> list[tuple[int, bool]]:
        """The engine goes away: ``shutdown`` (its sessions send DisconnectMsg, sockets close).

        Then, for each connection the survivor holds to it, the harness waits (bounded) until the
        socket monitor's fatal event is queued, so the survivor's next poll sees it."""
        mgr = self.managers[node]
        mgr.shutdown()
        self.alive[node] = False
        out = [(r.job_id, r.success) for r in mgr._finished_jobs]
        mgr._finished_jobs = []
        self._settle()
        return out

    def read(self, node: str, chunk_ids: list[int]) -> list[bytes]:
        buf = self.buffers[node]
        return [bytes(buf[c * self.block_len:(c + 1) * self.block_len]) for c in chunk_ids]

    def write(self, node: str, chunk_ids: list[int], blocks: list[bytes]) -> None:
        for c, data in zip(chunk_ids, blocks):
            self.buffers[node][c * self.block_len:(c + 1) * self.block_len] = data

    def messages(self) -> list[tuple[str, str, tuple]]:
        """Every control message so far as (sender node, receiver node, summary), in send order."""
        name = {v: k for k, v in self.ids.items()}
        return [(name[s], name[d], m) for s, d, m in self.wire.log]

    def snapshot(self, node: str) -> dict:
        """The manager's and its session's bookkeeping, in the reference's terms."""
        mgr = self.managers[node]
        name = {v: k for k, v in self.ids.items()}
        sessions = {}
        for pid, s in mgr._sessions.items():
            client = {kv: sorted((r, ld.job_id, ld.aborted_at is not None) for r, ld in st.loads.items())
                      for kv, st in s._client._requests.items() if st.loads}
            srv = s._server
            rounds = {kv: sorted((r, rnd.demand_received, rnd.inflight, rnd.remaining, rnd.cancelled,
                                  rnd.finishing, tuple(sorted(rnd.pending_job_ids)), rnd.lookup_supplied)
                                 for r, rnd in st.outbound.items())
                      for kv, st in srv._requests.items() if st.outbound}
            probes = {kv: sorted((bytes(k), h) for k, h in st.probes.items())
                      for kv, st in s._client._requests.items() if st.probes}
            lookups = {kv: (len(st.pending_lookups), sorted((i, lu.round_seq, sorted(bytes(k) for k in lu.pending))
                                                           for i, lu in st.lookups.items()))
                       for kv, st in srv._requests.items() if st.lookups or st.pending_lookups}
            sessions[name.get(pid, pid)] = dict(
                ready=s.ready, alive=s.alive, client=client, rounds=rounds, probes=probes, lookups=lookups,
                store_jobs=sorted(srv._store_jobs), inflight=len(srv._inflight),
                aborts=sorted(srv._pending_aborts), fault=srv.peer_fault)
        data = mgr._data
        return dict(
            sessions=sessions,
            unbound={kv: [b.job_id for b in bs] for kv, bs in sorted(mgr._unbound_stores.items())},
            bound=sorted(mgr._kv_to_session), reaped=sorted(mgr._reaped_stores),
            failed=sorted(mgr._failed_req_ids),
            transfers=[(tid, name.get(e.peer_id, e.peer_id), local, remote) for tid, e in data._inflight.items()
                       for h, local, remote in self.agents[node].pending_writes() if h is e.handle],
            peers=sorted(name.get(p, p) for p in data._remote_dlists),
            # the remote NIXL agents the engine's agent still holds, by name as NIXL keeps them (one
            # per registered peer: a failed or superseded registration must give its agent back)
            agents=sorted({a.rsplit("-", 1)[1] for a in self.agents[node].remotes + self.agents[node].leaked}),
            strikes={name.get(p, p): n for p, n in sorted(data._peer_strikes.items())},
            broken=sorted(tid for tid, e in data._inflight.items() if id(e.handle) in self.agents[node].broken),
            faults={name.get(p, p): c for p, c in sorted(data._peer_faults.items())})

    # -- plumbing ---------------------------------------------------------------------------------

    def _settle(self) -> None:
        for node in NODES:
            if self.alive.get(node):
                self.managers[node]._control._router.settle()
        if self._stranger is not None:  # what the engines sent the stranger: read, never answered
            self._stranger.settle()
            self._stranger._ahead.clear()
        self._await_monitors()

    def _await_monitors(self) -> None:
        """A live connection to an engine that has gone gets a fatal monitor event (disconnected,
        or closed when the dial fails); wait (bounded) until it is queued, so the next poll sees it."""
        gone = {self.ids[n] for n in NODES if not self.alive.get(n, True)}
        for node in NODES:
            if not self.alive.get(node):
                continue
            for pid, conn in self.managers[node]._control._connections.items():
                if pid in gone and conn.alive and not conn.monitor_socket.poll(int(WIRE_TIMEOUT_S * 1000)):
                    raise WireTimeout(f"{node}'s connection to the closed {pid} saw no monitor event")

    def close(self) -> None:
        """Shut down what is still running, release every socket and give the p2p modules their
        ``time`` back; idempotent.

        Whatever a failed trace left behind (a shutdown that raised half way, a transport whose
        ``close`` was cut short), every ZMQ context the world made is destroyed here with linger 0.
        A context left to the garbage collector is destroyed at an arbitrary later allocation with
        its sockets' own linger, and its ``term()`` then blocked the process: the ci-profile stall
        of issue #22."""
        import zmq

        wire = getattr(self, "wire", None)
        if wire is not None:
            wire.closing = True
        try:
            for node, mgr in getattr(self, "managers", {}).items():
                if getattr(self, "alive", {}).get(node, True):
                    try:
                        for conn in mgr._control._connections.values():  # the trace is over: no linger
                            conn._sockets.dealer.setsockopt(zmq.LINGER, 0)
                        mgr.shutdown()
                    except Exception:  # noqa: BLE001 - teardown of a failed trace must not mask its failure
                        pass
        finally:
            for ctx in wire.contexts if wire is not None else ():
                if not ctx.closed:
                    ctx.destroy(linger=0)
            self.alive = {n: False for n in NODES}
            for agent in getattr(self, "agents", {}).values():  # the pooled NIXL agents start the next world clean
                agent.release_all()
            for mod, t in self._saved_time.items():
                mod.time = t
            self._saved_time = {}
            saved_envs = getattr(self, "_saved_envs", None)
            if saved_envs is not None:
                saved_envs[0].envs = saved_envs[1]
                self._saved_envs = None
            if hasattr(self, "_logger"):
                self._logger.setLevel(self._saved_level)

    def open_contexts(self) -> int:
        """How many of the world's ZMQ contexts are still open (0 once :meth:`close` ran)."""
        return sum(not ctx.closed for ctx in self.wire.contexts)
