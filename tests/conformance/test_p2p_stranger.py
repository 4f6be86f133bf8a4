"""A third engine at the P2P tier's peer limit (``VLLM_P2P_MAX_PEERS``) and at the handshake (#22).

The stranger is a bare control socket (no tier, no data plane): it dials an engine with a
``connect`` the engine must refuse, and an engine may open a consumer request whose source is the
stranger, which never answers. vLLM's two managers (real ZMQ on loopback, NIXL over UCX) and the
reference world are driven with the same calls and compared on every observable after each one;
vLLM faults planted in the peer limit are found by the same comparison.
"""

from __future__ import annotations

import pytest

from kvref.impl.reference.offload.p2p.world import STRANGER_CONNECTS, P2PWorld, stranger_hello
from kvref.spec.errors import InvalidFieldError
from tests.vllm_env import require_vllm

pytestmark = pytest.mark.vllm


def _observe(world, calls: list[tuple]) -> list:
    """Run ``calls`` on ``world``; after each, what it returned and everything it shows."""
    seen = []
    try:
        for name, *args in calls:
            out = getattr(world, name)(*args)
            seen.append((name, out, world.snapshot("P"), world.snapshot("D"), world.messages(),
                         world.read("D", list(range(8)))))
    finally:
        world.close()
    return seen


def _tick() -> list[tuple]:
    return [c for _ in range(2) for n in ("P", "D") for c in (("serve", n), ("schedule_end", n))] + \
        [("poll", "P"), ("poll", "D")] * 2


def _scarce(kind: str) -> list[tuple]:
    """One peer slot each, taken by the P-D session: the stranger is refused both ways."""
    return [("new_request", "P", "p0", "remote_decoder", "kv0"), ("new_request", "D", "d0", "remote_prefiller", "kv0"),
            *_tick(), ("stranger_request", "D", "x0", "odd0"), ("lookup", "D", "x0", b"odd0/0"),
            ("submit_load", "D", "x0", 7, [b"odd0/0"], [6]), ("stranger_connects", "P", kind),
            ("stranger_connects", "D", kind), ("poll", "P"), ("poll", "D"), *_tick()]


def _roomy(kind: str) -> list[tuple]:
    """Free peer slots: the stranger's handshake opens a session that refuses it; D's dial of the
    stranger waits for a handshake that never comes, and its load fails when the handshake times out."""
    return [("stranger_connects", "P", kind), ("poll", "P"), ("stranger_request", "D", "x0", "odd0"),
            ("submit_load", "D", "x0", 7, [b"odd0/0"], [6]), ("poll", "D"), ("stranger_connects", "D", kind),
            ("poll", "D"), ("advance", 31.0), ("poll", "D"), ("poll", "D"), ("finish", "D", "x0"), ("poll", "D")]


def _both(calls: list[tuple], max_peers: int) -> tuple[list, list]:
    require_vllm()
    from kvref.impl.vllm.p2p import VllmP2PWorld

    return (_observe(VllmP2PWorld(max_peers=max_peers), calls),
            _observe(P2PWorld(max_peers=max_peers), calls))


def _first_difference(vllm: list, ref: list) -> tuple | None:
    return next(((i, a, b) for i, (a, b) in enumerate(zip(vllm, ref)) if a != b), None)


@pytest.mark.parametrize("kind", STRANGER_CONNECTS)
def test_a_stranger_is_refused_as_the_reference_says(kind):
    """Scarce slots: no session, no dial, the request's load fails; free slots: a session that
    refuses the handshake, and a dial that times out. vLLM and the reference agree on every step."""
    for calls, max_peers in ((_scarce(kind), 1), (_roomy(kind), 128)):
        vllm, ref = _both(calls, max_peers)
        assert _first_difference(vllm, ref) is None, _first_difference(vllm, ref)
        assert (7, False) in [j for name, out, *_ in ref if name == "poll" for j in out]
        assert any(src == "X" and dst == "P" and msg[0] == "connect" for src, dst, msg in ref[-1][4])


def test_the_reference_counts_the_refusals_at_the_peer_limit():
    """The machine's coverage counter is the reference's: both the dial not made and the connection
    refused are counted, and no session to the stranger exists."""
    w = P2PWorld(max_peers=1)
    for name, *args in _scarce("seed"):
        getattr(w, name)(*args)
    assert w.managers["D"].refused_at_limit == 2 and w.managers["P"].refused_at_limit == 1
    assert all(pid != "X:1" for m in w.managers.values() for pid in m.sessions)
    assert w.lookup("D", "x0", b"odd0/0") == "MISS"


def test_stranger_calls_refuse_bad_input():
    w = P2PWorld()
    with pytest.raises(InvalidFieldError, match="kind"):
        w.stranger_connects("P", "friendly")
    with pytest.raises(InvalidFieldError, match="node"):
        w.stranger_request("Q", "x0", "odd0")
    with pytest.raises(InvalidFieldError, match="kind"):
        stranger_hello("other", "X:1", 8, 16)
    w.stranger_request("D", "x0", "odd0")
    with pytest.raises(InvalidFieldError, match="req_id"):
        w.stranger_request("D", "x0", "odd0")


@pytest.mark.parametrize("where", ["_accept_new_peers", "_get_or_create_session"])
def test_an_off_by_one_peer_limit_in_vllm_is_found(monkeypatch, where):
    """Planted in vLLM: the inbound (``_accept_new_peers``) or outbound (``_get_or_create_session``)
    peer limit lets one session more in than ``VLLM_P2P_MAX_PEERS``: the engine talks to the
    stranger where the reference (and vLLM unplanted, the test above) refuses it."""
    require_vllm()
    from vllm.v1.kv_offload.tiering.p2p import manager as manager_module

    from kvref.impl.vllm.p2p import _EnvOverrides

    real = getattr(manager_module.P2PSecondaryTierManager, where)

    def planted(self, *args):
        saved = manager_module.envs
        manager_module.envs = _EnvOverrides(saved, VLLM_P2P_MAX_PEERS=saved.VLLM_P2P_MAX_PEERS + 1)
        try:
            return real(self, *args)
        finally:
            manager_module.envs = saved

    monkeypatch.setattr(manager_module.P2PSecondaryTierManager, where, planted)
    vllm, ref = _both(_scarce("block_len"), 1)
    assert _first_difference(vllm, ref) is not None
