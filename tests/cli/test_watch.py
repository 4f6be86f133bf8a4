"""``kvref watch`` against a real vLLM publisher on 127.0.0.1.

The events are vLLM's own: its ``KVCacheManager`` (with ``enable_kv_cache_events``) runs a small
workload with prefix hits, evictions and resets, and every step's ``take_events()`` is published
as a ``KVEventBatch`` by vLLM's ``ZmqEventPublisher`` (its publisher thread, sequence numbers,
msgpack encoding and replay socket). The only change to the publisher: it binds its 127.0.0.1
address instead of connecting to it (vLLM binds only wildcard addresses; tests stay on loopback).

Faults are injected at the publisher: a sequence number consumed without sending (a lost batch,
which the replay buffer cannot return either) and one payload sent twice on the wire (a duplicated
batch). Every wait is bounded (the watcher stops after ``--batches`` sequence numbers or
``--seconds``); nothing asserts on timing.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time

import pytest
from kvref.impl.request import Request, RequestStatus
from kvref.models.kv_event_watch import EventStreamWatcher

from kvref.cli import main
from tests.impl.reference.helpers import config, fa
from tests.vllm_env import require_vllm

#: an upper bound for one watcher run; the runs end by --batches long before (no timing is asserted)
BOUND_S = 60.0


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _vllm_batches(steps: int = 14) -> tuple[list[list], object]:
    """Per step, the events vLLM's own KVCacheManager queued (vLLM objects), and the manager."""
    from kvref.impl.vllm.kv_cache_manager import VllmKVCacheManager

    mgr = VllmKVCacheManager(config([fa(4)], num_blocks=12, enable_kv_cache_events=True))
    batches = []
    for step in range(steps):
        r = Request(f"r{step}", [step % 3] * 9 + list(range(3 + 5 * step % 13)))
        ids, hit = mgr.get_computed_blocks(r)
        if mgr.allocate_slots(r, r.num_tokens - hit, hit, ids if hit else None) is not None:
            r.num_computed_tokens, r.status = r.num_tokens, RequestStatus.RUNNING
            r.output_token_ids.append(7)
            if mgr.allocate_slots(r, 1) is not None:
                r.num_computed_tokens += 1
            mgr.free(r)
        if step % 6 == 5:
            assert mgr.reset_prefix_cache()
        events = mgr._mgr.take_events()
        batches.append(events or [])
    return batches, mgr


@pytest.fixture(scope="module")
def vllm_stream():
    require_vllm()
    batches, mgr = _vllm_batches()
    kinds = {type(e).__name__ for b in batches for e in b}
    assert kinds == {"BlockStored", "BlockRemoved", "AllBlocksCleared"}, kinds
    return batches, mgr


class _Publisher:
    """vLLM's ZmqEventPublisher on 127.0.0.1 (bound), with optional fault injection."""

    def __init__(self, duplicate_seq: int | None = None) -> None:
        from vllm.distributed.kv_events import ZmqEventPublisher

        class LoopbackPublisher(ZmqEventPublisher):
            _is_bind_endpoint = staticmethod(lambda endpoint: True)

        self.port, self.replay_port = _free_port(), _free_port()
        self.pub = LoopbackPublisher(0, endpoint=f"tcp://127.0.0.1:{self.port}",
                                     replay_endpoint=f"tcp://127.0.0.1:{self.replay_port}")
        if duplicate_seq is not None:  # the wire sends that batch twice
            real = self.pub._pub

            class Twice:
                def __getattr__(self, name):
                    return getattr(real, name)

                def send_multipart(self, frames, *a, **kw):
                    real.send_multipart(frames, *a, **kw)
                    if int.from_bytes(frames[1], "big") == duplicate_seq:
                        real.send_multipart(frames, *a, **kw)

            self.pub._pub = Twice()

    @property
    def endpoint(self) -> str:
        return f"tcp://127.0.0.1:{self.port}"

    @property
    def replay_endpoint(self) -> str:
        return f"tcp://127.0.0.1:{self.replay_port}"

    def publish(self, events: list) -> None:
        from vllm.distributed.kv_events import KVEventBatch

        self.pub.publish(KVEventBatch(ts=time.time(), events=events))

    def lose_one(self) -> None:
        """The next sequence number is used up without a batch: a lost batch (the replay buffer
        never held it either). The publisher thread numbers batches as it sends them, so wait
        until it has sent every batch published so far (bounded)."""
        deadline = time.monotonic() + BOUND_S
        while self.pub._event_queue.unfinished_tasks and time.monotonic() < deadline:
            time.sleep(0.01)
        assert not self.pub._event_queue.unfinished_tasks, "the publisher thread did not drain its queue"
        next(self.pub._seq_gen)

    def close(self) -> None:
        self.pub.shutdown()


def _in_thread(fn):
    out: dict = {}

    def target():
        out["value"] = fn()

    t = threading.Thread(target=target, daemon=True)
    t.start()
    return t, out


def _shadow_of_vllm_pool(mgr) -> dict:
    from vllm.v1.core.kv_cache_utils import (
        get_block_hash,
        get_group_id,
        maybe_convert_block_hash,
    )

    out: dict = {}
    for key, entry in mgr._pool.cached_block_hash_to_block._cache.items():
        n = len(entry) if isinstance(entry, dict) else 1
        k = ("GPU", get_group_id(key), maybe_convert_block_hash(get_block_hash(key)))
        out[k] = out.get(k, 0) + n
    return out


@pytest.mark.vllm
def test_clean_stream_exits_0_and_rebuilds_vllms_index(vllm_stream, capsys) -> None:
    batches, _mgr = vllm_stream
    pub = _Publisher()
    try:
        args = ["watch", pub.endpoint, "--replay-endpoint", pub.replay_endpoint, "--batches", str(len(batches)),
                "--seconds", str(BOUND_S), "--quiet", "--json"]
        t, out = _in_thread(lambda: main(args))
        for events in batches:
            pub.publish(events)
        t.join(BOUND_S + 10)
    finally:
        pub.close()
    assert out.get("value") == 0, capsys.readouterr()
    import json

    summary = json.loads(capsys.readouterr().out)
    assert summary["num_findings"] == 0 and summary["last_seq"] == len(batches) - 1
    assert summary["events"]["AllBlocksCleared"] == 2 and summary["shadow_sure"]


@pytest.mark.vllm
def test_watcher_shadow_equals_vllms_index_with_the_vllm_decoder(vllm_stream) -> None:
    from kvref.cli_watch import watch

    batches, mgr = vllm_stream
    pub = _Publisher()
    try:
        w = EventStreamWatcher()
        t, _ = _in_thread(lambda: watch(pub.endpoint, replay_endpoint=pub.replay_endpoint, seconds=BOUND_S,
                                        max_batches=len(batches), decoder="vllm", watcher=w))
        for events in batches:
            pub.publish(events)
        t.join(BOUND_S + 10)
    finally:
        pub.close()
    assert w.num_findings == 0 and w.next_seq == len(batches)
    assert w.shadow == _shadow_of_vllm_pool(mgr)  # the stream rebuilt vLLM's prefix-cache index
    w.check_invariants()


@pytest.mark.vllm
def test_a_lost_batch_is_flagged_and_exits_1(vllm_stream, capsys) -> None:
    batches, _ = vllm_stream
    pub = _Publisher()
    try:
        args = ["watch", pub.endpoint, "--replay-endpoint", pub.replay_endpoint,
                "--batches", str(len(batches) + 1), "--seconds", str(BOUND_S), "--quiet"]
        t, out = _in_thread(lambda: main(args))
        for i, events in enumerate(batches):
            if i == 4:
                pub.lose_one()
            pub.publish(events)
        t.join(BOUND_S + 10)
    finally:
        pub.close()
    text = capsys.readouterr().out
    assert out.get("value") == 1, text
    assert "[lost-batches] seq 5: 1 batch(es) lost: sequence 4 never arrived" in text


@pytest.mark.vllm
def test_a_duplicated_batch_is_flagged_and_exits_1(vllm_stream) -> None:
    from kvref.cli_watch import exit_status, watch

    batches, _ = vllm_stream
    dup = 6
    pub = _Publisher(duplicate_seq=dup)
    try:
        w = EventStreamWatcher()
        t, _ = _in_thread(lambda: watch(pub.endpoint, replay_endpoint=pub.replay_endpoint, seconds=BOUND_S,
                                        max_batches=len(batches), watcher=w))
        # Both copies must reach the live socket: publish the batches before the duplicated one
        # only as fast as the watcher receives one live (its subscription is then in place).
        deadline = time.monotonic() + BOUND_S
        for i, events in enumerate(batches):
            pub.publish(events)
            while i < dup and w.batches_received - w.batches_from_replay == 0 and time.monotonic() < deadline:
                time.sleep(0.01)
        t.join(BOUND_S + 10)
    finally:
        pub.close()
    assert w.batches_received - w.batches_from_replay > 0, "the watcher never got a live batch"
    assert w.findings_by_rule == {"duplicate-batch": 1}, w.summary()
    assert w.findings[0].seq == dup and exit_status(w) == 1


def test_bad_endpoints_exit_2(capsys) -> None:
    assert main(["watch", "tcp://*:5557", "--seconds", "1"]) == 2
    assert "endpoint" in capsys.readouterr().err
    assert main(["watch", "tcp://127.0.0.1:70000", "--seconds", "1"]) == 2
    assert main(["watch", "http://127.0.0.1:5557", "--seconds", "1"]) == 2
    assert main(["watch", "tcp://127.0.0.1:5557", "--replay-endpoint", "5558", "--seconds", "1"]) == 2
    assert main(["watch", "tcp://127.0.0.1:5557", "--seconds", "-3"]) == 2
    assert main(["watch", "tcp://127.0.0.1:5557", "--seconds", "1", "--batches", "0"]) == 2


def test_no_publisher_ends_by_itself_with_a_hint(capsys) -> None:
    port = _free_port()
    assert main(["watch", f"tcp://127.0.0.1:{port}", "--seconds", "0.3", "--quiet"]) == 0
    assert "no batch arrived" in capsys.readouterr().out


def test_ctrl_c_prints_the_partial_summary_and_exits_130(tmp_path) -> None:
    port = _free_port()
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    proc = subprocess.Popen([sys.executable, "-m", "kvref.cli", "watch", f"tcp://127.0.0.1:{port}",
                             "--seconds", str(BOUND_S)], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env=env)
    try:
        first = proc.stderr.readline()  # the first status line: the loop is running
        assert first.startswith("[kvref watch"), first
        proc.send_signal(signal.SIGINT)
        out, _ = proc.communicate(timeout=BOUND_S)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 130
    assert "interrupted" in out and "0 batches" in out
