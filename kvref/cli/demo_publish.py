"""``kvref demo publish ENDPOINT``: a real KV-event stream for ``kvref watch``, without a GPU server.

vLLM's own ``Scheduler`` runs a small workload on a fake model (CPU, no weights) and publishes
every step's KV cache events through vLLM's own ``ZmqEventPublisher`` — the sequence numbers,
msgpack payloads and replay socket a server configured with ``--kv-events-config`` has
(:mod:`kvref.impl.vllm.demo_publish`). In another terminal::

    kvref demo publish tcp://127.0.0.1:5557                  # replay socket on tcp://127.0.0.1:5558
    kvref watch tcp://127.0.0.1:5557 --replay-endpoint tcp://127.0.0.1:5558 --seconds 30

``--fault lost-batch|duplicate-batch|drop-stored`` breaks the stream on purpose, to see what a
finding looks like (``duplicate-batch`` reaches only a watcher subscribed while it is sent).
The publisher stays up ``--hold`` seconds after its last batch, serving replay requests, so a
watcher started late still fetches the whole stream; Ctrl-C ends the hold early.

Exit status: 0 every batch published, 2 bad endpoint or option (an address in use included),
130 interrupted before every batch was published.
"""

from __future__ import annotations

import argparse
import sys


def add_parser(sub: "argparse._SubParsersAction") -> argparse.ArgumentParser:
    from kvref.impl.vllm.demo_publish import FAULTS, WORKLOADS

    p = sub.add_parser("publish", help="publish vLLM's KV events from its own scheduler on a fake model (for "
                                       "kvref watch)", description=__doc__,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("endpoint", metavar="ENDPOINT",
                   help="where to publish: tcp://127.0.0.1:PORT (bound here), tcp://*:PORT or ipc://PATH")
    p.add_argument("--replay-endpoint", default=None,
                   help="the replay (ROUTER) address (default: the port after ENDPOINT's on the same host)")
    p.add_argument("--topic", default="", help="the topic (default: '')")
    p.add_argument("--workload", default="prefix-sharing", choices=tuple(WORKLOADS),
                   help="; ".join(f"{k}: {v}" for k, v in WORKLOADS.items()))
    p.add_argument("--fault", default=None, choices=FAULTS,
                   help="break the stream on purpose: a lost batch, a duplicated batch, a dropped BlockStored")
    p.add_argument("--interval", type=float, default=0.05, metavar="S",
                   help="seconds between scheduler steps (default 0.05)")
    p.add_argument("--hold", type=float, default=30.0, metavar="S",
                   help="seconds to keep serving replay requests after the last batch (default 30)")
    return p


def default_replay_endpoint(endpoint: str) -> str | None:
    """``tcp://HOST:PORT`` -> ``tcp://HOST:PORT+1`` (vLLM's documented pair is 5557/5558); None for
    ``ipc://`` (give one with ``--replay-endpoint``)."""
    if not endpoint.startswith("tcp://"):
        return None
    host, _, port = endpoint.rpartition(":")
    return f"{host}:{int(port) + 1}" if int(port) < 65535 else None


def _check(args: argparse.Namespace) -> None:
    import math

    from kvref.cli.watch import check_endpoint
    from kvref.spec.errors import InvalidFieldError

    check_endpoint("ENDPOINT", args.endpoint, bind=True)
    if args.replay_endpoint is None:
        args.replay_endpoint = default_replay_endpoint(args.endpoint)
    if args.replay_endpoint is not None:
        check_endpoint("--replay-endpoint", args.replay_endpoint, bind=True)
        if args.replay_endpoint == args.endpoint:
            raise InvalidFieldError("--replay-endpoint", args.replay_endpoint, "an address other than ENDPOINT")
    for flag, value, top in (("--interval", args.interval, 10.0), ("--hold", args.hold, 7 * 24 * 3600.0)):
        if not math.isfinite(value) or not 0 <= value <= top:
            raise InvalidFieldError(flag, value, f"a number of seconds in [0, {top:g}]")


def _watch_hint(endpoint: str) -> str:
    return endpoint.replace("tcp://*:", "tcp://127.0.0.1:").replace("tcp://0.0.0.0:", "tcp://127.0.0.1:")


def run(args: argparse.Namespace) -> int:
    _check(args)
    from kvref.impl.vllm.demo_publish import DemoStream, publish_demo
    from kvref.progress import Progress

    stream = DemoStream(args.endpoint, args.replay_endpoint, args.workload, args.fault)
    progress = Progress("demo publish")

    def published(s: DemoStream) -> None:
        progress.status = "every batch published; serving replay requests (Ctrl-C ends the hold)"
        progress.close()
        replay = f" --replay-endpoint {_watch_hint(s.replay_endpoint)}" if s.replay_endpoint else ""
        print(f"kvref demo publish {s.endpoint}: {s.summary()}", flush=True)
        print(f"watch it: kvref watch {_watch_hint(s.endpoint)}{replay} --batches {s.sequence_numbers} "
              f"(the replay buffer holds the stream for {args.hold:g} s more; Ctrl-C ends it)", file=sys.stderr,
              flush=True)

    try:
        with progress.heartbeat("importing vLLM and building its Scheduler and ZmqEventPublisher"):
            _run_with_status(progress, stream, lambda: publish_demo(
                args.endpoint, replay_endpoint=args.replay_endpoint, topic=args.topic, workload=args.workload,
                fault=args.fault, interval=args.interval, hold=args.hold, stream=stream, on_published=published))
    except KeyboardInterrupt:
        if not stream.done.is_set():
            raise  # kvref.cli: exit 130
        from kvref.cli.interrupt import acknowledge

        acknowledge()  # Ctrl-C during the hold: the stream was published whole
    return 0


def _run_with_status(progress, stream, work) -> None:
    """``work()`` while the heartbeat reports how far the stream got."""
    import threading

    stop = threading.Event()

    def follow() -> None:
        while not stop.wait(0.5) and not stream.done.is_set():
            if stream.steps:
                progress.status = f"step {stream.steps}, {stream.batches} batches published"

    t = threading.Thread(target=follow, daemon=True, name="kvref-demo-status")
    t.start()
    try:
        work()
    finally:
        stop.set()
        t.join(timeout=2)
