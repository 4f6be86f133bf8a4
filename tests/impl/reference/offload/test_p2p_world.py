"""The P2P tier's reference world (#22): two engines, hand-checked protocol outcomes, bad input."""

from __future__ import annotations

import pytest

from kvref.impl.reference.offload.p2p.client import ABORT_ACK_TIMEOUT_S, LOAD_TIMEOUT_S
from kvref.impl.reference.offload.p2p.manager import UNBOUND_STORE_TIMEOUT_S
from kvref.impl.reference.offload.p2p.world import P2PWorld
from kvref.models.machines.p2p import run_p2p_machine
from kvref.spec.errors import InvalidFieldError

K = [b"k0", b"k1"]


def _pair(w: P2PWorld, kv: str = "kv0") -> None:
    w.new_request("P", "p", "remote_decoder", kv)
    w.new_request("D", "d", "remote_prefiller", kv)


def _ticks(w: P2PWorld, n: int = 3) -> list:
    out = []
    for _ in range(n):
        w.complete_transfers("P", 8, True)
        out += w.poll("P") + w.poll("D")
        w.check_invariants()
    return out


def test_stored_blocks_reach_the_consumer_byte_for_byte():
    w = P2PWorld()
    _pair(w)
    w.write("P", [2, 3], [b"a" * 16, b"b" * 16])
    w.submit_store("P", "p", 1, K, [2, 3])
    assert w.snapshot("P")["unbound"] == {"kv0": [1]}  # parked until a fetch binds the id
    w.submit_load("D", "d", 2, K, [5, 6])
    assert sorted(_ticks(w)) == [(1, True), (2, True)]
    assert w.read("D", [5, 6]) == [b"a" * 16, b"b" * 16]
    kinds = [(s, d, msg[0]) for s, d, msg in w.messages()]
    # D reads P's connect and ack in one poll: the ack flushes its queued fetch before D acks P
    assert kinds == [("D", "P", "connect"), ("P", "D", "connect"), ("P", "D", "connect_ack"),
                     ("D", "P", "fetch"), ("D", "P", "connect_ack"), ("P", "D", "transfer_done")]


def test_an_unserved_load_times_out_is_aborted_and_fails():
    w = P2PWorld()
    _pair(w)
    w.submit_load("D", "d", 2, K, [5, 6])
    _ticks(w)
    w.advance(LOAD_TIMEOUT_S)
    assert w.poll("D") == []
    assert w.messages()[-1][:2] == ("D", "P") and w.messages()[-1][2][:3] == ("abort_fetch", "kv0", 0)
    assert w.poll("P") == []
    assert w.messages()[-1][2][:3] == ("abort_ack", "kv0", 0)  # nothing was being written: acked at once
    assert w.poll("D") == [(2, False)]
    assert w.lookup("D", "d", K[0]) == "MISS"  # a failed id prefills locally
    w.finish("D", "d")
    assert w.snapshot("D")["failed"] == []


def test_an_abort_the_producer_never_acks_fails_after_the_ack_timeout():
    w = P2PWorld()
    _pair(w)
    w.submit_load("D", "d", 2, K, [5, 6])
    _ticks(w)
    w.finish("D", "d")  # aborts the round
    assert w.messages()[-1][2][0] == "abort_fetch"
    w.shutdown("P")  # the ack never comes; D's session dies with the producer
    assert w.poll("D") == [(2, False)]
    assert ABORT_ACK_TIMEOUT_S < LOAD_TIMEOUT_S


def test_parked_stores_are_reaped_and_a_late_fetch_fails_at_once():
    w = P2PWorld()
    w.new_request("P", "p", "remote_decoder", "kv0")
    w.submit_store("P", "p", 1, K, [2, 3])
    w.advance(UNBOUND_STORE_TIMEOUT_S)
    assert w.poll("P") == [(1, False)]
    assert w.snapshot("P")["reaped"] == ["kv0"]
    w.submit_store("P", "p", 3, K, [2, 3])
    assert w.poll("P") == [(3, False)]  # no re-parking under a reaped id
    w.new_request("D", "d", "remote_prefiller", "kv0")
    w.submit_load("D", "d", 2, K, [5, 6])
    assert (2, False) in _ticks(w)


def test_a_producer_going_away_fails_the_consumers_load_and_id():
    w = P2PWorld()
    _pair(w)
    w.submit_store("P", "p", 1, K, [2, 3])
    w.submit_load("D", "d", 2, K, [5, 6])
    w.poll("P"), w.poll("D"), w.poll("P")
    assert w.snapshot("P")["transfers"], "the write is pending"
    w.shutdown("P")
    assert w.poll("D") == [(2, False)]
    assert w.snapshot("D")["sessions"] == {} and w.snapshot("D")["failed"] == ["kv0"]
    with pytest.raises(InvalidFieldError, match="node"):
        w.poll("P")


def test_a_data_plane_fault_disconnects_and_backs_off():
    w = P2PWorld()
    _pair(w)
    _ticks(w)
    w.fault("P")
    w.poll("P")
    assert w.snapshot("P")["sessions"] == {}  # nothing in flight: disconnected at once
    assert w.managers["P"].backoff  # the first fault reconnects at once, a repeat waits


def test_idle_sessions_are_evicted_only_where_peer_slots_are_scarce():
    """vLLM ``_reap_idle_sessions``: no pending work and no activity for the idle timeout evicts a
    session once ``sessions >= max_peers - min(8, max_peers - 1)``; the peer then sees it close."""
    for max_peers, evicted in ((2, True), (128, False)):
        w = P2PWorld(max_peers=max_peers, idle_timeout_s=10)
        _pair(w)
        _ticks(w)
        w.advance(9)
        _ticks(w, 1)  # not yet idle for the timeout
        assert set(w.snapshot("P")["sessions"]) == {"D"}
        w.advance(10)  # exactly the timeout since the last activity: idle (vLLM's deadline is inclusive)
        _ticks(w, 2)
        assert (w.snapshot("P")["sessions"] == {} and w.snapshot("D")["sessions"] == {}) is evicted
        assert (w.managers["P"].idle_reaped + w.managers["D"].idle_reaped > 0) is evicted
    w = P2PWorld(max_peers=2, idle_timeout_s=10)
    _pair(w)
    _ticks(w)
    w.submit_load("D", "d", 7, K, [5, 6])  # a load in flight is pending work: never idle
    w.advance(11)
    w.poll("D")
    assert set(w.snapshot("D")["sessions"]) == {"P"}


@pytest.mark.parametrize("call, kwargs, field", [
    ("new_request", dict(node="X", req_id="r", role="remote_decoder", kv_request_id="kv"), "node"),
    ("new_request", dict(node="P", req_id="r", role="remote_kv_source", kv_request_id="kv"), "role"),
    ("submit_store", dict(node="P", req_id="nope", job_id=1, keys=K, chunk_ids=[0, 1]), "req_id"),
    ("submit_store", dict(node="P", req_id="p", job_id=1, keys=K, chunk_ids=[0]), "chunk_ids"),
    ("submit_load", dict(node="D", req_id="d", job_id=-1, keys=K, chunk_ids=[0, 1]), "job_id"),
    ("complete_transfers", dict(node="P", count=1, ok="yes"), "ok"),
    ("advance", dict(seconds=-1), "seconds"),
    ("__init__", dict(max_peers=0), "max_peers"),
    ("__init__", dict(idle_timeout_s=-1), "idle_timeout_s"),
    ("write", dict(node="P", chunk_ids=[9], blocks=[b"x" * 16]), "chunk_ids"),
])
def test_bad_input_names_the_field_and_changes_nothing(call, kwargs, field):
    w = P2PWorld()
    _pair(w)
    before = (w.snapshot("P"), w.snapshot("D"), w.messages(), w.now)
    with pytest.raises(InvalidFieldError) as err:
        getattr(w, call)(**kwargs)
    assert err.value.field == field
    assert (w.snapshot("P"), w.snapshot("D"), w.messages(), w.now) == before


def test_the_reference_world_alone_keeps_its_invariants_on_generated_traces():
    ok, failure, _ = run_p2p_machine(with_vllm=False, examples=60, reproducible=True, shrink=False)
    assert ok, failure
