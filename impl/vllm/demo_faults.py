"""Faults planted in-process into vLLM's own KV-cache code, so a user sees what a divergence looks like.

``kvref demo record --fault NAME`` (and the detection campaign) run vLLM's real scheduler with one
of these behaviour classes re-introduced by monkeypatching vLLM's classes for the duration of a
``with plant(name):`` block; nothing on disk changes. Each is a class of real historic bugs, not a
replica of one fix:

* ``leak-on-refusal`` — ``KVCacheManager.allocate_slots`` refuses a waiting request after taking a
  block it never gives back (a refused admission that leaks: the pool shrinks until vLLM crashes);
* ``early-free`` — sliding-window / chunked-local managers skip one block more than the window
  allows (``get_num_skipped_tokens``): a block still inside the window is freed and reused;
* ``wrong-hit-length`` — ``get_computed_blocks`` reports a hit one block longer than the blocks it
  returns (a hit length counted from hashes, not from the blocks found);
* ``skip-preempt-reset`` — ``Scheduler._preempt_request`` keeps the request's computed tokens (the
  reset that makes a resumed request recompute is skipped);
* ``hit-stats`` — ``record_prefix_cache_stats`` counts a resumed (preempted) request as a new one,
  inflating the hit rate the metrics endpoint shows;
* ``crash`` — the coordinator's ``get_num_blocks_to_allocate`` counts one block too few, so the
  gate admits what the pool cannot hold and ``BlockPool.get_new_blocks`` raises ``ValueError:
  Cannot get N free blocks from the pool`` inside ``schedule()``;
* ``short-lookahead`` — ``KVCacheManager.allocate_slots`` reserves one lookahead slot fewer than an
  EAGLE-like drafter asked for (an off-by-one in speculative decoding's block reservation: the
  drafter then writes past the request's blocks);
* ``short-runway`` — ``Scheduler._reserve_prefill_lookahead`` keeps one token less than a
  multi-module MTP drafter's prefill runway (an off-by-one: a chunk may end one token inside it,
  where the last MTP module falls back to a sampled draft; manifests with ``spec-decode-mtp``).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

from kvref.spec.errors import InvalidFieldError

FAULTS = ("leak-on-refusal", "early-free", "wrong-hit-length", "skip-preempt-reset", "hit-stats", "crash",
          "short-lookahead", "short-runway")


def _patches(name: str) -> list[tuple[object, str, Callable]]:
    """``(class, attribute, replacement factory taking the original)`` for one fault."""
    from vllm.v1.core.kv_cache_coordinator import KVCacheCoordinator
    from vllm.v1.core.kv_cache_manager import KVCacheManager
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.core.single_type_kv_cache_manager import ChunkedLocalAttentionManager, SlidingWindowManager

    if name == "leak-on-refusal":
        def leak(orig):
            def allocate_slots(self, request, num_new_tokens, *args, **kwargs):
                out = orig(self, request, num_new_tokens, *args, **kwargs)
                if out is None and request.num_computed_tokens == 0 and self.block_pool.get_num_free_blocks() > 0:
                    self.block_pool.get_new_blocks(1)  # taken for the refused request, never returned
                return out
            return allocate_slots
        return [(KVCacheManager, "allocate_slots", leak)]
    if name == "early-free":
        def early(orig):
            def get_num_skipped_tokens(self, num_computed_tokens):
                n = orig(self, num_computed_tokens)
                return n + self.block_size if num_computed_tokens >= self.block_size else n
            return get_num_skipped_tokens
        return [(SlidingWindowManager, "get_num_skipped_tokens", early),
                (ChunkedLocalAttentionManager, "get_num_skipped_tokens", early)]
    if name == "wrong-hit-length":
        def longer(orig):
            def get_computed_blocks(self, request, *args, **kwargs):
                blocks, num_hits, boundary = orig(self, request, *args, **kwargs)
                bs = self.coordinator.block_size if hasattr(self.coordinator, "block_size") else 0
                bs = bs or self.kv_cache_config.kv_cache_groups[0].kv_cache_spec.block_size
                if num_hits and num_hits + bs <= request.num_tokens - 1:
                    num_hits += bs
                return blocks, num_hits, boundary
            return get_computed_blocks
        return [(KVCacheManager, "get_computed_blocks", longer)]
    if name == "skip-preempt-reset":
        def keep(orig):
            def _preempt_request(self, request, *args, **kwargs):
                computed = request.num_computed_tokens
                orig(self, request, *args, **kwargs)
                request.num_computed_tokens = computed
            return _preempt_request
        return [(Scheduler, "_preempt_request", keep)]
    if name == "hit-stats":
        def as_new(orig):
            def record_prefix_cache_stats(self, request, num_hits):
                if not self.log_stats or not self.prefix_cache_lookup_enabled(request):
                    return
                self.prefix_cache_stats.record(num_tokens=request.num_tokens, num_hits=num_hits, preempted=False)
            return record_prefix_cache_stats
        return [(KVCacheManager, "record_prefix_cache_stats", as_new)]
    if name == "crash":
        def fewer(orig):
            def get_num_blocks_to_allocate(self, *args, **kwargs):
                n = orig(self, *args, **kwargs)
                return n - 1 if n > 0 else n
            return get_num_blocks_to_allocate
        return [(KVCacheCoordinator, "get_num_blocks_to_allocate", fewer)]
    if name == "short-lookahead":
        def short(orig):
            def allocate_slots(self, request, num_new_tokens, *args, num_lookahead_tokens=0, **kwargs):
                return orig(self, request, num_new_tokens, *args,
                            num_lookahead_tokens=max(0, num_lookahead_tokens - 1), **kwargs)
            return allocate_slots
        return [(KVCacheManager, "allocate_slots", short)]
    if name == "short-runway":
        def runway(orig):
            def _reserve_prefill_lookahead(self, request, num_computed_tokens, num_new_tokens):
                remaining = request.num_tokens - num_computed_tokens - num_new_tokens
                if 0 < remaining < self.num_prefill_lookahead - 1:
                    num_new_tokens -= self.num_prefill_lookahead - 1 - remaining
                return max(num_new_tokens, 0)
            return _reserve_prefill_lookahead
        return [(Scheduler, "_reserve_prefill_lookahead", runway)]
    raise InvalidFieldError("fault", name, "one of " + ", ".join(FAULTS))


@contextlib.contextmanager
def plant(name: str | None) -> Iterator[None]:
    """Monkeypatch vLLM's classes with fault ``name`` inside the block (None: no fault)."""
    if name is None:
        yield
        return
    if name not in FAULTS:
        raise InvalidFieldError("fault", name, "one of " + ", ".join(FAULTS))
    saved = []
    try:
        for owner, attr, factory in _patches(name):
            orig = owner.__dict__.get(attr)
            saved.append((owner, attr, orig))
            setattr(owner, attr, factory(getattr(owner, attr)))
        yield
    finally:
        for owner, attr, orig in reversed(saved):
            if orig is None:
                delattr(owner, attr)
            else:
                setattr(owner, attr, orig)


__all__ = ["FAULTS", "plant"]
