"""``kvref watch ENDPOINT``: subscribe to a live vLLM KV-event publisher and check the stream.

Start vLLM with ``--kv-events-config '{"enable_kv_cache_events": true, "publisher": "zmq",
"endpoint": "tcp://*:5557", "replay_endpoint": "tcp://*:5558"}'`` and run
``kvref watch tcp://127.0.0.1:5557 --replay-endpoint tcp://127.0.0.1:5558 --seconds 600``.

The watcher keeps a shadow of the engine's prefix-cache index from the events (as a KV-aware
router does) and flags what vLLM's emission never produces: lost, duplicated or reordered batches
(sequence numbers), a removal of a hash that was never stored, a full-attention store on a parent
that was removed, malformed events, a changing data-parallel rank (the rules and where each comes
from in vLLM's code: docs/kv_events.md). With ``--replay-endpoint`` it first fetches the batches the
publisher still buffers (so it sees the stream from sequence 0 if the engine started less than
``buffer_steps`` batches ago), and on a gap fetches the missing batches before judging them lost.

A status line goes to stderr while it runs; at the end (``--seconds``, ``--batches``, or Ctrl-C)
a summary goes to stdout (``--json``: one JSON object).

Exit status: 0 the stream obeyed every rule (the summary says how many batches were checked),
1 findings, 2 bad endpoint or option, 3 nothing was checked (no batch arrived: no publisher, a
wrong endpoint or topic), 130 interrupted (the summary so far is printed first).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import re
import sys
import time
from typing import Any, TextIO

from kvref.spec.errors import InvalidFieldError

_TCP = re.compile(r"^tcp://(?P<host>\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9_.\-]+):(?P<port>[0-9]{1,5})$")

#: how long one replay answer may take before the replay socket is given up for this request
REPLAY_TIMEOUT_S = 5.0
#: after this long without a live batch the watcher asks the replay socket for anything newer: ZeroMQ
#: drops what a PUB socket sends before a subscription is in place (the "slow joiner"), so a batch
#: published while the watcher was joining is otherwise only recovered when a later one arrives
REPLAY_IDLE_S = 1.0
#: most batches one replay request may return (the publisher's default buffer_steps is 10 000)
REPLAY_MAX_BATCHES = 1_000_000


def check_endpoint(field: str, endpoint: Any, bind: bool = False) -> str:
    """A ZeroMQ address to connect to: ``tcp://HOST:PORT`` (port 1-65535) or ``ipc://PATH``;
    with ``bind`` also ``tcp://*:PORT`` (an address to listen on)."""
    allowed = f"a {'bind' if bind else 'connect'} address: tcp://HOST:PORT (port 1-65535) or ipc://PATH"
    if not isinstance(endpoint, str):
        raise InvalidFieldError(field, endpoint, allowed)
    if endpoint.startswith("ipc://") and len(endpoint) > len("ipc://"):
        return endpoint
    if bind and endpoint.startswith("tcp://*:"):
        endpoint_for_match = "tcp://0.0.0.0:" + endpoint[len("tcp://*:"):]
        m = _TCP.match(endpoint_for_match)
        if not m or not 1 <= int(m.group("port")) <= 65535:
            raise InvalidFieldError(field, endpoint, allowed)
        return endpoint
    m = _TCP.match(endpoint)
    if not bind and endpoint.startswith(("tcp://*", "tcp://0.0.0.0")):
        raise InvalidFieldError(field, endpoint, allowed + " (the publisher binds tcp://*:PORT; "
                                                           "connect to tcp://127.0.0.1:PORT or the engine's host)")
    if not m or not 1 <= int(m.group("port")) <= 65535:
        raise InvalidFieldError(field, endpoint, allowed)
    return endpoint


def add_parser(sub: argparse._SubParsersAction) -> argparse.ArgumentParser:
    p = sub.add_parser("watch", help="check a live vLLM KV-event stream (ZMQ) against the rules of vLLM's emission",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("endpoint", metavar="ENDPOINT", help="the publisher's address, e.g. tcp://127.0.0.1:5557")
    p.add_argument("--topic", default="", help="the configured topic (default: '', every message)")
    p.add_argument("--bind", action="store_true",
                   help="listen on ENDPOINT instead of connecting to it: for a publisher configured with a host "
                        "address (vLLM binds only tcp://*:PORT and connects to any other address)")
    p.add_argument("--seconds", type=float, default=60.0, help="stop after this many seconds (default 60)")
    p.add_argument("--batches", type=int, default=None,
                   help="stop once this many sequence numbers have passed (received or lost; default: no limit)")
    p.add_argument("--replay-endpoint", default=None,
                   help="the publisher's replay address (e.g. tcp://127.0.0.1:5558): fetch buffered batches at "
                        "start and on a gap")
    p.add_argument("--decoder", default="generic", choices=("generic", "vllm", "auto"),
                   help="generic: msgspec + vLLM 0.33.0's field table (fast start); vllm: vLLM's own "
                        "KVEventBatch struct (needs vLLM; importing it takes seconds); auto: vllm if importable")
    p.add_argument("--json", action="store_true", help="print the summary as one JSON object")
    p.add_argument("--quiet", action="store_true", help="no status line")
    return p


class _Replay:
    """A DEALER socket to the publisher's ROUTER replay socket (``ZmqEventPublisher._service_replay``)."""

    def __init__(self, ctx: Any, endpoint: str) -> None:
        import zmq

        self.zmq = zmq
        self.sock = ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.connect(endpoint)
        self.requests = 0
        self.timeouts = 0

    def fetch(self, start_seq: int, deadline: float | None = None) -> list[tuple[int, bytes, bytes]] | None:
        """Every batch the publisher still holds from ``start_seq`` on, as (seq, topic, payload);
        None when the publisher does not answer in time. ``deadline`` (``time.monotonic()``) is
        the run's own end: ``--seconds 0.3`` with a silent replay socket used to wait 5 s."""
        import time

        from kvref.impl.vllm.kv_events import END_SEQ, parse_seq

        self.requests += 1
        self.sock.send_multipart([b"", start_seq.to_bytes(8, "big")])
        out: list[tuple[int, bytes, bytes]] = []
        while len(out) < REPLAY_MAX_BATCHES:
            wait = REPLAY_TIMEOUT_S if deadline is None else min(REPLAY_TIMEOUT_S, deadline - time.monotonic())
            if wait <= 0 or not self.sock.poll(max(1, int(wait * 1000))):
                self.timeouts += 1
                return None if not out else out
            frames = self.sock.recv_multipart()
            if len(frames) != 4:
                continue  # not a replay answer: ignore it
            _, topic, seq_frame, payload = frames
            if seq_frame == END_SEQ:
                return out
            out.append((parse_seq(seq_frame), topic, payload))
        return out

    def close(self) -> None:
        self.sock.close(linger=0)


def watch(endpoint: str, *, topic: str = "", seconds: float = 60.0, max_batches: int | None = None,
          replay_endpoint: str | None = None, decoder: str = "generic", watcher: Any = None,
          status: TextIO | None = None, status_every: float | None = None, bind: bool = False,
          stop: Any = None) -> Any:
    """Subscribe, feed every batch to an :class:`~kvref.models.kv_events.watch.EventStreamWatcher`
    and return it when ``seconds`` have passed or ``max_batches`` sequence numbers have passed
    (received or lost: a stream with a gap still ends), or ``stop`` (a ``threading.Event``) is set.
    ``bind`` listens on ``endpoint`` (the publisher connects) instead of connecting to it.

    A ``KeyboardInterrupt`` propagates after the sockets are closed (the caller prints the
    partial summary from the ``watcher`` it passed in).
    """
    import zmq

    from kvref.impl.vllm.kv_events import EventDecodeError, make_decoder, parse_seq
    from kvref.models.kv_events.watch import EventStreamWatcher

    check_endpoint("endpoint", endpoint, bind=bind)
    if replay_endpoint is not None:
        check_endpoint("replay_endpoint", replay_endpoint)
    if not isinstance(topic, str):
        raise InvalidFieldError("topic", topic, "a str")
    if isinstance(seconds, bool) or not isinstance(seconds, (int, float)) or not 0 < seconds <= 7 * 24 * 3600:
        raise InvalidFieldError("seconds", seconds, "a number of seconds in (0, 604800]")
    if max_batches is not None and (type(max_batches) is not int or max_batches < 1):
        raise InvalidFieldError("batches", max_batches, "an int >= 1")
    if status is not None and decoder != "generic":  # importing vLLM takes seconds: say so (issue #25)
        status.write(f"[kvref watch] importing vLLM for --decoder {decoder} ...\n")
        status.flush()
    decode = make_decoder(decoder)
    w = watcher if watcher is not None else EventStreamWatcher()
    topic_bytes = topic.encode("utf-8")
    tty = status is not None and getattr(status, "isatty", lambda: False)()
    every = status_every if status_every is not None else (0.25 if tty else 5.0)
    ctx = zmq.Context.instance()
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.LINGER, 0)
    sub.setsockopt(zmq.SUBSCRIBE, topic_bytes)
    replay = None
    other_topics = 0

    def feed(seq: int, payload: bytes, source: str) -> None:
        try:
            b = decode(payload)
        except EventDecodeError as exc:
            w.feed_undecodable(seq, f"sequence {seq}: {exc}")
            return
        w.feed(seq, b.ts, b.events, b.data_parallel_rank, source=source,
               digest=hashlib.blake2b(payload, digest_size=16).digest())

    def feed_replay(start: int) -> None:
        got = replay.fetch(start, deadline) if replay is not None else None
        for seq, t, payload in got or ():
            if t == topic_bytes and (w.next_seq is None or seq >= w.next_seq):
                feed(seq, payload, "replay")

    start = time.monotonic()
    deadline = start + seconds
    last_status = 0.0
    last_live = start
    try:
        try:
            sub.bind(endpoint) if bind else sub.connect(endpoint)
        except zmq.ZMQError as exc:  # address in use, unknown host, ...: the endpoint is the problem
            raise InvalidFieldError("endpoint", endpoint,
                                    f"an address ZeroMQ can {'bind' if bind else 'connect to'} ({exc})") from None
        if replay_endpoint is not None:
            try:
                replay = _Replay(ctx, replay_endpoint)
            except zmq.ZMQError as exc:
                raise InvalidFieldError("replay_endpoint", replay_endpoint,
                                        f"an address ZeroMQ can connect to ({exc})") from None
            feed_replay(0)  # what happened before we subscribed, as far as the buffer reaches
        while time.monotonic() < deadline and (max_batches is None or _span(w) < max_batches) \
                and not (stop is not None and stop.is_set()):
            if status is not None and time.monotonic() - last_status >= every:
                last_status = time.monotonic()
                _status(status, tty, time.monotonic() - start, w)
            if not sub.poll(100):
                if replay is not None and time.monotonic() - last_live >= REPLAY_IDLE_S:
                    last_live = time.monotonic()
                    feed_replay(w.next_seq or 0)  # quiet: catch up on what the joining missed
                continue
            last_live = time.monotonic()
            frames = sub.recv_multipart()
            if len(frames) != 3:
                w.feed_undecodable(None, f"a message of {len(frames)} frames (expected topic, seq, payload)")
                continue
            t, seq_frame, payload = frames
            if t != topic_bytes:
                other_topics += 1
                continue
            try:
                seq = parse_seq(seq_frame)
            except EventDecodeError as exc:
                w.feed_undecodable(None, str(exc))
                continue
            if seq < 0:
                w.feed_undecodable(None, f"negative sequence number {seq}")
                continue
            if replay is not None and seq > (w.next_seq or 0):
                feed_replay(w.next_seq or 0)  # fetch what the gap holds before judging it lost
            feed(seq, payload, "live")
    finally:
        if status is not None:
            _status(status, tty, time.monotonic() - start, w, final=True)
        sub.close(linger=0)
        if replay is not None:
            replay.close()
    w.other_topics = other_topics  # type: ignore[attr-defined]
    return w


def _span(w: Any) -> int:
    """Sequence numbers accounted for since the first one seen (received or lost)."""
    return 0 if w.next_seq is None else w.next_seq - (w.first_seq or 0)


def exit_status(w: Any, interrupted: bool = False) -> int:
    """0 clean, 1 findings, 3 nothing checked (no batch arrived), 130 interrupted (the CLI's
    contract, :mod:`kvref.cli`). A watcher that received nothing is never "clean" (issue #25)."""
    from kvref.cli import EXIT_FINDINGS, EXIT_INTERRUPTED, EXIT_NOTHING_CHECKED, EXIT_OK

    if interrupted:
        return EXIT_INTERRUPTED
    if w.num_findings:
        return EXIT_FINDINGS
    return EXIT_OK if w.batches_received else EXIT_NOTHING_CHECKED


def verdict(w: Any, interrupted: bool = False) -> str:
    """The one-word verdict the summary ends with: ``clean``, ``findings``, ``nothing-checked``,
    ``interrupted`` (``--json``'s ``"verdict"``)."""
    if w.num_findings:
        return "findings"
    if interrupted:
        return "interrupted"
    return "clean" if w.batches_received else "nothing-checked"


def _status(out: TextIO, tty: bool, elapsed: float, w: Any, final: bool = False) -> None:
    line = f"[kvref watch {elapsed:6.1f}s] {w.status_line()}"
    if tty:
        out.write("\r" + line + "\x1b[K" + ("\n" if final else ""))  # \x1b[K: clear the rest of the line
    else:
        out.write(line + "\n")
    out.flush()


def _summary_text(s: dict[str, Any], endpoint: str, interrupted: bool) -> str:
    lines = [(f"kvref watch {endpoint}: {'interrupted; ' if interrupted else ''}"
              f"{s['batches_received']} batches (seq {s['first_seq']}..{s['last_seq']}, "
              f"{s['batches_from_replay']} from replay), events {s['events'] or '{}'}"),
             (f"  shadow: {s['live_entries']} live entries under {s['live_keys']} keys "
              f"({'sure' if s['shadow_sure'] else 'unsure: joined late or lost batches'}); "
              f"unknown removals {s['unknown_removals']}; restarts {s['restarts']}")]
    if s["num_findings"]:
        lines.append(f"FINDINGS: {s['num_findings']} {s['findings_by_rule']}")
        for f in s["findings"][:20]:
            where = f"seq {f['seq']}" + (f" event {f['event_index']}" if f["event_index"] is not None else "")
            lines.append(f"  [{f['rule']}] {where}: {f['message']}")
        if s["num_findings"] > 20:
            lines.append(f"  ... {s['num_findings'] - 20} more (--json lists up to {len(s['findings'])})")
    elif s["batches_received"] == 0:
        lines.append("NOTHING CHECKED: no batch arrived (exit 3): is the engine running with --kv-events-config, "
                     "and the endpoint (and --topic) right?")
    elif interrupted:
        lines.append(f"no finding in the {s['batches_received']} batches checked before the interrupt")
    else:
        lines.append(f"OK: {s['batches_received']} batches checked, the stream obeyed every rule")
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    from kvref.models.kv_events.watch import EventStreamWatcher

    check_endpoint("endpoint", args.endpoint, bind=args.bind)
    if args.replay_endpoint is not None:
        check_endpoint("replay_endpoint", args.replay_endpoint)
    w = EventStreamWatcher()
    interrupted = False
    try:
        watch(args.endpoint, topic=args.topic, seconds=args.seconds, max_batches=args.batches,
              replay_endpoint=args.replay_endpoint, decoder=args.decoder, watcher=w,
              status=None if args.quiet else sys.stderr, bind=args.bind)
    except KeyboardInterrupt:
        from kvref.cli.interrupt import acknowledge

        acknowledge()
        interrupted = True
        print("kvref watch: interrupted (exit 130); the summary so far follows", file=sys.stderr)
    s = w.summary()
    s["endpoint"], s["interrupted"] = args.endpoint, interrupted
    s["other_topics"] = getattr(w, "other_topics", 0)  # messages under another topic, skipped
    s["verdict"] = verdict(w, interrupted)
    if args.json:
        print(json.dumps(s, default=_json_default))
    else:
        print(_summary_text(s, args.endpoint, interrupted))
    return exit_status(w, interrupted)


def _json_default(v: Any) -> Any:
    return v.hex() if isinstance(v, bytes) else repr(v)
