"""Two rules of ``allocate_slots`` read inside vLLM's own manager, at every step: the blocks it takes
never exceed what its per-step check counted (M3, T7), and it touches every prefix hit before it
takes any block from the free queue (M10, #33775).

vLLM's ``KVCacheManager.allocate_slots`` decides with ``coordinator.get_num_blocks_to_allocate``
(after ``remove_skipped_blocks``) whether the free queue can serve the step, then touches the
prefix hits, allocates the external blocks and ``allocate_new_blocks``. When the predictor counts
fewer blocks than the allocation takes, nothing shows while the pool has blocks to spare; at the
pool's edge vLLM raises ``Cannot get N free blocks`` mid-step instead of preempting. That is the
whole class behind PR 40027 / #45856 (the admission cap clamping the per-step predictor too), a
dropped term for evictable hits, a predictor rounding down. The conformance machines only see it
when a generated trace lands exactly on the edge, so a fault survived on some seeds.

This watch reads the predictor's answer and the free count where vLLM checks them, and after the
allocation compares the blocks that actually left the free queue (net of any block the step freed,
so a violation is never a false alarm: gross taken >= net taken > predicted). Theorem T7
(``kvref prove``: predictor-equals-allocator) proves the rule for kvref's formulas; this is the same
rule observed on the installed vLLM, on every step of every trace, whatever the pool's pressure.

**M10 (#33775).** A prefix hit whose block sits in the free queue (ref count 0) is only safe once
``touch`` took it out: a ``get_new_blocks`` before that may pop it (evict its hash) and hand the
same block to another group or slot. vLLM 0.33.0 touches every group's hits first, then allocates
external and new blocks (``allocate_new_computed_blocks``' two phases). Before the fix each group
touched its hits and allocated its external blocks in turn, so a later group's hits could be
evicted by an earlier group's allocation; the state goes wrong only when the hits happen to be at
the head of the free queue, which a generated trace reaches on some seeds only. The order itself is
visible on every admission with hits and allocations: a ``touch`` of non-null blocks after a
``get_new_blocks`` that took blocks, within one ``allocate_slots``, is the finding.

It only wraps bound methods of one manager and its pool *instances* (nothing in vLLM's classes
changes) and never alters an argument or a result. ``check()`` raises
:class:`~kvref.impl.vllm.invariants.VllmStateError` (a finding) naming the request and the counts.
"""

from __future__ import annotations

from typing import Any


class AllocationWatch:
    """M3 and M10 on one vLLM ``KVCacheManager`` (see the module doc)."""

    def __init__(self, mgr: Any) -> None:
        self.violations: list[str] = []
        self.steps_checked = 0
        self._last: tuple[int, int] | None = None
        self._in_call = False
        self._taken_in_call = 0
        coordinator, pool = mgr.coordinator, mgr.block_pool
        predict, allocate = coordinator.get_num_blocks_to_allocate, mgr.allocate_slots
        touch, get_new_blocks = pool.touch, pool.get_new_blocks

        def pool_get_new_blocks(num_blocks: int) -> Any:
            out = get_new_blocks(num_blocks)
            if self._in_call:
                self._taken_in_call += len(out)
            return out

        def pool_touch(blocks: Any) -> Any:
            if self._in_call and self._taken_in_call:
                ids = [b.block_id for b in blocks if not b.is_null]
                if ids:
                    self.violations.append(
                        f"M10 (#33775): allocate_slots touched prefix hits {ids[:8]} after taking "
                        f"{self._taken_in_call} blocks from the free queue in the same call: an earlier "
                        f"allocation may have evicted them")
            return touch(blocks)

        def get_num_blocks_to_allocate(*args: Any, **kwargs: Any) -> int:
            n = predict(*args, **kwargs)
            # the full-sequence gate's call carries apply_admission_cap=True; the step's does not
            if not kwargs.get("apply_admission_cap", False):
                self._last = (n, pool.get_num_free_blocks())
            return n

        def allocate_slots(request: Any, *args: Any, **kwargs: Any) -> Any:
            self._last = None
            self._in_call, self._taken_in_call = True, 0
            try:
                out = allocate(request, *args, **kwargs)
            finally:
                self._in_call = False
            if out is not None and self._last is not None:
                predicted, free_before = self._last
                taken = free_before - pool.get_num_free_blocks()
                self.steps_checked += 1
                # a count below zero is vLLM's own arithmetic (Mamba "align" mode subtracts the blocks a
                # request already holds past what the chunk needs, unclamped): the free queue then
                # serves the step at any fill as long as nothing is taken, so the bound is the count
                # or zero (a pristine mamba-checkpoint run: counted -1, took 0). A group's negative
                # count hiding another group's need still shows: took 1 where the sum counted 0.
                if taken > max(predicted, 0):
                    self.violations.append(
                        f"M3 (T7): allocate_slots({request.request_id!r}) took {taken} blocks from the free queue "
                        f"where its per-step check counted {predicted} (free before: {free_before})")
            return out

        coordinator.get_num_blocks_to_allocate = get_num_blocks_to_allocate
        mgr.allocate_slots = allocate_slots
        pool.touch = pool_touch
        pool.get_new_blocks = pool_get_new_blocks

    def check(self) -> None:
        """Raise a finding for the first rule broken since the last check (then forget them)."""
        if self.violations:
            from kvref.impl.vllm.invariants import VllmStateError

            first, self.violations = self.violations[0], []
            why = ("at a full pool this step raises 'Cannot get N free blocks' instead of waiting "
                   "(PR 40027, #45856)" if first.startswith("M3") else "a hit evicted before it is touched is "
                   "handed out twice (a block in two tables)")
            raise VllmStateError(f"vLLM state {first} — {why}")
