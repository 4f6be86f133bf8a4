"""The explorer plugged into the reference: every interleaving of arrivals, scheduler steps,
step completions and aborts, at a small scope.

The system under exploration is the *real* reference stack — :class:`Scheduler` →
:class:`KVCacheManager` → coordinator → single-type managers → :class:`BlockPool` — not a
re-implementation. A state is the live object graph ``(scheduler, steps in flight, arrivals,
shadow block contents)``; ``step`` copies it with one ``pickle`` round trip (the C pickler copies
the ~100-object graph far faster than ``copy.deepcopy``, and measured as fast as a generic
structural copier written in Python) and calls the reference on the copy. What never changes is
not copied: frozen configs, specs and enum members are pickled as references, the frozen steps in
flight and the (immutable) shadow slot tuples are shared. A state's last action steps the state
itself (:meth:`KVSystem.step_consuming`): the engine drops it afterwards.

Actions (all enabled ones, in every order):

* ``arrive i`` — request ``i`` of the workload is added (arrivals in any order);
* ``schedule`` — one ``Scheduler.schedule()``; the step goes in flight (at most
  ``max_concurrent_batches``: 2 with async scheduling). A step that schedules nothing is a no-op;
* ``complete`` — the oldest in-flight step returns (``update_from_output``; a deterministic model
  samples token ``50 + position``): completions are FIFO as in vLLM's batch queue;
* ``abort i`` (if the scope allows) — ``finish_requests`` on a live request.

Checks in every state: ``Scheduler.check_invariants()`` (which runs the KV cache manager's,
the coordinator's, every manager's and the pool's, and I9 ref counts = table slots), plus two
oracles of our own:

* **window** — every block a scheduled step reads must be in the table: for sliding-window
  groups the positions ``[processed - sliding_window + 1, computed)`` (processed = computed −
  in flight), for chunked-local ones ``[processed // chunk * chunk, computed)``, for full
  attention all computed positions; a null there means a block was freed while still read;
* **content** — a shadow copy of what each block holds: every scheduled position writes, into the
  block it maps to, the identity of its K/V — the whole prefix up to it and the cache salt (K/V at
  a position depend on every earlier token). A prefix-cache hit must bring blocks whose shadow
  content is the request's own (a wrong hit — stale hash, unchained hash, ignored salt, wrong
  duplicate — shows here), and must leave the last token to compute. Without chunked prefill
  an admitted request must get all its remaining tokens (the waiting loop stops otherwise).

and that no per-request state (the block hasher's entries) outlives its request.

Deadlocks (no action changes the state while requests are unfinished — the head-of-line hang of
vLLM #39734 / #35541) and, optionally, livelocks are reported by the engine.

The state key covers the scheduler queues and every live request's progress, the free queue in
order, the prefix-cache index (keys with their blocks in insertion order: the first duplicate is
the one a lookup returns), every manager's tables and cached-block counts, the steps in flight and
the shadow contents of the blocks that are in use or cached. Free, uncached blocks' contents are
left out: nothing can read them before they are rewritten (the content oracle would flag it).
Symmetry reduction (``Scope.symmetry``): requests with the same prompt, ``max_tokens`` and salt
are interchangeable, so the key is the least one over renamings of their ids (see
:meth:`KVSystem._symmetries` for why that is sound).
"""

from __future__ import annotations

import pickle
from dataclasses import dataclass, field, replace
from operator import attrgetter
from typing import Any, Hashable

from kvref.spec.errors import InvalidFieldError, check_int

#: token the fake model samples at position p (deterministic, so the state space is finite)
def sampled_token(position: int) -> int:
    return 50 + position


#: the largest pool a scope may have (blocks incl. the null block): states are copied by pickling,
#: and a pool of a few hundred linked free-queue blocks overflows the pickler's recursion
MAX_SCOPE_BLOCKS = 128
#: the longest max_model_len a scope may have (its prompts are spelt out token by token anyway)
MAX_SCOPE_TOKENS = 1024


@dataclass(frozen=True)
class Scope:
    """What is explored.

    Args:
        name: a label for reports.
        prompts: one prompt per request (``len(prompt) + max_tokens <= max_model_len``).
        max_tokens: output tokens per request.
        block_size: tokens per block (all groups).
        sliding_window: window of the SWA group of a hybrid FA+SWA pair; None = full attention only.
        full_attention: include the full-attention group (False = SWA only).
        max_model_len: tokens per request at most.
        max_num_batched_tokens: the step's token budget.
        async_scheduling: two steps in flight.
        num_blocks: pool size incl. the null block; None = what startup sizing gives (one
            request of max_model_len, per-group caps, plus the null block).
        enable_caching: prefix caching.
        aborts: explore aborting each live request at every point.
        scheduler_reserve_full_isl: the full-sequence admission gate.
        salts: cache salt per request (None: no salts).
        symmetry: merge states that differ only by a renaming of identical requests.
        attention_chunk_size: adds a chunked-local attention group with this chunk.
        enable_chunked_prefill: False: a prompt that does not fit the step's remaining budget
            waits whole (vLLM then needs ``max_num_batched_tokens >= max_model_len``).
    """

    name: str = "default"
    prompts: tuple[tuple[int, ...], ...] = ((1, 2, 3, 4, 5, 6), (1, 2, 3, 4, 5, 6), (1, 2, 3, 4, 9))
    max_tokens: tuple[int, ...] = (2, 1, 2)
    block_size: int = 4
    sliding_window: int | None = 4
    full_attention: bool = True
    max_model_len: int = 12
    max_num_batched_tokens: int = 4
    async_scheduling: bool = True
    num_blocks: int | None = None
    enable_caching: bool = True
    aborts: bool = False
    scheduler_reserve_full_isl: bool = True
    salts: tuple[str | None, ...] | None = None
    symmetry: bool = True
    attention_chunk_size: int | None = None
    enable_chunked_prefill: bool = True

    def __post_init__(self) -> None:
        for name in ("prompts", "max_tokens"):
            value = getattr(self, name)
            if not isinstance(value, tuple) or not all(
                    isinstance(v, tuple) and all(type(t) is int for t in v) if name == "prompts" else type(v) is int
                    for v in value):
                raise InvalidFieldError(name, value, "a tuple of token tuples" if name == "prompts"
                                        else "a tuple of ints, one per prompt")
        if len(self.prompts) != len(self.max_tokens) or not self.prompts:
            raise InvalidFieldError("max_tokens", self.max_tokens, f"{len(self.prompts)} values, one per prompt")
        for p, m in zip(self.prompts, self.max_tokens):
            check_int("max_tokens[i]", m, minimum=1)
            if not p or len(p) + m > self.max_model_len:
                raise InvalidFieldError("prompts[i]", p, f"1..{self.max_model_len - m} tokens "
                                        f"(prompt + max_tokens <= max_model_len={self.max_model_len})")
        check_int("block_size", self.block_size, minimum=1)
        check_int("sliding_window", self.sliding_window, minimum=1, allow_none=True)
        check_int("max_model_len", self.max_model_len, minimum=2)
        check_int("max_num_batched_tokens", self.max_num_batched_tokens, minimum=1)
        check_int("num_blocks", self.num_blocks, minimum=2, allow_none=True)
        if self.max_model_len > MAX_SCOPE_TOKENS:
            raise InvalidFieldError("max_model_len", self.max_model_len, f"an int in [2, {MAX_SCOPE_TOKENS}] (explorer "
                                    "scopes are small by design)")
        blocks = self.num_blocks if self.num_blocks is not None else self.startup_num_blocks()
        if blocks > MAX_SCOPE_BLOCKS:
            raise InvalidFieldError("num_blocks", blocks, f"at most {MAX_SCOPE_BLOCKS} blocks (explorer scopes are "
                                    "small by design: every state holds a copy of the pool)")
        if self.salts is not None and (not isinstance(self.salts, tuple) or len(self.salts) != len(self.prompts)
                                       or not all(s is None or isinstance(s, str) for s in self.salts)):
            raise InvalidFieldError("salts", self.salts, f"None or {len(self.prompts)} values")
        if not self.full_attention and self.sliding_window is None:
            raise InvalidFieldError("full_attention", False, "True when sliding_window is None")
        if not self.enable_chunked_prefill and self.max_num_batched_tokens < self.max_model_len:
            # vLLM's config check: without chunking a prompt of max_model_len could never run
            raise InvalidFieldError("max_num_batched_tokens", self.max_num_batched_tokens,
                                    f">= max_model_len={self.max_model_len} when enable_chunked_prefill is False")

    @property
    def max_in_flight_tokens(self) -> int:
        return (2 if self.async_scheduling else 1) * self.max_num_batched_tokens

    def groups(self):
        from kvref.spec.kv_cache_interface import (
            ChunkedLocalAttentionSpec,
            FullAttentionSpec,
            KVCacheGroupSpec,
            SlidingWindowSpec,
        )

        common = dict(block_size=self.block_size, num_kv_heads=1, head_size=1, dtype="float32")
        groups = []
        if self.full_attention:
            groups.append(KVCacheGroupSpec(("full",), FullAttentionSpec(**common)))
        if self.sliding_window is not None:
            groups.append(KVCacheGroupSpec(("swa",), SlidingWindowSpec(sliding_window=self.sliding_window, **common)))
        if self.attention_chunk_size is not None:
            groups.append(KVCacheGroupSpec(("local",), ChunkedLocalAttentionSpec(
                attention_chunk_size=self.attention_chunk_size, **common)))
        return tuple(groups)

    def startup_num_blocks(self) -> int:
        """Blocks startup sizing gives for one request of ``max_model_len`` (+ the null block): the
        liveness oracle's one reading of startup's per-request bound (``max_memory_usage_blocks``
        through :func:`~kvref.impl.scheduler_types.engine_config_for`), not a formula of its own."""
        from kvref.impl.interface import PoolConfig
        from kvref.impl.reference.scheduler_liveness import max_blocks_per_request

        probe = PoolConfig.off_plan("a one-block probe that only asks the per-request bound",
                                    **self._plan_fields(num_blocks=1))
        return 1 + max_blocks_per_request(probe, self.scheduler_config())

    def _plan_fields(self, num_blocks: int) -> dict:
        return dict(num_blocks=num_blocks, groups=self.groups(), max_model_len=self.max_model_len,
                    scheduler_block_size=self.block_size, hash_block_size=self.block_size,
                    max_in_flight_tokens=self.max_in_flight_tokens, enable_caching=self.enable_caching)

    def pool_config(self):
        """The scope's pool: the plan's where startup builds exactly this pool for the scope's
        engine arguments (the default scopes: the pool startup sizing gives), else off-plan with
        why (a hand-set block count below one request, as ``undersized``)."""
        from kvref.impl.interface import PoolConfig
        from kvref.impl.scheduler_types import engine_config_for

        fields = self._plan_fields(self.num_blocks or self.startup_num_blocks())
        engine = engine_config_for(self.scheduler_config(), **{k: v for k, v in fields.items()
                                                              if k != "max_in_flight_tokens"})
        return PoolConfig.through_plan(fields, engine, "an explorer scope: tiny hand-sized pools keep "
                                                       "exhaustive search finite")

    def scheduler_config(self):
        from kvref.impl.scheduler_types import SchedulerConfig

        return SchedulerConfig(max_num_batched_tokens=self.max_num_batched_tokens, max_num_seqs=8,
                               async_scheduling=self.async_scheduling,
                               enable_chunked_prefill=self.enable_chunked_prefill,
                               scheduler_reserve_full_isl=self.scheduler_reserve_full_isl)


#: named scopes for ``kvref explore --scope NAME``
SCOPES: dict[str, Scope] = {
    # the default: 3 requests of <= 12 tokens (two identical prompts: prefix sharing), a hybrid
    # FA+SWA pair (block size 4, window 4), async scheduling (2 steps in flight), the pool startup
    # sizing gives: 3 FA + 4 SWA + the null block = 8 blocks
    "default": Scope(),
    # a pool exactly as large as startup sizing says, a request near max_model_len (liveness of
    # admission, vLLM #39734): 4 FA + 3 SWA + null = 8 blocks
    "tight": Scope(name="tight", prompts=((1, 2, 3, 4, 5, 6, 7),), max_tokens=(1,), block_size=2,
                   sliding_window=2, max_model_len=8, async_scheduling=False, max_num_batched_tokens=2),
    # two requests, block size 2, quick (CI / mutant campaign)
    "small": Scope(name="small", prompts=((1, 2, 3, 4, 5), (1, 2, 3, 4, 7)), max_tokens=(2, 2), block_size=2,
                   sliding_window=2, max_model_len=8, max_num_batched_tokens=2),
    # sliding window only (hits are found right to left)
    "swa": Scope(name="swa", prompts=((1, 2, 3, 4, 5), (9, 2, 3, 4, 5)), max_tokens=(1, 2), full_attention=False,
                 block_size=2, sliding_window=3, max_model_len=8, max_num_batched_tokens=2, num_blocks=6),
    # full attention only, with aborts at every point
    # (r1's whole prompt is in r0's full blocks; r2 differs from r0 only by its cache salt)
    "full": Scope(name="full", prompts=((1, 2, 3, 4, 5), (1, 2, 3, 4), (1, 2, 3, 4, 5)), max_tokens=(2, 1, 1),
                  block_size=2, sliding_window=None, max_model_len=8, max_num_batched_tokens=2, aborts=True,
                  salts=(None, None, "s")),
    # a pool smaller than startup sizing would accept: the explorer finds the head-of-line hang
    "undersized": Scope(name="undersized", prompts=((1, 2, 3, 4, 5, 6, 7),), max_tokens=(1,), block_size=2,
                        sliding_window=2, max_model_len=8, async_scheduling=False, max_num_batched_tokens=2,
                        num_blocks=7),
    # full attention + chunked-local attention (chunk 4): chunk-boundary frees
    "chunked": Scope(name="chunked", prompts=((1, 2, 3, 4, 5, 6), (1, 2, 3, 4, 5, 7)), max_tokens=(1, 1),
                     block_size=2, sliding_window=None, attention_chunk_size=4, max_model_len=8,
                     max_num_batched_tokens=2),
    # chunked prefill off: r1's prompt does not fit the budget beside r0's, so it must wait whole
    # (the waiting loop stops); the explorer's admission check sees a prompt cut to the remaining
    # budget. 9 blocks: room for both requests, so the budget (not the pool) is what stops r1
    "whole-prompts": Scope(name="whole-prompts", prompts=((1, 2, 3, 4, 5), (1, 2, 6, 7, 8), (9, 9)),
                           max_tokens=(1, 2, 1), block_size=2, sliding_window=None, max_model_len=8,
                           max_num_batched_tokens=8, enable_chunked_prefill=False, num_blocks=9),
    # three identical requests: what symmetry reduction is for
    "twins": Scope(name="twins", prompts=((1, 2, 3, 4, 5),) * 3, max_tokens=(1, 1, 1), block_size=2,
                   sliding_window=2, max_model_len=8, max_num_batched_tokens=2),
    # the larger one (nightly): four requests
    "large": Scope(name="large", prompts=((1, 2, 3, 4, 5, 6), (1, 2, 3, 4, 5, 6), (1, 2, 3, 4, 9), (7, 7, 3)),
                   max_tokens=(2, 1, 2, 2)),
}


def campaign_scopes() -> list[Scope]:
    """The scopes the mutant campaign explores (small ones, together a few seconds)."""
    return [SCOPES["tight"], SCOPES["small"], SCOPES["swa"], SCOPES["full"], SCOPES["chunked"],
            SCOPES["whole-prompts"]]


def reference_available() -> bool:
    try:
        import kvref.impl.reference.kv_cache_manager  # noqa: F401
        import kvref.impl.reference.scheduler  # noqa: F401
    except ImportError:
        return False
    return True


# ------------------------------------------------------------------------------ copying

#: objects that never change once built (configs, specs, enum members), pickled as a reference:
#: copies share them instead of rebuilding them on every unpickle (and enum members are not
#: looked up by value again). Keyed by id(); the strong reference keeps the id from being reused.
_SHARED: dict[int, Any] = {}
_DISPATCH: dict | None = None


def _shared(key: int) -> Any:
    return _SHARED[key]


def _share(obj: Any) -> tuple:
    _SHARED[id(obj)] = obj
    return (_shared, (id(obj),))


def _dispatch_table() -> dict:
    global _DISPATCH
    if _DISPATCH is None:
        import copyreg

        from kvref.impl.interface import PoolConfig
        from kvref.impl.reference.kv_cache_coordinator import SpecGroup
        from kvref.impl.scheduler_types import SchedulerConfig
        from kvref.impl.request import RequestStatus
        from kvref.spec import kv_cache_interface as kci

        table = dict(copyreg.dispatch_table)
        frozen = [PoolConfig, SchedulerConfig, SpecGroup, RequestStatus]  # SpecGroup: set up once, read only
        frozen += [t for t in vars(kci).values() if isinstance(t, type) and t.__module__ == kci.__name__
                   and getattr(getattr(t, "__dataclass_params__", None), "frozen", False)]
        for t in frozen:
            table[t] = _share
        _DISPATCH = table
    return _DISPATCH


def _dumps(obj: Any) -> bytes:
    import io

    f = io.BytesIO()
    p = pickle.Pickler(f, protocol=pickle.HIGHEST_PROTOCOL)
    p.dispatch_table = _dispatch_table()
    p.dump(obj)
    return f.getvalue()


# ------------------------------------------------------------------------------ the system

#: per-request progress in the state key (with ``len(output_token_ids)``); one C call per request
_REQUEST_KEY_FIELDS = attrgetter("status", "num_computed_tokens", "num_in_flight_tokens", "num_output_placeholders",
                                 "num_stale_output_tokens", "drop_stale_output", "num_preemptions",
                                 "is_prefill_chunk")


@dataclass
class KVState:
    scheduler: Any
    in_flight: list = field(default_factory=list)  # SchedulerOutputs not yet completed (FIFO)
    arrived: tuple[bool, ...] = ()
    #: (group, block id) -> per slot, the K/V identity written there (its number in
    #: KVSystem._kv_values) or None; the slot tuples are immutable, so copies share them
    content: dict = field(default_factory=dict)
    _blob: bytes | None = field(default=None, repr=False, compare=False)  # pickled copy (cache)


class KVSystem:
    """A :class:`~kvref.models.explorer.engine.TransitionSystem` over the reference scheduler stack."""

    def __init__(self, scope: Scope) -> None:
        self.scope = scope
        self.ids = [f"r{i}" for i in range(len(scope.prompts))]
        self.max_batches = 2 if scope.async_scheduling else 1
        self.perms = self._symmetries() if scope.symmetry else []
        self._pos = {rid: i for i, rid in enumerate(self.ids)}
        # shadow contents hold K/V identities (salt, prefix) as small ints: one number per
        # distinct identity, so state keys stay short and cheap to hash (BENCHMARKS.md: state keys)
        # The numbering is fixed up front from the workload (every prefix of every request's
        # deterministic token sequence), not assigned in discovery order: keys must not depend on
        # which process (explorer_search) or which order met an identity first. An identity
        # outside the table (only a faulty scheduler could write one) stands for itself.
        self._kv_ids: dict[tuple, int] = {}
        self._kv_values: list[tuple] = []
        for i, prompt in enumerate(scope.prompts):
            salt = scope.salts[i] if scope.salts else None
            tokens = list(prompt) + [sampled_token(len(prompt) + k) for k in range(scope.max_tokens[i])]
            for p in range(len(tokens)):
                identity = (salt, tuple(tokens[:p + 1]))
                if identity not in self._kv_ids:
                    self._kv_ids[identity] = len(self._kv_values)
                    self._kv_values.append(identity)

    def _kv_id(self, identity: tuple) -> int | tuple:
        return self._kv_ids.get(identity, identity)

    def _kv_value(self, kv_id: int | tuple) -> tuple:
        return self._kv_values[kv_id] if isinstance(kv_id, int) else kv_id

    def _symmetries(self) -> list[dict[str, str]]:
        """Renamings among requests that are indistinguishable (same prompt, max_tokens, salt).

        Sound because nothing in the reference depends on a request id's value: ids are dict keys
        and labels, queues are ordered by arrival (FCFS), and ``arrival_time`` is only read by the
        PRIORITY policy, which these scopes do not use. Arrival flags are renamed with the ids.
        """
        from itertools import permutations, product

        salts = self.scope.salts or (None,) * len(self.ids)
        classes: dict[tuple, list[str]] = {}
        for i, rid in enumerate(self.ids):
            classes.setdefault((self.scope.prompts[i], self.scope.max_tokens[i], salts[i]), []).append(rid)
        groups = [g for g in classes.values() if len(g) > 1]
        if not groups:
            return []
        out = []
        for choice in product(*(permutations(g) for g in groups)):
            ren = {rid: rid for rid in self.ids}
            for g, perm in zip(groups, choice):
                ren.update(zip(g, perm))
            out.append(ren)
        return out

    # --- engine protocol -----------------------------------------------------------------------

    def initial_states(self) -> list[KVState]:
        from kvref.impl.reference.scheduler import Scheduler

        from kvref.impl.reference.adapter import ReferenceKVCacheManager

        pool = self.scope.pool_config()
        sched = Scheduler(pool, self.scope.scheduler_config(), ReferenceKVCacheManager(pool))
        return [KVState(sched, [], (False,) * len(self.ids), {})]

    def actions(self, s: KVState) -> list[Hashable]:
        acts: list[Hashable] = [("arrive", self.ids[i]) for i, a in enumerate(s.arrived) if not a]
        sched = s.scheduler
        if len(s.in_flight) < self.max_batches and sched.has_unfinished_requests():
            acts.append(("schedule",))
        if s.in_flight:
            acts.append(("complete",))
        if self.scope.aborts:
            acts.extend(("abort", rid) for rid in self.ids if rid in sched.requests)
        return acts

    def step(self, s: KVState, action: Hashable) -> KVState:
        return self._step(s, self._copy(s), action)

    def step_consuming(self, s: KVState, action: Hashable) -> KVState:
        """Like :meth:`step`, but may reuse ``s`` (the engine's last action on a state it drops).

        Saves the copy: the engine expands a state by all its actions, and after the last one the
        state is never read again (counterexample traces are replayed from the initial state).
        """
        s._blob = None  # the cached copy no longer describes s once it is stepped in place
        return self._step(s, s, action)

    def _step(self, s: KVState, t: KVState, action: Hashable) -> KVState:
        from kvref.impl.request import Request
        from kvref.impl.scheduler_types import ModelOutput

        sched = t.scheduler
        kind = action[0]  # type: ignore[index]
        if kind == "arrive":
            i = self.ids.index(action[1])  # type: ignore[index]
            salt = self.scope.salts[i] if self.scope.salts else None
            sched.add_request(Request(self.ids[i], list(self.scope.prompts[i]), max_tokens=self.scope.max_tokens[i],
                                      arrival_time=float(i), cache_salt=salt))
            t.arrived = t.arrived[:i] + (True,) + t.arrived[i + 1:]
        elif kind == "schedule":
            out = sched.schedule()
            if out.scheduled:
                self._write_and_check_hits(t, out)
                t.in_flight.append(out)
            else:
                # nothing scheduled: no step goes in flight. The call may still have changed the
                # state (it can preempt a running request to make room and then find no room for
                # anything), so the successor is the stepped copy, not ``s``: returning ``s`` here
                # dropped such preemptions whenever the step ran on a copy, while the in-place
                # last action kept them. An unchanged state has the same key and merges with ``s``.
                sched._in_flight.pop(id(out), None)
        elif kind == "complete":
            out = t.in_flight.pop(0)
            sampled = {}
            for sr in out.scheduled:
                r = sched.requests.get(sr.request_id)
                if r is not None and not sr.is_prefill_chunk:
                    pos = sr.num_computed_tokens + sr.num_scheduled_tokens
                    sampled[sr.request_id] = [sampled_token(pos)]
            sched.update_from_output(out, ModelOutput(sampled))
        elif kind == "abort":
            sched.finish_requests(action[1])  # type: ignore[index]
        else:  # pragma: no cover - actions() only yields the kinds above
            raise InvalidFieldError("action", action, "arrive / schedule / complete / abort")
        self._drop_free_content(t)
        return t

    def key(self, s: KVState) -> Hashable:
        if not self.perms:
            return self._key(s, None)
        # symmetry reduction: the least key over renamings of identical requests. The parts that
        # do not mention request ids are computed once; only the id-bearing parts are renamed.
        common = self._common_key(s)
        return min((self._key(s, ren, common) for ren in self.perms), key=repr)

    def _common_key(self, s: KVState) -> tuple:
        """The key's parts that name no request: free queue, prefix-cache index, shadow contents."""
        pool = s.scheduler.kv_cache_manager.manager.block_pool
        index = sorted([(k, (v.block_id,) if not isinstance(v, dict) else tuple(v))
                        for k, v in pool.cached_block_hash_to_block._cache.items()])
        content = sorted(s.content.items())
        return pool.free_block_ids(), tuple(index), tuple(content)

    def _key(self, s: KVState, ren: dict[str, str] | None, common: tuple | None = None) -> Hashable:
        sched = s.scheduler
        kv = sched.kv_cache_manager.manager
        free, index, content = self._common_key(s) if common is None else common
        fields = _REQUEST_KEY_FIELDS
        if ren is None:
            arrived = s.arrived
            reqs = [(rid, len(r.output_token_ids), *fields(r)) for rid, r in sched.requests.items()]
            waiting = tuple([r.request_id for r in sched.waiting])
            running = tuple([r.request_id for r in sched.running])
            managers = tuple(
                (tuple(sorted([(rid, tuple([b.block_id for b in tbl])) for rid, tbl in m.req_to_blocks.items()])),
                 tuple(sorted(m.num_cached_block.items())))
                for m in kv.coordinator.single_type_managers)
            flight = tuple(tuple([(x.request_id, x.num_scheduled_tokens, x.num_computed_tokens, x.is_prefill_chunk)
                                  for x in out.scheduled]) for out in s.in_flight)
        else:
            n = ren.__getitem__
            pos = self._pos
            arrived = tuple(s.arrived[pos[old]] for old in sorted(ren, key=lambda o: pos[ren[o]]))
            reqs = [(n(rid), len(r.output_token_ids), *fields(r)) for rid, r in sched.requests.items()]
            waiting = tuple([n(r.request_id) for r in sched.waiting])
            running = tuple([n(r.request_id) for r in sched.running])
            managers = tuple(
                (tuple(sorted([(n(rid), tuple([b.block_id for b in tbl])) for rid, tbl in m.req_to_blocks.items()])),
                 tuple(sorted([(n(rid), c) for rid, c in m.num_cached_block.items()])))
                for m in kv.coordinator.single_type_managers)
            flight = tuple(tuple([(n(x.request_id), x.num_scheduled_tokens, x.num_computed_tokens, x.is_prefill_chunk)
                                  for x in out.scheduled]) for out in s.in_flight)
        reqs.sort()
        return (arrived, waiting, running, tuple(reqs), free, index, managers, flight, content)

    def check(self, s: KVState) -> None:
        sched = s.scheduler
        sched.check_invariants()
        kv = sched.kv_cache_manager.manager
        if kv.hasher is not None:  # no per-request state outlives its request
            stale = set(kv.hasher._entries) - set(sched.requests)
            assert not stale, f"the block hasher still holds finished requests {sorted(stale)}"
        for rid, r in sched.requests.items():
            if r not in sched.running:
                continue
            processed = r.num_computed_tokens - r.num_in_flight_tokens
            for g, m in enumerate(kv.coordinator.single_type_managers):
                table = m.req_to_blocks.get(rid, [])
                bs = m.block_size
                window = getattr(m, "sliding_window", None)
                chunk = getattr(m, "attention_chunk_size", None)
                lo = 0 if window is None else max(0, processed - window + 1)
                if chunk is not None:  # a token reads its own chunk only
                    lo = processed // chunk * chunk
                for p in range(lo, r.num_computed_tokens):
                    idx = p // bs
                    assert idx < len(table) and not table[idx].is_null, (
                        f"window: {rid} group {g} position {p} (processed {processed}, computed "
                        f"{r.num_computed_tokens}) is read but its block was freed")

    def deadlock_reason(self, s: KVState) -> str:
        sched = s.scheduler
        kv = sched.kv_cache_manager
        waiting = [f"{r.request_id} ({r.num_tokens} tokens)" for r in sched.waiting]
        return (f"waiting {', '.join(waiting) or 'none'}, running "
                f"{', '.join(r.request_id for r in sched.running) or 'none'}, {len(s.in_flight)} steps in flight, "
                f"{kv.get_num_free_blocks()} free blocks: the scheduler schedules nothing "
                "(a waiting request the admission gate never passes blocks the queue, vLLM #39734)")

    def is_final(self, s: KVState) -> bool:
        return all(s.arrived) and not s.scheduler.has_unfinished_requests() and not s.in_flight

    def describe(self, s: KVState) -> dict[str, str]:
        sched = s.scheduler
        kv = sched.kv_cache_manager
        reqs = []
        for rid in self.ids:
            r = sched.requests.get(rid)
            if r is None:
                i = self.ids.index(rid)
                reqs.append(f"{rid}:{'done' if s.arrived[i] else '-'}")
                continue
            tables = "|".join(",".join(str(b) for b in ids) for ids in kv.get_block_ids(rid))
            reqs.append(f"{rid}:{r.status.value[:4]} c{r.num_computed_tokens} f{r.num_in_flight_tokens} "
                        f"o{len(r.output_token_ids)} [{tables}]")
        return {"requests": "; ".join(reqs),
                "free queue": " ".join(str(b) for b in kv.free_block_queue()),
                "cached": str(len(kv.cached_blocks())),
                "in flight": str(len(s.in_flight))}

    # --- helpers -------------------------------------------------------------------------------

    @staticmethod
    def _copy(s: KVState) -> KVState:
        # A state is expanded by every enabled action: pickle it once, unpickle once per action.
        # The steps in flight are frozen ``SchedulerOutput``s: the copy shares them (same ids, so
        # the scheduler's id-keyed ``_in_flight`` stays valid) instead of pickling them.
        # Likewise the shadow contents: a block's slots are a tuple (replaced, never changed, in
        # _write_and_check_hits), so a shallow copy of the map is a full one.
        sched = s.scheduler
        blob = s._blob
        if blob is None:
            flight, sched_flight, content = s.in_flight, sched._in_flight, s.content
            s.in_flight = sched._in_flight = s.content = None  # type: ignore[assignment]
            try:
                blob = s._blob = _dumps(s)
            finally:
                s.in_flight, sched._in_flight, s.content = flight, sched_flight, content
        t = pickle.loads(blob)
        t._blob = None
        t.in_flight = list(s.in_flight)
        t.scheduler._in_flight = dict(sched._in_flight)
        t.content = dict(s.content)
        return t

    # --- moving states between processes (kvref.models.explorer.search) ----------------------

    def dump(self, s: KVState) -> bytes:
        """The whole state (steps in flight and shadow contents too) as bytes that this process
        or one forked from it *after* the dump can :meth:`load` (shared configs are sent as
        references into the registry the dump fills, see :func:`_share`)."""
        blob, s._blob = s._blob, None
        try:
            return _dumps(s)
        finally:
            s._blob = blob

    def load(self, blob: bytes) -> KVState:
        t = pickle.loads(blob)
        # the scheduler keys its steps in flight by id(); the loaded steps are new objects (the
        # same ones as in t.in_flight: one pickle keeps shared references shared)
        t.scheduler._in_flight = {id(out): out for out in t.scheduler._in_flight.values()}
        return t

    def _write_and_check_hits(self, t: KVState, out) -> None:
        """Shadow writes for every scheduled token; prefix hits must carry the right content."""
        sched = t.scheduler
        kv = sched.kv_cache_manager
        managers = kv.manager.coordinator.single_type_managers
        for sr in out.scheduled:
            r = sched.requests[sr.request_id]
            tokens = r.all_token_ids
            tables = kv.get_block_ids(sr.request_id)
            if sr.kind != "running":
                assert sr.num_computed_tokens < r.num_tokens, (
                    f"{sr.request_id}: admitted with {sr.num_computed_tokens} of {r.num_tokens} tokens "
                    "computed (a hit must leave the last token to compute)")
                # without chunked prefill a request leaves the waiting queue with all its remaining
                # tokens: vLLM's waiting loop stops when they do not fit the remaining budget
                assert self.scope.enable_chunked_prefill or \
                    sr.num_computed_tokens + sr.num_scheduled_tokens == r.num_tokens, (
                        f"{sr.request_id}: chunked prefill is off, but it was admitted ({sr.kind}) with "
                        f"{sr.num_scheduled_tokens} of its {r.num_tokens - sr.num_computed_tokens} remaining "
                        "tokens (the waiting loop must stop when they do not fit the budget)")
            for g, m in enumerate(managers):
                bs = m.block_size
                table = tables[g]
                if sr.kind != "running":  # admission: the prefix hit must be what we think it is
                    for p in range(sr.num_computed_tokens):
                        b = table[p // bs]
                        if b == 0:
                            continue
                        slots = t.content.get((g, b))
                        have = None if slots is None else slots[p % bs]
                        want = (r.cache_salt, tuple(tokens[:p + 1]))
                        assert have is not None and have == self._kv_id(want), (
                            f"content: {sr.request_id} hit block {b} (group {g}) holds KV of "
                            f"{None if have is None else self._kv_value(have)} at "
                            f"slot {p % bs}; the request needs {want}")
                end = sr.num_computed_tokens + sr.num_scheduled_tokens
                for p in range(sr.num_computed_tokens, end):
                    assert p // bs < len(table), f"{sr.request_id}: no block for position {p} in group {g}"
                    b = table[p // bs]
                    assert b != 0, f"{sr.request_id}: position {p} of group {g} is written to the null block"
                    # slots are immutable tuples (states share them, see _copy): replace, not mutate
                    old = t.content.get((g, b))
                    # a block is rewritten from its first slot
                    slots = [None] * bs if old is None or p % bs == 0 else list(old)
                    # K/V at position p depend on the whole prefix (and the salt isolates it)
                    slots[p % bs] = self._kv_id((r.cache_salt, tuple(tokens[:p + 1])))
                    t.content[(g, b)] = tuple(slots)

    @staticmethod
    def _drop_free_content(t: KVState) -> None:
        pool = t.scheduler.kv_cache_manager.manager.block_pool
        for g, b in list(t.content):
            block = pool.blocks[b]
            if block.ref_cnt == 0 and block.block_hash is None:
                del t.content[(g, b)]


def explore_scope(scope: Scope | str, **kwargs: Any):
    """Explore ``scope`` (a :class:`Scope` or a name in :data:`SCOPES`); kwargs go to
    :func:`~kvref.models.explorer.engine.explore`."""
    from kvref.models.explorer.engine import explore
    from kvref.models.explorer.scope_lookup import named_scope

    return explore(KVSystem(named_scope(scope, SCOPES, Scope)), **kwargs)


def with_overrides(scope: Scope, **changes: Any) -> Scope:
    return replace(scope, **changes)
