"""vLLM's P2P secondary tier (two ``P2PSecondaryTierManager`` over loopback ZMQ, the in-memory
data plane) in lock step with the reference world, on generated traces (#22).

The runs are derandomized (the same traces every run, under both profiles), so the paths they
are required to reach are reached every time.
"""

from __future__ import annotations

import dataclasses

import pytest

from kvref.models.machines import p2p as machine
from tests.conftest import profile_examples
from tests.vllm_env import require_vllm

pytestmark = pytest.mark.vllm

#: what every run must reach (counted by the machine): bytes through, both outcomes of loads and
#: stores, reaped parked stores, an engine going away, a data-plane fault
RARE = ("loads_ok", "loads_failed", "stores_ok", "stores_failed", "bytes_checked", "reaped", "shutdowns", "faults")


def _run(examples: int, **kw) -> tuple[bool, str, dict]:
    require_vllm()
    before = dataclasses.asdict(machine.COVERAGE)
    ok, failure, _ = machine.run_p2p_machine(with_vllm=True, examples=examples, reproducible=True, shrink=False, **kw)
    after = dataclasses.asdict(machine.COVERAGE)
    return ok, failure, {k: after[k] - before[k] for k in after}


def test_vllm_p2p_tier_agrees_with_the_reference_on_generated_traces():
    ok, failure, reached = _run(profile_examples(40, 200))
    assert ok, failure
    missed = [k for k in RARE if not reached[k]]
    assert not missed, f"the generated traces never reached {missed}: {reached}"


def test_a_wrong_abort_round_in_the_reference_is_found(monkeypatch):
    """The comparison is live: a reference that aborts the wrong fetch round diverges from vLLM."""
    from kvref.impl.reference.offload.p2p import messages

    real = messages.abort_fetch
    monkeypatch.setattr(messages, "abort_fetch", lambda kv, rnd: real(kv, rnd + 1))
    ok, failure, _ = _run(40)
    assert not ok
    assert "abort_fetch" in failure and "diverged" in failure


def test_the_in_memory_transport_keeps_vllms_data_transport_contract():
    """What the sessions rely on (vLLM ``data/base.py``): unregistered peers get no transfer id,
    ids are unique, poll reports each finished id once and only to its peer's scope, a wait-mode
    cancel keeps pending writes, an immediate one drops them, a completed write copies bytes."""
    require_vllm()
    from kvref.impl.vllm.p2p import _classes

    cls = _classes().InMemoryTransport
    fabric: dict = {}
    bufs = [bytearray(4 * 8), bytearray(4 * 8)]
    a, b = (cls(fabric, name, memoryview(buf).cast("B", (4, 8)), None) for name, buf in zip("ab", bufs))
    assert a.write_blocks("b", [0], [1]) is None
    a.add_remote_peer("b", b"b", b.base_addr, 4, 8)
    bufs[0][0:8] = b"01234567"
    t0, t1, t2 = a.write_blocks("b", [0], [1]), a.write_blocks("b", [0], [2]), a.write_blocks("b", [0], [3])
    assert len({t0, t1, t2}) == 3
    assert a.cancel([t0, t1], mode="wait") == [t0, t1]
    assert a.complete(1, ok=True) == 1 and bytes(bufs[1][8:16]) == b"01234567"
    assert a.poll("other").done == [] and list(a.poll("b").done) == [t0] and list(a.poll("b").done) == []
    assert a.cancel([t1], mode="immediate") == [] and a.complete(5, ok=False) == 1
    assert list(a.poll("b").failed) == [t2] and bytes(bufs[1][16:24]) == bytes(8)
    a.faults["b"] = "down"
    assert a.poll("b").peer_fault == "down"
    a.close()
    assert a.write_blocks("b", [0], [1]) is None


def test_closing_a_world_releases_every_zmq_context_even_when_a_shutdown_raises():
    """A context left to the garbage collector was destroyed at an arbitrary later allocation, and
    its ``term()`` blocked the process (the ci-profile stall of #22): ``close`` destroys every one,
    also when a manager's shutdown fails half way, and a second ``close`` is harmless."""
    require_vllm()
    from kvref.impl.vllm.p2p import VllmP2PWorld

    world = VllmP2PWorld()
    world.new_request("D", "d0", "remote_prefiller", "kv0")  # D dials P: a live connection each way
    world.poll("P")
    world.poll("D")
    assert world.open_contexts() == 2
    assert world.managers["P"]._control._connections and world.managers["D"]._control._connections

    def broken_shutdown():
        raise RuntimeError("shutdown failed half way")

    world.managers["P"].shutdown = broken_shutdown
    world.close()
    assert world.open_contexts() == 0
    world.close()
    assert world.open_contexts() == 0


def test_verify_with_reach_exits_after_the_p2p_check(tmp_path):
    """``kvref verify --against vllm --only conform-p2p --reach DIR --json`` ends (it was seen
    hanging after the check, #22) with rc 0 and the check's row in its JSON."""
    import json
    import subprocess
    import sys

    require_vllm()
    proc = subprocess.run([sys.executable, "-m", "kvref.cli", "verify", "--against", "vllm", "--only", "conform-p2p",
                           "--reach", str(tmp_path / "reach"), "--json"], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = {row["name"]: row for row in json.loads(proc.stdout)["checks"]}
    assert rows["conform-p2p"]["status"] == "passed", rows
    assert rows["conform-p2p"]["examined"] > 0
