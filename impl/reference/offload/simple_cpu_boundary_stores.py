"""What vLLM's SimpleCPU offload scheduler stores besides the positional scan (``simple_kv_offload/manager.py``).

Two sources a block-table cursor cannot follow:

* **Mamba "align" boundary states.** A Mamba "align" table nulls its interior states and relocates
  speculative blocks, so its positions are not stable; the KV cache manager instead hands each
  committed boundary state to the connector by block id, every step (``take_boundary_state_offloads``).
  The connector stores a hand-off when its block is a hashed, non-null block that is neither being
  stored nor already on the CPU, and the CPU pool has room; otherwise it counts why it declined
  (vLLM's ``BoundaryStoreStats``: a declined hand-off is silent by design, a later request simply
  misses, so the counters are the only trace). A hand-off of a request finishing or preempted in
  the same step is dropped: its blocks are being given back and may belong to another request
  already.
* **The full-attention partial tail.** With fine-grained hits (a block wider than the hash unit) the
  GPU manager publishes the prompt's last hash boundary inside a full-attention block
  (``FullAttentionManager._cache_partial_tail_block``); the finish-time flush copies that block
  too, so the boundary key reaches the CPU (vLLM's ``_find_fa_partial_tail_source``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from kvref.spec.errors import InvalidFieldError

from ..block_hash import make_block_hash_with_group_id
from ..block_pool import BlockPool
from ..kv_cache_block import KVCacheBlock

if TYPE_CHECKING:
    from .simple_cpu_offload_scheduler import SimpleCPUOffloadScheduler

#: vLLM's ``BoundaryStoreStats`` fields; all but ``published`` are ``SAVE_OUTCOMES`` labels
BOUNDARY_FIELDS = ("published", "stored", "dropped_cpu_full", "dropped_request_gone", "skipped_already_cached",
                   "skipped_in_flight", "dropped_null_block", "dropped_not_hashed")
OUTCOMES = BOUNDARY_FIELDS[1:]


@dataclass
class _BoundaryStoreStats:
    """Cumulative hand-off counters, one per :data:`BOUNDARY_FIELDS` name."""

    counts: dict[str, int] = field(default_factory=lambda: dict.fromkeys(BOUNDARY_FIELDS, 0))

    def count(self, name: str, n: int = 1) -> None:
        self.counts[name] += n

    def copy(self) -> _BoundaryStoreStats:
        return _BoundaryStoreStats(dict(self.counts))

    def delta(self, since: _BoundaryStoreStats) -> dict[str, int]:
        """Per field, how much it grew since ``since`` (never negative)."""
        return {k: max(0, v - since.counts[k]) for k, v in self.counts.items()}

    def as_dict(self) -> dict[str, int]:
        return dict(self.counts)


def _classify_store_candidate(block: KVCacheBlock, in_flight: set[int], cpu_pool: BlockPool) -> str:
    """``"ready"``, or the outcome that declines storing ``block`` (vLLM ``_classify_store_candidate``)."""
    if block.is_null:
        return "dropped_null_block"
    if block.block_hash is None:
        return "dropped_not_hashed"
    if block.block_id in in_flight:
        return "skipped_in_flight"
    if cpu_pool.cached_block_hash_to_block.get_one_block(block.block_hash) is not None:
        return "skipped_already_cached"
    return "ready"


def _check_boundary_offloads(offloads: Any, num_groups: int, num_gpu_blocks: int) -> None:
    """``offloads`` is ``{request id: [(group id, GPU block id, boundary tokens), ...]}``."""
    allowed = (f"a dict request id -> list of (group id < {num_groups}, GPU block id < {num_gpu_blocks}, "
               "boundary tokens >= 0) int triples")
    if not isinstance(offloads, dict):
        raise InvalidFieldError("boundary_state_offloads", offloads, allowed)
    for rid, entries in offloads.items():
        if not isinstance(rid, str) or not isinstance(entries, (list, tuple)):
            raise InvalidFieldError("boundary_state_offloads", offloads, allowed)
        for e in entries:
            if not (isinstance(e, (list, tuple)) and len(e) == 3 and all(type(x) is int and x >= 0 for x in e)
                    and e[0] < num_groups and e[1] < num_gpu_blocks):
                raise InvalidFieldError(f"boundary_state_offloads[{rid!r}]", e, allowed)


def _find_fa_partial_tail_source(sched: SimpleCPUOffloadScheduler, request: Any,
                                block_ids: Any) -> int | None:
    """The GPU block holding ``request``'s prompt-tail hash boundary in the first full-attention
    group, if it is worth storing at finish: fine-grained hits on, the boundary computed and inside
    a block (a boundary on a block edge is the positional scan's), the block not null, not being
    stored, carrying the boundary key (its primary or a secondary key), the key not on the CPU yet.
    Block tables only grow, so the block is found by position."""
    if not sched.cpu_coordinator.enable_partial_hash_hits:
        return None
    hbs, fbs = sched.hash_block_size, sched.fa_block_size
    boundary = request.num_prompt_tokens // hbs * hbs
    if boundary == 0 or boundary > request.num_computed_tokens or boundary % fbs == 0:
        return None
    idx = boundary // fbs
    fa_ids = block_ids[sched.fa_gidx]
    if idx >= len(fa_ids):
        return None
    gid = fa_ids[idx]
    pool = sched.gpu_pool
    block = pool.blocks[gid]
    if block.is_null or gid in sched._in_flight_store_gpu_blocks:
        return None
    hashes = sched.block_hasher(request)
    hash_idx = boundary // hbs - 1
    if hash_idx >= len(hashes):
        return None
    key = make_block_hash_with_group_id(hashes[hash_idx], sched.fa_gidx)
    if block.block_hash != key and key not in pool.cached_block_hashes_by_block.get(gid, ()):
        return None
    if sched.cpu_block_pool.cached_block_hash_to_block.get_one_block(key) is not None:
        return None
    return gid
