"""An in-memory object store behind the NIXL agent API that vLLM's object-store tier calls.

``tiering/obj/manager.py`` talks to S3 through NIXL's OBJ plugin (``nixl_agent``: register memory,
prepare descriptor lists, post READ/WRITE transfers, poll their state, query which objects exist).
NIXL is not installed here and no S3 endpoint is reachable, so this class implements exactly the
calls the tier makes, over a dict of object name -> bytes: it is the only fake in the obj runs
(docs/differences.md). A WRITE copies the registered DRAM rows into objects, a READ copies objects
into the rows (all or nothing: a missing object fails the transfer and writes nothing); both stay
``PROC`` until the harness completes them (:meth:`complete`), so the trace decides when, and whether
with an error. Telemetry reports no transfer time.

:meth:`InMemoryObjAgent.arm` makes the next call of one kind fail as NIXL reports failure (a
``None``/``0`` handle, an ``"ERR"`` state, an exception), one at a time; :meth:`leaks` counts the
registrations, descriptor-list handles and transfer handles still held (after the tier's shutdown:
none, but those a failed release was made to leak).
"""

from __future__ import annotations

import ctypes
import itertools
from types import SimpleNamespace

from kvref.spec.errors import InvalidFieldError


class _Descs(list):
    def trim(self):
        return list(self)


class _Dlist(list):
    """A prepared descriptor list handle (identity matters: it is released once)."""

    __hash__ = object.__hash__
    __eq__ = object.__eq__


#: the calls :meth:`InMemoryObjAgent.arm` can make fail (kvref.impl.reference.offload.tiering.obj_tier.FAULTS)
FAULTS = ("register", "prep", "make", "transfer", "check", "release_xfer", "release_dlist", "deregister")


class NixlCallError(RuntimeError):
    """What a NIXL call armed to fail raises."""


class InMemoryObjAgent:
    """``nixl_agent(name, config)`` as the obj tier uses it; ``bucket`` is shared by the agents of one
    world (the store outlives a tier)."""

    def __init__(self, name: str, config=None, bucket: dict | None = None) -> None:
        self.name = name
        self.bucket: dict[str, bytes] = {} if bucket is None else bucket
        self.xfers: dict[int, dict] = {}
        self._ids = itertools.count(1)
        self.armed: str | None = None
        self.fired: dict[str, int] = {f: 0 for f in FAULTS}
        self.registered: set[int] = set()  # id() of each live registration
        self.dlists: set[int] = set()  # id() of each live descriptor-list handle
        self._keep: dict[int, object] = {}  # keeps them alive, so ids stay unique

    def arm(self, stage: str) -> None:
        """The next call of kind ``stage`` (one of :data:`FAULTS`) fails; one armed at a time."""
        if stage not in FAULTS:
            raise InvalidFieldError("stage", stage, f"one of {FAULTS}")
        if self.armed is not None:
            raise InvalidFieldError("stage", stage, f"no other armed fault ({self.armed!r} is)")
        self.armed = stage

    def _take(self, stage: str) -> bool:
        if self.armed == stage:
            self.armed = None
            self.fired[stage] += 1
            return True
        return False

    def leaks(self) -> dict[str, int]:
        """Handles still held beyond those a failed release leaked on purpose."""
        out = {"registrations": len(self.registered) - self.fired["deregister"],
               "descriptor lists": len(self.dlists) - self.fired["release_dlist"],
               "transfers": len(self.xfers)}
        return {k: n for k, n in out.items() if n}

    def create_backend(self, backend: str, params: dict) -> None:
        if backend != "OBJ" or "bucket" not in params:
            raise InvalidFieldError("backend", backend, "the OBJ backend with a bucket")

    def query_memory(self, descs, mem_type: str, backend: str):
        return [{"size": len(self.bucket[d[3]])} if d[3] in self.bucket else None for d in descs]

    def register_memory(self, descs, mem_type: str):
        if mem_type == "OBJ" and self._take("register"):
            return None
        out = _Descs(descs)
        self.registered.add(id(out))
        self._keep[id(out)] = out
        return out

    def deregister_memory(self, descs) -> None:
        if self._take("deregister"):
            raise NixlCallError("kvref: deregister_memory failed (injected)")
        self.registered.discard(id(descs))
        self._keep.pop(id(descs), None)

    def prep_xfer_dlist(self, agent: str, descs, mem_type: str | None = None):
        if agent == "ObjAgent" and self._take("prep"):
            return None
        out = _Dlist(descs)
        self.dlists.add(id(out))
        self._keep[id(out)] = out
        return out

    def release_dlist_handle(self, handle) -> None:
        if self._take("release_dlist"):
            raise NixlCallError("kvref: release_dlist_handle failed (injected)")
        self.dlists.discard(id(handle))
        self._keep.pop(id(handle), None)

    def make_prepped_xfer(self, op, local, local_idx, remote, remote_idx):
        if self._take("make"):
            return 0
        xid = next(self._ids)
        self.xfers[xid] = {"op": op, "rows": [local[int(i)] for i in local_idx],
                           "objects": [remote[int(i)][3] for i in remote_idx], "state": "PROC"}
        return xid

    def transfer(self, xid) -> str:
        if self._take("transfer"):
            self.xfers[xid]["state"] = "ERR"
        return self.xfers[xid]["state"]

    def check_xfer_state(self, xid) -> str:
        if self._take("check"):
            raise NixlCallError(f"kvref: check_xfer_state({xid}) failed (injected)")
        return self.xfers[xid]["state"]

    def get_xfer_telemetry(self, xid):
        return SimpleNamespace(xferDuration=0)

    def release_xfer_handle(self, xid) -> None:
        if self._take("release_xfer"):
            raise NixlCallError(f"kvref: release_xfer_handle({xid}) failed (injected)")
        self.xfers.pop(xid, None)

    # -- the harness ------------------------------------------------------------------------

    def in_flight(self) -> list[int]:
        return [x for x, t in self.xfers.items() if t["state"] == "PROC"]

    def complete(self, xid: int, error: bool = False) -> None:
        """Transfer ``xid`` ends: its bytes move (unless ``error`` or, for a READ, an object is
        missing, which fails it and moves nothing)."""
        t = self.xfers[xid]
        if error or (t["op"] == "READ" and any(o not in self.bucket for o in t["objects"])):
            t["state"] = "ERR"
            return
        for (addr, length, _), obj in zip(t["rows"], t["objects"]):
            if t["op"] == "WRITE":
                self.bucket[obj] = ctypes.string_at(addr, length)
            else:
                data = self.bucket[obj]
                ctypes.memmove(addr, data, min(length, len(data)))
        t["state"] = "DONE"
