"""``kvref demo publish``: vLLM's own Scheduler on a fake model publishes through vLLM's own
ZmqEventPublisher on 127.0.0.1, and ``kvref watch`` checks the stream (issue #25).

Every wait is bounded (the watcher stops after ``--batches`` sequence numbers or ``--seconds``;
the publisher's hold ends when the test sets ``stop``); nothing asserts on timing."""

from __future__ import annotations

import json
import socket
import threading
import time

import pytest

from kvref.cli import main
from tests.vllm_env import require_vllm

BOUND_S = 120.0

pytestmark = pytest.mark.vllm


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class _Demo:
    """``publish_demo`` in a thread, holding its replay buffer until :meth:`close`."""

    def __init__(self, workload: str = "prefix-sharing", fault: str | None = None, interval: float = 0.0) -> None:
        from kvref.impl.vllm.demo_publish import DemoStream, publish_demo

        self.endpoint = f"tcp://127.0.0.1:{_free_port()}"
        self.replay_endpoint = f"tcp://127.0.0.1:{_free_port()}"
        self.stop = threading.Event()
        self.stream = DemoStream(self.endpoint, self.replay_endpoint, workload, fault)
        self.errors: list[BaseException] = []

        def target() -> None:
            try:
                publish_demo(self.endpoint, replay_endpoint=self.replay_endpoint, workload=workload, fault=fault,
                             interval=interval, hold=BOUND_S, stop=self.stop, stream=self.stream)
            except BaseException as exc:  # noqa: BLE001 — surfaced by the test
                self.errors.append(exc)

        self.thread = threading.Thread(target=target, daemon=True)

    def start(self) -> "_Demo":
        self.thread.start()
        return self

    def published(self) -> "_Demo":
        deadline = time.monotonic() + BOUND_S
        while not self.stream.done.wait(0.1) and not self.errors and time.monotonic() < deadline:
            pass
        assert not self.errors, self.errors
        assert self.stream.done.is_set(), "the demo did not publish its stream in time"
        return self

    def close(self) -> None:
        self.stop.set()
        self.thread.join(BOUND_S)


def _watch(demo: _Demo, capsys, *extra: str) -> tuple[int, dict]:
    rc = main(["watch", demo.endpoint, "--replay-endpoint", demo.replay_endpoint, "--batches",
               str(demo.stream.sequence_numbers), "--seconds", str(BOUND_S), "--quiet", "--json", *extra])
    return rc, json.loads(capsys.readouterr().out)


@pytest.mark.parametrize("workload", ["prefix-sharing", "hybrid-swa"])
def test_a_clean_demo_stream_is_checked_whole_and_exits_0(workload, capsys) -> None:
    require_vllm()
    demo = _Demo(workload).start().published()
    try:
        rc, summary = _watch(demo, capsys)
    finally:
        demo.close()
    assert rc == 0, summary
    assert summary["verdict"] == "clean" and summary["batches_received"] == demo.stream.batches > 10
    # vLLM's scheduler cached, evicted and reset: every event type of the stream went through the watcher
    assert set(summary["events"]) == {"BlockStored", "BlockRemoved", "AllBlocksCleared"}, summary["events"]
    assert summary["events"] == dict(sorted(demo.stream.events.items()))


def test_the_text_verdict_says_how_many_batches_were_checked(capsys) -> None:
    require_vllm()
    demo = _Demo().start().published()
    try:
        rc = main(["watch", demo.endpoint, "--replay-endpoint", demo.replay_endpoint, "--batches",
                   str(demo.stream.sequence_numbers), "--seconds", str(BOUND_S), "--quiet"])
    finally:
        demo.close()
    out = capsys.readouterr().out
    assert rc == 0 and f"OK: {demo.stream.batches} batches checked" in out, out


@pytest.mark.parametrize("fault, rule", [("lost-batch", "lost-batches"), ("drop-stored", "removed-never-stored")])
def test_a_faulty_demo_stream_exits_1_naming_the_rule(fault, rule, capsys) -> None:
    require_vllm()
    demo = _Demo("prefix-sharing", fault).start().published()
    try:
        rc, summary = _watch(demo, capsys)
    finally:
        demo.close()
    assert rc == 1 and summary["verdict"] == "findings", summary
    assert set(summary["findings_by_rule"]) == {rule}, summary["findings_by_rule"]


def test_a_duplicated_batch_reaches_a_live_watcher(capsys) -> None:
    """The duplicate is on the wire only (the replay buffer holds each batch once): the watcher is
    connecting before the demo binds, and a paced demo waits a moment after binding before its
    first step, so the subscription is in place before the duplicated batch goes out."""
    require_vllm()
    from kvref.cli.watch import watch
    from kvref.models.kv_events.watch import EventStreamWatcher

    demo = _Demo("prefix-sharing", "duplicate-batch", interval=0.02)
    w = EventStreamWatcher()
    stop = threading.Event()
    t = threading.Thread(target=lambda: watch(demo.endpoint, replay_endpoint=demo.replay_endpoint, seconds=BOUND_S,
                                              watcher=w, stop=stop), daemon=True)
    t.start()
    try:
        demo.start()
        deadline = time.monotonic() + BOUND_S
        while w.batches_received == 0 and time.monotonic() < deadline:  # the stream has reached the watcher
            time.sleep(0.01)
        demo.published()
        while w.next_seq != demo.stream.sequence_numbers and time.monotonic() < deadline:
            time.sleep(0.01)
    finally:
        stop.set()
        t.join(BOUND_S)
        demo.close()
    assert w.next_seq == demo.stream.sequence_numbers, w.summary()
    assert w.findings_by_rule == {"duplicate-batch": 1}, w.summary()


def test_bad_options_are_named_before_vllm_is_imported(capsys) -> None:
    assert main(["demo", "publish", "http://127.0.0.1:5557"]) == 2
    assert "ENDPOINT" in capsys.readouterr().err
    assert main(["demo", "publish", "tcp://127.0.0.1:5557", "--replay-endpoint", "tcp://127.0.0.1:5557"]) == 2
    assert "--replay-endpoint" in capsys.readouterr().err
    assert main(["demo", "publish", "tcp://127.0.0.1:5557", "--hold", "-1"]) == 2
    assert "--hold" in capsys.readouterr().err
    assert main(["demo", "publish", "tcp://127.0.0.1:5557", "--fault", "nosuch"]) == 2


def test_an_address_in_use_is_an_input_error(capsys) -> None:
    require_vllm()
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        assert main(["demo", "publish", f"tcp://127.0.0.1:{port}", "--hold", "0"]) == 2
    assert "endpoint" in capsys.readouterr().err
