"""vLLM's ``NixlTransport`` over real NIXL agents, with the world deciding when a WRITE lands.

The P2P world (:mod:`kvref.impl.vllm.p2p`) runs vLLM 0.33.0's own ``NixlTransport`` as the data
plane: memory registration, descriptor lists, peer registration on its worker thread, WRITE
submission, state polling, strikes and peer faults, cancel and close are all vLLM's code over a
real ``nixl_agent`` with its UCX backend, and a completed WRITE moves the bytes over UCX on
loopback from one engine's buffer to the other's.

Two things are the harness's, both at the NIXL agent (vLLM's ``_NixlAgent``), never in vLLM's code:

* **When a WRITE lands.** :class:`HeldAgent` forwards every agent call to the real agent except
  ``transfer``: a posted WRITE is *held* (its state reads ``PROC``) until the trace resolves it
  (:meth:`HeldAgent.complete`, oldest first, the reference data plane's order). A successful one is
  then posted to NIXL for real and awaited until NIXL reports ``DONE`` (bounded by
  :data:`LAND_TIMEOUT_S`); a failed one reads ``ERR`` and is never posted, so nothing lands — the
  outcome a failed RDMA WRITE reports. Without the hold, a loopback WRITE lands within
  microseconds and the traces would depend on thread timing.
* **Agent reuse.** Creating a NIXL agent with its UCX backend costs about half a second, so the
  process keeps one real agent per engine slot (:func:`pooled_agent`, replaced every
  :data:`RECYCLE_AFTER` worlds by :func:`recycle_agents`, destroyed by :func:`release_agents` when
  a check or test module is done: an agent's UCX threads poll for as long as it exists) and every
  world's transport gets a fresh :class:`HeldAgent` over it. vLLM's ``_init`` still registers the
  world's buffer and prepares its descriptors; ``close`` releases them again; what a failed trace
  leaves behind is released by :meth:`HeldAgent.release_all`. The UCX backend is created on the
  pooled agent once.

* **Refusals.** The trace may have NIXL refuse the next WRITE submissions
  (:meth:`HeldAgent.fail_submissions`: ``make_prepped_xfer`` raises, or ``transfer()`` reports
  ``"ERR"`` or raises, as the reference's ``SUBMIT_ERRORS`` names them) or the next peer
  registrations (:attr:`HeldAgent.registration_failures`: ``prep_xfer_dlist`` for the peer's
  blocks raises); vLLM's ``write_blocks`` and ``_build_peer_handles`` handle what is raised.

Peer registration (vLLM ``add_remote_peer_async``) runs on the transport's own worker thread;
:class:`SettledNixlTransport` waits for it to finish before returning the future, so the session's
``_poll_registration`` sees it resolved at the same poll as the reference (vLLM's only change of
behaviour under the harness: a registration never straddles two polls).
"""

from __future__ import annotations

import concurrent.futures
import gc
import threading
import time as _real_time
import weakref
from functools import lru_cache
from typing import Any

from kvref.impl.reference.offload.p2p.transport import SUBMIT_ERRORS

#: longest the harness waits for a released WRITE to be reported DONE by NIXL
LAND_TIMEOUT_S = 5.0


class nixlRemoteDisconnectError(RuntimeError):  # noqa: N801 - NIXL's name, which vLLM matches by type name
    """NIXL's error for a WRITE whose target endpoint is gone (terminal: nothing more lands)."""


class nixlNotFoundError(RuntimeError):  # noqa: N801
    """NIXL's error for a handle or remote agent it no longer knows (the WRITE may still land)."""


#: the errors a broken WRITE's state check raises, by the name the world is given
NIXL_ERRORS = {"remote_disconnect": nixlRemoteDisconnectError, "not_found": nixlNotFoundError}


def _exception(refusal: str) -> Exception:
    """What NIXL raises for a refused submission (the reference's ``SUBMIT_ERRORS`` entry)."""
    _, name, text = SUBMIT_ERRORS[refusal]
    cls = {"RuntimeError": RuntimeError, **{c.__name__: c for c in NIXL_ERRORS.values()}}[name]
    return cls(text)


class LandTimeout(RuntimeError):
    """A WRITE the trace let land was not reported DONE by NIXL in time (or reported ERR)."""


_POOL: dict[str, tuple[Any, str]] = {}  # slot -> (the real agent, its name)
_POOL_LOCK = threading.Lock()
_BACKENDS: set[tuple[str, str]] = set()  # (agent name, backend) created
#: worlds the pooled agents serve before they are replaced: UCX keeps the TCP connections of every
#: peer registration (about nine sockets a handshake, both ends in this process) until its agent
#: goes away, and a process that ran a thousand worlds on one pair ran out of file descriptors
RECYCLE_AFTER = 100
_WORLDS = [0, 0]  # worlds since the pool's agents were made, the pool's generation
_HELD: "weakref.WeakSet[HeldAgent]" = weakref.WeakSet()  # every HeldAgent not yet released


def recycle_agents() -> None:
    """Count one more world; every :data:`RECYCLE_AFTER` worlds the next world gets new agents
    (the old ones go with the worlds that still hold them, and their connections with them). The
    closed worlds' :class:`HeldAgent` let go of theirs at once, and the garbage collector runs:
    a closed world is a reference cycle that only a full collection frees, and until then it kept
    an old generation's agents, and their polling UCX threads, alive (three generations at once
    in a ci-profile run)."""
    with _POOL_LOCK:
        _WORLDS[0] += 1
        if _WORLDS[0] <= RECYCLE_AFTER:
            return
        _POOL.clear()
        _WORLDS[0], _WORLDS[1] = 1, _WORLDS[1] + 1
        done = [h for h in _HELD if h.closed]
        for h in done:
            _HELD.discard(h)
    for h in done:
        h.real = None
    gc.collect()


def release_agents() -> int:
    """Destroy the pooled NIXL agents and the agents of older generations that worlds still hold:
    the pool is emptied, every :class:`HeldAgent` gives back what it holds and lets go of its real
    agent, and the next world creates new agents (a new generation's names). NIXL has no call that
    stops an agent; its native agent, and the UCX progress threads that poll with a zero timeout
    (about 0.15 of a core each), go when the last reference to it does, so nothing else may keep
    one (:mod:`kvref.impl.vllm.native_agents`). Call it when no world is in use any more (the end
    of a check or a test module): a world still open has no agent afterwards. Returns how many
    agents were let go."""
    with _POOL_LOCK:
        agents = {id(agent): agent for agent, _ in _POOL.values()}
        _POOL.clear()
        _BACKENDS.clear()
        held = list(_HELD)
        _HELD.clear()
        agents.update((id(h.real), h.real) for h in held if h.real is not None)
        if agents:
            _WORLDS[0], _WORLDS[1] = 0, _WORLDS[1] + 1
    for h in held:
        h.release_all()
        h.real = None
    return len(agents)


def pooled_agent(slot: str) -> tuple[Any, str]:
    """The process's real NIXL agent for engine ``slot`` and its name (created on first use, then
    reused until :func:`recycle_agents` replaces it; the name ends in ``-<slot>``)."""
    from vllm.distributed.nixl_utils import NixlWrapper, nixl_agent_config

    with _POOL_LOCK:
        entry = _POOL.get(slot)
        if entry is None:
            name = f"kvref-p2p-g{_WORLDS[1]}-{slot}"
            entry = _POOL[slot] = (NixlWrapper(name, nixl_agent_config(backends=[])), name)
        return entry


class HeldAgent:
    """A NIXL agent whose WRITEs land when the trace says (module docstring)."""

    def __init__(self, slot: str, agents: dict[str, "HeldAgent"]) -> None:
        self.slot = slot
        self.real, self.real_name = pooled_agent(slot)
        _HELD.add(self)
        self._agents = agents  # the world's agents by slot (a closed one refuses registration)
        agents[slot] = self
        self.held: list[Any] = []  # posted WRITE handles, oldest first, not yet resolved
        self.resolved: dict[int, tuple[Any, str]] = {}  # id(handle) -> (handle, "DONE" | "ERR")
        self.broken: dict[int, tuple[Any, str]] = {}  # id(handle) -> (handle, error name): its state check raises
        self.remotes: list[str] = []  # remote agents this world loaded
        self.dlists: list[Any] = []
        self._dlist_owner: dict[int, str] = {}  # id(remote dlist) -> the remote agent it addresses
        #: id(handle) -> (remote agent, local block indexes, remote block indexes)
        self.writes: dict[int, tuple[str, list[int], list[int]]] = {}
        self.regs: list[Any] = []
        self.closed = False
        self.submit_failures: list[str | None] = []  # armed refusals of the next submissions (None: through)
        self._post_failures: dict[int, str] = {}  # id(handle) -> the refusal its transfer() meets
        self.registration_failures = 0  # armed refusals of the next peer registrations
        #: armed failures of the next releases of a peer's handles, by kind (``dlist``: its descriptor
        #: list, ``agent``: its remote agent), and the remote agents whose removal failed (still loaded)
        self.release_failures = {"dlist": 0, "agent": 0}
        self.leaked: list[str] = []

    # -- forwarded, tracked so a failed trace can be cleaned up -----------------------------------

    def create_backend(self, name: str, params: dict) -> None:
        if (self.real_name, name) not in _BACKENDS:
            self.real.create_backend(name, params)
            _BACKENDS.add((self.real_name, name))

    def register_memory(self, descs, mem_type: str = "DRAM"):
        reg = self.real.register_memory(descs, mem_type=mem_type)
        self.regs.append(reg)
        return reg

    def deregister_memory(self, reg) -> None:
        self.closed = True  # vLLM's close: the engine's memory is gone
        if reg in self.regs:
            self.regs.remove(reg)
        self.real.deregister_memory(reg)

    def get_xfer_descs(self, descs, mem_type: str = "DRAM"):
        return self.real.get_xfer_descs(descs, mem_type=mem_type)

    def prep_xfer_dlist(self, agent_name: str, descs):
        if self.registration_failures and agent_name in self.remotes:
            self.registration_failures -= 1
            raise RuntimeError(f"NIXL_ERR_BACKEND: prep_xfer_dlist for {agent_name} refused (injected)")
        dlist = self.real.prep_xfer_dlist(agent_name, descs)
        self.dlists.append(dlist)
        self._dlist_owner[id(dlist)] = agent_name
        return dlist

    def release_dlist_handle(self, dlist) -> None:
        self.dlists = [d for d in self.dlists if d is not dlist]
        owner = self._dlist_owner.pop(id(dlist), None)
        self.real.release_dlist_handle(dlist)
        if self.release_failures["dlist"] and owner not in (None, "NIXL_INIT_AGENT"):  # a peer's, not ours
            self.release_failures["dlist"] -= 1
            raise RuntimeError("NIXL_ERR_BACKEND: release_dlist_handle refused (injected)")

    def get_agent_metadata(self) -> bytes:
        return self.real.get_agent_metadata()

    def add_remote_agent(self, metadata: bytes) -> str:
        owner = next((a for a in self._agents.values()
                      if a.real is not None and a.real.get_agent_metadata() == metadata), None)
        if owner is None or owner.closed:
            # a real engine that has gone cannot be reached; NIXL names this error
            raise RuntimeError("NIXL_ERR_NOT_FOUND: the remote engine's agent has shut down")
        name = self.real.add_remote_agent(metadata)
        name = name.decode() if isinstance(name, bytes) else name
        self.remotes.append(name)
        self.leaked = [r for r in self.leaked if r != name]  # loaded again under its name
        return name

    def remove_remote_agent(self, name: str) -> None:
        # NIXL keeps one remote agent per name: loading it again (a peer registered a second time,
        # vLLM's handshake after a refused one) and removing it once leaves none
        self.remotes = [r for r in self.remotes if r != name]
        self.real.remove_remote_agent(name)
        if self.release_failures["agent"]:  # NIXL refuses: to the engine the agent stays loaded
            self.release_failures["agent"] -= 1
            self.leaked.append(name)
            raise RuntimeError("NIXL_ERR_BACKEND: remove_remote_agent refused (injected)")

    def make_prepped_xfer(self, op, local_dlist, local_idxs, remote_dlist, remote_idxs, *args, **kw):
        refusal = self.submit_failures.pop(0) if self.submit_failures else None
        if refusal is not None and SUBMIT_ERRORS[refusal][0] == "make_prepped_xfer":
            raise _exception(refusal)
        handle = self.real.make_prepped_xfer(op, local_dlist, local_idxs, remote_dlist, remote_idxs, *args, **kw)
        if refusal is not None:
            self._post_failures[id(handle)] = refusal
        self.writes[id(handle)] = (self._dlist_owner.get(id(remote_dlist), ""), [int(i) for i in local_idxs],
                                   [int(i) for i in remote_idxs])
        return handle

    # -- held WRITEs --------------------------------------------------------------------------------

    def transfer(self, handle, notif_msg: bytes = b"") -> str:
        refusal = self._post_failures.pop(id(handle), None)
        if refusal == "post_err":
            return "ERR"
        if refusal is not None:
            raise _exception(refusal)
        self.held.append(handle)
        return "PROC"

    def check_xfer_state(self, handle) -> str:
        if any(h is handle for h in self.held):
            return "PROC"
        broken = self.broken.get(id(handle))
        if broken is not None:
            raise NIXL_ERRORS[broken[1]](f"getXferStatus: {broken[1]} (injected by the trace)")
        entry = self.resolved.get(id(handle))
        if entry is not None:
            return entry[1]
        return self.real.check_xfer_state(handle)

    def release_xfer_handle(self, handle) -> None:
        self.held = [h for h in self.held if h is not handle]  # never posted: nothing lands
        self._post_failures.pop(id(handle), None)
        self.resolved.pop(id(handle), None)
        self.broken.pop(id(handle), None)
        self.writes.pop(id(handle), None)
        self.real.release_xfer_handle(handle)

    def fail_submissions(self, count: int, kind: str, after: int = 0) -> None:
        """After ``after`` more submissions go through, the next ``count`` are refused as ``kind``
        (the reference's ``SUBMIT_ERRORS``: which agent call fails and what it raises)."""
        self.submit_failures += [None] * after + [kind] * count

    def complete(self, count: int, ok: bool) -> int:
        """Resolve the oldest ``count`` held WRITEs: ``ok`` lands each (a real NIXL WRITE, awaited
        until DONE), otherwise each reads ``ERR`` and nothing is written. A WRITE whose target
        engine has shut down, or whose remote agent was removed meanwhile, fails (``ERR``): its
        endpoint is gone."""
        done, self.held = self.held[:count], self.held[count:]
        for handle in done:
            land = ok and self.reachable(handle)
            if land:
                self._land(handle)
            self.resolved[id(handle)] = (handle, "DONE" if land else "ERR")
        return len(done)

    def break_writes(self, count: int, error: str) -> int:
        """The oldest ``count`` held WRITEs break: from now on their state check raises NIXL's
        ``error`` (``remote_disconnect``: terminal; ``not_found``: the WRITE may still be landing, so
        it stays in flight); nothing is written."""
        done, self.held = self.held[:count], self.held[count:]
        for handle in done:
            self.broken[id(handle)] = (handle, error)
        return len(done)

    def reachable(self, handle) -> bool:
        """Whether the WRITE's target agent is still loaded here and its engine still running."""
        remote = self.writes.get(id(handle), ("",))[0]
        owner = next((a for a in self._agents.values() if a.real_name == remote), None)
        return remote in self.remotes and owner is not None and not owner.closed

    def pending_writes(self) -> list[tuple[Any, list[int], list[int]]]:
        """The held WRITEs, oldest first: (handle, local indexes, remote indexes)."""
        return [(h, *self.writes.get(id(h), ("", [], []))[1:]) for h in self.held]

    def _land(self, handle) -> None:
        status = self.real.transfer(handle)
        deadline = _real_time.monotonic() + LAND_TIMEOUT_S
        while status != "DONE":
            if status == "ERR":
                raise LandTimeout(f"NIXL reported ERR for a loopback WRITE of engine {self.slot}")
            if _real_time.monotonic() > deadline:
                raise LandTimeout(f"a loopback WRITE of engine {self.slot} was not DONE after {LAND_TIMEOUT_S}s")
            status = self.real.check_xfer_state(handle)

    def release_all(self) -> None:
        """Give back whatever the world's transport did not release (a failed trace), so the pooled
        agent starts the next world clean (nothing, once :func:`release_agents` let its agent go)."""
        if self.real is None:
            return
        for handle in self.held + [h for h, _ in self.resolved.values()] + [h for h, _ in self.broken.values()]:
            try:
                self.real.release_xfer_handle(handle)
            except Exception:  # noqa: BLE001 - best-effort cleanup of a failed trace
                pass
        self.held, self.resolved, self.writes, self.broken = [], {}, {}, {}
        self._post_failures, self.submit_failures, self.registration_failures = {}, [], 0
        self.release_failures, self.leaked = {"dlist": 0, "agent": 0}, []
        for name in self.remotes:
            try:
                self.real.remove_remote_agent(name)
            except Exception:  # noqa: BLE001
                pass
        for dlist in self.dlists:
            try:
                self.real.release_dlist_handle(dlist)
            except Exception:  # noqa: BLE001
                pass
        for reg in self.regs:
            try:
                self.real.deregister_memory(reg)
            except Exception:  # noqa: BLE001
                pass
        self.remotes, self.dlists, self.regs = [], [], []
        self.closed = True


@lru_cache(maxsize=1)
def settled_transport_class() -> type:
    """vLLM's ``NixlTransport`` whose peer registration has finished when its future is returned."""
    from vllm.v1.kv_offload.tiering.p2p.data.nixl import NixlTransport

    class SettledNixlTransport(NixlTransport):
        def add_remote_peer_async(self, peer_id, agent_metadata, base_addr, num_blocks, block_len):
            fut = super().add_remote_peer_async(peer_id, agent_metadata, base_addr, num_blocks, block_len)
            concurrent.futures.wait([fut], timeout=LAND_TIMEOUT_S)
            return fut

    return SettledNixlTransport


def nixl_module() -> Any:
    """vLLM's ``data/nixl.py`` module (whose ``_NixlAgent`` the world replaces while it builds)."""
    from vllm.v1.kv_offload.tiering.p2p.data import nixl

    return nixl
