"""Coordinators: one block pool, one manager per KV-cache group (vLLM ``kv_cache_coordinator.py``).

* :class:`KVCacheCoordinatorNoPrefixCache` — caching off (any number of groups, even 0).
* :class:`UnitaryKVCacheCoordinator` — one group; ``hash_block_size`` must equal its block size.
* :class:`HybridKVCacheCoordinator` — several groups; the prefix-cache hit is the fixed point of
  every group's own lookup (each can only shorten it), aligned to ``scheduler_block_size``.

``scheduler_block_size`` (vLLM PR #44165) is threaded down to every manager and must be
a multiple of ``hash_block_size`` and of every group's block size (PoolConfig validates this up
front; the coordinator re-checks because it can be built on its own, e.g. by the CPU offloader).

Hits are added in two phases — first every group touches its hits, then groups allocate blocks
for external (connector) tokens — so one group's allocation cannot evict another group's
untouched hits (vLLM #33775).

Fine-grained (partial) hash hits: a Mamba "align" group whose block is larger than
``hash_block_size`` turns them on when every other cacheable group can look up inside a block
(``partial_hash_hits_enabled``); hits then land on hash boundaries and the shared partial tail is
copied on write by the managers.

Sparse prefix-cache retention (``PoolConfig.prefix_cache_retention_interval``, validated there like
vLLM's coordinator validates it; spec/prefix_cache_retention.py): every ``cache_blocks`` hands the
managers the interval and the prompt's replay boundaries; sliding-window and Mamba managers publish
only the blocks their ``reachable_block_mask`` keeps. Under interval 0 ``prefill_end`` reaches the
managers (Mamba reserves a prefill checkpoint only on the chunk reaching it); otherwise it is 0.

Digest §6. DCP/PCP block scaling (spec/context_parallel.py), multi-module MTP's re-prefillable
tail (``num_prefill_lookahead``) and HiSparse group roles (``PoolConfig.group_roles``, the host
pool) are modelled; metrics other than prefix-cache stats are not.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from kvref.impl.interface import PoolConfig
from kvref.impl.request import Request
from kvref.spec.context_parallel import manager_block_size
from kvref.spec.errors import InvalidFieldError, check_int
from kvref.spec.hisparse import HiSparseHotSpec, HiSparseResidentSpec
from kvref.spec.kv_cache_interface import (
    ChunkedLocalAttentionSpec,
    CircularBufferSpec,
    CrossAttentionSpec,
    FullAttentionSpec,
    KVCacheGroupSpec,
    KVCacheSpec,
    MambaSpec,
    RSWASpec,
    SinkFullAttentionSpec,
    SlidingWindowSpec,
    UniformTypeKVCacheSpecs,
)
from kvref.spec.kv_zeroing import needs_kv_cache_zeroing
from kvref.spec.mathutil import cdiv, round_down
from kvref.spec.prefix_cache_retention import replay_boundaries

from .block_hash import BlockHash
from .block_pool import BlockPool
from .chunked_local_manager import ChunkedLocalAttentionManager
from .circular_buffer_manager import CircularBufferManager
from .cross_attention_manager import CrossAttentionManager
from .full_attention_manager import FullAttentionManager
from .hisparse_block_pool import ReuseWatchingBlockPool
from .hisparse_coordinator import HiSparseCoordinator
from .hisparse_hot_manager import HiSparseHotManager
from .hisparse_resident_manager import HiSparseResidentManager
from .hisparse_source_manager import HiSparseSourceManager
from .kv_cache_block import KVCacheBlock
from .mamba_manager import MambaManager
from .rswa_manager import RSWAManager
from .sink_full_attention_manager import SinkFullAttentionManager
from .single_type_manager import SingleTypeKVCacheManager
from .sliding_window_manager import SlidingWindowManager

HitBlocks = tuple[list[KVCacheBlock], ...]


def _layer_specs(spec: KVCacheSpec) -> tuple[KVCacheSpec, ...]:
    """Every layer spec of a group (a UniformType group holds several)."""
    if isinstance(spec, UniformTypeKVCacheSpecs):
        return tuple(spec.kv_cache_specs.values())
    return (spec,)


def partial_hash_hits_enabled(group_specs: Sequence[KVCacheSpec], hash_block_size: int,
                              manager_classes: Sequence[type[SingleTypeKVCacheManager]] | None = None,
                              dcp_world_size: int = 1) -> bool:
    """Whether aligned Mamba states support hits inside a block (vLLM's function of the same name):
    some Mamba "align" layer has a block larger than ``hash_block_size`` (or as large, under DCP,
    which scales the full-attention block instead), and (with ``manager_classes``, one per group)
    every other cacheable group either looks up inside blocks itself or has (DCP-scaled) blocks of
    exactly ``hash_block_size``."""
    if not any(isinstance(layer, MambaSpec) and layer.mamba_cache_mode == "align"
               and (layer.block_size > hash_block_size
                    or (dcp_world_size > 1 and layer.block_size == hash_block_size))
               for spec in group_specs for layer in _layer_specs(spec)):
        return False
    if manager_classes is None:
        return True
    return all(not spec.prefix_cacheable or cls.supports_fine_grained_hash_lookup
               or manager_block_size(spec, dcp_world_size) == hash_block_size
               for spec, cls in zip(group_specs, manager_classes))


def context_parallel_kwargs(manager: SingleTypeKVCacheManager, pcp_world_size: int | None = None) -> dict[str, int]:
    """The world-size keywords of a manager's ``find_longest_cache_hit``: the manager's own sizes
    (as vLLM's hybrid coordinator passes them; its one-group coordinator passes the engine's PCP
    size, ``pcp_world_size``), none at DCP = PCP = 1 (every manager class takes the call without
    them)."""
    pcp = manager.pcp_world_size if pcp_world_size is None else pcp_world_size
    if manager.dcp_world_size == 1 and pcp == 1:
        return {}
    return {"dcp_world_size": manager.dcp_world_size, "pcp_world_size": pcp}


def eagle_proof_margin(block_size: int, hash_block_size: int, fine_grained_lookup: bool) -> int:
    """Tokens an EAGLE group matches past a candidate hit before dropping them: one hash unit for
    fine-grained lookups, else one block (vLLM's function of the same name)."""
    if fine_grained_lookup and block_size > hash_block_size:
        return hash_block_size
    return block_size


def scheduler_spec(spec: KVCacheSpec) -> KVCacheSpec:
    """The scheduler sees one layer's spec for a UniformType group (vLLM
    ``generate_scheduler_kv_cache_config``)."""
    return spec.first_spec if isinstance(spec, UniformTypeKVCacheSpecs) else spec


def manager_class_for_spec(spec: KVCacheSpec, role: str = "default") -> type[SingleTypeKVCacheManager]:
    """vLLM's registry, for the specs kvref models (MLA is full attention); a role-registered
    manager (the HiSparse host source) takes precedence."""
    if role == "hisparse_source":
        return HiSparseSourceManager
    if isinstance(spec, HiSparseResidentSpec):
        return HiSparseResidentManager
    if isinstance(spec, HiSparseHotSpec):
        return HiSparseHotManager
    if isinstance(spec, RSWASpec):
        return RSWAManager
    if isinstance(spec, SinkFullAttentionSpec):
        return SinkFullAttentionManager
    if isinstance(spec, CircularBufferSpec):
        return CircularBufferManager
    if isinstance(spec, FullAttentionSpec):
        return FullAttentionManager
    if isinstance(spec, SlidingWindowSpec):
        return SlidingWindowManager
    if isinstance(spec, ChunkedLocalAttentionSpec):
        return ChunkedLocalAttentionManager
    if isinstance(spec, MambaSpec):
        return MambaManager
    if isinstance(spec, CrossAttentionSpec):
        return CrossAttentionManager
    raise InvalidFieldError("kv_cache_spec", type(spec).__name__,
                            "a spec with a KV-cache manager (full attention, MLA, R-SWA, attention sink, "
                            "sliding window, chunked local, circular buffer, Mamba or cross-attention)")


def get_manager_for_kv_cache_spec(spec: KVCacheSpec, max_in_flight_tokens: int, max_model_len: int,
                                  **kwargs) -> SingleTypeKVCacheManager:
    """Build the group's manager; windowed specs get their admission cap from the spec itself,
    the single source of truth shared with startup sizing (vLLM #40946)."""
    cls = manager_class_for_spec(spec, kwargs.pop("role", "default"))
    cap = (spec.max_admission_blocks_per_request(max_in_flight_tokens, max_model_len)
           if isinstance(spec, HiSparseResidentSpec) else spec.admission_cap(max_in_flight_tokens, max_model_len))
    if cap is not None:
        kwargs["max_admission_blocks_per_request"] = cap
    return cls(spec, **kwargs)


def _hisparse_kwargs(spec: KVCacheSpec, role: str, specs: Sequence[KVCacheSpec]) -> dict:
    """The role a group's manager is picked by, and whether a hot group has resident groups
    beside it (vLLM's hot manager asks its coordinator)."""
    kwargs: dict = {"role": role}
    if isinstance(spec, HiSparseHotSpec):
        kwargs["has_resident_groups"] = any(isinstance(s, HiSparseResidentSpec) for s in specs)
    return kwargs


class KVCacheCoordinator:
    """Owns the block pool and the per-group managers; fans every call out to them.

    Built from the one :class:`~kvref.impl.interface.PoolConfig` every implementation is created
    from (PoolConfig validated it: block-size divisibility, ranges): ``groups`` (scheduler view),
    ``num_blocks`` (pool size including the null block), ``max_model_len`` and the in-flight budget
    (feed the windowed admission caps), ``use_eagle`` (EAGLE/MTP drafting: flagged groups, all if
    none is flagged, drop their last hit block so it is recomputed), ``enable_caching``,
    ``scheduler_block_size`` / ``hash_block_size`` (see the module docstring) and
    ``enable_kv_cache_events`` (the pool queues KV cache events; vLLM threads the same flag from the
    scheduler through the manager and coordinator to the pool).
    """

    #: hits may land on hash boundaries inside a block (only the hybrid coordinator turns it on)
    enable_partial_hash_hits = False

    def __init__(self, config: PoolConfig) -> None:
        if not isinstance(config, PoolConfig):
            raise InvalidFieldError("config", config, "a kvref.impl.interface.PoolConfig")
        self.config = config
        num_blocks, max_model_len = config.num_blocks, config.max_model_len
        max_in_flight_tokens = config.effective_max_in_flight_tokens
        use_eagle, enable_caching = config.use_eagle, config.enable_caching
        scheduler_block_size, hash_block_size = config.scheduler_block_size, config.hash_block_size
        self.kv_cache_groups = tuple(config.groups)
        specs = [scheduler_spec(g.kv_cache_spec) for g in self.kv_cache_groups]
        self._check_modelled(specs, enable_caching, use_eagle, hash_block_size)
        self.specs = tuple(specs)
        self.max_model_len = max_model_len
        self.enable_caching = enable_caching
        self.scheduler_block_size = scheduler_block_size
        self.hash_block_size = hash_block_size
        roles = config.group_roles or ("default",) * len(self.kv_cache_groups)
        hisparse = config.hisparse_host_num_blocks is not None or "hisparse_source" in roles
        # HiSparse releases clean resident pages while still read (vLLM BlockPool.unpin_blocks)
        self.block_pool = (ReuseWatchingBlockPool if hisparse else BlockPool)(
            num_blocks, enable_caching, hash_block_size, enable_kv_cache_events=config.enable_kv_cache_events)
        self.eagle_group_ids = {i for i, g in enumerate(self.kv_cache_groups) if g.is_eagle_group}
        if use_eagle and not self.eagle_group_ids:
            self.eagle_group_ids = set(range(len(self.kv_cache_groups)))
        self.drop_eagle_group_ids = set(self.eagle_group_ids) if use_eagle else set()
        #: None dense, 0 replay boundaries / junctions only, k > 0 also one per k tokens (PoolConfig
        #: validated it as vLLM's coordinator does)
        self.retention_interval = config.prefix_cache_retention_interval
        #: multi-module MTP: the drafter may re-prefill these last computed tokens, so their KV is
        #: not final and is never published (vLLM's ``num_prefill_lookahead - 1``)
        self.num_reprefillable_tokens = max(0, config.num_prefill_lookahead - 1)
        # KV zeroing (spec/kv_zeroing.py), decided on the scheduler's view of the groups as in vLLM
        self.needs_kv_cache_zeroing = needs_kv_cache_zeroing(
            [KVCacheGroupSpec(g.layer_names, spec) for g, spec in zip(self.kv_cache_groups, specs)])
        self.single_type_managers: tuple[SingleTypeKVCacheManager, ...] = tuple(
            get_manager_for_kv_cache_spec(
                spec, max_in_flight_tokens, max_model_len, block_pool=self.block_pool,
                enable_caching=enable_caching, kv_cache_group_id=i,
                scheduler_block_size=scheduler_block_size,
                needs_kv_cache_zeroing=self.needs_kv_cache_zeroing,
                dcp_world_size=config.dcp_world_size, pcp_world_size=config.pcp_world_size,
                **_hisparse_kwargs(spec, roles[i], specs))
            for i, spec in enumerate(specs))
        #: the HiSparse coordinator bound to the host source (vLLM binds it on the first
        #: ``get_hisparse_coordinator``, which must run before the first admission: kvref binds it here)
        self.hisparse_coordinator: HiSparseCoordinator | None = None
        if "hisparse_source" in roles:
            self.hisparse_coordinator = HiSparseCoordinator(
                self.single_type_managers, num_blocks, config.hisparse_host_num_blocks, max_model_len,
                num_reprefillable_tokens=self.num_reprefillable_tokens)
        if use_eagle:
            for manager in self.single_type_managers:
                if isinstance(manager, MambaManager):
                    manager.drop_eagle_checkpoint_block = True

    @staticmethod
    def _check_modelled(specs: Sequence[KVCacheSpec], enable_caching: bool, use_eagle: bool,
                        hash_block_size: int) -> None:
        """Refuse configurations vLLM rejects (by assertion) or kvref does not model."""
        for i, spec in enumerate(specs):
            manager_class_for_spec(spec)
            if isinstance(spec, MambaSpec):
                if enable_caching and spec.mamba_cache_mode != "align":
                    raise InvalidFieldError(f"groups[{i}].mamba_cache_mode", spec.mamba_cache_mode,
                                            "'align' when prefix caching is enabled")
            if isinstance(spec, CrossAttentionSpec) and enable_caching:
                raise InvalidFieldError("enable_caching", True,
                                        "False for models with cross-attention (never prefix-cached)")
            if isinstance(spec, ChunkedLocalAttentionSpec) and enable_caching and use_eagle:
                raise InvalidFieldError("use_eagle", True,
                                        "False with chunked local attention and prefix caching")

    # ------------------------------------------------------------------ sizing / allocation

    def get_num_blocks_to_allocate(self, request_id: str, num_tokens: int, new_computed_blocks: HitBlocks,
                                   num_encoder_tokens: int, total_computed_tokens: int,
                                   num_local_computed_tokens: int, num_tokens_main_model: int,
                                   apply_admission_cap: bool = False, prefill_end: int = 0) -> int:
        """Σ over groups of the blocks an allocation consumes (cross-attention: encoder tokens).

        ``prefill_end`` only reaches the managers under retention interval 0 (Mamba then reserves
        a prefill checkpoint only on the chunk reaching it); otherwise vLLM forces it to 0, so every
        chunk may reserve one."""
        if self.retention_interval != 0:
            prefill_end = 0
        total = 0
        for i, manager in enumerate(self.single_type_managers):
            if manager.is_cross_attention:
                total += manager.get_num_blocks_to_allocate(
                    request_id, num_encoder_tokens, [], 0, 0, num_encoder_tokens,
                    apply_admission_cap=apply_admission_cap)
            else:
                total += manager.get_num_blocks_to_allocate(
                    request_id, num_tokens, new_computed_blocks[i], total_computed_tokens,
                    num_local_computed_tokens, num_tokens_main_model,
                    apply_admission_cap=apply_admission_cap, prefill_end=prefill_end)
        return total

    def is_running(self, request_id: str) -> bool:
        for manager in self.single_type_managers:
            if request_id in manager.num_cached_block:
                return True
        return False

    def allocate_new_computed_blocks(self, request_id: str, new_computed_blocks: HitBlocks,
                                     num_local_computed_tokens: int, num_external_computed_tokens: int,
                                     skip_zeroing_group_ids: tuple[int, ...] = ()) -> None:
        """Two phases: every group touches its hits, then every group allocates external blocks
        (vLLM #33775). A running request has no new hits: no-op. ``skip_zeroing_group_ids``: groups
        an asynchronous load writes, whose external blocks are not recorded for zeroing."""
        if self.is_running(request_id):
            assert all(len(blocks) == 0 for blocks in new_computed_blocks)
            return
        for i, manager in enumerate(self.single_type_managers):
            manager.add_local_computed_blocks(request_id, new_computed_blocks[i],
                                              num_local_computed_tokens, num_external_computed_tokens)
        if num_external_computed_tokens > 0:
            for i, manager in enumerate(self.single_type_managers):
                manager.allocate_external_computed_blocks(request_id, num_local_computed_tokens,
                                                          num_external_computed_tokens,
                                                          record_for_zeroing=i not in skip_zeroing_group_ids)

    def allocate_new_blocks(self, request_id: str, num_tokens: int, num_tokens_main_model: int,
                            num_encoder_tokens: int = 0) -> HitBlocks:
        return tuple(
            manager.allocate_new_blocks(
                request_id,
                num_encoder_tokens if manager.is_cross_attention else num_tokens,
                num_tokens_main_model)
            for manager in self.single_type_managers)

    # ------------------------------------------------------------------ caching

    def get_num_cacheable_tokens(self, num_computed_tokens: int, kv_cache_group_id: int) -> int:
        """Tokens whose KV is final and may be published: all but the re-prefillable tail."""
        return max(0, num_computed_tokens - self.num_reprefillable_tokens)

    def cache_blocks(self, request: Request, block_hashes: Sequence[BlockHash], num_computed_tokens: int) -> None:
        """Every caching group publishes up to its cacheable tokens, thinned by the retention
        interval around the prompt's replay boundaries (pool-wide EAGLE decides them)."""
        boundaries = replay_boundaries(request.num_prompt_tokens, self.scheduler_block_size,
                                       bool(self.drop_eagle_group_ids))
        for group_id, manager in enumerate(self.single_type_managers):
            if manager.enable_caching:
                manager.cache_blocks(request, block_hashes,
                                     self.get_num_cacheable_tokens(num_computed_tokens, group_id),
                                     self.retention_interval, boundaries)

    def find_longest_cache_hit(self, block_hashes: Sequence[BlockHash],
                               max_cache_hit_length: int) -> tuple[HitBlocks, int, int]:
        """(hit blocks per group, hit length, uncached common prefix tokens)."""
        raise NotImplementedError("each coordinator (no-cache, unitary, hybrid) implements its own cache-hit search")

    # ------------------------------------------------------------------ freeing and the rest

    def free(self, request_id: str) -> None:
        for manager in self.single_type_managers:
            manager.free(request_id)

    def pop_blocks_for_free(self, request_id: str) -> list[KVCacheBlock]:
        blocks: list[KVCacheBlock] = []
        for manager in self.single_type_managers:
            blocks.extend(manager.pop_blocks_for_free(request_id))
        return blocks

    def remove_skipped_blocks(self, request_id: str, processed_computed_tokens: int,
                              num_prompt_tokens: int | None = None) -> None:
        for manager in self.single_type_managers:
            manager.remove_skipped_blocks(request_id, processed_computed_tokens, num_prompt_tokens)

    def get_blocks(self, request_id: str) -> HitBlocks:
        return tuple(m.req_to_blocks.get(request_id) or [] for m in self.single_type_managers)

    def emit_cached_block_events(self, request: Request, block_hashes: Sequence[BlockHash],
                                 computed_blocks: HitBlocks) -> None:
        """``BlockStored`` per group for a reused prefix (``kv_cache_report_mode == "full"``), at
        the group manager's block size. NOTE: vLLM 0.33.0 passes the spec's unscaled
        ``block_size`` here, so under DCP its lookup asserts (a sharded group's unscaled block is
        not a multiple of the hash block) or announces the hit at the wrong granularity; kvref
        announces the blocks the hit holds (docs/differences.md, issue #23)."""
        for group_id, blocks in enumerate(computed_blocks):
            if blocks:
                manager = self.single_type_managers[group_id]
                manager.block_pool.emit_cached_block_events(request, block_hashes, len(blocks),
                                                            manager.block_size, group_id)

    def reset_prefix_cache(self) -> bool:
        """Reset each manager's pool once (the HiSparse host source has its own)."""
        pools = dict.fromkeys(m.block_pool for m in self.single_type_managers) or {self.block_pool: None}
        return all([pool.reset_prefix_cache() for pool in pools])

    def new_step_starts(self) -> None:
        for manager in self.single_type_managers:
            manager.new_step_starts()

    def check_invariants(self) -> None:
        """The pool's I1–I8 and every manager's rules, all on one shared pool (M8, docs/invariants.md)."""
        self.block_pool.check_invariants()
        for manager in self.single_type_managers:
            if isinstance(manager, HiSparseSourceManager):  # bound to its private host pool
                manager.block_pool.check_invariants()
            else:
                assert manager.block_pool is self.block_pool, \
                    f"M8: group {manager.kv_cache_group_id}'s manager has a pool of its own"
            manager.check_invariants()
        if self.hisparse_coordinator is not None:
            self.hisparse_coordinator.check_invariants()


class KVCacheCoordinatorNoPrefixCache(KVCacheCoordinator):
    """Prefix caching off: hits are always empty."""

    def __init__(self, config: PoolConfig) -> None:
        super().__init__(config)
        if config.enable_caching:
            raise InvalidFieldError("enable_caching", True, "False for the no-prefix-cache coordinator")

    def find_longest_cache_hit(self, block_hashes: Sequence[BlockHash],
                               max_cache_hit_length: int) -> tuple[HitBlocks, int, int]:
        return tuple([] for _ in self.single_type_managers), 0, 0


class UnitaryKVCacheCoordinator(KVCacheCoordinator):
    """One group: the hit is that manager's own lookup, aligned to its block size."""

    def __init__(self, config: PoolConfig) -> None:
        if isinstance(config, PoolConfig):
            if len(config.groups) != 1:
                raise InvalidFieldError("groups", len(config.groups), "exactly one group")
            # the manager's block: block_size × DCP for a DCP-sharded group
            block_size = manager_block_size(scheduler_spec(config.groups[0].kv_cache_spec), config.dcp_world_size)
            if config.enable_caching and config.hash_block_size != block_size:
                raise InvalidFieldError("hash_block_size", config.hash_block_size,
                                        f"the group's block_size={block_size} (one group"
                                        + (f", DCP {config.dcp_world_size})" if block_size != scheduler_spec(
                                            config.groups[0].kv_cache_spec).block_size else ")"))
        super().__init__(config)
        self.block_size = self.single_type_managers[0].block_size
        self.single_type_managers[0].use_eagle = 0 in self.drop_eagle_group_ids

    def find_longest_cache_hit(self, block_hashes: Sequence[BlockHash],
                               max_cache_hit_length: int) -> tuple[HitBlocks, int, int]:
        manager = self.single_type_managers[0]
        blocks, hit_length = type(manager).find_longest_cache_hit(
            block_hashes, max_cache_hit_length, [0], self.block_pool, self.specs[0],
            0 in self.drop_eagle_group_ids, self.block_size,
            **context_parallel_kwargs(manager, self.config.pcp_world_size))
        return blocks, hit_length, 0


@dataclass
class SpecGroup:
    """Groups with one spec, looked up together (``use_eagle`` if any member drops EAGLE)."""

    spec: KVCacheSpec
    group_ids: list[int]
    manager_cls: type[SingleTypeKVCacheManager]
    use_eagle: bool
    #: the managers' block size (``spec.block_size × DCP`` for a DCP-sharded spec) and the
    #: ``find_longest_cache_hit`` keywords of their context-parallel world sizes
    block_size: int = 0
    cp_kwargs: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not self.block_size:
            self.block_size = self.spec.block_size
        # cached type tests: the lookup loop runs for every new request
        self.is_full_attention = isinstance(self.spec, FullAttentionSpec)
        self.is_mamba = isinstance(self.spec, MambaSpec)


class HybridKVCacheCoordinator(KVCacheCoordinator):
    """Several groups sharing one pool; hits are aligned to ``scheduler_block_size``."""

    def __init__(self, config: PoolConfig) -> None:
        super().__init__(config)
        scheduler_block_size, hash_block_size = config.scheduler_block_size, config.hash_block_size
        for i, (spec, manager) in enumerate(zip(self.specs, self.single_type_managers)):
            if spec.prefix_cacheable and manager.block_size % hash_block_size:
                raise InvalidFieldError("hash_block_size", hash_block_size,
                                        f"a divisor of group {i}'s block_size={manager.block_size}")
        for i, spec in enumerate(self.specs):
            if isinstance(spec, ChunkedLocalAttentionSpec) and spec.block_size != scheduler_block_size:
                raise InvalidFieldError(f"groups[{i}].block_size", spec.block_size,
                                        f"scheduler_block_size={scheduler_block_size}: chunked local "
                                        "attention hits need block-aligned lookups (vLLM asserts this)")
        self.enable_partial_hash_hits = partial_hash_hits_enabled(
            self.specs, hash_block_size, [type(m) for m in self.single_type_managers], config.dcp_world_size)
        alignment = self._cache_hit_alignment_tokens
        for manager in self.single_type_managers:
            manager.cache_hit_alignment_tokens = alignment
        self._split_groups()

    @property
    def _cache_hit_alignment_tokens(self) -> int:
        """Where hits land (vLLM's private property of this name, which its tests read):
        ``hash_block_size`` with fine-grained partial hits, else ``scheduler_block_size``."""
        return self.hash_block_size if self.enable_partial_hash_hits else self.scheduler_block_size

    def _split_groups(self) -> None:
        """Batch prefix-cacheable groups with equal specs; full attention first (its left-to-right
        scan bounds the others cheaply)."""
        self.attention_groups: list[SpecGroup] = []
        for i, spec in enumerate(self.specs):
            if not spec.prefix_cacheable:
                continue
            cls = type(self.single_type_managers[i])
            use_eagle = i in self.drop_eagle_group_ids
            for group in self.attention_groups:
                if group.spec == spec and group.manager_cls is cls:
                    group.group_ids.append(i)
                    group.use_eagle = group.use_eagle or use_eagle
                    break
            else:
                manager = self.single_type_managers[i]
                self.attention_groups.append(SpecGroup(spec, [i], cls, use_eagle, manager.block_size,
                                                       context_parallel_kwargs(manager)))
        if not self.attention_groups:
            raise InvalidFieldError("kv_cache_groups", [type(s).__name__ for s in self.specs],
                                    "at least one prefix-cacheable group")
        self.attention_groups.sort(key=lambda g: not g.is_full_attention)
        #: exactly full attention + one other spec group: one pass of the fixed point suffices
        self._simple_hybrid = len(self.attention_groups) == 2 and self.attention_groups[0].is_full_attention
        for group in self.attention_groups:
            if group.use_eagle:
                for gid in group.group_ids:
                    self.single_type_managers[gid].use_eagle = True

    def _align_cacheable(self, num_tokens: int) -> int:
        """The longest prefix of ``num_tokens`` a later hit could match: whole scheduler blocks,
        or everything with fine-grained hits (rounding even to ``hash_block_size`` would
        re-register a privatized Mamba tail)."""
        if self.enable_partial_hash_hits:
            return num_tokens
        return round_down(num_tokens, self.scheduler_block_size)

    def get_num_cacheable_tokens(self, num_computed_tokens: int, kv_cache_group_id: int) -> int:
        """Only what a hit can land on is published; an EAGLE group also publishes the block past
        the boundary (it matches one block further and drops it)."""
        aligned = self._align_cacheable(num_computed_tokens)
        manager = self.single_type_managers[kv_cache_group_id]
        if manager.use_eagle and aligned > 0:
            finalized = max(0, num_computed_tokens - self.num_reprefillable_tokens)
            return min(finalized, self._align_cacheable(finalized) + manager.block_size)
        return aligned

    def _eagle_lookup_length(self, group: SpecGroup, length: int, num_hash_tokens: int) -> int:
        """An EAGLE (non-Mamba) group looks one drop unit past ``length`` and drops it again."""
        fine = self.enable_partial_hash_hits and group.manager_cls.supports_fine_grained_hash_lookup
        margin = eagle_proof_margin(group.block_size, self.hash_block_size, fine)
        return min(length + margin, num_hash_tokens)

    def find_longest_cache_hit(self, block_hashes: Sequence[BlockHash],
                               max_cache_hit_length: int) -> tuple[HitBlocks, int, int]:
        """Fixed point: each spec group looks up at most the current length and may shorten it;
        repeat until nobody shortens (one pass for full attention + one other group). Full
        attention is downward-closed, so after its first lookup it is only trimmed. An EAGLE group
        looks one block further and drops it, at most once per candidate length (vLLM #32802)."""
        num_groups = len(self.kv_cache_groups)
        hit_length = max_cache_hit_length
        longest_hit_length = 0  # the longest single-group hit: a shared prefix one group lacks
        blocks_by_group: list[list[KVCacheBlock] | None] = [None] * num_groups
        hit_by_group = [0] * num_groups
        simple = self._simple_hybrid
        eagle_verified: set[int] = set()
        max_hash_tokens = len(block_hashes) * self.hash_block_size
        alignment = self._cache_hit_alignment_tokens
        while True:
            curr_hit_length = hit_length
            for idx, group in enumerate(self.attention_groups):
                first = group.group_ids[0]
                if group.is_full_attention and blocks_by_group[first] is not None:
                    curr_hit_length = min(curr_hit_length, hit_by_group[first])
                    continue
                drop_eagle = group.use_eagle and idx not in eagle_verified
                max_length = curr_hit_length
                if drop_eagle and not group.is_mamba:
                    max_length = self._eagle_lookup_length(group, curr_hit_length, max_hash_tokens)
                blocks, new_hit = group.manager_cls.find_longest_cache_hit(
                    block_hashes, max_length, group.group_ids, self.single_type_managers[first].block_pool,
                    group.spec, drop_eagle, alignment,
                    **group.cp_kwargs)
                if drop_eagle:
                    eagle_verified.add(idx)
                elif new_hit < curr_hit_length:
                    eagle_verified.clear()
                curr_hit_length = new_hit
                for gid, group_blocks in zip(group.group_ids, blocks):
                    blocks_by_group[gid] = group_blocks
                    hit_by_group[gid] = new_hit
                longest_hit_length = max(longest_hit_length, curr_hit_length)
            if curr_hit_length >= hit_length:
                break
            hit_length = curr_hit_length
            if simple:
                break
        for group in self.attention_groups:
            # the HiSparse host source keeps its longer hit (``retains_longer_hit``)
            if not group.is_full_attention or getattr(self.single_type_managers[group.group_ids[0]],
                                                      "retains_longer_hit", False):
                continue
            num_blocks = cdiv(hit_length, group.block_size)
            for gid in group.group_ids:
                if blocks_by_group[gid] is not None:
                    del blocks_by_group[gid][num_blocks:]
                    hit_by_group[gid] = hit_length
        blocks_out = tuple(b if b is not None else [] for b in blocks_by_group)
        num_uncached_common_prefix_tokens = longest_hit_length - hit_length
        return blocks_out, hit_length, num_uncached_common_prefix_tokens

    def find_longest_cache_hit_per_group(self, block_hashes: Sequence[BlockHash],
                                         max_cache_hit_length: int) -> tuple[HitBlocks, tuple[int, ...]]:
        """Every spec group's own longest hit, not reconciled to one length: what a KV connector
        asks when Mamba and full attention hits diverge (vLLM's method of the same name, used by
        ``get_computed_blocks_for_connector`` and the offloading connector). EAGLE groups drop
        their block on every lookup (no fixed point to verify against)."""
        check_int("max_cache_hit_length", max_cache_hit_length, minimum=0)
        num_groups = len(self.kv_cache_groups)
        hit_blocks: list[list[KVCacheBlock]] = [[] for _ in range(num_groups)]
        hit_lengths = [0] * num_groups
        num_hash_tokens = len(block_hashes) * self.hash_block_size
        for group in self.attention_groups:
            length = max_cache_hit_length
            if group.use_eagle and not group.is_mamba:
                length = self._eagle_lookup_length(group, length, num_hash_tokens)
            blocks, group_hit = group.manager_cls.find_longest_cache_hit(
                block_hashes, length, group.group_ids, self.single_type_managers[group.group_ids[0]].block_pool,
                group.spec, group.use_eagle,
                self._cache_hit_alignment_tokens, **group.cp_kwargs)
            for gid, group_blocks in zip(group.group_ids, blocks):
                hit_blocks[gid] = group_blocks
                hit_lengths[gid] = group_hit
        return tuple(hit_blocks), tuple(hit_lengths)


def get_kv_cache_coordinator(config: PoolConfig) -> KVCacheCoordinator:
    """Pick the coordinator vLLM would: no caching -> NoPrefixCache; one group -> Unitary; else
    Hybrid."""
    if not isinstance(config, PoolConfig):
        raise InvalidFieldError("config", config, "a kvref.impl.interface.PoolConfig")
    if not config.enable_caching:
        return KVCacheCoordinatorNoPrefixCache(config)
    cls = UnitaryKVCacheCoordinator if len(config.groups) == 1 else HybridKVCacheCoordinator
    return cls(config)
