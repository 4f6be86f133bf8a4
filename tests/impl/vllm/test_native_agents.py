"""NIXL agents kvref's vLLM harnesses start are destroyed when it is done with them (#22/#26).

A leaked agent's UCX threads poll with a zero timeout for the rest of the process: a test file
that leaked a handful left 1-2 cores busy for every later test of its process, and ``kvref verify
--against vllm`` the same. Each test counts the process's native threads (``/proc/self/task``, the
threads Python did not start) and the NIXL agents alive, before and after.
"""

from __future__ import annotations

import os

import pytest

from kvref.impl.vllm.native_agents import (
    drop_import_tracebacks,
    drop_tracebacks,
    live_nixl_agents,
    native_thread_ids,
    release_native_agents,
)
from tests.vllm_env import require_vllm

needs_proc = pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="no /proc: threads cannot be counted")


def _raise_chain() -> None:
    def inner():
        raise KeyError("inner")

    try:
        inner()
    except KeyError as exc:
        raise RuntimeError("outer") from exc


def test_drop_tracebacks_drops_the_whole_chain_and_keeps_the_message():
    try:
        try:
            _raise_chain()
        except RuntimeError:
            raise ValueError("handled")  # noqa: B904 - its __context__ is the RuntimeError
    except ValueError as exc:
        caught = exc
    chain = [caught, caught.__context__, caught.__context__.__cause__]
    assert all(e.__traceback__ is not None for e in chain)
    drop_tracebacks(caught)
    assert [e.__traceback__ for e in chain] == [None, None, None]
    assert [str(e) for e in chain] == ["handled", "outer", "'inner'"]


@needs_proc
def test_a_released_p2p_world_leaves_no_agent_and_no_native_thread(monkeypatch):
    """Two P2P worlds, the second after the pool was recycled (its new agents replace the first
    world's, which go at once), closed, then released: the native threads the agents started are
    gone and no NIXL agent is alive. ~3 s."""
    require_vllm()
    pytest.importorskip("nixl")
    from kvref.impl.vllm import p2p_nixl
    from kvref.impl.vllm.p2p import VllmP2PWorld

    release_native_agents()  # whatever an earlier test of this process left
    before = native_thread_ids()
    assert live_nixl_agents() == []
    monkeypatch.setattr(p2p_nixl, "RECYCLE_AFTER", 1)
    names = []
    for _ in range(2):
        world = VllmP2PWorld(num_blocks=4, block_len=8)
        try:
            running = native_thread_ids() - before
            assert running, "a P2P world's UCX agents run native threads: the test could not fail"
            names.append(live_nixl_agents())
        finally:
            world.close()
    assert len(names[0]) == 2 and len(names[1]) == 2 and not set(names[0]) & set(names[1]), names
    del world
    assert release_native_agents() >= 2
    assert live_nixl_agents() == []
    assert native_thread_ids() - before == set()
    assert release_native_agents() == 0  # nothing left: a second release finds nothing


@needs_proc
def test_failed_kvcr_start_ups_leave_no_agent_and_no_native_thread():
    """KVCR start-ups that fail after kvcr created its NIXL agent (a G3 tier that cannot start, a
    NIXL backend no machine has) leave nothing running once vLLM's refusal returns: no release
    call is needed. ~3 s."""
    require_vllm()
    pytest.importorskip("kvcr")
    pytest.importorskip("nixl")
    import zmq

    from kvref.models.machines.tiering_config import run_config_cases

    release_native_agents()
    # kvcr's control channel uses zmq's process-wide context, whose IO and reaper threads live as
    # long as the process (two idle threads, once): started here, before the count
    zmq.Context.instance().socket(zmq.PAIR).close()
    before = native_thread_ids()
    stats = run_config_cases(0, 4, ("g3", "backend"))
    assert stats.get("refused_g3", 0) + stats.get("refused_backend", 0) >= 2, stats
    assert live_nixl_agents() == []
    assert native_thread_ids() - before == set()


def test_vllms_kept_import_error_holds_no_frame():
    """vLLM keeps torchcodec's import error at module level; once dropped, its traceback (the
    frames of whatever first imported vLLM's multimodal package) is gone."""
    require_vllm()
    import vllm.multimodal.media.audio as audio

    exc = audio._torchcodec_import_exc
    if exc is None:
        pytest.skip("torchcodec imports here: vLLM keeps no import error")
    drop_import_tracebacks()
    assert exc.__traceback__ is None and audio._torchcodec_import_exc is exc
