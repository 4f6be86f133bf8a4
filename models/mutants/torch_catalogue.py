"""Bookkeeping mutants of the torch implementation, for showing the data path catches them.

Each mutant changes one rule of the bookkeeping the way a plausible bug would:

* :class:`EarlySlidingWindowFree` — a sliding-window group frees one block more than
  ``get_num_skipped_tokens`` allows (an off-by-one in the window edge): the block holding the
  oldest tokens still inside the window is nulled/reused.
* :class:`UncountedHitTouch` — a prefix hit on a block another request holds takes no
  reference, so the first owner's free puts the block back in the free queue while it is still
  referenced; a later allocation hands it out and overwrites it.
* :class:`WrongCpuBlockLoader` — an offload load copies from the neighbouring CPU block.

The mutant tests assert each is caught by *wrong numbers* alone (paged attention vs dense).
"""

from __future__ import annotations

import torch

from kvref.impl.torch.block_pool import NOT_FREE, NULL_BLOCK_ID, TorchBlockPool
from kvref.impl.torch.group_kinds import SlidingWindowKind
from kvref.impl.torch.manager import TorchKVCacheManager
from kvref.impl.torch.offload_copy import OffloadCopier


class _EarlyWindowKind(SlidingWindowKind):
    def skipped_tokens(self, n: int) -> int:
        s = super().skipped_tokens(n)
        return s + self.block_size if s > 0 else 0


class EarlySlidingWindowFree(TorchKVCacheManager):
    """Sliding-window blocks are freed one block early."""

    def __init__(self, pool_config, device=None) -> None:
        super().__init__(pool_config, device)
        for g in self.groups:
            if isinstance(g.kind, SlidingWindowKind):
                g.kind = _EarlyWindowKind(g.kind.spec)


class _UncountedTouchPool(TorchBlockPool):
    def touch(self, block_ids: list[int]) -> None:
        ids = [b for b in block_ids if b != NULL_BLOCK_ID]
        if not ids:
            return
        t = torch.tensor(ids, dtype=torch.int64, device=self.device)
        idle = t[self.ref_cnt[t] == 0]
        self.queue_key[idle] = NOT_FREE
        self.num_free -= idle.numel()
        self.ref_cnt[idle] = 1  # BUG: a block already held by someone gains no reference


class UncountedHitTouch(TorchKVCacheManager):
    """Prefix hits on live blocks take no reference."""

    def __init__(self, pool_config, device=None) -> None:
        super().__init__(pool_config, device)
        self.pool = _UncountedTouchPool(pool_config.num_blocks, pool_config.enable_caching, self.device)


class WrongCpuBlockLoader(OffloadCopier):
    """Loads read the CPU block after the right one (wrapping around)."""

    def load(self, job):
        return super().load([(g, (c + 1) % self.num_cpu_blocks) for g, c in job])
