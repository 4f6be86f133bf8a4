"""Where a prefill chunk must stop on a Mamba "align" pool (vLLM ``Scheduler._mamba_block_aligned_split``).

In "align" cache mode a Mamba state is only written at chunk ends, and state slot ``p`` must hold
the state after exactly ``(p + 1) * block_size`` tokens. So the scheduler clips every prefill chunk:

* a chunk that does not reach the end of the prefill ends on a block boundary (a block wider than
  the largest prefill chunk advances sub-block and re-aligns at the next boundary);
* a chunk starting mid-block stops at the next block boundary;
* no chunk runs past the last cacheable block boundary of the sequence
  (``get_mamba_prefill_checkpoint_position(num_tokens, block_size, …)``), nor past the prompt's
  partial-tail hash boundary when fine-grained hits are on, nor past a shared-prefix junction;
* unless the backend exports the prefill checkpoint from inside this (final) chunk
  (``is_mamba_prefill_checkpoint_valid`` with prefill checkpoint blocks): then neither the last
  cacheable position nor the partial tail stops it.

The earliest mandatory stop strictly inside the chunk wins. ``prefill_end`` is
``max(num_prompt_tokens, num_tokens - 1)``: a resumed request replays its output tokens as prefill.

Pure functions of plain numbers, so the KV-manager generators, the reference scheduler and the
conformance check against vLLM's own method share one statement of the rule.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvref.spec.errors import InvalidFieldError, check_int
from kvref.spec.kv_cache_interface import (
    KVCacheSpec,
    MambaSpec,
    get_mamba_prefill_checkpoint_position,
    is_mamba_prefill_checkpoint_valid,
)


@dataclass(frozen=True)
class MambaSplitConfig:
    """The scheduler's settings the split reads (vLLM's attribute names in brackets).

    Args:
        block_size: the aligned block size (``cache_config.block_size``; "align" mode sets the
            Mamba block to it).
        hash_block_size: prefix-hash granularity (``hash_block_size``).
        scheduler_block_size: the scheduler's block size (``block_size``, the LCM of the groups'),
            which places the prompt checkpoint without fine-grained hits; None = ``block_size``.
        partial_cache_hit: fine-grained Mamba hits are on (``mamba_partial_cache_hit``).
        has_prefill_checkpoint_blocks: every Mamba group has checkpoint blocks
            (``mamba_has_prefill_checkpoint_blocks``).
        checkpoint_alignment: the first Mamba group's ``prefill_checkpoint_alignment``.
        use_eagle_block_drop: EAGLE hits drop their last block (``use_eagle_block_drop``).
        num_hash_lookahead_tokens: tokens a lookahead hash needs past a boundary.
        max_prefill_tokens: ``max_num_scheduled_tokens``, lowered by a positive
            ``long_prefill_token_threshold``.
        shared_prefix_checkpoint: stop exactly at a shared-prefix junction
            (``mamba_shared_prefix_checkpoint``), else at its block floor.
    """

    block_size: int
    hash_block_size: int
    partial_cache_hit: bool = False
    has_prefill_checkpoint_blocks: bool = False
    checkpoint_alignment: int | None = None
    use_eagle_block_drop: bool = False
    num_hash_lookahead_tokens: int = 0
    max_prefill_tokens: int = 1 << 30
    shared_prefix_checkpoint: bool = False
    scheduler_block_size: int | None = None

    def __post_init__(self) -> None:
        check_int("block_size", self.block_size, minimum=1)
        check_int("scheduler_block_size", self.scheduler_block_size, minimum=1, allow_none=True)
        check_int("hash_block_size", self.hash_block_size, minimum=1)
        check_int("checkpoint_alignment", self.checkpoint_alignment, minimum=1, allow_none=True)
        check_int("num_hash_lookahead_tokens", self.num_hash_lookahead_tokens, minimum=0)
        check_int("max_prefill_tokens", self.max_prefill_tokens, minimum=1)
        for flag in ("partial_cache_hit", "has_prefill_checkpoint_blocks", "use_eagle_block_drop",
                     "shared_prefix_checkpoint"):
            if not isinstance(getattr(self, flag), bool):
                raise InvalidFieldError(flag, getattr(self, flag), "True or False")

    @classmethod
    def from_specs(cls, specs: "tuple[KVCacheSpec, ...] | list[KVCacheSpec]", hash_block_size: int,
                   scheduler_block_size: int, partial_cache_hit: bool, use_eagle_block_drop: bool = False,
                   max_prefill_tokens: int = 1 << 30) -> "MambaSplitConfig | None":
        """The config of a pool's group specs, or None when no Mamba group is in "align" mode
        (vLLM's ``need_mamba_block_aligned_split``). The block size is the Mamba group's (in an
        "align" hybrid vLLM sets ``cache_config.block_size`` to it)."""
        if not isinstance(specs, (tuple, list)) or not all(isinstance(s, KVCacheSpec) for s in specs):
            raise InvalidFieldError("specs", specs, "a sequence of KVCacheSpec")
        mamba = [s for s in specs if isinstance(s, MambaSpec)]
        if not any(s.mamba_cache_mode == "align" for s in mamba):
            return None
        return cls(block_size=mamba[0].block_size, hash_block_size=hash_block_size,
                   partial_cache_hit=partial_cache_hit,
                   has_prefill_checkpoint_blocks=all(s.num_prefill_checkpoint_blocks > 0 for s in mamba),
                   checkpoint_alignment=mamba[0].prefill_checkpoint_alignment,
                   use_eagle_block_drop=use_eagle_block_drop, max_prefill_tokens=max_prefill_tokens,
                   scheduler_block_size=scheduler_block_size)


def mamba_block_aligned_split(config: MambaSplitConfig, num_computed_tokens: int, num_prompt_tokens: int,
                              num_tokens: int, num_new_tokens: int, num_new_local_computed_tokens: int = 0,
                              num_external_computed_tokens: int = 0, shared_prefix_boundary: int = 0) -> int:
    """How many of ``num_new_tokens`` the chunk may schedule (possibly 0).

    ``num_computed_tokens`` + the new local hit + external tokens is where the chunk starts;
    ``num_tokens`` counts prompt and output tokens; ``shared_prefix_boundary`` is the request's
    junction from ``get_computed_blocks`` (0 if none).
    """
    if not isinstance(config, MambaSplitConfig):
        raise InvalidFieldError("config", config, "a MambaSplitConfig")
    for name, value in (("num_computed_tokens", num_computed_tokens), ("num_prompt_tokens", num_prompt_tokens),
                        ("num_tokens", num_tokens), ("num_new_tokens", num_new_tokens),
                        ("num_new_local_computed_tokens", num_new_local_computed_tokens),
                        ("num_external_computed_tokens", num_external_computed_tokens),
                        ("shared_prefix_boundary", shared_prefix_boundary)):
        check_int(name, value, minimum=0)
    start = num_computed_tokens + num_new_local_computed_tokens + num_external_computed_tokens
    prefill_end = max(num_prompt_tokens, num_tokens - 1)
    if start >= prefill_end:
        return num_new_tokens
    bs, hbs = config.block_size, config.hash_block_size
    drop, lookahead = config.use_eagle_block_drop, config.num_hash_lookahead_tokens
    last_cache_position = get_mamba_prefill_checkpoint_position(num_tokens, bs, drop, lookahead)
    end = start + num_new_tokens
    checkpoint_position = get_mamba_prefill_checkpoint_position(
        prefill_end, hbs if config.partial_cache_hit else (config.scheduler_block_size or bs), drop, lookahead)
    use_internal_checkpoint = (config.has_prefill_checkpoint_blocks and end >= prefill_end
                               and is_mamba_prefill_checkpoint_valid(start, end, checkpoint_position, hbs, bs,
                                                                     config.checkpoint_alignment))
    if use_internal_checkpoint:
        last_cache_position = 0
    if end < prefill_end:
        # chunk ends are block aligned, unless a block is wider than any prefill chunk
        aligned_end = end // bs * bs
        if aligned_end > start or bs <= config.max_prefill_tokens:
            end = aligned_end
    next_block_boundary = (start // bs + 1) * bs
    tail_boundary = (get_mamba_prefill_checkpoint_position(num_prompt_tokens, hbs, drop, lookahead)
                     if config.partial_cache_hit and not use_internal_checkpoint else 0)
    junction = shared_prefix_boundary
    block_floored = start + (junction - start) // bs * bs
    junction_stop = junction if config.shared_prefix_checkpoint and junction <= num_prompt_tokens \
        else block_floored
    stops = (
        next_block_boundary if start % bs and not use_internal_checkpoint else 0,
        last_cache_position,
        tail_boundary if last_cache_position < tail_boundary < num_prompt_tokens else 0,
        junction_stop if start < junction < end else 0,
    )
    end = min((s for s in stops if start < s < end), default=end)
    return max(end - start, 0)


def scheduler_split_config(scheduler) -> MambaSplitConfig | None:
    """The split settings of a reference :class:`~kvref.impl.reference.scheduler.Scheduler` (its
    pool and config), computed once and kept on it; None unless a Mamba group is "align" (vLLM's
    ``need_mamba_block_aligned_split``)."""
    cached = getattr(scheduler, "_mamba_split_config", False)
    if cached is not False:
        return cached
    from kvref.impl.reference.kv_cache_coordinator import manager_class_for_spec, partial_hash_hits_enabled

    pool, cfg = scheduler.pool, scheduler.config
    specs = [getattr(g.kv_cache_spec, "first_spec", g.kv_cache_spec) for g in pool.groups]
    partial = pool.enable_caching and len(specs) > 1 and partial_hash_hits_enabled(
        specs, pool.hash_block_size, [manager_class_for_spec(s) for s in specs])
    max_prefill = cfg.scheduled_tokens_cap  # vLLM: self.max_num_scheduled_tokens, not the input budget
    if cfg.long_prefill_token_threshold > 0:
        max_prefill = min(max_prefill, cfg.long_prefill_token_threshold)
    config = MambaSplitConfig.from_specs(specs, pool.hash_block_size, pool.scheduler_block_size, partial,
                                         use_eagle_block_drop=pool.use_eagle, max_prefill_tokens=max_prefill)
    if config is not None:
        # vLLM's scheduler reads both beside the specs: lookahead hashes move the prompt checkpoint
        # (get_mamba_prefill_checkpoint_position), and mamba_shared_prefix_checkpoint is
        # mamba_partial_cache_hit and the manager's narrowing (found replaying recorded runs, #28)
        from dataclasses import replace

        config = replace(config, num_hash_lookahead_tokens=pool.num_hash_lookahead_tokens,
                         shared_prefix_checkpoint=config.partial_cache_hit and bool(
                             getattr(scheduler.kv_cache_manager, "mamba_shared_prefix_checkpoint", False)))
    scheduler._mamba_split_config = config
    return config


def store_shared_prefix_boundary(scheduler, request) -> None:
    """Set ``request.shared_prefix_boundary`` from a fresh prefix-cache look-up, as vLLM's
    ``schedule()`` does on every admission look-up (also one that starts an async KV load: the
    promoted request's later chunks stop at the same junction).

    Only where it matters, Mamba "align" pools (the split) and sparse retention (which keeps the
    junction's sliding-window tail too, ``reachable_block_mask``'s reachable boundaries); elsewhere
    the second look-up is skipped."""
    if scheduler_split_config(scheduler) is None and scheduler.pool.prefix_cache_retention_interval is None:
        return
    manager = getattr(scheduler.kv_cache_manager, "manager", None)  # the reference's rich manager
    lookup = getattr(manager, "get_computed_blocks", None)
    request.shared_prefix_boundary = lookup(request)[2] if lookup is not None else 0


def split_scheduled_chunk(scheduler, request, num_new_tokens: int, num_new_local_computed_tokens: int = 0,
                          admitting: bool = False, num_external_computed_tokens: int = 0) -> int:
    """The scheduler's hook: ``num_new_tokens`` clipped for ``request`` on a Mamba "align" pool,
    unchanged on any other pool.

    ``admitting``: the request was just looked up in the prefix cache, which (as in vLLM's
    ``schedule()``) sets its ``shared_prefix_boundary``: the junction where one group cached more
    than the reconciled hit, a stop for this and every later chunk of the request (see
    :func:`store_shared_prefix_boundary`). ``num_external_computed_tokens``: a KV connector's
    (synchronous) external hit, which moves the chunk's start as in vLLM's
    ``start = num_computed + local + external``."""
    if admitting:
        store_shared_prefix_boundary(scheduler, request)
    config = scheduler_split_config(scheduler)
    if config is None:
        return num_new_tokens
    return mamba_block_aligned_split(config, request.num_computed_tokens, request.num_prompt_tokens,
                                     request.num_tokens, num_new_tokens, num_new_local_computed_tokens,
                                     num_external_computed_tokens,
                                     shared_prefix_boundary=getattr(request, "shared_prefix_boundary", 0))
