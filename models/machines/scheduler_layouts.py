"""Scheduler traces on vLLM 0.33.0's other full-attention layouts: a part of ``conform-scheduler``
(issues #22 and #28).

The KV cache manager machines compare these managers with vLLM's call by call; here vLLM's
``Scheduler`` drives them, so what the scheduler asks of them (admission gates, preemption,
prefix hits across turns, the processed-token basis of frees under async scheduling) is compared
too. The pools (:data:`~kvref.models.machines.scheduler.LAYOUT_KINDS`) are the layouts a real
engine builds:

* ``rswa``: every decoder layer R-SWA (Unlimited-OCR's ``RSWAAttention`` reports
  :class:`~kvref.spec.kv_cache_interface.RSWASpec`; one group). ``KVCacheManager.allocate_slots``
  passes the prompt length to ``remove_skipped_blocks``, so ``RSWAManager`` frees the *gap* blocks
  between the prompt's last block and the window of the last ``rswa_window`` generated tokens; no
  admission cap (vLLM sizes R-SWA as full attention). Freed gap blocks keep their hashes in the
  free queue, so a follow-up turn may hit them.
* ``full+circular``: full attention beside a compressor's ring (DeepSeek-V4.1's compressor,
  GLM-5-next's tail cache: :class:`~kvref.spec.kv_cache_interface.CircularBufferSpec`, a ring that
  divides the attention block). ``CircularBufferManager`` claims one block per request on its first
  allocation, never caches or hits it, and the hybrid coordinator leaves the group out of the hit
  search.

Not drawn: ``SinkFullAttentionSpec`` (OpenPangu's ``StaticSinkAttention``): vLLM 0.33.0 cannot
build ``SinkFullAttentionManager`` behind its coordinator (its ``__init__`` lacks the
``needs_kv_cache_zeroing`` keyword ``get_manager_for_kv_cache_spec`` passes: ``TypeError`` at
startup; docs/differences.md), so no engine with such a group schedules anything. And
``HiddenStateCacheSpec``. vLLM builds it only for ``extract_hidden_states`` (the
speculative method that stores the target's hidden states in the KV cache and hands them out
through a KV connector, e.g. ``ExampleHiddenStatesConnector``); its group is managed by
``FullAttentionManager``, so without that connector it is one more full-attention group, which the
main machine's pools already are.

Arrivals, multi-turn follow-ups and prefix-cache resets are :class:`CacheControlsMachine`'s, plus
arrivals that decode long (:class:`LayoutsMachine`).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import replace
from typing import Callable

from hypothesis import strategies as st
from hypothesis.stateful import precondition, rule

from kvref.models.machines.counted_lockstep import run_counted
from kvref.models.machines.scheduler import (
    COVERAGE,
    LAYOUT_KINDS,
    MAX_REQUESTS,
    SchedulerRun,
    machine_with,
    request_specs,
    run_lockstep_machine,
    scheduler_setups,
)
from kvref.models.machines.scheduler_cache_controls import (
    CacheControlsLockstep,
    CacheControlsMachine,
    _roomy,
)

#: what the reference's managers did, summed over a run (reset by :func:`run_layouts_machine`)
LAYOUT_COVERAGE: Counter = Counter()


class LayoutsMachine(CacheControlsMachine):
    """:class:`CacheControlsMachine` with arrivals that decode long (8 to 32 tokens, cut at
    ``max_model_len``): an R-SWA gap opens only once a request has generated its window and a block
    more past its prompt's last block, which the main machine's outputs (up to 12 tokens) seldom do."""

    @precondition(lambda self: self.num_added < MAX_REQUESTS)
    @rule(data=st.data())
    def long_output(self, data):
        spec = data.draw(request_specs(self.num_added, self.driver.pool.max_model_len))
        self.num_added += 1
        self.driver.add(replace(spec, max_tokens=data.draw(st.integers(8, 32))))
        COVERAGE["long_outputs"] += 1


def layout_setups():
    """R-SWA and full + ring pools, synchronous or async, FCFS or PRIORITY, as the main machine
    draws them (mostly tight, one in three a preemption storm), roomy (finished turns stay cached
    for their follow-ups), or with speculative decoding (n-gram or EAGLE-like, multi-module MTP's
    runway included: DeepSeek-V4.1 drafts with MTP beside its rings; the fake model accepts no
    draft, as in :class:`CacheControlsMachine`)."""
    drawn = scheduler_setups(kinds=LAYOUT_KINDS)
    return st.one_of(drawn, drawn.map(_roomy), scheduler_setups(kinds=LAYOUT_KINDS, spec=True))


def run_layouts_machine(examples: int, reproducible: bool = False, shrink: bool = True,
                        seed: int | None = None) -> SchedulerRun:
    """The reference scheduler in lock step with vLLM 0.33.0's on :func:`layout_setups` (traces of at
    least 30 operations; liveness drained at teardown as in the main machine). The coverage adds
    ``rswa_gap_blocks_freed`` (gap blocks the reference's ``RSWAManager`` freed) and
    ``ring_blocks_claimed`` (rings its ``CircularBufferManager`` claimed)."""
    from kvref.impl.reference.circular_buffer_manager import CircularBufferManager
    from kvref.impl.reference.rswa_manager import RSWAManager
    from kvref.impl.reference.scheduler import Scheduler
    from kvref.impl.vllm.scheduler import VllmEnv, VllmScheduler

    env = VllmEnv()
    factories: dict[str, Callable] = {"vllm": lambda p, c: VllmScheduler(p, c, env),
                                      "ref": lambda p, c: Scheduler(p, c)}
    base = machine_with(factories, setups=layout_setups(), name="LayoutsBase")
    remove, claim = RSWAManager.remove_skipped_blocks, CircularBufferManager._claim_ring_block

    def counting_remove(self, request_id, processed_computed_tokens, num_prompt_tokens=None):
        table = self.req_to_blocks.get(request_id, [])
        before = sum(b is self._null_block for b in table)
        remove(self, request_id, processed_computed_tokens, num_prompt_tokens)
        LAYOUT_COVERAGE["rswa_gap_blocks_freed"] += sum(b is self._null_block for b in table) - before

    def counting_claim(self, request_id, record_for_zeroing=True):
        blocks = claim(self, request_id, record_for_zeroing)
        LAYOUT_COVERAGE["ring_blocks_claimed"] += len(blocks)
        return blocks

    RSWAManager.remove_skipped_blocks, CircularBufferManager._claim_ring_block = counting_remove, counting_claim
    try:
        return SchedulerRun(**run_counted(
            lambda counting: type("LayoutsRun", (LayoutsMachine, base), {"driver_class": counting}),
            CacheControlsLockstep,
            lambda machine: run_lockstep_machine(machine, examples, steps=45, min_steps=31, seed=seed,
                                                 reproducible=reproducible, shrink=shrink), COVERAGE, LAYOUT_COVERAGE))
    finally:
        RSWAManager.remove_skipped_blocks, CircularBufferManager._claim_ring_block = remove, claim
