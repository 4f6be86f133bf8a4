"""vLLM's CPU-tier cache policies vs the reference's on generated operation sequences (#22).

Each case builds one policy on both sides — vLLM's resolved through its ``CachePolicyFactory``
(LRU, ARC, or the out-of-tree :class:`~kvref.impl.vllm.offload_policies.TouchPerGroupLRUCachePolicy`
found by module path) and the reference's (:mod:`kvref.impl.reference.offload.lru_policy`,
``arc_policy``) — and applies the same random calls, keeping the manager's side of the contract
(a chunk is inserted pending or ready; ``mark_evictable`` / ``mark_non_evictable`` exactly when
``ref_cnt`` reaches / leaves 0; at most ``capacity`` residents). After every call it compares
every key's ``get`` (chunk id, ref count), the ordered ``evict`` result (or None), and the
policy's state: ARC's T1/T2/B1/B2 orders and target T1 size, LRU's ranks and evictable set. The
reference's ``check_invariants`` runs after every call.

Some cases are *bulk*: ~70-90 keys all ready, so a touch or a request commit updates >= 64
evictable keys at once and vLLM's LRU rebuilds its heap instead of pushing (a path the manager's
traces never reach). Every case also checks the factory: a taken name is refused with ValueError
and leaves the registry unchanged; an unknown name without a module path is refused.
"""

from __future__ import annotations

import random
from typing import Any

from kvref.impl.reference.offload.arc_policy import ARCCachePolicy
from kvref.impl.reference.offload.cache_policy import CachePolicy, ChunkStatus
from kvref.impl.reference.offload.keys import RequestContext, make_offload_key
from kvref.impl.reference.offload.lru_policy import LRUCachePolicy


class TouchPerGroupLRU(LRUCachePolicy):
    """The reference's counterpart of the out-of-tree policy: LRU, base-class request commit."""

    on_request_finished = CachePolicy.on_request_finished


KINDS = ("lru", "arc", "out-of-tree")


def _reference(kind: str, capacity: int) -> CachePolicy:
    return {"lru": LRUCachePolicy, "arc": ARCCachePolicy, "out-of-tree": TouchPerGroupLRU}[kind](capacity)


def _vllm(kind: str, capacity: int):
    from kvref.impl.vllm.offload_policies import OUT_OF_TREE_MODULE, VllmPolicy

    if kind == "out-of-tree":
        return VllmPolicy("TouchPerGroupLRUCachePolicy", capacity, OUT_OF_TREE_MODULE)
    return VllmPolicy(kind, capacity)


def observe_reference(policy: CachePolicy) -> dict[str, Any]:
    if isinstance(policy, ARCCachePolicy):
        return {"t1": list(policy.t1), "t2": list(policy.t2), "b1": list(policy.b1), "b2": list(policy.b2),
                "target": float(policy.target_t1_size)}
    return {"ranks": dict(policy.ranks), "evictable": set(policy.evictable), "resident": set(policy.chunks)}


class PolicyPair:
    """The same policy on both sides plus the manager-side shadow of each chunk's ref count."""

    def __init__(self, kind: str, capacity: int, keys: list[bytes], rng: random.Random) -> None:
        self.kind, self.capacity, self.keys, self.rng = kind, capacity, keys, rng
        self.ref = _reference(kind, capacity)
        self.vllm = _vllm(kind, capacity)
        self.ref_cnt: dict[bytes, int] = {}  # resident key -> ref count (the manager's view)
        self.ref_chunks: dict[bytes, ChunkStatus] = {}
        self.vllm_chunks: dict[bytes, Any] = {}
        self.contexts: list[tuple[RequestContext, Any]] = []
        self.next_chunk = 0
        self.ops = 0

    # -- the manager's side of the contract ------------------------------------------------
    def _set_ref_cnt(self, key: bytes, value: int) -> None:
        before = self.ref_cnt[key]
        self.ref_cnt[key] = value
        self.ref_chunks[key].ref_cnt = value
        self.vllm_chunks[key].ref_cnt = value
        if value == 0 and before != 0:
            self._both("mark_evictable", key)
        elif before == 0 and value != 0:
            self._both("mark_non_evictable", key)

    def _both(self, method: str, *args: Any) -> None:
        getattr(self.ref, method)(*args)
        self.vllm.call(method, *args)

    def _forget(self, key: bytes) -> None:
        for table in (self.ref_cnt, self.ref_chunks, self.vllm_chunks):
            table.pop(key, None)

    def context(self) -> tuple[RequestContext, Any]:
        if not self.contexts or self.rng.random() < 0.3:
            req_id = f"req-{len(self.contexts)}"
            chosen = self.rng.sample(self.keys, self.rng.randint(0, len(self.keys)))
            positions = {k: (i + 1) * 16 for i, k in enumerate(chosen)}
            ref_ctx = RequestContext(req_id)
            for k, pos in positions.items():
                ref_ctx.set_offload_key_position(k, pos)
            self.contexts.append((ref_ctx, self.vllm.new_context(req_id, positions)))
        return self.rng.choice(self.contexts)

    def _some_keys(self, most: int | None = None) -> list[bytes]:
        return self.rng.sample(self.keys, self.rng.randint(0, min(len(self.keys), most or len(self.keys))))

    # -- one generated call ----------------------------------------------------------------
    def step(self, bulk: bool = False) -> str:
        rng = self.rng
        resident = list(self.ref_cnt)
        op = rng.choice(("insert", "insert", "complete", "pin", "unpin", "remove", "touch", "store_miss",
                         "access", "finished", "finished", "evict", "evict", "clear")
                        + (("complete", "remove", "remove") if self.kind == "arc" else ()))
        if op == "clear" and rng.random() < 0.8:
            op = "touch"
        if bulk:
            op = rng.choice(("touch", "finished", "access", "evict", "pin", "unpin"))
        if op == "insert":
            free = [k for k in self.keys if k not in self.ref_cnt]
            fresh = [k for k in free if k not in getattr(self.ref, "b1", ()) and k not in getattr(self.ref, "b2", ())]
            if fresh and rng.random() < 0.7:  # ARC: new keys, so ghosts pile up past the capacity
                free = fresh
            if not free or len(resident) >= self.capacity:
                op = "evict"
            else:
                key, ready = rng.choice(free), rng.random() < (0.6 if self.kind == "arc" else 0.3)
                self._insert(key, 0 if ready else -1)
                return f"insert {key.hex()[:6]} ready={ready}"
        if op == "complete":
            pending = [k for k in resident if self.ref_cnt[k] == -1]
            if pending:
                key = rng.choice(pending)
                self._set_ref_cnt(key, 0)
                return f"complete {key.hex()[:6]}"
            op = "touch"
        if op == "pin":
            ready = [k for k in resident if self.ref_cnt[k] >= 0]
            if ready:
                key = rng.choice(ready)
                self._set_ref_cnt(key, self.ref_cnt[key] + 1)
                return f"pin {key.hex()[:6]}"
            op = "touch"
        if op == "unpin":
            pinned = [k for k in resident if self.ref_cnt[k] > 0]
            if pinned:
                key = rng.choice(pinned)
                self._set_ref_cnt(key, self.ref_cnt[key] - 1)
                return f"unpin {key.hex()[:6]}"
            op = "touch"
        if op == "remove":  # a failed store (pending), or any unpinned chunk the manager drops
            droppable = [k for k in resident if self.ref_cnt[k] <= 0]
            frequent = [k for k in droppable if k in getattr(self.ref, "t2", ())]
            if frequent and rng.random() < 0.8:  # ARC: one in T2 (a path the manager never takes)
                droppable = frequent
            if droppable:
                key = rng.choice(droppable)
                self._both("remove", key)
                self._forget(key)
                return f"remove {key.hex()[:6]}"
            op = "touch"
        if op == "clear":
            self._both("clear")
            self.ref_cnt.clear()
            self.ref_chunks.clear()
            self.vllm_chunks.clear()
            return "clear"
        if op == "evict":
            return self._evict()
        ref_ctx, v_ctx = self.context()
        keys = self.rng.sample(self.keys, self.rng.randint(len(self.keys) - 10, len(self.keys))) if bulk \
            else self._some_keys()
        if op == "touch":
            self.ref.touch(keys, ref_ctx)
            self.vllm.touch(keys, v_ctx)
        elif op == "store_miss":
            self.ref.on_store_miss(keys, ref_ctx)
            self.vllm.call("on_store_miss", keys, v_ctx)
        elif op == "access":
            self.ref.on_request_access(keys, ref_ctx)
            self.vllm.call("on_request_access", keys, v_ctx)
        else:
            cut = rng.randint(0, len(keys))
            groups = [keys[:cut], keys[cut:]] if rng.random() < 0.5 else [keys]
            insertion_only = {k for k in keys if rng.random() < 0.3}
            reused = {k for k in keys if k not in insertion_only and rng.random() < 0.6}
            self.ref.on_request_finished(groups, insertion_only, reused, ref_ctx)
            self.vllm.on_request_finished(groups, insertion_only, reused, v_ctx)
        return f"{op} {len(keys)} keys of {ref_ctx.req_id}"

    def _insert(self, key: bytes, ref_cnt: int) -> None:
        ref_ctx, v_ctx = self.context()
        self.next_chunk += 1
        self.ref_chunks[key] = ChunkStatus(self.next_chunk, ref_cnt)
        self.vllm_chunks[key] = self.vllm.new_chunk(self.next_chunk, ref_cnt)
        self.ref_cnt[key] = ref_cnt
        self.ref.insert(key, self.ref_chunks[key], ref_ctx)
        self.vllm.call("insert", key, self.vllm_chunks[key], v_ctx)

    def _evict(self) -> str:
        rng = self.rng
        evictable = sum(1 for c in self.ref_cnt.values() if c == 0)
        n = rng.choice((0, 1, rng.randint(0, evictable + 1), evictable, evictable + 1))
        protected = {k for k in self.ref_cnt if rng.random() < 0.2}
        got_ref = self.ref.evict(n, set(protected))
        got_vllm = self.vllm.evict(n, set(protected))
        ref_view = None if got_ref is None else [(k, c.chunk_id) for k, c in got_ref]
        if ref_view != got_vllm:
            raise AssertionError(f"{self.kind} evict({n}, {len(protected)} protected): reference "
                                 f"{_short(ref_view)}, vLLM {_short(got_vllm)}")
        for key, _ in ref_view or ():
            self._forget(key)
        return f"evict {n} -> {len(ref_view) if ref_view is not None else None}"

    def compare(self, what: str) -> None:
        self.ref.check_invariants()
        for key in self.keys:
            ref_chunk = self.ref.get(key)
            ref_view = None if ref_chunk is None else (ref_chunk.chunk_id, ref_chunk.ref_cnt)
            if ref_view != self.vllm.get(key):
                raise AssertionError(f"{self.kind} after {what}: get({key.hex()[:6]}) reference {ref_view}, "
                                     f"vLLM {self.vllm.get(key)}")
        mine, theirs = observe_reference(self.ref), self.vllm.observe()
        if mine != theirs:
            diff = {k: (_short(mine[k]), _short(theirs[k])) for k in mine if mine[k] != theirs.get(k)}
            raise AssertionError(f"{self.kind} after {what}: state differs (reference, vLLM): {diff}")


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) < 300 else text[:300] + "..."


def check_factory() -> None:
    """A taken name is refused and the registry stays; an unknown name needs a module path."""
    from kvref.impl.vllm.offload_policies import policy_class, register_policy, registered_policies

    before = registered_policies()
    for name in before:
        try:
            register_policy(name, "vllm.v1.kv_offload.cpu.policies.lru", "LRUCachePolicy")
        except ValueError:
            pass
        else:
            raise AssertionError(f"vLLM's CachePolicyFactory accepted a second registration of {name!r}")
    if registered_policies() != before:
        raise AssertionError(f"a refused registration changed the registry: {before} -> {registered_policies()}")
    try:
        policy_class("kvref-no-such-policy")
    except ValueError:
        return
    raise AssertionError("vLLM's CachePolicyFactory resolved an unknown policy name without a module path")


def run_policy_cases(seed: int, cases: int) -> dict[str, int]:
    """``cases`` generated sequences (kinds in turn, every fourth one bulk); raises AssertionError
    naming the call and the first difference."""
    rng = random.Random(f"offload-policies-{seed}")
    check_factory()
    ops = bulk_cases = 0
    for i in range(cases):
        kind = KINDS[i % len(KINDS)]
        bulk = i % 4 == 3 and kind != "arc"
        n_keys = rng.randint(70, 90) if bulk else rng.randint(6, 14) if kind == "arc" else rng.randint(3, 10)
        keys = [make_offload_key(rng.randbytes(8), rng.randint(0, 2)) for _ in range(n_keys)]
        # ARC: a capacity under half the keys, so its ghost lists outgrow it and are trimmed
        capacity = n_keys if bulk else rng.randint(2, 4) if kind == "arc" else rng.randint(2, n_keys)
        pair = PolicyPair(kind, capacity, keys, rng)
        if bulk:
            bulk_cases += 1
            for key in keys:
                pair._insert(key, 0)
            pair.compare("bulk inserts")
        for _ in range(rng.randint(30, 80) if kind == "arc" else rng.randint(10, 40)):  # ARC adapts slowly
            what = pair.step(bulk=bulk and rng.random() < 0.5)
            pair.compare(what)
            ops += 1
    return {"cases": cases, "ops": ops, "bulk": bulk_cases}
