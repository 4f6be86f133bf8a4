"""NIXL refusing to release a removed peer's handles (vLLM ``NixlTransport._release_remote_handles``,
#22): the descriptor list's release failing must not skip the remote agent's removal, and an agent
whose removal failed stays loaded until the peer registers again. vLLM's world and the reference
are compared on every observable after each call; the skip, planted in vLLM, is found."""

from __future__ import annotations

import pytest

from kvref.impl.reference.offload.p2p.world import P2PWorld
from tests.conformance.test_p2p_stranger import _first_difference, _observe, _tick
from tests.vllm_env import require_vllm

pytestmark = pytest.mark.vllm


def _calls(kind: str) -> list[tuple]:
    """P and D handshake; P's NIXL is armed; P judges D unusable and tears the session down (the
    peer is removed); D dials again for a new request (D registered again at P)."""
    return [("new_request", "P", "p0", "remote_decoder", "kv0"), ("new_request", "D", "d0", "remote_prefiller", "kv0"),
            *_tick(), ("fail_releases", "P", 1, kind), ("fault", "P"), *_tick(), ("advance", 2.0),
            ("new_request", "D", "d1", "remote_prefiller", "kv1"), *_tick()]


def _both(kind: str) -> tuple[list, list]:
    require_vllm()
    from kvref.impl.vllm.p2p import VllmP2PWorld

    return _observe(VllmP2PWorld(), _calls(kind)), _observe(P2PWorld(), _calls(kind))


@pytest.mark.parametrize("kind", ["dlist", "agent"])
def test_refused_releases_leave_what_the_reference_says(kind):
    vllm, ref = _both(kind)
    assert _first_difference(vllm, ref) is None, _first_difference(vllm, ref)
    agents = {name: snap_p["agents"] for name, _, snap_p, *_ in ref if name in ("fail_releases", "advance")}
    assert agents["fail_releases"] == ["D"]  # registered before the session went down
    # after the teardown P still holds D's agent only where NIXL refused its removal
    assert agents["advance"] == (["D"] if kind == "agent" else [])
    assert ref[-1][2]["agents"] == ["D"]  # D registered again

def test_a_dlist_failure_that_skips_the_agent_removal_is_found(monkeypatch):
    """Planted in vLLM: one try around both releases, so a refused descriptor-list release leaves
    the remote agent loaded (the stale registration vLLM's two separate tries prevent)."""
    require_vllm()
    from vllm.v1.kv_offload.tiering.p2p.data.nixl import NixlTransport

    def planted(self, peer_id, dlist, nixl_name):
        try:
            if dlist is not None:
                self._agent.release_dlist_handle(dlist)
            if nixl_name:
                self._agent.remove_remote_agent(nixl_name)
        except Exception:  # noqa: BLE001 - the planted fault
            pass

    monkeypatch.setattr(NixlTransport, "_release_remote_handles", planted)
    vllm, ref = _both("dlist")
    diff = _first_difference(vllm, ref)
    assert diff is not None and diff[1][2]["agents"] == ["D"] and diff[2][2]["agents"] == [], diff
