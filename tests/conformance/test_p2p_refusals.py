"""What the P2P tier's setup can refuse, vLLM's tier beside the reference world call by call (#22):
WRITE submissions NIXL refuses (vLLM ``NixlTransport.write_blocks``' except path: strikes, peer
faults by exception name or status text), peer registrations that fail and hash seeds that differ
(the handshake is refused), and requests whose ``kv_transfer_params`` are missing or malformed.

Each scenario runs on both worlds and compares every call's result, both engines' bookkeeping and
every control message after each call; a fault planted in vLLM's code for the path (its function
recompiled with one edit, test-local) makes the same scenario diverge. The generated traces of
``conform-p2p`` reach these paths too (``tests/conformance/test_p2p.py``).
"""

from __future__ import annotations

import contextlib
import inspect
import sys
import textwrap

import pytest

from kvref.impl.reference.offload.p2p.transport import SUBMIT_ERRORS
from kvref.impl.reference.offload.p2p.world import MALFORMED
from tests.vllm_env import require_vllm

pytestmark = pytest.mark.vllm

KEYS = [b"kv0/0", b"kv0/1"]
BLOCKS = [bytes([i]) * 16 for i in (1, 2)]


@contextlib.contextmanager
def planted(owner, name: str, old: str, new: str):
    """vLLM's ``owner.name`` recompiled with ``old`` replaced by ``new`` (once), for the block."""
    func = vars(owner)[name] if not inspect.ismodule(owner) else getattr(owner, name)
    src = textwrap.dedent(inspect.getsource(func))
    assert src.count(old) == 1, f"{name}: the planted edit must match once"
    ns: dict = {}
    module = sys.modules[func.__module__]
    exec(compile(src.replace(old, new), f"<planted {name}>", "exec"), vars(module), ns)  # noqa: S102
    setattr(owner, name, ns[name])
    try:
        yield
    finally:
        setattr(owner, name, func)


def lockstep(calls: list[tuple]) -> str | None:
    """Run ``calls`` on vLLM's world and the reference's; the first difference, or None."""
    require_vllm()
    from kvref.impl.reference.offload.p2p.world import P2PWorld
    from kvref.impl.vllm.p2p import VllmP2PWorld

    worlds = {"vllm": VllmP2PWorld(), "ref": P2PWorld()}
    try:
        for w in worlds.values():
            w.write("P", [0, 1], BLOCKS)
            for slot, key in enumerate(KEYS):
                w.hold("P", key, slot, 0)
        for call in calls:
            out = {n: getattr(w, call[0])(*call[1:]) for n, w in worlds.items()}
            if out["vllm"] != out["ref"]:
                return f"{call}: {out}"
            for node in ("P", "D"):
                if all(w.alive[node] for w in worlds.values()):
                    snaps = {n: w.snapshot(node) for n, w in worlds.items()}
                    if snaps["vllm"] != snaps["ref"]:
                        return f"after {call}, {node}'s snapshot: {snaps}"
                reads = {n: w.read(node, list(range(8))) for n, w in worlds.items()}
                if reads["vllm"] != reads["ref"]:
                    return f"after {call}, {node}'s buffer: {reads}"
            msgs = {n: w.messages() for n, w in worlds.items()}
            if msgs["vllm"] != msgs["ref"]:
                return f"after {call}, messages: {msgs}"
        return None
    finally:
        for w in worlds.values():
            w.close()


HANDSHAKE = [("new_request", "D", "d0", "remote_prefiller", "kv0"), ("new_request", "P", "p0", "remote_decoder", "kv0"),
             ("poll", "P"), ("poll", "D"), ("poll", "P"), ("poll", "D")]


def refused_round(kind: str) -> list[tuple]:
    """D fetches both keys of kv0; NIXL lets one WRITE through and refuses the next as ``kind``; P
    stores one key (its WRITE goes out), then the other, whose WRITE is refused while the first is
    still in flight: the round fails once that one lands."""
    return HANDSHAKE + [("submit_load", "D", "d0", 1, KEYS, [2, 3]), ("poll", "P"),
                        ("fail_submissions", "P", 1, kind, 1), ("submit_store", "P", "p0", 2, KEYS[:1], [0]),
                        ("submit_store", "P", "p0", 3, KEYS[1:], [1]), ("poll", "P"), ("poll", "D"),
                        ("complete_transfers", "P", 1, True), ("poll", "P"), ("poll", "D"), ("poll", "P"),
                        ("poll", "D")]


def refused_writes(kind: str, count: int = 3) -> list[tuple]:
    """``count`` refused submissions in a row (a round each), then a round whose WRITE lands."""
    calls = HANDSHAKE + [("fail_submissions", "P", count, kind)]
    for r in range(count + 1):
        calls += [("submit_load", "D", "d0", 10 * r, KEYS[:1], [2]), ("poll", "P"),
                  ("submit_store", "P", "p0", 10 * r + 1, KEYS[:1], [0]), ("poll", "P"), ("poll", "D")]
    return calls + [("complete_transfers", "P", 1, True), ("poll", "P"), ("poll", "D")]


@pytest.mark.parametrize("kind", sorted(SUBMIT_ERRORS))
def test_a_refused_write_fails_its_round_as_the_reference_says(kind):
    assert lockstep(refused_round(kind)) is None
    assert lockstep(refused_writes(kind)) is None


def test_three_refused_posts_fault_the_peer_with_the_last_cause():
    """vLLM's and the reference's data planes, refusals classified at submission: three strikes in
    a row fault the peer with the last error's text; NIXL's peer-scope errors fault it at once,
    matched by exception name or by the status in the error's text; a refusal gets no id."""
    require_vllm()
    from kvref.impl.reference.offload.p2p.world import P2PWorld
    from kvref.impl.vllm.p2p import VllmP2PWorld

    want = {"post_err": ({"D": 3}, "3 consecutive transfer failures (last: RuntimeError: transfer() posted with "
                                   "status ERR)"),
            "prep_error": ({"D": 3}, "3 consecutive transfer failures (last: RuntimeError: NIXL_ERR_BACKEND: "
                                     "make_prepped_xfer refused (injected))"),
            "remote_disconnect": ({}, "NIXL_ERR_REMOTE_DISCONNECT"), "not_found": ({}, "NIXL_ERR_NOT_FOUND")}
    for kind, (strikes, fault) in want.items():
        for world in (VllmP2PWorld(num_blocks=4, block_len=8), P2PWorld(num_blocks=4, block_len=8)):
            try:
                world.new_request("D", "d0", "remote_prefiller", "kv0")
                for _ in range(2):
                    world.poll("P")
                    world.poll("D")
                vllm = isinstance(world, VllmP2PWorld)
                plane = world.managers["P"]._data if vllm else world.planes["P"]
                d_id = world.ids["D"] if vllm else "D:1"
                world.fail_submissions("P", 3, kind)
                assert [plane.write_blocks(d_id, [0], [1]) for _ in range(3)] == [None] * 3
                snap = world.snapshot("P")
                assert (snap["strikes"], snap["faults"]) == (strikes, {"D": fault}), (kind, type(world).__name__)
                assert plane.write_blocks(d_id, [0], [1]) is not None and len(world.snapshot("P")["transfers"]) == 1
            finally:
                world.close()


def test_a_nixl_error_named_only_in_its_text_must_fault_the_peer():
    """Planted in vLLM: ``_peer_fault_status`` matches exception names only (a NIXL_ERR_NOT_FOUND
    raised as a plain RuntimeError becomes a strike, not a peer fault)."""
    require_vllm()
    from vllm.v1.kv_offload.tiering.p2p.data import nixl

    with planted(nixl, "_peer_fault_status",
                 "return next((s for s in _PEER_FAULT_ERRORS.values() if s in text), None)", "return None"):
        assert "faults" in (lockstep(refused_writes("not_found")) or "")


def test_a_refused_write_that_is_not_classified_is_found():
    """Planted in vLLM: ``write_blocks`` forgets to record a refused submission (no strike, no
    fault), so three refusals in a row never fault the peer."""
    require_vllm()
    from vllm.v1.kv_offload.tiering.p2p.data.nixl import NixlTransport

    with planted(NixlTransport, "write_blocks", "self._record_failure(peer_id, exc)", "pass"):
        assert "strikes" in (lockstep(refused_writes("post_err")) or "")


def test_a_round_whose_write_was_refused_must_end():
    """Planted in vLLM: a refused WRITE no longer marks its round finishing, so the round (and the
    load and store jobs it holds) waits for a write that will never come."""
    require_vllm()
    from vllm.v1.kv_offload.tiering.p2p.session.server import ServerRole

    with planted(ServerRole, "_submit_transfer", "rnd.finishing = True\n", "pass\n"):
        assert lockstep(refused_round("prep_error")) is not None


REJECTIONS = {
    "registration": [("fail_registrations", "P", 1)],
    "seed": [("reseed", "D", True)],
    "seed restored": [("reseed", "D", True), ("reseed", "D", False)],
}


@pytest.mark.parametrize("why", sorted(REJECTIONS))
def test_a_refused_handshake_fails_the_consumer_as_the_reference_says(why):
    """A registration that fails on the producer, or a consumer whose hash seed differs: the
    handshake is refused, the session reaped, the consumer's lookups MISS and its load fails;
    a request after that opens a new session (which the restored seed lets through)."""
    calls = REJECTIONS[why] + HANDSHAKE + [
        ("lookup", "D", "d0", KEYS[0]), ("submit_load", "D", "d0", 1, KEYS, [2, 3]), ("poll", "D"), ("poll", "P"),
        ("advance", 31.0), ("poll", "D"), ("poll", "P"), ("lookup", "D", "d0", KEYS[0]),
        ("new_request", "D", "d1", "remote_prefiller", "kv1"), ("poll", "P"), ("poll", "D"), ("poll", "P"),
        ("poll", "D")]
    assert lockstep(calls) is None


def test_a_failed_registration_must_give_its_nixl_agent_back():
    """Planted in vLLM: ``_build_peer_handles`` keeps the remote agent it loaded when preparing the
    peer's descriptors fails (a stale registration left behind)."""
    require_vllm()
    from vllm.v1.kv_offload.tiering.p2p.data.nixl import NixlTransport

    with planted(NixlTransport, "_build_peer_handles", "self._release_remote_handles(peer_id, None, nixl_name)",
                 "pass"):
        assert "agents" in (lockstep(REJECTIONS["registration"] + HANDSHAKE) or "")


def test_a_peer_whose_hash_seed_differs_must_be_refused():
    """Planted in vLLM: the handshake no longer compares hash seeds (peers whose block hashes
    differ would exchange nothing, silently)."""
    require_vllm()
    from vllm.v1.kv_offload.tiering.p2p.session.session import P2PSession

    with planted(P2PSession, "_on_connect", "if msg[ConnectMsg.HASH_SEED] != self._local_hash_seed:", "if False:"):
        assert lockstep(REJECTIONS["seed"] + HANDSHAKE) is not None


@pytest.mark.parametrize("role", MALFORMED)
def test_a_request_with_missing_or_malformed_params_is_served_as_the_reference_says(role):
    """Not a P2P request to vLLM (lookups MISS, stores succeed locally, loads fail), except a
    ``remote_decoder`` block without an id (a producer whose stores fail): on either engine."""
    calls = [("new_request", n, f"{n}m", role, "kv0") for n in ("P", "D")] + [
        step for n in ("P", "D") for step in (
            ("lookup", n, f"{n}m", KEYS[0]), ("submit_store", n, f"{n}m", 1, KEYS[:1], [0]),
            ("submit_load", n, f"{n}m", 2, KEYS, [2, 3]), ("submit_load", n, f"{n}m", 3, [], []), ("poll", n),
            ("finish", n, f"{n}m"))]
    assert lockstep(calls) is None


def test_a_local_store_of_a_request_that_is_not_p2p_must_succeed():
    """Planted in vLLM: ``submit_store`` fails the jobs of requests without a ``remote_decoder``
    block instead of succeeding them locally."""
    require_vllm()
    from vllm.v1.kv_offload.tiering.p2p.manager import P2PSecondaryTierManager

    with planted(P2PSecondaryTierManager, "submit_store",
                 "JobResult(job_id=job_id, success=True)", "JobResult(job_id=job_id, success=False)"):
        assert "poll" in (lockstep([("new_request", "P", "pm", "no_params", "kv0"),
                                    ("submit_store", "P", "pm", 1, KEYS[:1], [0]), ("poll", "P")]) or "")


def _messages():
    from hypothesis import strategies as st

    value = st.one_of(st.none(), st.booleans(), st.integers(-2, 3), st.text(max_size=2), st.binary(max_size=2),
                      st.lists(st.one_of(st.booleans(), st.integers(-1, 2), st.binary(min_size=1, max_size=2)),
                               max_size=3))
    fields = ("peer_id", "kv_request_id", "round_seq", "keys", "block_indexes", "hits", "success")
    return st.builds(lambda kind, body: {"type": kind, **body},
                     st.sampled_from(("connect_ack", "fetch", "transfer_done", "abort_fetch", "abort_ack", "lookup",
                                      "lookup_resp")),
                     st.dictionaries(st.sampled_from(fields), value))


def test_the_reference_rejects_exactly_the_control_messages_vllm_rejects():
    """vLLM's ``*Msg.validate`` and the reference's ``messages.validate`` on generated messages of
    every validated type (any field missing, of the wrong type, negative, or a list of mixed
    items): one raises ValueError exactly when the other does (a rejected message disconnects)."""
    require_vllm()
    from hypothesis import given, settings

    from kvref.impl.reference.offload.p2p import messages
    from tests.conftest import profile_examples
    from vllm.v1.kv_offload.tiering.p2p.session import protocol as p

    classes = {c.TYPE: c for c in (p.ConnectAckMsg, p.FetchMsg, p.TransferDoneMsg, p.AbortFetchMsg, p.AbortAckMsg,
                                   p.LookupMsg, p.LookupRespMsg)}

    def rejects(validate, msg) -> bool:
        try:
            validate(dict(msg))
        except ValueError:
            return True
        return False

    @settings(max_examples=profile_examples(200, 400), deadline=None, derandomize=True, database=None)
    @given(msg=_messages())
    def agree(msg):
        assert rejects(classes[msg["type"]].validate, msg) == rejects(messages.validate, msg), msg

    agree()
