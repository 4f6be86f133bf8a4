"""T7 on vLLM's own manager, at every step: the blocks ``allocate_slots`` takes never exceed what
its per-step check counted.

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

It only wraps two bound methods of one manager *instance* (nothing in vLLM's classes changes) and
never alters an argument or a result. ``check()`` raises
:class:`~kvref.impl.vllm.invariants.VllmStateError` (a finding) naming the request and the counts.
"""

from __future__ import annotations

from typing import Any


class AllocationWatch:
    """Per-step predicted vs taken blocks on one vLLM ``KVCacheManager`` (see the module doc)."""

    def __init__(self, mgr: Any) -> None:
        self.violations: list[str] = []
        self.steps_checked = 0
        self._last: tuple[int, int] | None = None
        coordinator, pool = mgr.coordinator, mgr.block_pool
        predict, allocate = coordinator.get_num_blocks_to_allocate, mgr.allocate_slots

        def get_num_blocks_to_allocate(*args: Any, **kwargs: Any) -> int:
            n = predict(*args, **kwargs)
            # the full-sequence gate's call carries apply_admission_cap=True; the step's does not
            if not kwargs.get("apply_admission_cap", False):
                self._last = (n, pool.get_num_free_blocks())
            return n

        def allocate_slots(request: Any, *args: Any, **kwargs: Any) -> Any:
            self._last = None
            out = allocate(request, *args, **kwargs)
            if out is not None and self._last is not None:
                predicted, free_before = self._last
                taken = free_before - pool.get_num_free_blocks()
                self.steps_checked += 1
                if taken > predicted:
                    self.violations.append(
                        f"allocate_slots({request.request_id!r}) took {taken} blocks from the free queue "
                        f"where its per-step check counted {predicted} (free before: {free_before})")
            return out

        coordinator.get_num_blocks_to_allocate = get_num_blocks_to_allocate
        mgr.allocate_slots = allocate_slots

    def check(self) -> None:
        """Raise a finding for the first step whose allocation exceeded its check (then forget it)."""
        if self.violations:
            from kvref.impl.vllm.invariants import VllmStateError

            first, self.violations = self.violations[0], []
            raise VllmStateError(f"vLLM state M3 (T7): {first} — at a full pool this step raises "
                                 f"'Cannot get N free blocks' instead of waiting (PR 40027, #45856)")
