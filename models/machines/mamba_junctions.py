"""The Mamba shared-prefix checkpoint in the KV-manager machine (issue #23).

vLLM 0.33.0's ``CacheConfig.enable_mamba_shared_prefix_checkpoint``: when a request's prefix-cache
hit is held below a longer one by a lagging Mamba group (``get_computed_blocks`` returns the
junction, which the scheduler stores as ``Request.shared_prefix_boundary``), the scheduler ends a
prefill chunk exactly at the junction and the Mamba "align" manager keys the state there as a
partial tail, so the next sibling sharing that prefix resumes at it instead of recomputing the
prefix. ``KVCacheManager`` narrows the flag (``mamba_shared_prefix_checkpoint``): only with EAGLE
groups, partial hash hits and no multi-module MTP tail; the scheduler reads the same predicate.

Here: the draw (ask for the flag on pools with a Mamba "align" group, with EAGLE one pool in two),
the comparison of the narrowed predicate between implementations, the chunk split that stops at
the junction, and a counter of junction states keyed inside a block (tests assert the path ran).
"""

from __future__ import annotations

import dataclasses

from hypothesis import strategies as st

from kvref.impl.interface import PoolConfig
from kvref.impl.reference.mamba_manager import MambaManager
from kvref.impl.reference.scheduler_mamba_split import MambaSplitConfig
from kvref.models.conformance.differential import Divergence, Harness
from kvref.spec.errors import InvalidFieldError
from kvref.spec.kv_cache_interface import MambaSpec
from kvref.spec.mathutil import cdiv


def shared_prefix_checkpoint_draws(mode: bool | str) -> st.SearchStrategy[tuple[bool, bool]]:
    """(ask for the flag, turn EAGLE on): ``mode`` True asks one pool in two, ``"always"`` always."""
    if mode not in (True, "always"):
        raise InvalidFieldError("shared_prefix_checkpoint", mode, 'True or "always"')
    return st.tuples(st.just(True) if mode == "always" else st.booleans(), st.booleans())


def with_shared_prefix_checkpoint(pool: PoolConfig, ask: bool, eagle: bool) -> PoolConfig:
    """``pool`` with ``enable_mamba_shared_prefix_checkpoint=ask`` (and EAGLE drafting added when
    ``eagle``) where a Mamba group runs in "align" mode; other pools unchanged."""
    if not ask or not any(isinstance(g.kv_cache_spec, MambaSpec) and g.kv_cache_spec.mamba_cache_mode == "align"
                          for g in pool.groups):
        return pool
    return dataclasses.replace(pool, enable_mamba_shared_prefix_checkpoint=True,
                               use_eagle=pool.use_eagle or eagle)


def compare_shared_prefix_checkpoint(managers: dict) -> bool:
    """The implementations' narrowed ``mamba_shared_prefix_checkpoint`` (vLLM's ``KVCacheManager``
    and the reference's), which must agree: it decides where the scheduler ends chunks."""
    answers = {k: m.mamba_shared_prefix_checkpoint for k, m in managers.items()
               if hasattr(m, "mamba_shared_prefix_checkpoint")}
    if len(set(answers.values())) > 1:
        raise Divergence(f"mamba_shared_prefix_checkpoint differs: {answers}",
                         "setup: mamba_shared_prefix_checkpoint differs")
    return bool(answers) and next(iter(answers.values()))


def with_split_junction_stop(config: MambaSplitConfig | None, on: bool) -> MambaSplitConfig | None:
    """The chunk split stopping exactly at a junction, as vLLM's scheduler decides it
    (``mamba_partial_cache_hit and kv_cache_manager.mamba_shared_prefix_checkpoint``)."""
    if config is None:
        return None
    return dataclasses.replace(config, shared_prefix_checkpoint=on and config.partial_cache_hit)


class JunctionCheckpoints:
    """Counts (request, junction) pairs whose Mamba state the reference keyed inside a block at a
    junction other than the prompt's own boundary: the states only the shared-prefix checkpoint
    keys. ``reference`` is the reference's adapter on a pool where the feature is on, else None."""

    def __init__(self, harness: Harness | None = None, reference=None) -> None:
        self.harness = harness
        self.managers = () if reference is None else tuple(
            m for m in reference.manager.coordinator.single_type_managers
            if isinstance(m, MambaManager) and m.shared_prefix_checkpoint)
        self.seen: set[tuple[str, int]] = set()

    @property
    def count(self) -> int:
        return len(self.seen)

    def observe(self) -> None:
        if not self.managers or self.harness is None:
            return
        for rid, s in self.harness.reqs.items():
            request = s.request
            junction = getattr(request, "shared_prefix_boundary", 0)
            for m in self.managers:
                if not junction or junction % m.block_size == 0 or (rid, junction) in self.seen:
                    continue
                table = m.req_to_blocks.get(rid, ())
                idx = cdiv(junction, m.block_size) - 1
                if idx < len(table) and table[idx].block_hash_num_tokens == junction \
                        and junction != m._prompt_boundary(request, m.block_pool.hash_block_size):
                    self.seen.add((rid, junction))
