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


def _step(w: P2PWorld, n: int = 2) -> list:
    """``n`` scheduler steps of both engines: serve the peer's lookups, end the step, poll."""
    out = []
    for _ in range(n):
        for node in ("P", "D"):
            w.serve(node)
            w.schedule_end(node)
        w.complete_transfers("P", 8, True)
        out += w.poll("P") + w.poll("D")
        w.check_invariants()
    return out


def test_a_symmetric_consumer_probes_then_fetches_what_the_peer_pinned():
    """``remote_kv_source``: lookups answer RETRY until P's serve resolves them against its tiering
    manager (a HIT_PENDING key is asked again at the next serve), the hits are pinned as that
    round's supply, and the fetch of the confirmed keys moves their bytes."""
    w = P2PWorld()
    w.write("P", [0, 1], [b"a" * 16, b"b" * 16])
    w.hold("P", b"k0", 0, 0)
    w.hold("P", b"k1", 1, 1)  # still being promoted: one HIT_PENDING first
    w.new_request("D", "s", "remote_kv_source", "kv0")
    assert [w.lookup("D", "s", k) for k in K] == ["RETRY", "RETRY"]
    _step(w, 4)  # handshake, the lookup goes out, P serves it (k1 pending), P serves k1 again
    assert [w.lookup("D", "s", k) for k in K] == ["HIT", "HIT"]
    w.submit_load("D", "s", 9, K, [4, 5])
    done = _step(w)
    assert (9, True) in done and {(1_000_000, True), (1_000_001, True)} <= set(done)  # the pins end too
    assert w.read("D", [4, 5]) == [b"a" * 16, b"b" * 16]
    calls = [c[0] for c in w.parent_log("P")]
    assert calls == ["on_new_request", "lookup", "lookup", "create_store_job", "lookup", "create_store_job",
                     "on_request_finished"]  # every synthetic request is finished: nothing left open


def test_a_probe_stuck_pending_misses_at_the_deadline_and_an_unpinned_fetch_fails_at_once():
    w = P2PWorld()
    w.hold("P", b"k0", 0, 0)
    w.hold("P", b"k1", 1, 10**6)  # never leaves HIT_PENDING
    w.new_request("D", "s", "remote_kv_source", "kv0")
    assert [w.lookup("D", "s", k) for k in K] == ["RETRY", "RETRY"]
    _step(w, 4)
    assert [w.lookup("D", "s", k) for k in K] == ["RETRY", "RETRY"]  # P holds the response back
    w.advance(5)  # LOOKUP_PENDING_TIMEOUT_S after the lookup arrived
    _step(w, 2)
    assert [w.lookup("D", "s", k) for k in K] == ["HIT", "MISS"]
    # a peer out of protocol fetches a key the round holds no pin for: the round fails at once
    assert w.inject("D", {"type": "fetch", "kv_request_id": "kv0", "keys": K, "block_indexes": [4, 5],
                          "round_seq": 0})
    _step(w, 1)
    assert ("P", "D", ("transfer_done", "kv0", 0, (), (), False, ())) in w.messages()


@pytest.mark.parametrize("call, kwargs, field", [
    ("new_request", dict(node="X", req_id="r", role="remote_decoder", kv_request_id="kv"), "node"),
    ("new_request", dict(node="P", req_id="r", role="remote_nowhere", kv_request_id="kv"), "role"),
    ("submit_store", dict(node="P", req_id="nope", job_id=1, keys=K, chunk_ids=[0, 1]), "req_id"),
    ("submit_store", dict(node="P", req_id="p", job_id=1, keys=K, chunk_ids=[0]), "chunk_ids"),
    ("submit_load", dict(node="D", req_id="d", job_id=-1, keys=K, chunk_ids=[0, 1]), "job_id"),
    ("complete_transfers", dict(node="P", count=1, ok="yes"), "ok"),
    ("advance", dict(seconds=-1), "seconds"),
    ("__init__", dict(max_peers=0), "max_peers"),
    ("hold", dict(node="P", key=b"k", chunk_id=8, pending=0), "chunk_ids"),
    ("hold", dict(node="P", key=b"k", chunk_id=0, pending=True), "pending"),
    ("break_transfers", dict(node="P", count=1, error="melted"), "error"),
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
