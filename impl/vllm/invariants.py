"""kvref's state invariants, read from *vLLM's own objects* (block pool, managers, scheduler).

The conformance checks compare what each implementation lets us observe (block ids, free-queue
order, hashes). A fault that only drifts vLLM's *internal* bookkeeping — a ref count one too high,
a free-queue back link pointing at the wrong block, a cached-block counter that survives a
``free`` — stays invisible to such a comparison until, many operations later, it changes an
observable (or never does inside a 40-op trace). So every vLLM adapter's ``check_invariants()``
calls the readers of this module after every operation: the reference's ``check_invariants`` rules
(docs/invariants.md: I1-I6, I9, M1, M2, M6, M8, and the scheduler-state rules Q1-Q4 listed there),
applied to vLLM's ``BlockPool``,
``FreeKVCacheBlockQueue``, single-type managers and ``Scheduler``.

Every reader is pure (it reads, never mutates) and raises :class:`VllmStateError` (an
``AssertionError``: the harnesses report it as a finding) naming the rule, the block or request
and the values. Nothing here depends on the call sequence, so the same reader serves the KV
manager adapter, the scheduler adapter, the block-pool driver and the offload engines.

Rules that hold only for some managers are keyed by vLLM's class *names*
(``FullAttentionManager``, ``SlidingWindowManager``, ``ChunkedLocalAttentionManager``): an
exact-type test, so a subclass with different table semantics (R-SWA's gap, HiSparse residency)
is left alone instead of being flagged.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any


class VllmStateError(AssertionError):
    """vLLM's own state breaks one of kvref's invariants (the message names rule, object, values)."""


def _fail(rule: str, msg: str) -> None:
    raise VllmStateError(f"vLLM state {rule}: {msg}")


#: managers whose tables never hold the null block (no skipped prefix, no state slots)
_NO_NULL_SLOTS = frozenset({"FullAttentionManager", "CrossAttentionManager", "SinkFullAttentionManager"})
#: managers whose null slots are exactly a prefix of the table (the window's skipped blocks; see
#: ``SingleTypeKVCacheManager._remove_blocks_in_range``: it walks back and stops at the first null)
_NULL_PREFIX = frozenset({"SlidingWindowManager", "ChunkedLocalAttentionManager"})


def check_free_queue(pool: Any) -> list[Any]:
    """The free queue is a well-formed doubly linked list (vLLM's ``FreeKVCacheBlockQueue``).

    Walked forward from the fake head *and* backward from the fake tail: every ``next`` has the
    matching ``prev``, both walks give the same blocks in opposite orders, the length equals
    ``num_free_blocks``, and a block outside the queue has no links (``popleft``/``remove`` clear
    them; a stale link is how a half-done ``remove`` shows). Returns the queued blocks, head first.
    """
    q = pool.free_block_queue
    head, tail = q.fake_free_list_head, q.fake_free_list_tail
    limit = len(pool.blocks) + 1
    fwd: list[Any] = []
    prev, cur = head, head.next_free_block
    while cur is not tail:
        if cur is None:
            _fail("I5", f"forward walk fell off the list after {len(fwd)} blocks (next is None "
                                f"before the fake tail)")
        if cur.prev_free_block is not prev:
            _fail("I5", f"block {cur.block_id}.prev_free_block is "
                                f"{getattr(cur.prev_free_block, 'block_id', None)}, but it follows "
                                f"{prev.block_id} (-1 = fake head) in the forward walk")
        fwd.append(cur)
        if len(fwd) > limit:
            _fail("I5", f"forward walk longer than the pool ({limit} blocks): a cycle")
        prev, cur = cur, cur.next_free_block
    if tail.prev_free_block is not prev:
        _fail("I5", f"fake tail's prev_free_block is {getattr(tail.prev_free_block, 'block_id', None)}, "
                            f"the forward walk ends at {prev.block_id}")
    bwd: list[Any] = []
    cur = tail.prev_free_block
    while cur is not head:
        if cur is None or len(bwd) > limit:
            _fail("I5", "backward walk from the fake tail does not reach the fake head")
        bwd.append(cur)
        cur = cur.prev_free_block
    if [b.block_id for b in bwd[::-1]] != [b.block_id for b in fwd]:
        _fail("I5", f"forward walk {[b.block_id for b in fwd]} != reversed backward walk "
                            f"{[b.block_id for b in bwd[::-1]]}")
    if q.num_free_blocks != len(fwd):
        _fail("I5", f"num_free_blocks={q.num_free_blocks} but the queue links {len(fwd)} blocks")
    ids = [b.block_id for b in fwd]
    if len(set(ids)) != len(ids):
        _fail("I5", f"a block is queued twice: {ids}")
    queued = set(map(id, fwd))
    for b in pool.blocks:
        if id(b) not in queued and (b.prev_free_block is not None or b.next_free_block is not None):
            _fail("I5", f"block {b.block_id} is not in the free queue but keeps links "
                                f"prev={getattr(b.prev_free_block, 'block_id', None)} "
                                f"next={getattr(b.next_free_block, 'block_id', None)}")
    return fwd


def check_block_pool(pool: Any, num_blocks: int | None = None) -> None:
    """I1-I6 on vLLM's ``BlockPool``: ids, the null block, the free queue, ref counts, the hash map.

    * I1: ``blocks[i].block_id == i`` (and ``num_blocks`` of them when given);
    * I2: block 0 is ``null_block``: never queued, never hashed, never in the hash map, ref count
      untouched (0: ``touch`` and ``free_blocks`` skip it; vLLM: "its ref_cnt is not maintained");
    * I3/I4: a non-null block is in the free queue iff its ``ref_cnt`` is 0, never negative;
    * I5: the queue is well linked and its length is ``num_free_blocks`` (:func:`check_free_queue`);
    * I6: every hashed block is in ``cached_block_hash_to_block`` under its hash, and every entry
      of the map is a block whose primary or secondary hash is that key (no dangling entries).
    """
    blocks = pool.blocks
    if num_blocks is not None and len(blocks) != num_blocks:
        _fail("I1", f"pool has {len(blocks)} blocks, expected {num_blocks}")
    for i, b in enumerate(blocks):
        if b.block_id != i:
            _fail("I1", f"blocks[{i}].block_id is {b.block_id}")
    null = pool.null_block
    if null is not blocks[0] or not null.is_null:
        _fail("I2", "block 0 is not the pool's null block")
    if any(b.is_null for b in blocks[1:]):
        _fail("I2", f"blocks {[b.block_id for b in blocks[1:] if b.is_null]} are marked null besides block 0")
    if null.block_hash is not None:
        _fail("I2", "the null block has a block hash (it was cached)")
    if null.ref_cnt != 0:
        _fail("I2", f"the null block's ref_cnt is {null.ref_cnt} (touched or freed like a real block)")
    queue = check_free_queue(pool)
    in_queue = set(map(id, queue))
    if id(null) in in_queue:
        _fail("I2", "the null block is in the free queue (it would be handed out)")
    for b in blocks[1:]:
        if b.ref_cnt < 0:
            _fail("I4", f"block {b.block_id} ref_cnt={b.ref_cnt} < 0")
        if (id(b) in in_queue) != (b.ref_cnt == 0):
            _fail("I3", f"block {b.block_id} ref_cnt={b.ref_cnt} but in_free_queue={id(b) in in_queue}")
    cache = pool.cached_block_hash_to_block
    secondary = getattr(pool, "cached_block_hashes_by_block", {})
    mapped = 0
    for key, entry in cache._cache.items():
        group = entry.values() if isinstance(entry, dict) else (entry,)
        for b in group:
            mapped += 1
            if b.is_null:
                _fail("I6", "the null block is in the prefix-cache hash map")
            if b.block_hash != key and key not in secondary.get(b.block_id, ()):
                _fail("I6", f"the hash map holds block {b.block_id} under a key that is neither its primary "
                            "nor a secondary hash (a stale entry: an evicted block can still be hit)")
    hashed = [b for b in blocks if b.block_hash is not None]
    for b in hashed:
        if not cache.contain(b.block_hash, b.block_id):
            _fail("I6", f"block {b.block_id} has a hash but is not in the hash map under it")
    num_secondary = sum(len(s) for s in secondary.values())
    if mapped != len(hashed) + num_secondary:
        _fail("I6", f"hash map holds {mapped} entries, blocks carry {len(hashed)} primary + {num_secondary} "
                    "secondary hashes")


def check_managers(coordinator: Any, pool: Any, *, exact_ref_counts: bool = True,
                   requests: dict[str, Any] | None = None) -> None:
    """I9, M1, M2, M6 and M8 across every single-type manager of a vLLM ``KVCacheCoordinator``.

    * I9: a non-null block's ``ref_cnt`` equals the number of table slots holding it, summed over
      all groups and requests (``exact_ref_counts=False``: at least that many, for callers that pin
      blocks outside tables, e.g. the SimpleCPU offload scheduler touching blocks it is storing);
    * M8: a real block is in one group's tables at a time and once per table; every group knows
      the same requests (``allocate_new_blocks`` creates the entry in every group, ``free`` pops
      them all);
    * M2: ``num_cached_block`` only for requests with a table, at most its length (a counted block
      need *not* still be hashed: a connector's ``evict_blocks`` drops the hashes of blocks in use);
    * M6: null slots only where the attention type puts them: none in a full-attention table, a
      prefix of a sliding-window / chunked-local one (the skipped blocks);
    * M1 (with ``requests``, request id -> object with ``num_computed_tokens``): a held request's
      tables span its computed tokens in every attention group (the KV of a computed token has a
      slot: an under-allocation, e.g. of external tokens, shows here before any kernel reads it).
    """
    managers = list(coordinator.single_type_managers)
    holders: dict[int, int] = {}
    owner: dict[int, int] = {}  # block id -> the group whose tables hold it
    keys = None
    for g, mgr in enumerate(managers):
        name = type(mgr).__name__
        tables = mgr.req_to_blocks
        live = {rid for rid, t in tables.items() if t}
        if keys is None:
            keys = (g, live)
        elif live != keys[1] and name != "MambaManager" and type(managers[keys[0]]).__name__ != "MambaManager":
            _fail("M8", f"group {g} holds tables for {sorted(live)}, group {keys[0]} for {sorted(keys[1])}")
        for rid, table in tables.items():
            seen: set[int] = set()
            for pos, b in enumerate(table):
                if b.is_null:
                    continue
                if b.block_id in seen:
                    _fail("M8", f"request {rid!r} group {g}: block {b.block_id} appears twice in its table")
                seen.add(b.block_id)
                other = owner.setdefault(b.block_id, g)
                if other != g:
                    _fail("M8", f"block {b.block_id} is in group {other}'s and group {g}'s tables (request "
                                f"{rid!r}): one block's memory would hold two groups' KV")
                holders[b.block_id] = holders.get(b.block_id, 0) + 1
            nulls = [b.is_null for b in table]
            if name in _NO_NULL_SLOTS and any(nulls):
                _fail("M6", f"request {rid!r} group {g} ({name}): null slots at "
                            f"{[i for i, n in enumerate(nulls) if n]} in a full-attention table")
            if name in _NULL_PREFIX and any(nulls):
                k = nulls.index(False) if False in nulls else len(nulls)
                if any(nulls[k:]):
                    _fail("M6", f"request {rid!r} group {g} ({name}): null slots "
                                f"{[i for i, n in enumerate(nulls) if n]} are not a prefix of the table "
                                f"(a skipped block was kept while a later one was freed)")
        for rid, n in mgr.num_cached_block.items():
            table = tables.get(rid)
            if table is None:
                _fail("M2", f"group {g}: num_cached_block[{rid!r}]={n} but the request holds no table "
                            "(kept after free: its next blocks would be taken as already cached)")
            if n > len(table):
                _fail("M2", f"group {g}: num_cached_block[{rid!r}]={n} > table length {len(table)}")
        # a cross-attention table holds the encoder's tokens, allocated at admission, not the
        # decoder's computed tokens: M1's span rule is the decoder groups' (encoder-decoder pools, #22)
        if requests is not None and name in (_NO_NULL_SLOTS | _NULL_PREFIX) - {"CrossAttentionManager"}:
            bs = mgr.block_size
            for rid, table in tables.items():
                r = requests.get(rid)
                if r is None or not table:
                    continue
                if len(table) * bs < r.num_computed_tokens:
                    _fail("M1", f"request {rid!r} group {g}: {len(table)} slots of {bs} tokens do not span its "
                                f"{r.num_computed_tokens} computed tokens")
    for b in pool.blocks[1:]:
        n = holders.get(b.block_id, 0)
        if (b.ref_cnt != n) if exact_ref_counts else (b.ref_cnt < n):
            _fail("I9", f"block {b.block_id} ref_cnt={b.ref_cnt} but {n} table slots hold it")


def check_kv_cache_manager(mgr: Any, *, num_blocks: int | None = None, exact_ref_counts: bool = True,
                           requests: dict[str, Any] | None = None) -> None:
    """:func:`check_block_pool` + :func:`check_managers` on a vLLM ``KVCacheManager``."""
    pool = mgr.block_pool
    check_block_pool(pool, num_blocks)
    check_managers(mgr.coordinator, pool, exact_ref_counts=exact_ref_counts, requests=requests)


def _queue(q: Any) -> list[Any]:
    return list(q) if q is not None else []


def check_scheduler(sched: Any, *, max_num_seqs: int | None = None, kv: bool = True) -> None:
    """Q1-Q4 on a vLLM ``Scheduler`` (and, with ``kv``, its KV cache manager's state).

    * Q1: ``running`` and the waiting queues hold each request once, are disjoint, and only
      requests of ``requests``; at most ``max_num_seqs`` run;
    * Q2: statuses match the queue: running requests are RUNNING; waiting ones WAITING, PREEMPTED
      or WAITING_FOR_REMOTE_KVS (the connector's in-flight loads), WAITING_FOR_STREAMING_REQ or
      WAITING_FOR_STRUCTURED_OUTPUT_GRAMMAR;
    * Q3: a request waiting without KV (not in ``kv_holding_waiting``, not loading) holds no
      blocks, and a preempted one has ``num_computed_tokens == 0`` (``_preempt_request`` resets
      it: its KV is gone, so it must recompute from the start);
    * Q4: every running request holds tables spanning its computed tokens; every table belongs to
      a live request (a finished or preempted request's blocks were returned).
    """
    from vllm.v1.request import RequestStatus as VS

    reqs = sched.requests
    running = list(sched.running)
    holding = _queue(getattr(sched, "kv_holding_waiting", None))
    waiting = _queue(sched.waiting) + holding
    for name, q in (("running", running), ("waiting", waiting)):
        ids = [r.request_id for r in q]
        if len(set(ids)) != len(ids):
            _fail("Q1", f"{name} holds a request twice: {ids}")
        for r in q:
            if reqs.get(r.request_id) is not r:
                _fail("Q1", f"{r.request_id!r} is in {name} but not in scheduler.requests")
    both = {r.request_id for r in running} & {r.request_id for r in waiting}
    if both:
        _fail("Q1", f"requests both running and waiting: {sorted(both)}")
    if max_num_seqs is not None and len(running) > max_num_seqs:
        _fail("Q1", f"{len(running)} running requests > max_num_seqs={max_num_seqs}")
    for r in running:
        if r.status != VS.RUNNING:
            _fail("Q2", f"{r.request_id!r} is in running with status {r.status.name}")
    waiting_ok = {VS.WAITING, VS.PREEMPTED, VS.WAITING_FOR_REMOTE_KVS}
    for extra in ("WAITING_FOR_FSM", "WAITING_FOR_STREAMING_REQ", "WAITING_FOR_STRUCTURED_OUTPUT_GRAMMAR"):
        if hasattr(VS, extra):
            waiting_ok.add(getattr(VS, extra))
    for r in waiting:
        if r.status not in waiting_ok:
            _fail("Q2", f"{r.request_id!r} is waiting with status {r.status.name}")
    if not kv:
        return
    mgr = sched.kv_cache_manager
    # blocks in a connector's deferred_frees keep a reference no table slot accounts for
    check_kv_cache_manager(mgr, requests={r.request_id: r for r in running},
                           exact_ref_counts=not getattr(sched, "deferred_frees", None))
    managers = mgr.coordinator.single_type_managers
    holders = {rid for m in managers for rid, t in m.req_to_blocks.items() if t}
    holding_ids = {r.request_id for r in holding}
    for r in waiting:
        if r.request_id in holding_ids or r.status == VS.WAITING_FOR_REMOTE_KVS:
            continue
        if r.request_id in holders:
            _fail("Q3", f"{r.request_id!r} waits ({r.status.name}) but still holds blocks")
        if r.status == VS.PREEMPTED and r.num_computed_tokens != 0:
            _fail("Q3", f"preempted {r.request_id!r} keeps num_computed_tokens={r.num_computed_tokens} "
                        "though its blocks were freed")
    live = {r.request_id for r in running} | {r.request_id for r in waiting}
    if getattr(sched, "connector", None) is not None:
        # a KV connector may keep a finished request's blocks (async send, aborted load) until the
        # worker reports the transfer done; vLLM keeps such a request in ``requests`` till then
        live |= {rid for rid, r in reqs.items() if r.is_finished()}
    stray = holders - live
    if stray:
        _fail("Q4", f"blocks held by requests neither running nor waiting: {sorted(stray)}")
    for r in running:
        if r.num_computed_tokens > 0 and r.request_id not in holders:
            _fail("Q4", f"running {r.request_id!r} has {r.num_computed_tokens} computed tokens but no blocks")


def live_requests(objs: Iterable[Any]) -> dict[str, Any]:
    """``{request_id: request}`` of the given request objects (helper for adapters' ``requests=``)."""
    return {r.request_id: r for r in objs}
