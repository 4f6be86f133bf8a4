"""A real KV-event stream without a GPU server: vLLM's own ``Scheduler`` on a fake model publishes
through vLLM's own ``ZmqEventPublisher`` (``kvref demo publish``, issue #25).

What runs is what a server runs: :class:`~kvref.impl.vllm.scheduler.VllmScheduler` builds vLLM's
``Scheduler`` (its ``KVCacheManager`` with ``enable_kv_cache_events``), and every
``update_from_output`` ends, as in the engine core, with ``kv_event_publisher.publish(
KVEventBatch(...))`` of the events the manager queued in that step. The publisher is vLLM's
``ZmqEventPublisher`` built from a ``KVEventsConfig`` (its thread, sequence numbers, msgpack
payloads, replay buffer and ROUTER socket). One difference, for loopback use: vLLM *binds* only
wildcard addresses (``tcp://*:PORT``) and *connects* to a host address; here a host address such
as ``tcp://127.0.0.1:5557`` is bound, so ``kvref watch tcp://127.0.0.1:5557`` connects to it as it
would to a server configured with ``tcp://*:5557``. The "model" samples a fixed token per request
(no forward pass: the scheduler and the KV cache are the subject).

Faults (``fault=``) show what a broken stream looks like to ``kvref watch``:

* ``lost-batch``: one sequence number is used up without a batch (the replay buffer never holds
  it either): ``lost-batches``.
* ``duplicate-batch``: one batch goes out twice on the PUB socket: ``duplicate-batch`` (seen only by
  a watcher subscribed while it is sent: the replay buffer holds it once).
* ``drop-stored``: the ``BlockStored`` of a block that is evicted later is left out of its batch
  (what a publisher that lost an event would send): ``removed-never-stored`` when the removal comes.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable

from kvref.spec.errors import InvalidFieldError

#: the workloads ``kvref demo publish --workload`` knows, with what each shows
WORKLOADS = {
    "prefix-sharing": "full attention, 3 rounds of 4 requests sharing prompt prefixes on a 10-block pool: "
              "prefix hits, evictions, a prefix-cache reset per round",
    "hybrid-swa": "full attention + sliding window (window 8): the same rounds on two KV cache groups, "
              "sliding-window blocks freed while requests run",
}
FAULTS = ("lost-batch", "duplicate-batch", "drop-stored")
#: the batch (0-based, in publishing order) a fault hits
FAULT_AT = 3
#: seconds a paced demo waits after binding before its first step
SETTLE_S = 0.5


@dataclass
class DemoStream:
    """What :func:`publish_demo` published, readable while it runs (``done`` is set once every batch
    has left the publisher thread)."""

    endpoint: str
    replay_endpoint: str | None
    workload: str
    fault: str | None
    batches: int = 0
    events: dict[str, int] = field(default_factory=dict)
    steps: int = 0
    done: threading.Event = field(default_factory=threading.Event)

    @property
    def sequence_numbers(self) -> int:
        """Sequence numbers used (a lost batch uses one without a batch)."""
        return self.batches + (self.fault == "lost-batch")

    def summary(self) -> str:
        ev = ", ".join(f"{k} {v}" for k, v in sorted(self.events.items())) or "none"
        fault = f"; fault {self.fault} at batch {FAULT_AT}" if self.fault else ""
        return (f"published {self.batches} batches (sequence 0..{self.sequence_numbers - 1}) from {self.steps} "
                f"scheduler steps of vLLM's Scheduler, workload {self.workload}: events {ev}{fault}")


def _pool(workload: str):
    from kvref.impl.interface import PoolConfig
    from kvref.spec.kv_cache_interface import FullAttentionSpec, KVCacheGroupSpec, SlidingWindowSpec

    full = FullAttentionSpec(block_size=4, num_kv_heads=1, head_size=4, dtype="float32")
    groups = [KVCacheGroupSpec(("full",), full)]
    if workload == "hybrid-swa":
        groups.append(KVCacheGroupSpec(("swa",), SlidingWindowSpec(block_size=4, num_kv_heads=1, head_size=4,
                                                                   dtype="float32", sliding_window=8)))
    return PoolConfig.off_plan("a small demo pool, so a short workload evicts and publishes BlockRemoved; "
                               "below one 64-token request, which startup would refuse",
                               num_blocks=10 if workload == "prefix-sharing" else 16, groups=tuple(groups),
                               max_model_len=64, scheduler_block_size=4, hash_block_size=4,
                               max_in_flight_tokens=32, enable_kv_cache_events=True)


def _publisher(endpoint: str, replay_endpoint: str | None, topic: str):
    """vLLM's ``ZmqEventPublisher`` from a ``KVEventsConfig`` through vLLM's factory; a host address
    is bound instead of connected to (the subclass changes nothing else)."""
    from vllm.config.kv_events import KVEventsConfig
    from vllm.distributed.kv_events import EventPublisherFactory, ZmqEventPublisher

    config = KVEventsConfig(enable_kv_cache_events=True, publisher="zmq", endpoint=endpoint,
                            replay_endpoint=replay_endpoint, topic=topic)
    if ZmqEventPublisher._is_bind_endpoint(endpoint):
        return EventPublisherFactory.create(config)

    class BoundPublisher(ZmqEventPublisher):
        _is_bind_endpoint = staticmethod(lambda endpoint: True)

    return BoundPublisher(0, endpoint=endpoint, replay_endpoint=replay_endpoint, topic=topic)


class _FaultyPublisher:
    """In front of vLLM's publisher, as the scheduler's ``kv_event_publisher``: counts what goes
    out and injects the chosen fault at batch :data:`FAULT_AT`."""

    def __init__(self, real: Any, stream: DemoStream) -> None:
        self.real = real
        self.stream = stream
        self.stored_dropped: set = set()

    def publish(self, batch: Any) -> None:
        s = self.stream
        if s.fault == "lost-batch" and s.batches == FAULT_AT:
            _drain(self.real)
            next(self.real._seq_gen)  # a number used up without a batch: lost on the wire and in replay
        if s.fault == "drop-stored" and s.batches >= FAULT_AT and not self.stored_dropped:
            kept = [e for e in batch.events if not (type(e).__name__ == "BlockStored" and e.block_hashes)]
            if len(kept) < len(batch.events):
                self.stored_dropped = {h for e in batch.events if e not in kept for h in e.block_hashes}
                batch.events = kept
        if s.fault == "duplicate-batch" and s.batches == FAULT_AT:
            _send_twice(self.real, s.batches)  # this batch's sequence number (no number was lost)
        for e in batch.events:
            name = type(e).__name__
            s.events[name] = s.events.get(name, 0) + 1
        s.batches += 1
        self.real.publish(batch)

    def shutdown(self) -> None:
        self.real.shutdown()

    def get_publisher_config(self):
        return self.real.get_publisher_config()


def _drain(pub: Any, bound_s: float = 30.0) -> None:
    """Wait (bounded) until vLLM's publisher thread has sent every batch queued so far."""
    deadline = time.monotonic() + bound_s
    while pub._event_queue.unfinished_tasks and time.monotonic() < deadline:
        time.sleep(0.01)


def _send_twice(pub: Any, seq: int) -> None:
    """From now on the PUB socket carries batch ``seq`` twice (only the publisher thread sends on it)."""
    real = pub._pub

    class Twice:
        def __getattr__(self, name: str) -> Any:
            return getattr(real, name)

        def send_multipart(self, frames, *args, **kwargs):
            real.send_multipart(frames, *args, **kwargs)
            if int.from_bytes(frames[1], "big") == seq:
                real.send_multipart(frames, *args, **kwargs)

    pub._pub = Twice()


def _requests(workload: str, round_: int):
    from kvref.impl.request import Request

    for i in range(4):
        family = i % 2  # two prompt families: the second request of each hits the first one's blocks
        yield Request(f"r{round_}.{i}", [family + 1] * 8 + [round_ + 3, i + 3] * 3 + [i] * (i + 1), max_tokens=4)


def publish_demo(endpoint: str, *, replay_endpoint: str | None = None, topic: str = "",
                 workload: str = "prefix-sharing", fault: str | None = None, interval: float = 0.05, hold: float = 30.0,
                 stop: threading.Event | None = None, stream: DemoStream | None = None,
                 on_published: Callable[[DemoStream], None] | None = None) -> DemoStream:
    """Run ``workload`` on vLLM's ``Scheduler`` and publish its KV events on ``endpoint``.

    Args:
        endpoint / replay_endpoint: where vLLM's publisher binds its PUB / ROUTER sockets.
        workload: a name of :data:`WORKLOADS`; fault: None or one of :data:`FAULTS`.
        interval: seconds between scheduler steps (a watcher sees a live stream).
        hold: seconds the publisher stays up after the last batch, serving replay requests (a
            watcher started late still fetches the whole stream), unless ``stop`` is set first.
        on_published: called once every batch has left the publisher thread.

    Returns the :class:`DemoStream` (also filled in while it runs when passed in).
    """
    if workload not in WORKLOADS:
        raise InvalidFieldError("--workload", workload, "one of " + ", ".join(WORKLOADS))
    if fault is not None and fault not in FAULTS:
        raise InvalidFieldError("--fault", fault, "one of " + ", ".join(FAULTS))
    from kvref.impl.scheduler_types import ModelOutput, SchedulerConfig
    from kvref.impl.vllm.scheduler import VllmScheduler

    s = stream or DemoStream(endpoint, replay_endpoint, workload, fault)
    try:  # first: an address in use is reported before the scheduler is built
        real = _publisher(endpoint, replay_endpoint, topic)
    except Exception as exc:  # noqa: BLE001 — zmq: address in use, bad host
        raise InvalidFieldError("endpoint", endpoint, f"addresses vLLM's publisher can bind ({exc})") from None
    stop = stop or threading.Event()
    try:
        sched = VllmScheduler(_pool(workload), SchedulerConfig(max_num_batched_tokens=32, max_num_seqs=4))
        # what the engine core's scheduler publishes through, with the demo's fault in front
        sched.scheduler.kv_event_publisher = _FaultyPublisher(real, s)
        if interval > 0:  # a paced (live) demo: watchers already waiting connect first (ZeroMQ's slow joiner)
            stop.wait(SETTLE_S)
        for round_ in range(3):
            for r in _requests(workload, round_):
                sched.add_request(r)
            for _ in range(60):  # bounded: a round ends in a handful of steps
                if not sched.has_unfinished_requests() or stop.is_set():
                    break
                out = sched.schedule()
                sched.update_from_output(out, ModelOutput({r.request_id: [7] for r in out.scheduled
                                                           if not r.is_prefill_chunk}))
                s.steps += 1
                stop.wait(interval)
            if stop.is_set():
                break
            sched.scheduler.reset_prefix_cache()
            sched.update_from_output(sched.schedule(), ModelOutput())  # the step that publishes the clear
            s.steps += 1
        _drain(real)
        s.done.set()
        if on_published is not None:
            on_published(s)
        stop.wait(hold)
    finally:
        real.shutdown()
    return s
