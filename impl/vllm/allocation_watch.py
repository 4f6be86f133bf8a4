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

**M3g, per group (#22/#28).** vLLM compares only the *sum* of the groups' counts with the free
blocks, and its Mamba "align" count can be negative (a running request whose main-model tokens fell
back after rejected drafts), so a sum can hide one group's need behind another's negative count, or
an over-count in one group hide an under-count in another. The watch also reads each single-type
manager's own count and charges each group's gross take (blocks from ``get_new_blocks`` and
free-queue hits it touched) to it: a group taking more than its count (0 below zero), a step taking
more than the free blocks its check saw, or a step asking an empty pool after its check passed (vLLM
then raises, and the summed bound above never runs) is a finding. vLLM's scheduler never nets the
counts (``docs/invariants.md`` M3g: a fixed lookahead makes every other group's count 0 when Mamba's
is negative); a caller raising a running request's lookahead after a rollback does.

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
    """M3 (summed and per group, M3g) and M10 on one vLLM ``KVCacheManager`` (see the module doc)."""

    def __init__(self, mgr: Any) -> None:
        self.violations: list[str] = []
        self.steps_checked = 0
        #: steps where one group counted below zero while another counted above it (the sum nets
        #: them): how often a trace reached the case M3g guards
        self.netted_steps = 0
        #: checked steps where some group counted below zero (vLLM's Mamba "align" predictor)
        self.negative_count_steps = 0
        self._last: tuple[int, int] | None = None
        self._in_call = False
        self._taken_in_call = 0
        self._group: int | None = None  # the group whose allocation is running, if any
        self._request_id = ""
        self._group_counts: dict[int, int] = {}
        self._group_taken: dict[int, int] = {}
        coordinator, pool = mgr.coordinator, mgr.block_pool
        predict, allocate = coordinator.get_num_blocks_to_allocate, mgr.allocate_slots
        touch, get_new_blocks = pool.touch, pool.get_new_blocks

        def charge(n: int) -> None:
            self._taken_in_call += n
            if self._group is not None:
                self._group_taken[self._group] = self._group_taken.get(self._group, 0) + n

        def pool_get_new_blocks(num_blocks: int) -> Any:
            if self._in_call and self._last is not None and num_blocks > pool.get_num_free_blocks():
                # vLLM raises next: the step passed its admission check and the pool cannot serve it
                self._admitted_but_short(num_blocks, pool.get_num_free_blocks())
            out = get_new_blocks(num_blocks)
            if self._in_call:
                charge(len(out))
            return out

        def pool_touch(blocks: Any) -> Any:
            if self._in_call:
                if self._taken_in_call:
                    ids = [b.block_id for b in blocks if not b.is_null]
                    if ids:
                        self.violations.append(
                            f"M10 (#33775): allocate_slots touched prefix hits {ids[:8]} after taking "
                            f"{self._taken_in_call} blocks from the free queue in the same call: an earlier "
                            f"allocation may have evicted them")
                # a hit with no holder sits in the free queue: touching takes it out (gross, per group)
                evicted = sum(b.ref_cnt == 0 and not b.is_null for b in blocks)
                if evicted and self._group is not None:
                    self._group_taken[self._group] = self._group_taken.get(self._group, 0) + evicted
            return touch(blocks)

        def get_num_blocks_to_allocate(*args: Any, **kwargs: Any) -> int:
            self._group_counts = {}
            n = predict(*args, **kwargs)
            # the full-sequence gate's call carries apply_admission_cap=True; the step's does not
            if not kwargs.get("apply_admission_cap", False):
                self._last = (n, pool.get_num_free_blocks())
                self._step_counts = dict(self._group_counts)
            return n

        self._step_counts: dict[int, int] = {}
        for g, manager in enumerate(getattr(coordinator, "single_type_managers", ())):
            self._wrap_group(g, manager)

        def allocate_slots(request: Any, *args: Any, **kwargs: Any) -> Any:
            self._last = None
            self._step_counts, self._group_taken = {}, {}
            self._request_id = request.request_id
            self._in_call, self._taken_in_call = True, 0
            try:
                out = allocate(request, *args, **kwargs)
            finally:
                self._in_call, self._group = False, None
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
                self._check_groups(request.request_id, free_before)
            return out

        coordinator.get_num_blocks_to_allocate = get_num_blocks_to_allocate
        mgr.allocate_slots = allocate_slots
        pool.touch = pool_touch
        pool.get_new_blocks = pool_get_new_blocks

    def _wrap_group(self, g: int, manager: Any) -> None:
        """Read group ``g``'s own per-step count and charge what its allocation calls take to it."""
        count = manager.get_num_blocks_to_allocate

        def get_num_blocks_to_allocate(*args: Any, **kwargs: Any) -> int:
            n = count(*args, **kwargs)
            self._group_counts[g] = self._group_counts.get(g, 0) + n
            return n

        manager.get_num_blocks_to_allocate = get_num_blocks_to_allocate
        for name in ("add_local_computed_blocks", "allocate_external_computed_blocks", "allocate_new_blocks"):
            method = getattr(manager, name, None)
            if method is not None:
                setattr(manager, name, self._charged(g, method))

    def _charged(self, g: int, method: Any) -> Any:
        def call(*args: Any, **kwargs: Any) -> Any:
            outer, self._group = self._group, g
            try:
                return method(*args, **kwargs)
            finally:
                self._group = outer
        return call

    def _check_groups(self, request_id: str, free_before: int) -> None:
        """M3g: per group, the blocks its allocation took (gross: new blocks and free-queue hits
        touched) never exceed its own count, or 0 where that count is negative. vLLM's coordinator
        compares only the sum, so a Mamba "align" count below zero (a running request holding more
        state blocks than this step's main-model tokens need) nets out another group's need; the
        step then passes the check at a full pool and raises mid-allocation. Also the whole step:
        the gross blocks taken never exceed the free blocks the admission check saw."""
        counts = self._step_counts
        if any(n < 0 for n in counts.values()):
            self.negative_count_steps += 1
            self.netted_steps += any(n > 0 for n in counts.values())
        for g, taken in sorted(self._group_taken.items()):
            if g in counts and taken > max(counts[g], 0):
                self.violations.append(
                    f"M3g: allocate_slots({request_id!r}) group {g} took {taken} blocks where its own "
                    f"count was {counts[g]} (per-group counts {counts}, summed {sum(counts.values())}, "
                    f"free before: {free_before})")
                return
        gross = sum(self._group_taken.values())
        if gross > free_before:
            self.violations.append(
                f"M3g: allocate_slots({request_id!r}) took {gross} blocks where its admission check saw "
                f"{free_before} free (per-group counts {counts})")

    def _admitted_but_short(self, num_blocks: int, num_free: int) -> None:
        assert self._last is not None
        predicted, free_before = self._last
        self.violations.append(
            f"M3g: allocate_slots({self._request_id!r}) passed its admission check (counted {predicted}, "
            f"per-group {self._step_counts}, free {free_before}) and then asked the pool for {num_blocks} "
            f"blocks with {num_free} free: vLLM raises 'Cannot get {num_blocks} free blocks from the pool'")

    def check(self) -> None:
        """Raise a finding for the first rule broken since the last check (then forget them)."""
        if self.violations:
            from kvref.impl.vllm.invariants import VllmStateError

            first, self.violations = self.violations[0], []
            why = ("at a full pool this step raises 'Cannot get N free blocks' instead of waiting "
                   "(PR 40027, #45856)" if first.startswith("M3") else "a hit evicted before it is touched is "
                   "handed out twice (a block in two tables)")
            raise VllmStateError(f"vLLM state {first} — {why}")
