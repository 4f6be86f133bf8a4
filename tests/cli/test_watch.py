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

from tests.foreground import as_foreground_job
from kvref.impl.request import Request, RequestStatus
from kvref.models.kv_events.watch import EventStreamWatcher

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
        events = mgr.vllm_manager.take_events()
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

    def __init__(self) -> None:
        from vllm.distributed.kv_events import ZmqEventPublisher

        class LoopbackPublisher(ZmqEventPublisher):
            _is_bind_endpoint = staticmethod(lambda endpoint: True)

        self.port, self.replay_port = _free_port(), _free_port()
        self.pub = LoopbackPublisher(0, endpoint=f"tcp://127.0.0.1:{self.port}",
                                     replay_endpoint=f"tcp://127.0.0.1:{self.replay_port}")

    def send_twice(self, seq: int) -> None:
        """From now on the wire carries batch ``seq`` twice (the publisher thread's PUB socket is
        wrapped; only that thread sends on it)."""
        real = self.pub._pub

        class Twice:
            def __getattr__(self, name):
                return getattr(real, name)

            def send_multipart(self, frames, *a, **kw):
                real.send_multipart(frames, *a, **kw)
                if int.from_bytes(frames[1], "big") == seq:
                    real.send_multipart(frames, *a, **kw)

        self.pub._pub = Twice()

    def drop_on_wire(self, seq: int) -> None:
        """From now on batch ``seq`` never reaches the PUB socket but stays in the replay buffer:
        what a subscriber that is still joining (ZeroMQ's slow joiner) experiences."""
        real = self.pub._pub

        class Drop:
            def __getattr__(self, name):
                return getattr(real, name)

            def send_multipart(self, frames, *a, **kw):
                if int.from_bytes(frames[1], "big") != seq:
                    real.send_multipart(frames, *a, **kw)

        self.pub._pub = Drop()

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
    assert summary["verdict"] == "clean"
    assert summary["events"]["AllBlocksCleared"] == 2 and summary["shadow_sure"]


@pytest.mark.vllm
def test_watcher_shadow_equals_vllms_index_with_the_vllm_decoder(vllm_stream) -> None:
    from kvref.cli.watch import watch

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
def test_a_last_batch_missed_on_the_wire_is_fetched_from_replay(vllm_stream) -> None:
    """No later batch reveals the gap, so only asking the replay socket while the stream is quiet
    recovers it (the CI flake behind this test: the final batch was published while the watcher's
    subscription was still joining, and the watcher waited for it until --seconds)."""
    from kvref.cli.watch import watch

    batches, mgr = vllm_stream
    pub = _Publisher()
    w = EventStreamWatcher()
    stop = threading.Event()
    t, _ = _in_thread(lambda: watch(pub.endpoint, replay_endpoint=pub.replay_endpoint, seconds=BOUND_S,
                                    decoder="vllm", watcher=w, stop=stop))
    try:
        warmups = _until_live(pub, w)  # the start-up replay is over: only a later fetch can help
        total = warmups + len(batches)
        pub.drop_on_wire(total - 1)
        for events in batches:
            pub.publish(events)
        _until_seq(w, total)
    finally:
        stop.set()
        t.join(BOUND_S)
        pub.close()
    assert w.num_findings == 0 and w.next_seq == total, w.summary()
    assert w.batches_from_replay >= 1
    assert w.shadow == _shadow_of_vllm_pool(mgr)


def _until_seq(w: EventStreamWatcher, total: int) -> None:
    """Wait (bounded) until the watcher has accounted for ``total`` sequence numbers."""
    deadline = time.monotonic() + BOUND_S
    while w.next_seq != total and time.monotonic() < deadline:
        time.sleep(0.01)


def _until_live(pub: _Publisher, w: EventStreamWatcher) -> int:
    """Publish empty batches, one at a time, until one arrives live: the subscription is in place
    (bounded). Returns how many were published."""
    deadline = time.monotonic() + BOUND_S
    warmups = 0
    while w.batches_received - w.batches_from_replay == 0 and time.monotonic() < deadline:
        pub.publish([])
        warmups += 1
        time.sleep(0.05)
    assert w.batches_received - w.batches_from_replay > 0, "the watcher never got a live batch"
    return warmups


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
    from kvref.cli.watch import exit_status, watch

    batches, _ = vllm_stream
    pub = _Publisher()
    w = EventStreamWatcher()
    stop = threading.Event()
    t, _ = _in_thread(lambda: watch(pub.endpoint, replay_endpoint=pub.replay_endpoint, seconds=BOUND_S,
                                    watcher=w, stop=stop))
    try:
        # Both copies must reach the live socket, so first make sure the subscription is in place.
        warmups = _until_live(pub, w)
        dup = warmups + 3
        pub.send_twice(dup)
        for events in batches:
            pub.publish(events)
        total = warmups + len(batches)
        _until_seq(w, total)
    finally:
        stop.set()
        t.join(BOUND_S)
        pub.close()
    assert w.next_seq == total, w.summary()
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
    capsys.readouterr()
    with socket.socket() as busy:  # --bind on an address in use: the endpoint is named, exit 2
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        assert main(["watch", "--bind", f"tcp://127.0.0.1:{port}", "--seconds", "1", "--quiet"]) == 2
    assert "endpoint" in capsys.readouterr().err


def test_no_publisher_is_nothing_checked_never_ok(capsys) -> None:
    """A watcher that received nothing examined nothing: exit 3 and a verdict that says so, never
    "OK: the stream obeyed every rule" with exit 0 (issue #25)."""
    import json

    port = _free_port()
    assert main(["watch", f"tcp://127.0.0.1:{port}", "--seconds", "0.3", "--quiet"]) == 3
    text = capsys.readouterr().out
    assert "NOTHING CHECKED: no batch arrived" in text and "OK" not in text
    assert main(["watch", f"tcp://127.0.0.1:{port}", "--seconds", "0.3", "--quiet", "--json"]) == 3
    summary = json.loads(capsys.readouterr().out)
    assert summary["verdict"] == "nothing-checked" and summary["batches_received"] == 0


def test_ctrl_c_prints_the_partial_summary_and_exits_130(tmp_path) -> None:
    port = _free_port()
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    proc = subprocess.Popen([sys.executable, "-m", "kvref.cli", "watch", f"tcp://127.0.0.1:{port}",
                             "--seconds", str(BOUND_S)], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env=env, preexec_fn=as_foreground_job)
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


@pytest.mark.vllm
def test_vllms_scheduler_publishes_to_a_bound_watcher() -> None:
    """The whole engine-side path: vLLM's Scheduler with a kv_events_config (its own publisher,
    configured with a host address, connects; the watcher binds 127.0.0.1), steps that cache,
    evict, finish and reset; the watcher sees every batch and no finding."""
    require_vllm()
    from kvref.impl.interface import PoolConfig
    from kvref.impl.scheduler_types import ModelOutput, SchedulerConfig
    from kvref.impl.vllm.scheduler import VllmEnv, VllmScheduler
    from kvref.spec.kv_cache_interface import KVCacheGroupSpec
    from vllm.config.kv_events import KVEventsConfig

    from kvref.cli.watch import watch

    port, replay_port = _free_port(), _free_port()
    env = VllmEnv()
    env.vllm_config.kv_events_config = KVEventsConfig(
        enable_kv_cache_events=True, publisher="zmq", endpoint=f"tcp://127.0.0.1:{port}",
        replay_endpoint=f"tcp://127.0.0.1:{replay_port}", topic="kvref")
    w = EventStreamWatcher()
    stop = threading.Event()
    t, _ = _in_thread(lambda: watch(f"tcp://127.0.0.1:{port}", bind=True, topic="kvref", seconds=BOUND_S,
                                    replay_endpoint=f"tcp://127.0.0.1:{replay_port}", watcher=w, stop=stop))
    cfg = SchedulerConfig(max_num_batched_tokens=32, max_num_seqs=4)
    pool = PoolConfig(num_blocks=10, groups=(KVCacheGroupSpec(("full",), fa(4)),), max_model_len=64,
                      scheduler_block_size=4, hash_block_size=4, max_in_flight_tokens=cfg.max_in_flight_tokens)
    s = VllmScheduler(pool, cfg, env)
    publisher = s.scheduler.kv_event_publisher
    try:
        for round_ in range(3):
            for i in range(3):
                s.add_request(Request(f"q{round_}.{i}", [i % 2] * 8 + [round_, i] * 3, max_tokens=3))
            for _ in range(40):  # bounded: each round ends in a handful of steps
                if not s.has_unfinished_requests():
                    break
                out = s.schedule()
                s.update_from_output(out, ModelOutput({r.request_id: [5] for r in out.scheduled
                                                       if not r.is_prefill_chunk}))
            assert s.scheduler.reset_prefix_cache()
            s.update_from_output(s.schedule(), ModelOutput())  # an empty step publishes the clear
        deadline = time.monotonic() + BOUND_S
        while publisher._event_queue.unfinished_tasks and time.monotonic() < deadline:
            time.sleep(0.01)
        published = next(publisher._seq_gen)  # the next number: how many batches went out
        while w.next_seq != published and time.monotonic() < deadline:
            time.sleep(0.01)
    finally:
        stop.set()
        t.join(BOUND_S)
        publisher.shutdown()
    assert w.next_seq == published and w.first_seq == 0, w.summary()
    assert w.num_findings == 0, w.summary()
    assert set(w.events_by_type) == {"BlockStored", "BlockRemoved", "AllBlocksCleared"}, w.events_by_type
    assert w.shadow == {} and w.summary()["shadow_sure"]  # the last batch cleared everything


def test_the_vllm_decoder_says_it_imports_vllm(capsys) -> None:
    """`--decoder vllm` imports vLLM (seconds) before the first status line: it says so first."""
    require_vllm()
    port = _free_port()
    assert main(["watch", f"tcp://127.0.0.1:{port}", "--seconds", "0.2", "--decoder", "vllm"]) == 3
    err = capsys.readouterr().err
    assert err.splitlines()[0] == "[kvref watch] importing vLLM for --decoder vllm ..."
