"""An in-memory object store behind the NIXL agent API that vLLM's object-store tier calls.

``tiering/obj/manager.py`` talks to S3 through NIXL's OBJ plugin (``nixl_agent``: register memory,
prepare descriptor lists, post READ/WRITE transfers, poll their state, query which objects exist).
NIXL is not installed here and no S3 endpoint is reachable, so this class implements exactly the
calls the tier makes, over a dict of object name -> bytes: it is the only fake in the obj runs
(docs/differences.md). A WRITE copies the registered DRAM rows into objects, a READ copies objects
into the rows (all or nothing: a missing object fails the transfer and writes nothing); both stay
``PROC`` until the harness completes them (:meth:`complete`), so the trace decides when, and whether
with an error. Telemetry reports no transfer time.
"""

from __future__ import annotations

import ctypes
import itertools
from types import SimpleNamespace

from kvref.spec.errors import InvalidFieldError


class _Descs(list):
    def trim(self):
        return list(self)


class InMemoryObjAgent:
    """``nixl_agent(name, config)`` as the obj tier uses it; ``bucket`` is shared by the agents of one
    world (the store outlives a tier)."""

    def __init__(self, name: str, config=None, bucket: dict | None = None) -> None:
        self.name = name
        self.bucket: dict[str, bytes] = {} if bucket is None else bucket
        self.xfers: dict[int, dict] = {}
        self._ids = itertools.count(1)

    def create_backend(self, backend: str, params: dict) -> None:
        if backend != "OBJ" or "bucket" not in params:
            raise InvalidFieldError("backend", backend, "the OBJ backend with a bucket")

    def query_memory(self, descs, mem_type: str, backend: str):
        return [{"size": len(self.bucket[d[3]])} if d[3] in self.bucket else None for d in descs]

    def register_memory(self, descs, mem_type: str):
        return _Descs(descs)

    def deregister_memory(self, descs) -> None:
        return None

    def prep_xfer_dlist(self, agent: str, descs, mem_type: str | None = None):
        return list(descs)

    def release_dlist_handle(self, handle) -> None:
        return None

    def make_prepped_xfer(self, op, local, local_idx, remote, remote_idx):
        xid = next(self._ids)
        self.xfers[xid] = {"op": op, "rows": [local[int(i)] for i in local_idx],
                           "objects": [remote[int(i)][3] for i in remote_idx], "state": "PROC"}
        return xid

    def transfer(self, xid) -> str:
        return self.xfers[xid]["state"]

    def check_xfer_state(self, xid) -> str:
        return self.xfers[xid]["state"]

    def get_xfer_telemetry(self, xid):
        return SimpleNamespace(xferDuration=0)

    def release_xfer_handle(self, xid) -> None:
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
