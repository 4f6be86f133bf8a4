"""Errors the reference runtime raises on bad calls (all ``ValueError`` subclasses via KVRefError).

Each is raised *before* anything is mutated, so the state stays valid (``check_invariants()``
passes afterwards).
"""

from __future__ import annotations

from kvref.spec.errors import InvalidFieldError, KVRefError

__all__ = ["InvalidFieldError", "KVRefError", "NotEnoughFreeBlocksError", "BlockRefCountError",
           "UnknownRequestError", "NotModelledError"]


class NotEnoughFreeBlocksError(KVRefError):
    """``get_new_blocks(n)`` with fewer than ``n`` free blocks.

    Same message as vLLM's ``ValueError("Cannot get {n} free blocks from the pool")``, which
    surfaced as a crash when the admission predictor under-counted (vLLM PR #40027, #39734).
    """

    def __init__(self, num_blocks: int, num_free: int) -> None:
        self.num_blocks = num_blocks
        self.num_free = num_free
        super().__init__(f"Cannot get {num_blocks} free blocks from the pool "
                         f"(num_blocks={num_blocks}, only {num_free} free)")


class BlockRefCountError(KVRefError):
    """Freeing a block whose reference count is already 0 (a double free).

    vLLM decrements without a check: the count goes negative, the block never returns to the free
    queue and the pool silently leaks it.
    """

    def __init__(self, block_id: int, ref_cnt: int) -> None:
        self.block_id = block_id
        self.ref_cnt = ref_cnt
        super().__init__(f"block_id={block_id} is invalid: expected a block in use "
                         f"(ref_cnt > 0), got ref_cnt={ref_cnt} (double free?)")


class UnknownRequestError(KVRefError):
    """An operation that needs the request's blocks names a request the manager does not hold."""

    def __init__(self, request_id: str, why: str) -> None:
        self.request_id = request_id
        super().__init__(f"request_id={request_id!r} is invalid: {why}")


class NotModelledError(KVRefError):
    """A configuration vLLM supports but the reference does not model (yet); see docs/differences.md."""
