"""The scheduler-side CPU offloading manager (vLLM ``kv_offload/cpu/manager.py::CPUOffloadingManager``).

It knows which chunks live in the CPU buffer, pins them while loads read them, keeps new chunks
unreadable until their write completes, and evicts through a pluggable policy (LRU or ARC).

Life of a chunk::

    prepare_store -> ref_cnt -1 (write pending; lookup says HIT_PENDING; never evicted)
    complete_store(success) -> 0 (HIT, evictable)      complete_store(failure) -> gone
    prepare_load -> +1 (pinned)   complete_load -> -1 (back to evictable at 0)

``prepare_store`` is all or nothing: either every new key gets a chunk (evicting exactly the
shortfall, never a key of the offer itself) or nothing changes and it returns None.

Where vLLM asserts on a call the state does not allow (loading an absent or pending chunk,
completing a load twice), this reference raises :class:`OffloadStateError` and changes nothing.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Collection, Iterable

from kvref.spec.errors import InvalidFieldError, check_choice, check_int

from .arc_policy import ARCCachePolicy
from .cache_policy import CachePolicy, ChunkStatus
from .keys import LookupResult, OffloadKey, OffloadStateError, RequestContext, get_offload_group_idx
from .lru_policy import LRUCachePolicy

POLICIES: dict[str, type[CachePolicy]] = {"lru": LRUCachePolicy, "arc": ARCCachePolicy}


@dataclass(frozen=True)
class PrepareStoreOutput:
    keys_to_store: list[OffloadKey]
    chunk_ids: list[int]
    evicted_keys: list[OffloadKey]


@dataclass(frozen=True)
class OffloadingEvent:
    keys: list[OffloadKey]
    removed: bool
    metadata_only: bool = False  # a failed store's cleanup, not a public eviction


@dataclass
class _RequestCacheAccess:
    """What one request did to the cache, committed to the policy when it finishes."""

    owner: object
    generation: int
    key_groups: dict[int, list[OffloadKey]] = field(default_factory=dict)
    seen: set[OffloadKey] = field(default_factory=set)
    inserted: set[OffloadKey] = field(default_factory=set)
    reused: set[OffloadKey] = field(default_factory=set)
    store_misses: set[OffloadKey] = field(default_factory=set)
    finished: bool = False


def _check_keys(name: str, keys) -> list[OffloadKey]:
    if isinstance(keys, (bytes, str)) or not isinstance(keys, Iterable):
        raise InvalidFieldError(name, keys, "a collection of offload keys (bytes)")
    keys = list(keys)
    for k in keys:
        if not isinstance(k, bytes) or len(k) < 4:
            raise InvalidFieldError(f"{name}[i]", k, "bytes of length >= 4 (hash + group index)")
    return keys


def _check_ctx(ctx, allow_none: bool = False) -> None:
    if ctx is None and allow_none:
        return
    if not isinstance(ctx, RequestContext):
        raise InvalidFieldError("ctx", ctx, "a RequestContext" + (" or None" if allow_none else ""))


class CPUOffloadingManager:
    """Args:
        num_chunks: CPU slots (>= 1).
        cache_policy: "lru" or "arc".
        enable_events: collect stored/removed events for ``take_events``.
        store_threshold: offers a key needs before it is stored (1 = always; >= 2 tracks
            counts in an LRU table of at most ``max_tracker_size`` keys).
    """

    def __init__(self, num_chunks: int, cache_policy: str = "lru", enable_events: bool = False,
                 store_threshold: int = 1, max_tracker_size: int = 64_000) -> None:
        check_int("num_chunks", num_chunks, minimum=1)
        check_choice("cache_policy", cache_policy, tuple(POLICIES))
        check_int("store_threshold", store_threshold, minimum=1)
        check_int("max_tracker_size", max_tracker_size, minimum=1)
        self.num_chunks = num_chunks
        self.policy: CachePolicy = POLICIES[cache_policy](num_chunks)
        self.events: list[OffloadingEvent] | None = [] if enable_events else None
        self.store_threshold = store_threshold
        self.max_tracker_size = max_tracker_size
        self.counts: OrderedDict[OffloadKey, int] | None = OrderedDict() if store_threshold >= 2 else None
        # metrics since the last get_stats (vLLM ``*_in_current_batch``): sizes of the allocations
        # asked for, new chunks the store threshold held back
        self.allocation_sizes: list[int] = []
        self.stores_skipped = 0
        self._num_allocated = 0  # fresh chunk ids 0..num_chunks-1 are handed out first
        self._free_list: list[int] = []  # then recycled ids, last freed first
        self.num_evictable = 0
        self.num_write_pending = 0
        self._generation = 0

    # -- chunk pool --------------------------------------------------------------------------

    @property
    def num_free_chunks(self) -> int:
        return len(self._free_list) + self.num_chunks - self._num_allocated

    def _allocate(self, n: int) -> list[int]:
        fresh = min(n, self.num_chunks - self._num_allocated)
        ids = list(range(self._num_allocated, self._num_allocated + fresh))
        self._num_allocated += fresh
        ids += [self._free_list.pop() for _ in range(n - fresh)]
        return ids

    # -- per-request access log --------------------------------------------------------------

    def _access(self, ctx: RequestContext) -> _RequestCacheAccess:
        st = ctx.get_state(_RequestCacheAccess)
        if st is None or st.owner is not self or st.generation != self._generation:
            st = _RequestCacheAccess(self, self._generation)
            ctx.set_state(st)
        return st

    def _record(self, keys: Iterable[OffloadKey], ctx: RequestContext, reused: Iterable[OffloadKey] = ()) -> None:
        st = self._access(ctx)
        new = []
        for k in keys:
            if k in st.seen:
                continue
            st.key_groups.setdefault(get_offload_group_idx(k), []).append(k)
            st.seen.add(k)
            new.append(k)
        if new:
            self.policy.on_request_access(new, ctx)
        # Reading back a chunk this request itself inserted is not a reuse.
        st.reused.update(k for k in reused if k not in st.inserted)

    def _record_offers(self, keys: list[OffloadKey]) -> None:
        """Count offers for the admission threshold; never drop a key of the current offer."""
        assert self.counts is not None
        offered_known = set()
        for k in keys:
            if k in self.counts:
                self.counts.move_to_end(k)
                self.counts[k] += 1
                offered_known.add(k)
        unprotected = len(self.counts) - len(offered_known)
        for k in keys:
            if k in self.counts:
                continue
            if len(self.counts) >= self.max_tracker_size:
                if unprotected == 0:
                    continue
                self.counts.popitem(last=False)
                unprotected -= 1
            self.counts[k] = 1

    # -- OffloadingManager API ---------------------------------------------------------------

    def on_new_request(self, ctx: RequestContext) -> None:
        _check_ctx(ctx)
        self._access(ctx)

    def lookup(self, key: OffloadKey, ctx: RequestContext | None = None) -> LookupResult:
        _check_keys("key", (key,))
        _check_ctx(ctx, allow_none=True)
        chunk = self.policy.get(key)
        if chunk is None:
            return LookupResult.MISS
        return LookupResult.HIT if chunk.is_ready else LookupResult.HIT_PENDING

    def prepare_load(self, keys: Collection[OffloadKey], ctx: RequestContext) -> list[int]:
        """Pin ready chunks for reading; returns their chunk ids."""
        _check_ctx(ctx)
        keys = _check_keys("keys", keys)
        ids = self._pin_ready_chunks(keys, "prepare_load needs resident, ready chunks")
        self._record(keys, ctx, reused=keys)
        return ids

    def _pin_ready_chunks(self, keys: list[OffloadKey], needs: str) -> list[int]:
        """Pin (``ref_cnt`` += 1, non-evictable from the first pin) the chunks of checked ``keys``,
        all of which must be resident and ready, else nothing is pinned and OffloadStateError says
        which one is not and what the caller (``needs``) requires; returns their chunk ids. Loads
        to the GPU and the tiering manager's cascades pin alike."""
        for k in keys:
            chunk = self.policy.get(k)
            if chunk is None or not chunk.is_ready:
                raise OffloadStateError(f"keys: {k!r} is {'absent' if chunk is None else 'still being written'};"
                                        f" {needs}")
        ids = []
        for k in keys:
            chunk = self.policy.get(k)
            if chunk.ref_cnt == 0:
                self.policy.mark_non_evictable(k)
                self.num_evictable -= 1
            chunk.ref_cnt += 1
            ids.append(chunk.chunk_id)
        return ids

    def touch(self, keys: Collection[OffloadKey], ctx: RequestContext) -> None:
        _check_ctx(ctx)
        self.policy.touch(_check_keys("keys", keys), ctx)

    def complete_load(self, keys: Collection[OffloadKey], ctx: RequestContext | None = None) -> None:
        _check_ctx(ctx, allow_none=True)
        keys = _check_keys("keys", keys)
        need: dict[OffloadKey, int] = {}
        for k in keys:
            need[k] = need.get(k, 0) + 1
        for k, n in need.items():
            chunk = self.policy.get(k)
            if chunk is None or chunk.ref_cnt < n:
                raise OffloadStateError(f"keys: {k!r} has {0 if chunk is None else max(chunk.ref_cnt, 0)} "
                                        f"load pins, complete_load releases {n}")
        for k in keys:
            chunk = self.policy.get(k)
            chunk.ref_cnt -= 1
            if chunk.ref_cnt == 0:
                self.num_evictable += 1
                self.policy.mark_evictable(k)

    def prepare_store(self, keys: Collection[OffloadKey], ctx: RequestContext) -> PrepareStoreOutput | None:
        _check_ctx(ctx)
        keys = _check_keys("keys", keys)
        if len(set(keys)) != len(keys):
            # vLLM would allocate two chunks for one key and leak one (its callers never repeat a key).
            raise InvalidFieldError("keys", keys, "distinct offload keys")
        if self.counts is not None:
            self._record_offers(keys)
        new_keys: list[OffloadKey] = []
        ready_existing: list[OffloadKey] = []
        for k in keys:
            chunk = self.policy.get(k)
            if chunk is None:
                new_keys.append(k)
            elif chunk.is_ready:
                ready_existing.append(k)
        if self.counts is not None:
            candidates = len(new_keys)
            new_keys = [k for k in new_keys if self.counts.get(k, 0) >= self.store_threshold]
            self.stores_skipped += candidates - len(new_keys)

        st = self._access(ctx)
        misses = [k for k in new_keys if k not in st.store_misses]
        if misses:
            # ARC learns from ghost hits before insert() forgets the ghost; once per request.
            self.policy.on_store_miss(misses, ctx)
            st.store_misses.update(misses)
        recorded = set(new_keys) | set(ready_existing)
        self._record([k for k in keys if k in recorded], ctx, reused=ready_existing)

        if not new_keys:
            return PrepareStoreOutput([], [], [])

        self.allocation_sizes.append(len(new_keys))  # counted even if the allocation then fails
        shortfall = len(new_keys) - self.num_free_chunks
        evicted: list[OffloadKey] = []
        if shortfall > 0:
            if shortfall > self.num_evictable:
                return None
            # The whole offer is protected: a key already stored must survive this call.
            victims = self.policy.evict(shortfall, set(keys))
            if victims is None:
                return None
            self.num_evictable -= len(victims)
            for k, chunk in victims:
                self._free_list.append(chunk.chunk_id)
                evicted.append(k)
            if self.events is not None:
                self.events.append(OffloadingEvent(evicted, removed=True))

        ids = self._allocate(len(new_keys))
        for k, cid in zip(new_keys, ids):
            self.policy.insert(k, ChunkStatus(cid), ctx)
        self.num_write_pending += len(new_keys)
        st.inserted.update(new_keys)
        return PrepareStoreOutput(new_keys, ids, evicted)

    def complete_store(self, keys: Collection[OffloadKey], ctx: RequestContext | None = None,
                       success: bool = True) -> None:
        """Pending chunks among ``keys`` become readable (or vanish on failure); others are ignored,
        as in vLLM (a key may have been stored by another job already)."""
        _check_ctx(ctx, allow_none=True)
        keys = _check_keys("keys", keys)
        if not isinstance(success, bool):
            raise InvalidFieldError("success", success, "a bool")
        done: list[OffloadKey] = []
        for k in keys:
            chunk = self.policy.get(k)
            if chunk is None or chunk.is_ready:
                continue
            self.num_write_pending -= 1
            if success:
                chunk.ref_cnt = 0
                self.num_evictable += 1
                self.policy.mark_evictable(k)
            else:
                self.policy.remove(k)
                self._free_list.append(chunk.chunk_id)
            done.append(k)
        if done and self.events is not None:
            self.events.append(OffloadingEvent(done, removed=not success, metadata_only=not success))

    def on_request_finished(self, ctx: RequestContext) -> None:
        _check_ctx(ctx)
        st = ctx.get_state(_RequestCacheAccess)
        if st is None or st.owner is not self or st.generation != self._generation or st.finished:
            return
        st.finished = True
        groups = []
        for g in sorted(st.key_groups):
            ks = st.key_groups[g]
            pos = {k: p for k in ks if (p := ctx.get_offload_key_position(k)) is not None}
            if len(pos) == len(ks):
                ks = sorted(ks, key=pos.__getitem__)
            groups.append(tuple(ks))
        self.policy.on_request_finished(tuple(groups), st.inserted - st.reused, st.reused, ctx)

    def reset_cache(self) -> None:
        """Forget everything. The scheduler guarantees no completion of a pre-reset job arrives."""
        self.policy.clear()
        self._generation += 1
        self.num_evictable = 0
        self.num_write_pending = 0
        self._free_list.clear()
        self._num_allocated = 0

    def get_stats(self) -> dict:
        """The manager's metrics since the last call (vLLM ``CPUOffloadingManager.get_stats``):
        cache usage (chunks in use, neither free nor evictable), write usage (chunks being
        written), read usage (the rest of the use), each as a fraction of the pool; the sizes of
        the allocations asked for; with a store threshold, the new chunks it held back."""
        used = self.num_chunks - self.num_free_chunks - self.num_evictable
        usage = used / self.num_chunks
        write = self.num_write_pending / self.num_chunks
        out = {"cpu_cache_usage_perc": usage, "cpu_cache_write_usage_perc": write,
               "cpu_cache_read_usage_perc": max(usage - write, 0.0)}
        if self.allocation_sizes:
            out["cpu_allocation_size"] = self.allocation_sizes
        self.allocation_sizes = []
        if self.store_threshold >= 2:
            out["stores_skipped"] = self.stores_skipped
            self.stores_skipped = 0
        return out

    def take_events(self) -> list[OffloadingEvent]:
        if self.events is None:
            return []
        events, self.events = self.events, []
        out = []
        for ev in events:
            if ev.metadata_only:
                # A retry may already own the key again; do not announce its removal.
                ks = [k for k in ev.keys if self.policy.get(k) is None]
                if not ks:
                    continue
                ev = OffloadingEvent(ks, ev.removed, ev.metadata_only)
            out.append(ev)
        return out

    # -- inspection --------------------------------------------------------------------------

    def chunk_state(self) -> dict[OffloadKey, tuple[int, int]]:
        """key -> (chunk_id, ref_cnt) for every resident chunk."""
        return {k: (c.chunk_id, c.ref_cnt) for k in self.policy.resident_keys() if (c := self.policy.get(k))}

    def check_invariants(self) -> None:
        self.policy.check_invariants()
        state = self.chunk_state()
        ids = [cid for cid, _ in state.values()]
        assert len(ids) == len(set(ids)), "O4: two keys share a CPU chunk"
        assert not set(ids) & set(self._free_list), "O4: a resident chunk is also free"
        assert len(self._free_list) == len(set(self._free_list)), "O4: a chunk freed twice"
        assert all(0 <= i < self._num_allocated for i in ids + self._free_list), "O4: chunk id out of range"
        assert len(ids) + len(self._free_list) == self._num_allocated, "O4: a chunk id leaked"
        assert self.num_evictable == sum(1 for _, r in state.values() if r == 0), "O4: evictable count drifted"
        assert self.num_write_pending == sum(1 for _, r in state.values() if r == -1), "O4: pending count drifted"
        assert all(r >= -1 for _, r in state.values()), "O4: a chunk's ref_cnt is below -1"
