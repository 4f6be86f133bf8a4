"""The control plane between engines (vLLM ``tiering/p2p/control/``: base.py's contract, zmq.py).

Each engine listens on one address and keeps one connection per peer; messages to a peer go out
on that connection and arrive, in order, at the peer's listening socket. ``poll`` is the only I/O
driver; each call

1. drops connections marked dead since the last call;
2. hands every arrived message to the sender's connection, or — for a sender without one —
   opens an *inbound* connection, returned from this poll (once) with the message buffered;
3. marks dead a connection whose peer went away (vLLM: the socket monitor's disconnect event,
   or its closed event when dialing an engine that has gone) and drops it.

A message sent to an engine that has gone is lost. ``send`` on a dead connection raises.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Callable


@dataclass
class Conn:
    peer_id: str
    _send: Callable[[dict], None]
    inbox: list[dict] = field(default_factory=list)
    dead: bool = False
    closed: bool = False
    peer_gone: bool = False  # the monitor's fatal event, seen at the next poll

    @property
    def alive(self) -> bool:
        return not (self.dead or self.closed)

    def send(self, msg: dict) -> None:
        if not self.alive:
            raise RuntimeError(f"send on a closed connection to {self.peer_id}")
        self._send(msg)

    def recv(self) -> list[dict]:
        out, self.inbox = self.inbox, []
        return out

    def mark_dead(self) -> None:
        self.dead = True

    def close(self) -> None:
        self.dead = self.closed = True


class ControlPlane:
    """One engine's listening socket and its connections; ``deliver`` is the network's send."""

    def __init__(self, local_id: str, deliver: Callable[[str, str, dict], None],
                 gone: Callable[[str], bool] = lambda peer_id: False) -> None:
        self.local_id = local_id
        self._deliver = deliver
        self._gone = gone
        self.connections: dict[str, Conn] = {}
        self.arrived: deque[tuple[str, dict]] = deque()
        self.closed = False

    def connect(self, peer_id: str) -> Conn:
        old = self.connections.get(peer_id)
        if old is not None:
            assert not old.alive, f"a live connection to {peer_id} already exists"
            self.connections.pop(peer_id).close()
        return self._open(peer_id)

    def _open(self, peer_id: str) -> Conn:
        conn = Conn(peer_id, lambda msg: self._deliver(self.local_id, peer_id, msg))
        # dialing an engine that has gone fails; vLLM's monitor reports it (EVENT_CLOSED) by the next poll
        conn.peer_gone = self._gone(peer_id)
        self.connections[peer_id] = conn
        return conn

    def _sweep(self) -> None:
        for pid in [p for p, c in self.connections.items() if not c.alive]:
            self.connections.pop(pid).close()

    def poll(self) -> list[Conn]:
        self._sweep()
        inbound: list[tuple[str, dict]] = []
        while self.arrived:
            sender, msg = self.arrived.popleft()
            conn = self.connections.get(sender)
            if conn is not None:
                conn.inbox.append(msg)
            else:
                inbound.append((sender, msg))
        for conn in self.connections.values():
            if conn.alive and conn.peer_gone:
                conn.mark_dead()
        self._sweep()
        new: list[Conn] = []
        for sender, msg in inbound:
            conn = self.connections.get(sender)
            if conn is None:
                conn = self._open(sender)
                new.append(conn)
            conn.inbox.append(msg)
        return new

    def peer_went_away(self, peer_id: str) -> None:
        conn = self.connections.get(peer_id)
        if conn is not None:
            conn.peer_gone = True

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        for conn in self.connections.values():
            conn.close()
        self.connections.clear()
        self.arrived.clear()

    def check_invariants(self) -> None:
        assert all(pid == c.peer_id for pid, c in self.connections.items()), "P3: a connection under another peer id"
        assert not self.closed or not self.connections, "P3: a closed control plane keeps connections"
