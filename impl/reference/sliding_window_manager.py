"""Sliding-window attention (vLLM ``SlidingWindowManager``).

The next token reads the last ``sliding_window`` tokens, so everything before
``n - sliding_window + 1 - extra_retained_tokens`` is skipped: its whole blocks become null
placeholders and go back to the pool (on the processed-token basis). Example: window 4, 7 tokens
computed -> the next token (7) reads 4..7, tokens 0..3 are skipped.

A hit needs ``cdiv(sliding_window - 1, block_size)`` contiguous cached blocks ending at the hit
(one more with EAGLE, whose last block is dropped); the search runs right to left. So only those
runs are worth publishing (``reachable_block_mask``): at every alignment boundary when dense, and
under sparse prefix-cache retention (``prefix_cache_retention_interval``, spec/prefix_cache_retention.py)
one per interval plus the runs ending at the prompt's replay boundaries and the shared-prefix junction.
"""

from __future__ import annotations

from collections.abc import Sequence

from kvref.spec.kv_cache_interface import KVCacheSpec, SlidingWindowSpec
from kvref.spec.mathutil import cdiv

from .block_hash import BlockHash, resolve_block_hashes
from .block_pool import BlockPool, BlockPoolCore
from .kv_cache_block import KVCacheBlock
from .single_type_manager import SingleTypeKVCacheManager


class SlidingWindowManager(SingleTypeKVCacheManager):
    def __init__(self, kv_cache_spec: SlidingWindowSpec, **kwargs) -> None:
        super().__init__(kv_cache_spec, **kwargs)
        self.sliding_window = kv_cache_spec.sliding_window
        self.extra_retained_tokens = kv_cache_spec.extra_retained_tokens

    def get_num_skipped_tokens(self, num_computed_tokens: int) -> int:
        return max(0, num_computed_tokens - self.sliding_window + 1 - self.extra_retained_tokens)

    @staticmethod
    def _contiguous_blocks_for_hit(window: int, block_size: int, use_eagle: bool) -> int:
        return cdiv(window - 1, block_size) + (1 if use_eagle else 0)

    @classmethod
    def find_longest_cache_hit(cls, block_hashes: Sequence[BlockHash], max_length: int,
                               kv_cache_group_ids: Sequence[int], block_pool: BlockPool,
                               kv_cache_spec: KVCacheSpec, drop_eagle_block: bool,
                               alignment_tokens: int) -> tuple[tuple[list[KVCacheBlock], ...], int]:
        """Right to left: the first run of ``need`` cached blocks whose right end is aligned wins;
        the hit is everything up to it (nulls before the run). If no run is long enough, a run
        reaching block 0 is a (short-prompt) hit, trimmed to the alignment."""
        assert isinstance(kv_cache_spec, SlidingWindowSpec)
        block_size = kv_cache_spec.block_size
        hashes = resolve_block_hashes(block_hashes, block_pool.hash_block_size, block_size)
        need = cls._contiguous_blocks_for_hit(kv_cache_spec.sliding_window, block_size, drop_eagle_block)
        max_num_blocks = max_length // block_size
        null = block_pool.null_block
        computed = tuple([null] * max_num_blocks for _ in kv_cache_group_ids)
        get_cached = BlockPoolCore.get_cached_block  # our own hashes: the plain lookup
        run = 0
        found = False
        for i in range(max_num_blocks - 1, -1, -1):
            hit = get_cached(block_pool, hashes[i], kv_cache_group_ids)
            if not hit:
                run = 0
                continue
            if run == 0 and block_size != alignment_tokens:
                # a run's right end must leave an aligned hit (after the EAGLE pop)
                end_blocks = i if drop_eagle_block else i + 1
                if (end_blocks * block_size) % alignment_tokens:
                    continue
            for blocks, block in zip(computed, hit):
                blocks[i] = block
            run += 1
            if run >= need:
                for blocks in computed:
                    del blocks[i + run:]
                found = True
                break
        if not found:
            for blocks in computed:
                del blocks[run:]
            cls._pop_to_alignment(computed, block_size, alignment_tokens)
        if drop_eagle_block and computed[0]:
            for blocks in computed:
                blocks.pop()
            cls._pop_to_alignment(computed, block_size, alignment_tokens)
        return computed, len(computed[0]) * block_size

    @staticmethod
    def _pop_to_alignment(computed: tuple[list[KVCacheBlock], ...], block_size: int,
                          alignment_tokens: int) -> None:
        while block_size != alignment_tokens and len(computed[0]) * block_size % alignment_tokens:
            for blocks in computed:
                blocks.pop()

    @classmethod
    def reachable_block_mask(cls, start_block: int, end_block: int, alignment_tokens: int | None,
                             kv_cache_spec: KVCacheSpec, use_eagle: bool,
                             retention_interval: int | None = None,
                             reachable_boundaries: Sequence[int] = (), dcp_world_size: int = 1,
                             final_segment_end_block: int | None = None) -> list[bool] | None:
        """Only the ``need`` blocks ending at a boundary a hit can land on are worth publishing.

        The segments: every alignment boundary when dense (``retention_interval`` None: with
        alignment 32 and block 16, a window needing one block keeps odd blocks), one per
        ``retention_interval`` tokens when positive, none when 0. Under sparse retention (0 or
        positive) the ``need``-block tail ending at each of ``reachable_boundaries`` (floored to the
        alignment) is kept too: the prompt's replay boundary and a shared-prefix junction land
        between segments. With EAGLE the run ends one block further (the peeked block). None (cache
        all) when a segment is no longer than the run, or the alignment is sub-block (block
        granularity cannot express it: every block is kept, which never loses a hit).

        With decode context parallelism a block spans ``dcp_world_size`` ranks' tokens, so the run
        and the segments are counted in those wider blocks. ``final_segment_end_block`` (passed by
        the offloading connector, which stores a finished request's last, partial segment too):
        without EAGLE the ``need`` blocks before it, within that partial segment, are kept as well.
        """
        assert isinstance(kv_cache_spec, SlidingWindowSpec)
        if alignment_tokens is None:
            return None
        block_size = kv_cache_spec.block_size * dcp_world_size
        if alignment_tokens % block_size:
            return None
        need = cls._contiguous_blocks_for_hit(kv_cache_spec.sliding_window, block_size, use_eagle)
        shift = 1 if use_eagle else 0
        mask = [False] * (end_block - start_block)
        segment_tokens = alignment_tokens if retention_interval is None else retention_interval
        if segment_tokens:
            per_segment = segment_tokens // block_size
            if need >= per_segment:
                return None
            for i in range(start_block, end_block):
                if i >= shift and (i - shift) % per_segment >= per_segment - need:
                    mask[i - start_block] = True
            if final_segment_end_block is not None and not use_eagle:
                _keep_final_segment_tail(mask, start_block, end_block, final_segment_end_block, per_segment, need)
        if retention_interval is not None:
            for boundary in reachable_boundaries:
                end = boundary // alignment_tokens * alignment_tokens // block_size + shift
                for j in range(max(start_block, end - need), min(end_block, end)):
                    mask[j - start_block] = True
        return mask


def _keep_final_segment_tail(mask: list[bool], start_block: int, end_block: int, final_end: int,
                             per_segment: int, need: int) -> None:
    """Mark the ``need`` blocks before ``final_end`` that lie in its partial segment (none when
    ``final_end`` is on a segment boundary: the segment tails already cover it)."""
    partial = final_end % per_segment
    if not partial:
        return
    tail_start = max(final_end - partial, final_end - need)
    for i in range(max(start_block, tail_start), min(end_block, final_end)):
        mask[i - start_block] = True
