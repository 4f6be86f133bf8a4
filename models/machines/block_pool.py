"""Hypothesis state machine for the block pool, with a plain model beside it.

The machine plays the part of the managers: *owners* (stand-ins for one request's table in one
group) look up their longest cached prefix, touch the hits, grow with fresh blocks, publish full
blocks in the prefix cache and free their table tail-first — plus the rarer calls
(``evict_blocks``, ``reset_prefix_cache``, leading null placeholders like a sliding-window table).
Owners share content prefixes on purpose, so hits, duplicates in the index and LRU eviction of
cached blocks all happen.

Beside the pool runs :class:`PoolModel`, a deliberately naive model of the rules of docs/invariants.md I1–I10
(a Python list for the free queue, dicts for ref counts and the index). After every step the
machine checks ``check_invariants()`` of every implementation and compares what each can observe
with the model: the free queue *in order*, every ref count, the primary hash of every cached block
and the block ids each call returned. Block ids must match exactly: vLLM's order is defined.

Implementations (``targets``): ``"reference"`` (kvref's :class:`BlockPool`) and ``"vllm"``
(vLLM 0.33.0's own ``BlockPool``, driven with the same calls).
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from typing import Any

from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from kvref.impl.block_pool_driver import GROUP_ID, ReferenceBlockPoolDriver as ReferenceDriver

NONE_HASH = hashlib.sha256(b"kvref-machine-none").digest()


def chain_hashes(content: tuple[int, ...]) -> list[bytes]:
    """One 32-byte hash per block of ``content`` (a block = one int), chained over the prefix."""
    out, parent = [], NONE_HASH
    for c in content:
        parent = hashlib.sha256(parent + c.to_bytes(4, "big")).digest()
        out.append(parent)
    return out


def key_of(h: bytes) -> bytes:
    return h + GROUP_ID.to_bytes(4, "big")


# ---------------------------------------------------------------------------------- the model


@dataclass
class PoolModel:
    """The block pool rules as plainly as they can be said (docs/invariants.md I3, I6–I8)."""

    num_blocks: int
    free: list[int] = field(default_factory=list)  # front first; block 0 (null) never here
    ref: dict[int, int] = field(default_factory=dict)
    primary: dict[int, bytes] = field(default_factory=dict)  # block -> key
    index: dict[bytes, list[int]] = field(default_factory=dict)  # key -> blocks, first inserted first

    def __post_init__(self) -> None:
        self.free = list(range(1, self.num_blocks))
        self.ref = {b: 0 for b in range(1, self.num_blocks)}

    def lookup(self, key: bytes) -> int | None:
        blocks = self.index.get(key)
        return blocks[0] if blocks else None

    def _evict(self, b: int) -> None:
        key = self.primary.pop(b, None)
        if key is not None:
            self.index[key].remove(b)
            if not self.index[key]:
                del self.index[key]

    def get_new_blocks(self, n: int) -> list[int]:
        taken, self.free = self.free[:n], self.free[n:]
        for b in taken:
            self._evict(b)
            self.ref[b] = 1
        return taken

    def touch(self, blocks: list[int]) -> None:
        for b in blocks:
            if b == 0:
                continue
            if self.ref[b] == 0:
                self.free.remove(b)
            self.ref[b] += 1

    def free_blocks(self, ordered: list[int]) -> None:
        front, back = [], []
        for b in ordered:
            if b == 0:
                continue
            self.ref[b] -= 1
            if self.ref[b] == 0:
                (back if b in self.primary else front).append(b)
        self.free = front + self.free + back

    def cache(self, hashes: list[bytes], blocks: list[int], start: int, end: int) -> None:
        for i in range(start, end):
            b = blocks[i]
            if b == 0:
                continue
            key = key_of(hashes[i])
            if self.primary.get(b) == key:
                continue
            assert b not in self.primary, "model: a fresh full block cannot carry a hash"
            self.primary[b] = key
            self.index.setdefault(key, []).append(b)

    def evict_blocks(self, ids: list[int]) -> None:
        for b in ids:
            self._evict(b)

    def reset(self) -> bool:
        if len(self.free) != self.num_blocks - 1:
            return False
        self.primary.clear()
        self.index.clear()
        return True


# ---------------------------------------------------------------------------------- drivers


class VllmDriver:
    """The installed vLLM's BlockPool (built lazily: :mod:`kvref.impl.vllm.block_pool`)."""

    def __new__(cls, num_blocks: int, hash_block_size: int):
        from kvref.impl.vllm.block_pool import VllmBlockPoolDriver

        return VllmBlockPoolDriver(num_blocks, hash_block_size)


DRIVERS = {"reference": ReferenceDriver, "vllm": VllmDriver}


# ---------------------------------------------------------------------------------- the machine


@dataclass
class Owner:
    hashes: list[bytes]
    blocks: list[int]
    num_cached: int


class BlockPoolMachine(RuleBasedStateMachine):
    """Drives one or more block pools and the model with the same calls. Subclass and set
    ``targets`` (see :func:`make_block_pool_machine`)."""

    targets: tuple[str, ...] = ("reference",)
    num_blocks: int = 10
    block_size: int = 4
    steps = 0  # class-wide count of executed steps (benchmarks)
    #: class-wide counts of what the runs reached (tests assert on them, so a machine that silently
    #: stopped reaching exhaustion, eviction or hits fails its test): ``hits``, ``evictions``,
    #: ``exhausted`` (a get_new_blocks that had to raise), ``null_slots``
    coverage: dict[str, int] = {}

    def __init__(self) -> None:
        super().__init__()
        self.impls = [DRIVERS[t](self.num_blocks, self.block_size) for t in self.targets]
        self.model = PoolModel(self.num_blocks)
        self.owners: dict[int, Owner] = {}
        self.next_owner = 0
        self.history: list[tuple[int, ...]] = []  # contents admitted so far (to re-admit: hits)

    def _all(self, method: str, *args: Any) -> list[Any]:
        return [getattr(impl, method)(*args) for impl in self.impls]

    def _same(self, what: str, got: list[Any], want: Any) -> None:
        for impl, g in zip(self.impls, got):
            assert g == want, f"{impl.name}: {what} = {g!r}, model says {want!r}"

    # --- rules -----------------------------------------------------------------------------

    @precondition(lambda self: len(self.owners) < 6)
    @rule(content=st.lists(st.integers(0, 2), min_size=1, max_size=5).map(tuple),
          nulls=st.integers(0, 2))
    def admit(self, content: tuple[int, ...], nulls: int) -> None:
        """Longest cached prefix (all groups must hit), touch the hits; ``nulls`` leading
        placeholders model skipped sliding-window blocks."""
        self._admit(content, nulls)

    @precondition(lambda self: len(self.owners) < 6 and self.history)
    @rule(data=st.data(), more=st.lists(st.integers(0, 2), max_size=2).map(tuple))
    def readmit(self, data: st.DataObject, more: tuple[int, ...]) -> None:
        """A request sharing a prefix with an earlier one: hits (live or evictable) are likely."""
        content = data.draw(st.sampled_from(self.history), label="content")
        self._admit(content + more, 0)

    @precondition(lambda self: self.owners)
    @rule(data=st.data())
    def fill(self, data: st.DataObject) -> None:
        """A request's whole life in one step: grow to its full length and publish every block."""
        oid = data.draw(st.sampled_from(sorted(self.owners)), label="owner")
        o = self.owners[oid]
        n = len(o.hashes) - len(o.blocks)
        if n <= 0 or n > len(self.model.free):
            return
        got = self._all("get_new_blocks", n)
        want = self._model_get_new_blocks(n)
        self._same(f"get_new_blocks({n})", got, want)
        o.blocks.extend(want)
        end = len(o.hashes)
        if end > o.num_cached:
            self._all("cache", o.hashes, o.blocks, o.num_cached, end, self.block_size)
            self.model.cache(o.hashes, o.blocks, o.num_cached, end)
            o.num_cached = end

    def _count(self, what: str, n: int = 1) -> None:
        type(self).coverage[what] = type(self).coverage.get(what, 0) + n

    def _model_get_new_blocks(self, n: int) -> list[int]:
        """The model's allocation, counting the cached blocks it evicts on the way (I7)."""
        before = set(self.model.primary)
        got = self.model.get_new_blocks(n)
        self._count("evictions", len(before & set(got)))
        return got

    def _admit(self, content: tuple[int, ...], nulls: int) -> None:
        self.history.append(content)
        hashes = chain_hashes(content)
        hits: list[int] = []
        for i, h in enumerate(hashes[:-1]):  # like vLLM: the last token is always recomputed
            got = self._all("get_cached_block", h)
            want = self.model.lookup(key_of(h))
            self._same(f"get_cached_block(hash {i})", got, want)
            if want is None:
                break
            hits.append(want)
        # leading placeholders: skipped positions (a sliding-window table after its window moved on)
        table = [0] * nulls + hits[nulls:]
        self._count("hits", bool(hits[nulls:]))
        self._count("null_slots", bool(nulls))
        self._all("touch", table)
        self.model.touch(table)
        self.owners[self.next_owner] = Owner(hashes, table, len(table))
        self.next_owner += 1

    @precondition(lambda self: self.owners)
    @rule(data=st.data(), n=st.integers(0, 4))
    def grow(self, data: st.DataObject, n: int) -> None:
        oid = data.draw(st.sampled_from(sorted(self.owners)), label="owner")
        if n > len(self.model.free):
            self._count("exhausted")
            for impl in self.impls:
                before = impl.free_queue()
                try:
                    impl.get_new_blocks(n)
                except ValueError as e:
                    assert "Cannot get" in str(e), f"{impl.name}: wrong error {e!r}"
                else:
                    raise AssertionError(f"{impl.name}: get_new_blocks({n}) with "
                                         f"{len(self.model.free)} free did not raise")
                assert impl.free_queue() == before, f"{impl.name}: a failed get_new_blocks changed the queue"
            return
        got = self._all("get_new_blocks", n)
        want = self._model_get_new_blocks(n)
        self._same(f"get_new_blocks({n})", got, want)
        self.owners[oid].blocks.extend(want)

    @precondition(lambda self: self.owners)
    @rule(data=st.data(), k=st.integers(1, 3))
    def cache(self, data: st.DataObject, k: int) -> None:
        oid = data.draw(st.sampled_from(sorted(self.owners)), label="owner")
        o = self.owners[oid]
        end = min(len(o.blocks), len(o.hashes), o.num_cached + k)
        if end <= o.num_cached:
            return
        self._all("cache", o.hashes, o.blocks, o.num_cached, end, self.block_size)
        self.model.cache(o.hashes, o.blocks, o.num_cached, end)
        o.num_cached = end

    @precondition(lambda self: self.owners)
    @rule(data=st.data())
    def free(self, data: st.DataObject) -> None:
        """A request finishes: its table is freed tail first (vLLM frees ``reversed(blocks)``)."""
        oid = data.draw(st.sampled_from(sorted(self.owners)), label="owner")
        o = self.owners.pop(oid)
        order = list(reversed(o.blocks))
        self._all("free_blocks", order)
        self.model.free_blocks(order)

    @rule(ids=st.lists(st.integers(1, 9), max_size=3, unique=True))
    def evict(self, ids: list[int]) -> None:
        ids = [i for i in ids if i < self.num_blocks]
        self._all("evict_blocks", ids)
        self.model.evict_blocks(ids)

    @rule()
    def reset(self) -> None:
        got = self._all("reset")
        self._same("reset_prefix_cache()", got, self.model.reset())

    # --- invariants --------------------------------------------------------------------------

    @invariant()
    def count_step(self) -> None:
        type(self).steps += 1

    @invariant()
    def agrees_with_model(self) -> None:
        for impl in self.impls:
            impl.check_invariants()
            assert impl.num_free() == len(self.model.free), \
                f"{impl.name}: {impl.num_free()} free, model {len(self.model.free)}"
            assert impl.free_queue() == self.model.free, \
                f"{impl.name}: free queue {impl.free_queue()}, model {self.model.free}"
            assert impl.ref_counts() == self.model.ref, \
                f"{impl.name}: ref counts {impl.ref_counts()}, model {self.model.ref}"
            assert impl.primary() == self.model.primary, f"{impl.name}: cached blocks differ from the model"

    @invariant()
    def ref_counts_are_table_slots(self) -> None:
        """I9: without connectors, a block's ref count is the number of table slots holding it."""
        slots: dict[int, int] = {b: 0 for b in range(1, self.num_blocks)}
        for o in self.owners.values():
            for b in o.blocks:
                if b:
                    slots[b] += 1
        assert slots == self.model.ref, "model ref counts differ from table slots"
        for impl in self.impls:
            assert impl.ref_counts() == slots, f"{impl.name}: ref counts are not the table slot counts"


def make_block_pool_machine(*targets: str, num_blocks: int = 10,
                            block_size: int = 4) -> type[BlockPoolMachine]:
    """A machine class driving ``targets`` (``"reference"``, ``"vllm"``) beside the model."""
    for t in targets:
        if t not in DRIVERS:
            from kvref.spec.errors import InvalidFieldError

            raise InvalidFieldError("targets", t, "one of " + ", ".join(DRIVERS))
    name = "BlockPoolMachine_" + "_".join(targets)
    return type(name, (BlockPoolMachine,), {"targets": tuple(targets), "num_blocks": num_blocks,
                                             "block_size": block_size, "steps": 0, "coverage": {}})
