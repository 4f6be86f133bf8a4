"""A shadow of an engine's prefix-cache index, kept from its KV cache event stream, and the rules
that stream must obey (the pure logic of ``kvref watch``; no sockets here).

A router that routes by prefix (llm-d, Dynamo, vLLM's production stack) keeps exactly such a
shadow. Each rule below is derived from where vLLM 0.33.0 emits and publishes events, and from the
reference that reproduces that emission (``kvref.impl.reference.block_pool``); docs/kv_events.md
has the table with the code locations.

Stream rules (``ZmqEventPublisher._publisher_thread``: ``seq = next(self._seq_gen)`` with
``_seq_gen = itertools.count()``, one number per batch, sent in order on one PUB socket):

* ``lost-batches``: a sequence number is skipped. Batches the replay socket still holds are fetched
  before this (the CLI does it); what it cannot return is lost, and the shadow is then *unsure*
  until the next ``AllBlocksCleared``.
* ``duplicate-batch``: a sequence number arrives twice on the live stream (a replayed batch the
  live stream also delivers is not a duplicate: replay overlaps by design).
* ``reordered-batch``: a batch arrives after a later one (it had been counted as lost).
* ``rank-changed``: one publisher serves one data-parallel rank (``publish`` stamps
  ``data_parallel_rank``; ranks get their own port), so the rank never changes within a stream.
* A batch with sequence 0 and other content after later ones is a *restart* of the publisher
  (a new engine, whose cache is empty): the shadow starts over; counted, not a finding.

Index rules, per key ``(medium, group_idx, hash)`` (vLLM's ``BlockHashToBlockMap`` keeps several
blocks under one key — no de-duplication, NOTE #1 there — so the shadow counts entries per key):

* ``removed-never-stored``: a ``BlockRemoved`` for a key with no live entry. vLLM emits a removal
  only for keys ``_remove_cached_block_hashes`` actually popped from the index, and every key
  enters the index through ``_insert_block_hash`` in ``cache_full_blocks`` /
  ``cache_partial_block``, which emit a ``BlockStored`` naming it (``move_block_hashes`` re-points
  a live key without events). Flagged only while the shadow is *sure* (the stream was seen from
  sequence 0 or from the last ``AllBlocksCleared``, without losses); otherwise counted as an
  unknown removal.
* ``store-after-removed-parent``: a ``BlockStored`` in a full-attention group (``kv_cache_spec_kind``
  ``full_attention`` / ``mla_attention``) whose ``parent_block_hash`` was removed and not stored
  again. The parent is the storing request's own previous block in that group, which it holds
  (``ref_cnt > 0``), and a held block is never evicted (``get_new_blocks`` evicts only blocks
  from the free queue, ``reset_prefix_cache`` refuses while blocks are in use). The one exception
  in vLLM is a KV connector's ``evict_blocks`` after failed loads, which invalidates held blocks.
  Sliding-window, chunked-local and Mamba groups free and evict a request's old blocks while it
  runs, so their parents may be gone legitimately: not checked.
* ``malformed-event``: shapes ``_build_block_stored_event`` / ``_emit_block_removed_events``
  never produce: ``block_size <= 0``; ``token_ids`` not a whole number of blocks, or fewer tokens
  than hashes need; ``extra_keys`` / ``lookahead_token_ids`` not one entry per hash; a removal
  naming no hash.
* ``AllBlocksCleared`` (``reset_prefix_cache`` succeeded: no block was in use) empties the GPU
  shadow; the shadow is sure again from there. Other media (a connector's ``CPU`` tier) keep theirs.

What the shadow cannot see: ``BlockStored`` events of report mode "full" announce reused blocks
that are already cached, so they count an entry the index does not have; that can only hide a
``removed-never-stored``, never invent one.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from kvref.spec.errors import InvalidFieldError

RULES = ("lost-batches", "duplicate-batch", "reordered-batch", "rank-changed", "undecodable-batch",
         "removed-never-stored", "store-after-removed-parent", "malformed-event")

#: groups whose stores must extend a live parent (see the module docstring)
PARENT_CHECKED_KINDS = frozenset({"full_attention", "mla_attention"})

MEDIUM_GPU = "GPU"

Key = tuple[Any, Any, Any]  # (medium, group_idx, hash)


@dataclass(frozen=True)
class Finding:
    """One violation: the rule, where (sequence number, event index in the batch) and what."""

    rule: str
    seq: int | None
    event_index: int | None
    message: str

    def to_json(self) -> dict[str, Any]:
        return {"rule": self.rule, "seq": self.seq, "event_index": self.event_index, "message": self.message}


def _hashable(h: Any) -> Any:
    return bytes(h) if isinstance(h, (bytearray, memoryview)) else h


def _show(h: Any) -> str:
    if isinstance(h, bytes):
        return h[:8].hex() + ("…" if len(h) > 8 else "")
    return repr(h)


@dataclass
class EventStreamWatcher:
    """Feed it every batch (``feed``), in arrival order; read ``findings`` and ``summary()``.

    Args:
        max_findings_kept: findings kept in detail (all are counted in ``findings_by_rule``).
        window: how many recent sequence numbers are remembered to tell duplicates from
            reordered batches (older repeats are counted as duplicates without a content check).
        max_removed_kept: removed keys remembered for the parent rule (oldest forgotten first;
            forgetting can only miss a finding, never invent one).
    """

    max_findings_kept: int = 200
    window: int = 4096
    max_removed_kept: int = 1_000_000

    findings: list[Finding] = field(default_factory=list)
    findings_by_rule: dict[str, int] = field(default_factory=dict)
    #: next expected sequence number (None before the first batch)
    next_seq: int | None = None
    first_seq: int | None = None
    #: recent sequence numbers -> (delivered live?, digest of the batch)
    _recent: OrderedDict = field(default_factory=OrderedDict)
    #: sequence numbers counted as lost (a late arrival of one is a reordering)
    _lost: set[int] = field(default_factory=set)
    #: live entries per key
    shadow: dict[Key, int] = field(default_factory=dict)
    #: keys whose entries all went (value: the seq of the removal), for the parent rule
    _removed: OrderedDict = field(default_factory=OrderedDict)
    #: per medium: whether every store since the shadow's start is known
    _sure: dict[Any, bool] = field(default_factory=dict)
    _default_sure: bool = True
    rank: int | None = None
    _rank_known: bool = False

    # counters
    batches_received: int = 0
    batches_applied: int = 0
    batches_from_replay: int = 0
    replay_overlaps: int = 0
    duplicates: int = 0
    reordered: int = 0
    lost: int = 0
    restarts: int = 0
    undecodable: int = 0
    unknown_removals: int = 0
    events_by_type: dict[str, int] = field(default_factory=dict)
    last_ts: float | None = None

    def __post_init__(self) -> None:
        for name in ("max_findings_kept", "window", "max_removed_kept"):
            value = getattr(self, name)
            if type(value) is not int or value < 1:
                raise InvalidFieldError(name, value, "an int >= 1")

    # ------------------------------------------------------------------ input

    def feed(self, seq: int, ts: float, events: list[dict[str, Any]], data_parallel_rank: int | None = None,
             *, source: str = "live", digest: bytes | None = None) -> list[Finding]:
        """Account for one batch; returns the findings it caused.

        Args:
            seq: the publisher's sequence number.
            ts / events / data_parallel_rank: the decoded ``KVEventBatch`` (events as plain
                dicts, ``kvref.impl.vllm.kv_events``).
            source: ``"live"`` (the PUB stream) or ``"replay"`` (fetched from the replay socket).
            digest: identifies the payload (to tell a duplicate from a restart); computed from
                the events when None.
        """
        if type(seq) is not int or seq < 0:
            raise InvalidFieldError("seq", seq, "an int >= 0")
        if source not in ("live", "replay"):
            raise InvalidFieldError("source", source, "'live' or 'replay'")
        if not isinstance(events, list):
            raise InvalidFieldError("events", type(events).__name__, "a list of plain event dicts")
        digest = digest if digest is not None else hashlib.sha256(repr((ts, events)).encode()).digest()
        self.batches_received += 1
        self.batches_from_replay += source == "replay"
        new: list[Finding] = []
        if self.next_seq is None:
            self._start(seq)
        elif seq < self.next_seq:
            seen = self._recent.get(seq)
            if seq == 0 and source == "live" and 0 not in self._lost and (seen is None or seen[1] != digest):
                self.restarts += 1  # a new publisher: its cache starts empty
                self._restart()
                self._start(0)
            else:
                self._late(seq, seen, source, digest, new)
                return new
        elif seq > self.next_seq:
            missing = seq - self.next_seq
            self.lost += missing
            self._lost.update(range(self.next_seq, seq) if missing <= self.window else ())
            if len(self._lost) > self.window:  # only recent losses can still arrive late
                self._lost = set(sorted(self._lost)[-self.window:])
            self._add(new, "lost-batches", seq, None,
                      f"{missing} batch(es) lost: sequence {self.next_seq}"
                      + (f"..{seq - 1}" if missing > 1 else "") + f" never arrived (next came {seq})")
            self._make_unsure()
        self._remember(seq, source == "live", digest)
        self.next_seq = seq + 1
        self._check_rank(seq, data_parallel_rank, new)
        self._apply(seq, events, new)
        self.batches_applied += 1
        self.last_ts = ts
        return new

    def feed_undecodable(self, seq: int | None, error: str) -> Finding:
        """A batch that could not be decoded: a finding; its sequence number still counts."""
        self.undecodable += 1
        self.batches_received += 1
        found: list[Finding] = []
        self._add(found, "undecodable-batch", seq, None, error)
        if seq is not None and (self.next_seq is None or seq >= self.next_seq):
            if self.next_seq is None:
                self._start(seq)
            self._remember(seq, True, b"undecodable")
            self.next_seq = seq + 1
            self._make_unsure()  # whatever it held is unknown
        return found[0]

    # ------------------------------------------------------------------ stream bookkeeping

    def _start(self, seq: int) -> None:
        self.first_seq = seq
        self.next_seq = seq
        # Joining mid-stream (the CLI fetches the replay buffer first): stores before it are unknown.
        self._default_sure = seq == 0
        self._sure.clear()

    def _restart(self) -> None:
        self.shadow.clear()
        self._removed.clear()
        self._recent.clear()
        self._lost.clear()
        self._rank_known = False

    def _remember(self, seq: int, live: bool, digest: bytes) -> None:
        self._recent[seq] = (live, digest)
        while len(self._recent) > self.window:
            self._recent.popitem(last=False)

    def _late(self, seq: int, seen: tuple[bool, bytes] | None, source: str, digest: bytes,
              new: list[Finding]) -> None:
        """A batch numbered below the next expected one."""
        if seen is not None:
            live, _ = seen
            if source == "replay":
                self.replay_overlaps += 1  # replay re-sends what we have: by design
            elif not live:
                self._recent[seq] = (True, seen[1])  # the live copy of a replayed batch
                self.replay_overlaps += 1
            else:
                self.duplicates += 1
                self._add(new, "duplicate-batch", seq, None,
                          f"sequence {seq} delivered twice" + ("" if seen[1] == digest else " with different content"))
            return
        if seq in self._lost:
            self._lost.discard(seq)
            self.reordered += 1
            self._add(new, "reordered-batch", seq, None,
                      f"sequence {seq} arrived after sequence {self.next_seq - 1} (counted as lost before); "
                      "its events were not applied")
            return
        if source == "replay":
            self.replay_overlaps += 1  # from before we joined: its stores are unknown anyway
            return
        self.duplicates += 1
        self._add(new, "duplicate-batch", seq, None,
                  f"sequence {seq} arrived again after {self.next_seq - 1} (older than the {self.window}-batch window)")

    def _check_rank(self, seq: int, rank: int | None, new: list[Finding]) -> None:
        if not self._rank_known:
            self.rank, self._rank_known = rank, True
        elif rank != self.rank:
            self._add(new, "rank-changed", seq, None,
                      f"data_parallel_rank {rank} in a stream of rank {self.rank} (one publisher per rank)")

    def _make_unsure(self) -> None:
        self._default_sure = False
        for medium in self._sure:
            self._sure[medium] = False

    def _is_sure(self, medium: Any) -> bool:
        return self._sure.get(medium, self._default_sure)

    # ------------------------------------------------------------------ the index rules

    def _apply(self, seq: int, events: Iterable[dict[str, Any]], new: list[Finding]) -> None:
        for i, e in enumerate(events):
            kind = e.get("type") if isinstance(e, dict) else None
            self.events_by_type[str(kind)] = self.events_by_type.get(str(kind), 0) + 1
            if kind == "BlockStored":
                self._stored(seq, i, e, new)
            elif kind == "BlockRemoved":
                self._removed_event(seq, i, e, new)
            elif kind == "AllBlocksCleared":
                self._cleared()
            else:
                self._add(new, "malformed-event", seq, i, f"unknown event {e!r:.120}")

    def _stored(self, seq: int, i: int, e: dict[str, Any], new: list[Finding]) -> None:
        hashes = e.get("block_hashes") or []
        medium, group = e.get("medium"), e.get("group_idx")
        bad = _stored_shape_problem(e)
        if bad:
            self._add(new, "malformed-event", seq, i, f"BlockStored {bad}")
        parent = e.get("parent_block_hash")
        if parent is not None and e.get("kv_cache_spec_kind") in PARENT_CHECKED_KINDS and self._is_sure(medium):
            pkey = (medium, group, _hashable(parent))
            if pkey not in self.shadow and pkey in self._removed:
                self._add(new, "store-after-removed-parent", seq, i,
                          f"BlockStored extends parent {_show(parent)} (group {group}), removed at sequence "
                          f"{self._removed[pkey]} and not stored since: a full-attention request holds its parent "
                          "block, so it cannot have been evicted (unless a KV connector's evict_blocks)")
        for h in hashes:
            key = (medium, group, _hashable(h))
            self.shadow[key] = self.shadow.get(key, 0) + 1
            self._removed.pop(key, None)

    def _removed_event(self, seq: int, i: int, e: dict[str, Any], new: list[Finding]) -> None:
        hashes = e.get("block_hashes") or []
        medium, group = e.get("medium"), e.get("group_idx")
        if not hashes:
            self._add(new, "malformed-event", seq, i, "BlockRemoved names no block hash")
        for h in hashes:
            key = (medium, group, _hashable(h))
            count = self.shadow.get(key, 0)
            if count > 1:
                self.shadow[key] = count - 1
                continue
            if count == 1:
                del self.shadow[key]
                self._removed[key] = seq
                self._removed.move_to_end(key)
                while len(self._removed) > self.max_removed_kept:
                    self._removed.popitem(last=False)
                continue
            if not self._is_sure(medium):
                self.unknown_removals += 1
                continue
            again = self._removed.get(key)
            self._add(new, "removed-never-stored", seq, i,
                      f"BlockRemoved {_show(h)} (group {group}, {medium}) has no live entry: "
                      + (f"its last entry was removed at sequence {again}" if again is not None
                         else "never stored since the stream (or the last AllBlocksCleared) began"))

    def _cleared(self) -> None:
        for key in [k for k in self.shadow if k[0] in (MEDIUM_GPU, None)]:
            del self.shadow[key]
        for key in [k for k in self._removed if k[0] in (MEDIUM_GPU, None)]:
            del self._removed[key]
        self._sure[MEDIUM_GPU] = True
        self._sure[None] = True

    # ------------------------------------------------------------------ output

    def _add(self, out: list[Finding], rule: str, seq: int | None, index: int | None, message: str) -> None:
        assert rule in RULES, rule
        f = Finding(rule, seq, index, message)
        out.append(f)
        self.findings_by_rule[rule] = self.findings_by_rule.get(rule, 0) + 1
        if len(self.findings) < self.max_findings_kept:
            self.findings.append(f)

    @property
    def num_findings(self) -> int:
        return sum(self.findings_by_rule.values())

    def summary(self) -> dict[str, Any]:
        """Everything a status line or the final report shows, as plain JSON-able values."""
        return {
            "batches_received": self.batches_received, "batches_applied": self.batches_applied,
            "batches_from_replay": self.batches_from_replay, "replay_overlaps": self.replay_overlaps,
            "first_seq": self.first_seq, "last_seq": None if self.next_seq is None else self.next_seq - 1,
            "lost_batches": self.lost, "duplicate_batches": self.duplicates, "reordered_batches": self.reordered,
            "restarts": self.restarts, "undecodable_batches": self.undecodable,
            "events": dict(sorted(self.events_by_type.items())), "live_keys": len(self.shadow),
            "live_entries": sum(self.shadow.values()), "unknown_removals": self.unknown_removals,
            "shadow_sure": self._is_sure(MEDIUM_GPU), "data_parallel_rank": self.rank,
            "num_findings": self.num_findings, "findings_by_rule": dict(sorted(self.findings_by_rule.items())),
            "findings": [f.to_json() for f in self.findings],
        }

    def status_line(self) -> str:
        s = self.summary()
        ev = s["events"]
        return (f"seq={s['last_seq']} batches={s['batches_received']} stored={ev.get('BlockStored', 0)} "
                f"removed={ev.get('BlockRemoved', 0)} cleared={ev.get('AllBlocksCleared', 0)} "
                f"live={s['live_entries']} lost={s['lost_batches']} dup={s['duplicate_batches']} "
                f"findings={s['num_findings']}")

    def check_invariants(self) -> None:
        """The watcher's own bookkeeping is consistent (called by the tests after every batch)."""
        assert all(count > 0 for count in self.shadow.values()), "a shadow key with no entries"
        assert not (set(self.shadow) & set(self._removed)), "a key both live and removed"
        assert len(self._recent) <= self.window and len(self._removed) <= self.max_removed_kept
        assert len(self._lost) <= self.window
        assert len(self.findings) == min(self.num_findings, self.max_findings_kept)
        assert set(self.findings_by_rule) <= set(RULES)
        if self.next_seq is None:
            assert self.batches_applied == 0 and not self.shadow
        else:
            assert self.first_seq is not None and self.first_seq < self.next_seq or self.batches_applied == 0
            assert all(s < self.next_seq for s in self._recent), "a remembered sequence ahead of the stream"
            assert all(s < self.next_seq for s in self._lost), "a lost sequence ahead of the stream"
        assert self.batches_applied + self.duplicates + self.reordered + self.replay_overlaps \
            + self.undecodable <= self.batches_received
        assert sum(self.events_by_type.values()) >= 0


def _stored_shape_problem(e: dict[str, Any]) -> str | None:
    hashes = e.get("block_hashes")
    tokens = e.get("token_ids")
    size = e.get("block_size")
    if not isinstance(hashes, list) or not isinstance(tokens, list) or type(size) is not int:
        return "lacks block_hashes / token_ids / block_size"
    if size <= 0:
        return f"has block_size {size}"
    if len(tokens) % size:
        return f"has {len(tokens)} token ids, not a whole number of {size}-token blocks"
    if len(tokens) < len(hashes) * size:
        return f"has {len(hashes)} hashes but only {len(tokens)} token ids"
    for name in ("extra_keys", "lookahead_token_ids"):
        v = e.get(name)
        if v is not None and (not isinstance(v, list) or len(v) != len(hashes)):
            return f"has {name} of length {len(v) if isinstance(v, list) else v!r}, not one per hash ({len(hashes)})"
    return None
