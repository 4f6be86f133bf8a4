"""``plan_kv_cache``: the whole startup sizing of vLLM 0.33.0 for one worker, as a pure function.

Replays ``EngineCore._initialize_kv_caches`` → ``get_global_kv_cache_groups`` →
``get_kv_cache_configs`` → ``generate_scheduler_kv_cache_config`` → ``update_kv_cache_capacity``
→ ``resolve_kv_cache_block_sizes``, in that order:

1. group the layers (:mod:`kvref.spec.grouping`);
2. bytes per block (:func:`~kvref.spec.pool_sizing.pool_bytes_per_block`);
3. ``num_gpu_blocks_override`` replaces the profiled memory by ``override × bytes_per_block``
   *before* auto-fit and the check (vLLM #41069, fixing #35541);
4. hold back one block for the null block in the check and in auto-fit (vLLM #47272/#48724);
5. auto-fit ``max_model_len`` when asked (``"auto"``/``-1``);
6. the enough-memory check (:class:`~kvref.spec.errors.InsufficientKVCacheError` carries the
   estimated maximum length);
7. ``num_blocks = memory // bytes_per_block`` (the null block included);
8. the scheduler's view of the groups, max concurrency, and the scheduler/hash block sizes
   (vLLM #44165).

One worker, no pipeline parallelism; any of vLLM's six ``KVCacheLayout``s (default ``LBNHC``;
block-outermost ones pack mixed page sizes, :mod:`kvref.spec.planning_packed`); what is not
modelled is listed in docs/differences.md.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Mapping

from .block_sizes import resolve_cache_hit_alignment_tokens, resolve_kv_cache_block_sizes
from .config import EngineConfig
from .errors import InvalidFieldError, check_int
from .grouping import check_exact_partition, validate_layers
from .kv_cache_interface import KVCacheGroupSpec, KVCacheSpec, UniformTypeKVCacheSpecs
from .kv_cache_tensors import KVCacheTensor, check_kv_cache_tensors, kv_cache_tensors
from .pool_sizing import (
    auto_fit_max_model_len,
    check_enough_kv_cache_memory,
    estimate_max_model_len,
    group_blocks_per_request,
    max_concurrency,
    needed_bytes_for,
    pool_bytes_per_block,
)
from .planning_packed import DEFAULT_KV_CACHE_LAYOUT, check_layout, get_kv_cache_groups_for_layout, validate_kv_cache_layout


@dataclass(frozen=True)
class GroupPlan:
    """One KV cache group of a plan, at the plan's final ``max_model_len``.

    Args:
        layer_names: the layers sharing this group's block table.
        kv_cache_spec: the group spec as the workers see it (a :class:`UniformTypeKVCacheSpecs`
            for mixed page sizes of one type).
        scheduler_spec: the spec the scheduler's managers get (first layer's spec for a
            uniform-type group, as ``generate_scheduler_kv_cache_config`` does).
        blocks_per_request: block ids one ``max_model_len`` request may hold in this group.
        admission_cap: ``max_admission_blocks_per_request`` for sliding-window / chunked-local
            groups (the runtime gate's cap), else None.
        num_padding_layers: layers this group lacks to the widest group (their pages are wasted).
    """

    layer_names: tuple[str, ...]
    kv_cache_spec: KVCacheSpec
    scheduler_spec: KVCacheSpec
    blocks_per_request: int
    admission_cap: int | None
    num_padding_layers: int

    @property
    def kind(self) -> str:
        return type(self.scheduler_spec).__name__

    @property
    def block_size(self) -> int:
        return self.kv_cache_spec.block_size

    @property
    def page_size_bytes(self) -> int:
        """Bytes of one block of one layer of this group (sum of layers for uniform-type groups)."""
        return self.scheduler_spec.page_size_bytes


@dataclass(frozen=True)
class KVCachePlan:
    """The result of :func:`plan_kv_cache`: what vLLM would build at startup.

    ``num_blocks`` includes the null block (block 0), so ``num_blocks - 1`` blocks are usable.
    impl builds its pool from :meth:`pool_config_kwargs` (``PoolConfig(**plan.pool_config_kwargs())``);
    spec does not import impl.

    Fields (vLLM's name in parentheses):
        groups: worker-side groups (``KVCacheConfig.kv_cache_groups`` of the worker).
        scheduler_groups: the scheduler's groups (``generate_scheduler_kv_cache_config``).
        group_plans: per group, blocks of one max-length request and the admission cap.
        bytes_per_block: ``_pool_bytes_per_block``.
        memory_bytes: profiled memory, or ``num_gpu_blocks_override × bytes_per_block``.
        check_memory_bytes: ``memory_bytes - bytes_per_block`` (null block held back).
        num_blocks: ``KVCacheConfig.num_blocks`` (``cache_config.num_gpu_blocks``).
        max_model_len / original_max_model_len / auto_fitted: after / before auto-fit.
        needed_bytes: ``_max_memory_usage_bytes_from_groups`` at ``max_model_len``.
        scheduler_block_size, hash_block_size: ``resolve_kv_cache_block_sizes``.
        cache_hit_alignment_tokens: ``resolve_cache_hit_alignment_tokens``.
        max_concurrency, kv_cache_size_tokens: ``get_kv_cache_capacity`` (null block counted).
        max_servable_len: kvref's own figure: the largest length (up to the model's own maximum)
            one request could have in this pool.
    """

    groups: tuple[KVCacheGroupSpec, ...]
    scheduler_groups: tuple[KVCacheGroupSpec, ...]
    group_plans: tuple[GroupPlan, ...]
    bytes_per_block: int
    memory_bytes: int
    check_memory_bytes: int
    num_blocks: int
    max_model_len: int
    original_max_model_len: int
    auto_fitted: bool
    needed_bytes: int
    scheduler_block_size: int
    hash_block_size: int
    cache_hit_alignment_tokens: int
    max_concurrency: float
    kv_cache_size_tokens: int
    max_servable_len: int
    max_in_flight_tokens: int
    enable_caching: bool
    config: EngineConfig = field(repr=False)
    kv_cache_layout: str = DEFAULT_KV_CACHE_LAYOUT

    @property
    def num_usable_blocks(self) -> int:
        """Blocks a request can get: all but the null block."""
        return self.num_blocks - 1

    @property
    def blocks_per_request(self) -> tuple[int, ...]:
        return tuple(g.blocks_per_request for g in self.group_plans)

    @property
    def admission_caps(self) -> tuple[int | None, ...]:
        return tuple(g.admission_cap for g in self.group_plans)

    @property
    def kv_cache_tensors(self) -> tuple[KVCacheTensor, ...]:
        """The worker's ``KVCacheConfig.kv_cache_tensors``: where each layer's bytes live in the
        allocation (:mod:`kvref.spec.kv_cache_tensors`, #22)."""
        return kv_cache_tensors(self.groups, self.num_blocks, self.kv_cache_layout)

    def pool_config_kwargs(self) -> dict[str, Any]:
        """Keyword arguments of ``kvref.impl.interface.PoolConfig`` for this plan."""
        return dict(num_blocks=self.num_blocks, groups=self.scheduler_groups, max_model_len=self.max_model_len,
                    scheduler_block_size=self.scheduler_block_size, hash_block_size=self.hash_block_size,
                    max_in_flight_tokens=self.max_in_flight_tokens, enable_caching=self.enable_caching)

    def check_invariants(self) -> None:
        """The startup guarantees vLLM relies on later (AssertionError when one is broken)."""
        assert self.bytes_per_block == pool_bytes_per_block(self.groups)
        assert self.num_blocks * self.bytes_per_block <= self.memory_bytes
        # S4: one max-length request fits in the usable blocks (null block held back).
        assert sum(self.blocks_per_request) <= self.num_usable_blocks, (self.blocks_per_request, self.num_blocks)
        assert self.needed_bytes == self.bytes_per_block * sum(self.blocks_per_request)
        assert self.needed_bytes <= self.check_memory_bytes
        # S6 / vLLM #44165: the coordinator's divisibility assertion.
        assert self.scheduler_block_size % self.hash_block_size == 0
        for g in self.scheduler_groups:
            assert self.scheduler_block_size % g.kv_cache_spec.block_size == 0
        assert 1 <= self.max_model_len <= self.original_max_model_len or not self.auto_fitted
        assert self.max_servable_len >= self.max_model_len
        for gp in self.group_plans:
            if gp.admission_cap is not None and gp.kv_cache_spec is gp.scheduler_spec:
                # S1: sizing charges exactly the runtime cap
                assert gp.admission_cap == gp.blocks_per_request
        check_kv_cache_tensors(self.groups, self.num_blocks, self.kv_cache_layout, self.kv_cache_tensors)

    def to_dict(self) -> dict[str, Any]:
        """Plain data (JSON-ready) for ``kvref size --json``."""
        return {
            "num_blocks": self.num_blocks,
            "num_usable_blocks": self.num_usable_blocks,
            "bytes_per_block": self.bytes_per_block,
            "memory_bytes": self.memory_bytes,
            "max_model_len": self.max_model_len,
            "original_max_model_len": self.original_max_model_len,
            "auto_fitted": self.auto_fitted,
            "needed_bytes_per_max_len_request": self.needed_bytes,
            "blocks_per_max_len_request": sum(self.blocks_per_request),
            "scheduler_block_size": self.scheduler_block_size,
            "hash_block_size": self.hash_block_size,
            "cache_hit_alignment_tokens": self.cache_hit_alignment_tokens,
            "max_concurrency": self.max_concurrency,
            "kv_cache_size_tokens": self.kv_cache_size_tokens,
            "max_servable_len": self.max_servable_len,
            "max_in_flight_tokens": self.max_in_flight_tokens,
            "groups": [
                {
                    "kind": g.kind,
                    "layers": list(g.layer_names),
                    "num_layers": len(g.layer_names),
                    "num_padding_layers": g.num_padding_layers,
                    "block_size": g.block_size,
                    "page_size_bytes": g.page_size_bytes,
                    "blocks_per_request": g.blocks_per_request,
                    "admission_cap": g.admission_cap,
                }
                for g in self.group_plans
            ],
        }


def scheduler_view(groups: tuple[KVCacheGroupSpec, ...]) -> tuple[KVCacheGroupSpec, ...]:
    """vLLM's ``generate_scheduler_kv_cache_config``: a uniform-type group is represented by its
    first layer's spec (all its layers need the same token slots)."""
    from .pool_sizing import validate_groups

    groups = tuple(validate_groups(groups))
    out = []
    for g in groups:
        spec = g.kv_cache_spec
        if isinstance(spec, UniformTypeKVCacheSpecs):
            spec = spec.first_spec
        out.append(KVCacheGroupSpec(g.layer_names, spec, g.is_eagle_group))
    return tuple(out)


def plan_kv_cache(layers: Mapping[str, KVCacheSpec], config: EngineConfig, available_memory: int, *,
                  kv_cache_layout: str = DEFAULT_KV_CACHE_LAYOUT) -> KVCachePlan:
    """Size the KV cache pool for ``layers`` (layer name → spec, model order) as vLLM 0.33.0 does.

    Args:
        layers: every KV-cache layer of the model, as the worker reports them (the specs vLLM gets
            after ``get_global_kv_cache_groups`` sets ``extra_retained_tokens``).
        config: engine settings; ``max_model_len="auto"`` (or -1) auto-fits.
        available_memory: bytes the profiler left for the KV cache (ignored for the block count
            when ``num_gpu_blocks_override`` is set, exactly as in vLLM).
        kv_cache_layout: vLLM's resolved ``cache_config.kv_cache_layout`` (``VLLM_KV_CACHE_LAYOUT``);
            block-outermost layouts (``BLHNC``, ``BLNHC``, ``BHLNC``) pack mixed page sizes
            (:mod:`kvref.spec.planning_packed`).

    Raises:
        InvalidFieldError: bad input, an invalid ``prefix_match_unit``, a sliding-window layer
            with DCP > 1, or a ``kv_cache_layout`` that cannot express mixed page sizes.
        KVCacheGroupingError: layers vLLM cannot group.
        InsufficientKVCacheError: the pool cannot hold one ``max_model_len`` request (or, with
            auto-fit, a single token); ``estimated_max_model_len`` says what would fit.
    """
    if not isinstance(config, EngineConfig):
        raise InvalidFieldError("config", config, "an EngineConfig")
    check_int("available_memory", available_memory, minimum=0)
    layers = validate_layers(layers)
    check_layout(kv_cache_layout)

    groups = get_kv_cache_groups_for_layout(layers, config.disable_hybrid_kv_cache_manager, kv_cache_layout)
    check_exact_partition(groups, layers)
    validate_kv_cache_layout(kv_cache_layout, groups)  # vLLM: in the first block-size probe
    bpb = pool_bytes_per_block(groups)
    memory = available_memory
    if config.num_gpu_blocks_override is not None:
        memory = config.num_gpu_blocks_override * bpb
    check_memory = memory - bpb  # the null block is never handed out

    original = config.resolved_max_model_len
    max_model_len = original
    if config.auto_fit:
        max_model_len = auto_fit_max_model_len(groups, config, check_memory, original)
    check_enough_kv_cache_memory(groups, config, check_memory, max_model_len)
    num_blocks = memory // bpb

    sched_groups = scheduler_view(groups)
    widest = max(len(g.layer_names) for g in groups)
    group_plans = []
    for g, sg in zip(groups, sched_groups):
        spec = sg.kv_cache_spec
        cap = spec.admission_cap(config.max_in_flight_tokens, max_model_len)
        group_plans.append(GroupPlan(g.layer_names, g.kv_cache_spec, spec,
                                     group_blocks_per_request(g.kv_cache_spec, config, max_model_len), cap,
                                     widest - len(g.layer_names)))
    concurrency = max_concurrency(sched_groups, config, max_model_len, num_blocks)
    scheduler_block_size, hash_block_size = resolve_kv_cache_block_sizes(sched_groups, config)
    servable = estimate_max_model_len(groups, config, check_memory, max(config.derived_max_model_len, max_model_len))
    return KVCachePlan(
        groups=groups, scheduler_groups=sched_groups, group_plans=tuple(group_plans), bytes_per_block=bpb,
        memory_bytes=memory, check_memory_bytes=check_memory, num_blocks=num_blocks,
        max_model_len=max_model_len, original_max_model_len=original, auto_fitted=config.auto_fit,
        needed_bytes=needed_bytes_for(groups, config, max_model_len),
        scheduler_block_size=scheduler_block_size, hash_block_size=hash_block_size,
        cache_hit_alignment_tokens=resolve_cache_hit_alignment_tokens(sched_groups, config, scheduler_block_size,
                                                                      hash_block_size),
        max_concurrency=concurrency,
        kv_cache_size_tokens=int(concurrency * max_model_len) if concurrency != float("inf") else -1,
        max_servable_len=servable, max_in_flight_tokens=config.max_in_flight_tokens,
        enable_caching=config.enable_prefix_caching, config=config, kv_cache_layout=kv_cache_layout)
