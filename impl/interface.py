"""The one interface every implementation answers (reference, torch, vLLM adapter).

A state machine drives all of them with the same operations and compares what each can observe:
admission decisions, computed tokens, block ids per group (exactly: free-queue order is defined),
free-block counts, the cached blocks, offload jobs. Block ids are plain ints; block 0 is the null
block. Per-group results are tuples indexed by KV cache group id.

The reference's Python types are richer (``KVCacheBlocks`` of ``KVCacheBlock``); implementations
convert at this boundary, so comparisons never depend on object identity.
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

from .request import Request

BlockIds = tuple[tuple[int, ...], ...]
"""Block ids per KV cache group."""


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
