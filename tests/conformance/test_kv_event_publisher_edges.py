"""vLLM's KV-event publisher on tcp endpoints (bound on ``tcp://*:0``, IPv4 and IPv6, and
connecting), with unencodable batches, batches carrying their own rank and malformed replay
requests; its factory and the event aggregator (:mod:`kvref.impl.vllm.kv_event_publisher_edges`,
issue #22). Each planted fault in vLLM's code for these paths is reported."""

from __future__ import annotations

import contextlib
import inspect
import random
import sys
import textwrap

import pytest

from tests.vllm_env import require_vllm

pytestmark = pytest.mark.vllm


def _batches(seed: int, n: int):
    """Random steps' events: stored and removed blocks on random media and groups, some clears."""
    require_vllm()
    from vllm.distributed.kv_events import AllBlocksCleared, BlockRemoved, BlockStored

    rng = random.Random(seed)
    out = []
    for _ in range(n):
        events = []
        for _ in range(rng.randint(0, 4)):
            h = rng.randrange(1 << 40)
            if rng.random() < 0.6:
                events.append(BlockStored(block_hashes=[h, h + 1], parent_block_hash=rng.choice((None, h - 1)),
                                          token_ids=[rng.randrange(100) for _ in range(rng.randint(0, 4))],
                                          block_size=rng.choice((0, 16)), lora_id=None,
                                          medium=rng.choice(("CPU", "GPU")), lora_name=None,
                                          group_idx=rng.randrange(3)))
            elif rng.random() < 0.9:
                events.append(BlockRemoved(block_hashes=[h], medium=rng.choice(("CPU", "GPU")),
                                           group_idx=rng.randrange(3)))
            else:
                events.append(AllBlocksCleared())
        out.append(events)
    return out


def _edges():
    from kvref.impl.vllm import kv_event_publisher_edges

    return kv_event_publisher_edges


@contextlib.contextmanager
def _planted(cls, method: str, *edits: str):
    """vLLM's ``cls.<method>`` with each ``old`` of ``edits`` (old, new, old, new, ...) replaced by
    its ``new`` in the method's source (once each; a static or class method stays one)."""
    func = vars(cls)[method]
    src = inspect.getsource(func)
    for old, new in zip(edits[::2], edits[1::2]):
        assert src.count(old) == 1, (method, old)
        src = src.replace(old, new)
    ns: dict = {}
    exec(compile(textwrap.dedent(src), f"<fault {method}>", "exec"),  # noqa: S102
         vars(sys.modules[cls.__module__]), ns)
    setattr(cls, method, ns[method])
    try:
        yield
    finally:
        setattr(cls, method, func)


@pytest.mark.parametrize("seed", [0, 1])
def test_publisher_edges_match_the_documented_protocol(seed):
    E = _edges()
    batches = _batches(seed, 6 + 3 * seed)
    assert E.check_tcp_streams(batches, seed) == []
    assert E.check_publisher_factory(seed) == []
    assert E.check_aggregator_refusals([e for b in batches for e in b], seed) == []


def _zmq_cls():
    require_vllm()
    from vllm.distributed.kv_events import ZmqEventPublisher

    return ZmqEventPublisher


def test_unresolved_wildcard_endpoint_is_found():
    """``tcp://*:0`` reported as given instead of the bound ``tcp://<node ip>:<port>``."""
    cls = _zmq_cls()
    with _planted(cls, "_bind", "return get_tcp_uri(ip, int(port))", "return endpoint"):
        problems = _edges().check_tcp_streams(_batches(2, 4), 2)
    assert any("reports the endpoint 'tcp://*:0'" in p for p in problems), problems


def test_sequence_taken_after_encoding_is_found():
    """A batch that fails to encode no longer uses up its sequence number: no gap for the router."""
    cls = _zmq_cls()
    with _planted(cls, "_publisher_thread", "seq = next(self._seq_gen)\n\n                payload = self._pack.encode(event)",
                  "payload = self._pack.encode(event)\n                seq = next(self._seq_gen)"):
        problems = _edges().check_tcp_streams(_batches(3, 4), 3)
    assert any("live stream sequences" in p for p in problems), problems


def test_rank_overwritten_is_found():
    """The publisher stamps its own rank over a batch's."""
    cls = _zmq_cls()
    with _planted(cls, "publish", "if events.data_parallel_rank is None:", "if True:"):
        problems = _edges().check_tcp_streams(_batches(4, 8), 4)
    assert any("differs from the published batch" in p for p in problems), problems


def test_malformed_replay_request_answered_is_found():
    """A replay request of the wrong shape answered as if it were well formed."""
    cls = _zmq_cls()
    with _planted(cls, "_service_replay", "client_id, _, start_seq_bytes = frame",
                  "client_id, _, start_seq_bytes = frame[0], frame[1], frame[-1]",
                  "if len(frame) != 3:", "if len(frame) < 3:"):
        problems = _edges().check_tcp_streams(_batches(5, 5), 5)
    assert any("replay" in p or "nobody asked" in p for p in problems), problems


def test_duplicate_registration_and_merge_faults_are_found():
    """A second registration of a publisher kind silently replacing the first, and a merge that
    drops the other container's first event, are each reported."""
    require_vllm()
    from vllm.distributed.kv_events import EventPublisherFactory, KVConnectorKVEvents

    with _planted(EventPublisherFactory, "register_publisher", "if name in cls._registry:", "if False:"):
        problems = _edges().check_publisher_factory(6)
    assert any("registered twice" in p for p in problems), problems
    with _planted(KVConnectorKVEvents, "merge", "other.get_all_events()", "other.get_all_events()[1:]"):
        batches = _batches(7, 6)
        problems = _edges().check_aggregator_refusals([e for b in batches for e in b], 7)
    assert any("merge" in p for p in problems), problems
