"""The one interface every implementation answers (reference, torch, vLLM adapter).

A state machine drives all of them with the same operations and compares what each can observe:
admission decisions, computed tokens, block ids per group (exactly: free-queue order is defined),
free-block counts, the cached blocks, offload jobs. Block ids are plain ints; block 0 is the null
block. Per-group results are tuples indexed by KV cache group id.

The reference's Python types are richer (``KVCacheBlocks`` of ``KVCacheBlock``); implementations
convert at this boundary, so comparisons never depend on object identity.
"""

from __future__ import annotations

import importlib
import dataclasses
from dataclasses import dataclass, field
from typing import Callable, Protocol, runtime_checkable

from kvref.spec.context_parallel import check_context_parallel
from kvref.spec.errors import InvalidFieldError, check_int, check_sequence
from kvref.spec.kv_cache_interface import KVCacheGroupSpec
from kvref.spec.prefix_cache_retention import validate_prefix_cache_retention_interval

from .request import Request

BlockIds = tuple[tuple[int, ...], ...]
"""Block ids per KV cache group."""

#: the largest pool any implementation builds (blocks incl. the null block). The reference keeps a
#: Python object per block: 2**22 blocks is ~1 GiB and some seconds to build; ``10**30`` used to be
#: accepted and then build blocks until memory ran out. Real vLLM pools stay well below it.
MAX_NUM_BLOCKS = 1 << 22


@dataclass(frozen=True)
class PoolConfig:
    """What every implementation is created from: the scheduler-side view of a KV cache plan.

    Mirrors the arguments vLLM's ``KVCacheManager`` takes (``KVCacheConfig.num_blocks`` and
    groups, ``max_model_len``, ``scheduler_block_size``, ``hash_block_size``,
    ``max_in_flight_tokens``, ``enable_caching``, ``watermark``, ``use_eagle``,
    ``enable_kv_cache_events``). ``num_blocks`` includes the null block 0.
    ``enable_kv_cache_events`` makes the pool queue KV cache events (implementations that model
    them expose ``take_kv_events()``; see docs/kv_events.md).
    """

    num_blocks: int
    groups: tuple[KVCacheGroupSpec, ...]
    max_model_len: int
    scheduler_block_size: int
    hash_block_size: int
    max_in_flight_tokens: int | None = None
    enable_caching: bool = True
    watermark: float = 0.0
    use_eagle: bool = False
    enable_kv_cache_events: bool = False
    #: block hashing (issue #23): vLLM's ``prefix_caching_hash_algo`` (sha256, sha256_cbor, xxhash,
    #: xxhash_cbor), ``num_hash_lookahead_tokens`` (EAGLE block drop: tokens after each block its
    #: hash covers) and the NONE_HASH seed (None: ``init_none_hash``'s rule — PYTHONHASHSEED, else
    #: fixed for sha256, random for xxhash); ``log_stats`` keeps prefix-cache stats
    prefix_caching_hash_algo: str = "sha256"
    num_hash_lookahead_tokens: int = 0
    none_hash_seed: str | None = None
    log_stats: bool = False
    #: sparse prefix-cache retention (issue #23, spec/prefix_cache_retention.py): ``None`` dense (vLLM
    #: ``KVCacheConfig``'s default), ``0`` only replay boundaries and shared-prefix junctions, ``k > 0``
    #: also one checkpoint per ``k`` tokens; applies to sliding-window and Mamba groups only
    prefix_cache_retention_interval: int | None = None
    #: vLLM's ``num_prefill_lookahead_tokens`` (``VllmConfig``: 0 without EAGLE, 1 for EAGLE-family
    #: drafters, ``num_speculative_tokens`` for multi-module MTP): the drafter reads that many prefill
    #: tokens past a chunk, so the last ``num_prefill_lookahead - 1`` computed tokens are
    #: re-prefillable and never published to the prefix cache (issue #23)
    num_prefill_lookahead: int = 0
    #: context parallelism (issue #23, spec/context_parallel.py): vLLM's ``dcp_world_size`` (the
    #: managers of DCP-sharded groups count ``block_size × dcp`` tokens per block) and
    #: ``pcp_world_size`` (scales nothing; narrows the groups accepted with prefix caching). vLLM's
    #: scheduler passes ``decode_context_parallel_size`` and PCP 1
    dcp_world_size: int = 1
    pcp_world_size: int = 1
    #: vLLM's ``CacheConfig.enable_mamba_shared_prefix_checkpoint`` (issue #23): a Mamba "align"
    #: group also keys the state at a request's shared-prefix junction, where an EAGLE sibling
    #: resumes; vLLM's ``KVCacheManager`` narrows it (EAGLE groups, partial hash hits, no MTP tail)
    enable_mamba_shared_prefix_checkpoint: bool = False
    #: HiSparse (issue #23): each group's role, vLLM's ``KVCacheGroupRole`` values (``"default"``,
    #: ``"hisparse_source"``: the host source, whose manager moves to a private host pool;
    #: ``"hisparse_indexer"``), None for all default; and ``KVCacheConfig.hisparse_host_num_blocks``,
    #: the host pool's size, which a source group requires (vLLM's coordinator raises without it)
    group_roles: tuple[str, ...] | None = None
    hisparse_host_num_blocks: int | None = None
    #: how this pool was made: ``"plan"`` (:meth:`from_plan`, the road startup takes), ``"off-plan:
    #: <why>"`` (:meth:`off_plan`) or ``""`` (built field by field, e.g. in a unit test). Not part of
    #: equality: two pools with the same fields behave the same whatever their origin.
    origin: str = field(default="", compare=False)

    @classmethod
    def from_plan(cls, plan, *, watermark: float = 0.0, use_eagle: bool = False,
                  enable_kv_cache_events: bool = False) -> "PoolConfig":
        """The runtime pool of a startup plan: the one road from a user's config to a pool (#26).

        Every derived value (``scheduler_block_size``, ``hash_block_size``, ``max_in_flight_tokens``,
        the scheduler's groups) is taken from :class:`kvref.spec.planning.KVCachePlan`, where
        :func:`~kvref.spec.planning.plan_kv_cache` computed it once under vLLM's name, so a pool made
        here is exactly what vLLM's engine hands its ``KVCacheManager`` and the startup-versus-runtime
        agreement kvref exists for (vLLM #39734 / #35541) holds by construction. ``watermark``,
        ``use_eagle`` and ``enable_kv_cache_events`` are the scheduler-side settings that are not
        part of the plan.

        Raises:
            InvalidFieldError: ``plan`` is not a ``KVCachePlan``.
        """
        from kvref.spec.planning import KVCachePlan

        if not isinstance(plan, KVCachePlan):
            raise InvalidFieldError("plan", plan, "a KVCachePlan from kvref.spec.planning.plan_kv_cache")
        return cls(**plan.pool_config_kwargs(), watermark=watermark, use_eagle=use_eagle,
                   enable_kv_cache_events=enable_kv_cache_events, origin="plan")

    @classmethod
    def off_plan(cls, why: str, **fields) -> "PoolConfig":
        """A pool built field by field on purpose, saying why it does not come from a plan.

        The explorer's tiny scopes, fault scenarios, the CPU side of an offload pool and the
        generators that aim at admission edges need pools startup would never produce (a block
        short of one max-length request, a hand-picked block count); they come through this door,
        so a reader sees every place that bypasses :meth:`from_plan` and the reason. The fields are
        checked exactly like a planned pool's.

        Raises:
            InvalidFieldError: ``why`` is empty or not a string, or a field is invalid.
        """
        if not isinstance(why, str) or not why.strip():
            raise InvalidFieldError("why", why, "a non-empty string saying why the pool is off-plan")
        if "origin" in fields:
            raise InvalidFieldError("origin", fields["origin"], "not given: off_plan sets it from why")
        return cls(**fields, origin=f"off-plan: {why.strip()}")

    @classmethod
    def through_plan(cls, fields: dict, engine, why: str, reasons: tuple[str, ...] | list[str] = (),
                     settings: dict | None = None) -> "PoolConfig":
        """The plan's pool when startup builds exactly ``fields``, else the off-plan door saying why:
        the one road for every generator and scope that draws a pool (#26).

        ``fields`` are the pool fields a startup plan decides (``num_blocks`` incl. the null block,
        ``groups``, ``max_model_len``, ``scheduler_block_size``, ``hash_block_size``,
        ``max_in_flight_tokens``, ``enable_caching``), ``engine`` the ``EngineConfig`` a user would
        give vLLM for them (``num_gpu_blocks_override`` the block count:
        :func:`kvref.impl.scheduler_types.engine_config_for`), ``settings`` the scheduler-side
        fields no plan carries (watermark, EAGLE, hash lookahead, retention). With no ``reasons``
        given and :func:`~kvref.spec.planning.plan_kv_cache` building exactly ``fields``, the
        result is the plan's (``origin == "plan"``: startup and the runtime agree by
        construction); otherwise it is :meth:`off_plan` with ``why`` and each reason (the plan's
        refusal, or the fields startup would build otherwise). Either door gives the same fields.

        Raises:
            InvalidFieldError: ``fields``/``settings`` not a dict, ``engine`` not an
                ``EngineConfig``, ``reasons`` not strings, or a field invalid.
        """
        from kvref.spec.config import EngineConfig
        from kvref.spec.errors import KVRefError
        from kvref.spec.planning import plan_kv_cache

        if not isinstance(why, str) or not why.strip():
            raise InvalidFieldError("why", why, "a non-empty string saying why a pool would be off-plan")
        if not isinstance(fields, dict) or "groups" not in fields:
            raise InvalidFieldError("fields", fields, "a dict of PoolConfig fields with groups")
        if not isinstance(engine, EngineConfig):
            raise InvalidFieldError("engine", engine, "an EngineConfig")
        if not isinstance(reasons, (list, tuple)) or not all(isinstance(r, str) for r in reasons):
            raise InvalidFieldError("reasons", reasons, "a list of strings")
        if settings is not None and not isinstance(settings, dict):
            raise InvalidFieldError("settings", settings, "None or a dict of PoolConfig fields")
        settings = dict(settings or {})
        known = {f.name for f in dataclasses.fields(cls)} - {"origin"}
        for name, given in (("fields", fields), ("settings", settings)):
            if not set(given) <= known:
                raise InvalidFieldError(name, sorted(set(given) - known), f"PoolConfig field names ({sorted(known)})")
        reasons = list(reasons)
        groups = fields["groups"]
        if not reasons and isinstance(groups, (list, tuple)) and all(isinstance(g, KVCacheGroupSpec) for g in groups):
            try:
                plan = plan_kv_cache({g.layer_names[0]: g.kv_cache_spec for g in groups}, engine, 0)
            except KVRefError as exc:  # mostly: a pool below one max_model_len request (aimed at on purpose)
                reasons.append(f"startup refuses it ({type(exc).__name__})")
            else:
                pool = dataclasses.replace(cls.from_plan(plan), **settings)
                differ = sorted(k for k, v in fields.items() if getattr(pool, k) != v)
                if not differ:
                    return pool
                reasons.append(f"startup would build other {', '.join(differ)} (page sizes unified or padded)")
        return cls.off_plan(f"{why}: " + "; ".join(reasons) if reasons else why, **fields, **settings)

    @property
    def effective_max_in_flight_tokens(self) -> int:
        """The in-flight budget the windowed admission caps are computed with: ``max_in_flight_tokens``,
        or ``max_model_len`` when it is None (a pool built without a scheduler behind it reserves for
        a whole request in flight: the cap then never binds before ``max_model_len``)."""
        return self.max_model_len if self.max_in_flight_tokens is None else self.max_in_flight_tokens

    def __post_init__(self) -> None:
        check_int("num_blocks", self.num_blocks, minimum=1)
        if self.num_blocks > MAX_NUM_BLOCKS:
            raise InvalidFieldError("num_blocks", self.num_blocks, f"an int in [1, {MAX_NUM_BLOCKS}] (MAX_NUM_BLOCKS)")
        check_sequence("groups", self.groups, "a tuple of KVCacheGroupSpec")
        object.__setattr__(self, "groups", tuple(self.groups))
        for i, g in enumerate(self.groups):
            if not isinstance(g, KVCacheGroupSpec):
                raise InvalidFieldError(f"groups[{i}]", g, "a KVCacheGroupSpec")
        check_int("max_model_len", self.max_model_len, minimum=1)
        check_int("scheduler_block_size", self.scheduler_block_size, minimum=1)
        check_int("hash_block_size", self.hash_block_size, minimum=1)
        check_int("max_in_flight_tokens", self.max_in_flight_tokens, minimum=1, allow_none=True)
        if not isinstance(self.watermark, (int, float)) or isinstance(self.watermark, bool) \
                or not 0.0 <= self.watermark < 1.0:
            raise InvalidFieldError("watermark", self.watermark, "a float in [0, 1)")
        for flag in ("enable_caching", "use_eagle", "enable_mamba_shared_prefix_checkpoint"):
            if not isinstance(getattr(self, flag), bool):
                raise InvalidFieldError(flag, getattr(self, flag), "True or False")
        if not isinstance(self.enable_kv_cache_events, bool):
            raise InvalidFieldError("enable_kv_cache_events", self.enable_kv_cache_events, "True or False")
        if self.prefix_caching_hash_algo not in ("sha256", "sha256_cbor", "xxhash", "xxhash_cbor"):
            raise InvalidFieldError("prefix_caching_hash_algo", self.prefix_caching_hash_algo,
                                    "one of sha256, sha256_cbor, xxhash, xxhash_cbor")
        check_int("num_hash_lookahead_tokens", self.num_hash_lookahead_tokens, minimum=0)
        if self.none_hash_seed is not None and not isinstance(self.none_hash_seed, str):
            raise InvalidFieldError("none_hash_seed", self.none_hash_seed, "None or a str")
        if not isinstance(self.log_stats, bool):
            raise InvalidFieldError("log_stats", self.log_stats, "True or False")
        if not isinstance(self.origin, str):
            raise InvalidFieldError("origin", self.origin, "a string (set by from_plan / off_plan)")
        # vLLM's coordinator raises ValueError on these; kvref rejects them up front.
        validate_prefix_cache_retention_interval(self.prefix_cache_retention_interval,
                                                 self.scheduler_block_size, self.groups)
        check_int("num_prefill_lookahead", self.num_prefill_lookahead, minimum=0)
        # vLLM's coordinator raises ValueError on this (multi-module MTP hits drop one scheduler
        # block, which must hold the re-prefilled tail); kvref rejects it up front.
        if self.enable_caching and (self.use_eagle or any(g.is_eagle_group for g in self.groups)) \
                and self.scheduler_block_size < self.num_prefill_lookahead:
            raise InvalidFieldError("num_prefill_lookahead", self.num_prefill_lookahead,
                                    f"at most scheduler_block_size={self.scheduler_block_size} with prefix "
                                    "caching and EAGLE groups (multi-module MTP)")
        # vLLM asserts these in the coordinator and the managers' lookups; kvref rejects them up front.
        check_context_parallel([getattr(g.kv_cache_spec, "first_spec", g.kv_cache_spec) for g in self.groups],
                               self.dcp_world_size, self.pcp_world_size, self.enable_caching)
        self._check_hisparse()
        # vLLM asserts this in the coordinator (PR 44165); kvref rejects it up front.
        if self.scheduler_block_size % self.hash_block_size:
            raise InvalidFieldError("scheduler_block_size", self.scheduler_block_size,
                                    f"a multiple of hash_block_size={self.hash_block_size}")
        for i, g in enumerate(self.groups):
            if self.scheduler_block_size % g.kv_cache_spec.block_size:
                raise InvalidFieldError(
                    "scheduler_block_size", self.scheduler_block_size,
                    f"a multiple of group {i}'s block_size={g.kv_cache_spec.block_size}")


    def _check_hisparse(self) -> None:
        """Group roles and the HiSparse host pool: one role per group, at most one host source
        (vLLM: "Only one HiSparse host group is supported."), which needs host capacity."""
        check_int("hisparse_host_num_blocks", self.hisparse_host_num_blocks, minimum=1, allow_none=True)
        if self.group_roles is None:
            return
        check_sequence("group_roles", self.group_roles, "a tuple of group roles")
        object.__setattr__(self, "group_roles", tuple(self.group_roles))
        if len(self.group_roles) != len(self.groups):
            raise InvalidFieldError("group_roles", self.group_roles, f"one role per group ({len(self.groups)})")
        for i, role in enumerate(self.group_roles):
            if role not in GROUP_ROLES:
                raise InvalidFieldError(f"group_roles[{i}]", role, "one of " + ", ".join(GROUP_ROLES))
        num_sources = self.group_roles.count("hisparse_source")
        if num_sources > 1:
            raise InvalidFieldError("group_roles", self.group_roles, "at most one hisparse_source group")
        if num_sources and self.hisparse_host_num_blocks is None:
            raise InvalidFieldError("hisparse_host_num_blocks", None,
                                    "the host pool's size (a hisparse_source group needs host capacity)")


#: vLLM 0.33.0's ``KVCacheGroupRole`` values
GROUP_ROLES = ("default", "hisparse_source", "hisparse_indexer")


@runtime_checkable
class KVCacheManagerLike(Protocol):
    """vLLM's ``KVCacheManager`` surface, in plain ids."""

    num_groups: int

    def get_computed_blocks(self, request: Request) -> tuple[BlockIds, int]:
        """Prefix-cache lookup: (hit block ids per group, number of hit tokens). Does not mutate."""

    def allocate_slots(
        self,
        request: Request,
        num_new_tokens: int,
        num_new_computed_tokens: int = 0,
        new_computed_block_ids: BlockIds | None = None,
        num_lookahead_tokens: int = 0,
        num_external_computed_tokens: int = 0,
        delay_cache_blocks: bool = False,
        full_sequence_must_fit: bool = False,
        reserved_blocks: int = 0,
        has_scheduled_reqs: bool = True,
    ) -> BlockIds | None:
        """Allocate; return the newly allocated block ids per group, or None when they do not fit."""

    def free(self, request: Request) -> None:
        """Release all blocks of the request (tail blocks are evicted first)."""

    def get_block_ids(self, request_id: str) -> BlockIds:
        """The request's whole block table per group (0 for null placeholders)."""

    def get_num_free_blocks(self) -> int:
        """Free-queue length (includes evictable cached blocks)."""

    def free_block_queue(self) -> tuple[int, ...]:
        """Block ids in free-queue order, front (next to be allocated) first."""

    def cached_blocks(self) -> dict[tuple[int, int], bytes]:
        """``{(group_id, block_id): primary block hash}`` for every block in the hash map."""

    def check_invariants(self) -> None:
        """Raise AssertionError if an internal invariant does not hold."""

    # Optional methods: callers use ``getattr(manager, name, None)``; implementations that lack the
    # concept simply leave them out (a Protocol's default bodies are not inherited structurally).

    def new_step_starts(self) -> None:
        """Optional. A scheduler step begins (vLLM resets per-step state, e.g. Mamba's same-step guard)."""

    def forget(self, request_id: str) -> None:
        """Optional. The request is gone for good (finished/aborted); drop any per-request mirror."""


ManagerFactory = Callable[[PoolConfig], KVCacheManagerLike]

_FACTORIES: dict[str, ManagerFactory] = {}
#: modules that register a kind when imported (``register_manager`` at module level)
_BUILTIN_MODULES = {
    "reference": "kvref.impl.reference.adapter",
    "vllm": "kvref.impl.vllm.kv_cache_manager",
    "torch": "kvref.impl.torch.adapter",
}


def register_manager(kind: str, factory: ManagerFactory) -> None:
    """Make ``make_manager(kind, ...)`` build managers with ``factory(pool_config)``."""
    if not isinstance(kind, str) or not kind:
        raise InvalidFieldError("kind", kind, "a non-empty str")
    if not callable(factory):
        raise InvalidFieldError("factory", factory, "a callable taking a PoolConfig")
    _FACTORIES[kind] = factory


def manager_kinds() -> tuple[str, ...]:
    """Kinds ``make_manager`` knows (registered or importable on demand)."""
    return tuple(sorted(set(_FACTORIES) | set(_BUILTIN_MODULES)))


def make_manager(kind: str, pool_config: PoolConfig) -> KVCacheManagerLike:
    """Build the ``kind`` implementation (``"reference"``, ``"vllm"``, ``"torch"``) of a pool.

    Built-in kinds live in modules that register themselves when imported; they are imported only
    here, so ``import kvref.impl`` needs neither vLLM nor torch.
    """
    if not isinstance(kind, str):
        raise InvalidFieldError("kind", kind, "one of " + ", ".join(manager_kinds()))
    if kind not in _FACTORIES and kind in _BUILTIN_MODULES:
        importlib.import_module(_BUILTIN_MODULES[kind])
    if kind not in _FACTORIES:
        raise InvalidFieldError("kind", kind, "one of " + ", ".join(manager_kinds()))
    if not isinstance(pool_config, PoolConfig):
        raise InvalidFieldError("pool_config", pool_config, "a PoolConfig")
    return _FACTORIES[kind](pool_config)
