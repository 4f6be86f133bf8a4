"""What differs between attention types: skipped tokens, cache-hit lookup, which blocks to cache.

One small class per vLLM single-type manager the torch implementation models
(``FullAttentionManager``, ``SlidingWindowManager``, ``ChunkedLocalAttentionManager``), holding
only the type-specific rules; the shared per-request bookkeeping lives in
:mod:`kvref.impl.torch.manager`. Lookups take the request's fine hashes (at ``hash_block_size``)
and view them at the group's block size (coarse hash ``i`` = fine hash ``(i+1)k-1``).

Mamba is modelled without prefix caching only (``mamba_cache_mode`` "none"/"all" with caching
off, where vLLM's ``MambaManager`` is the base manager plus speculative blocks). Not modelled:
fine-grained (partial-hash) hits, Mamba "align" mode, retention intervals.
"""

from __future__ import annotations

from kvref.spec.kv_cache_interface import (
    ChunkedLocalAttentionSpec,
    FullAttentionSpec,
    KVCacheSpec,
    MambaSpec,
    SlidingWindowSpec,
)
from kvref.spec.mathutil import cdiv

from .block_pool import NULL_BLOCK_ID, TorchBlockPool
from .hashing import coarse_hashes

Hit = tuple[list[list[int]], int]


class GroupKind:
    """Rules of one attention type for one spec."""

    name = "base"

    def __init__(self, spec: KVCacheSpec) -> None:
        self.spec = spec
        self.block_size = spec.block_size

    def skipped_tokens(self, num_computed_tokens: int) -> int:
        """Leading tokens no later token attends to (their blocks can be freed)."""
        return 0

    def admission_cap(self, max_in_flight_tokens: int, max_model_len: int) -> int | None:
        return None

    def extra_slot_tokens(self) -> int:
        """Tokens added to every allocation target (Mamba's speculative state blocks)."""
        return 0

    def find_hit(self, pool: TorchBlockPool, fine: list[bytes], hash_block_size: int,
                 max_length: int, group_ids: list[int], alignment: int, drop_eagle: bool = False) -> Hit:
        """Longest hit ``<= max_length`` (aligned) hitting in every group of ``group_ids``.

        ``drop_eagle`` drops the last matched block (EAGLE recomputes it for its hidden states)."""
        raise NotImplementedError("abstract: each group kind implements its own cache-hit search")

    def cache_mask(self, start: int, end: int, alignment: int, use_eagle: bool = False) -> list[bool] | None:
        """Which of blocks ``[start, end)`` to put in the hash map (None = all)."""
        return None


class FullAttentionKind(GroupKind):
    """Keeps every block; a hit is the longest cached prefix (chained hashes: first miss ends it)."""

    name = "full_attention"

    def find_hit(self, pool, fine, hash_block_size, max_length, group_ids, alignment, drop_eagle=False) -> Hit:
        bs = self.block_size
        hashes = coarse_hashes(fine, hash_block_size, bs)
        out: list[list[int]] = [[] for _ in group_ids]
        for h in hashes[: max_length // bs]:
            got = pool.get_cached_block(h, group_ids)
            if got is None:
                break
            for lst, b in zip(out, got):
                lst.append(b)
        hit = len(out[0]) * bs
        if drop_eagle and hit > 0:
            hit -= min(alignment, bs)
        hit -= hit % alignment
        n = cdiv(hit, bs)
        return [lst[:n] for lst in out], hit


class SlidingWindowKind(GroupKind):
    """Keeps the last ``sliding_window - 1`` (+ extra retained) tokens' blocks.

    A hit needs ``cdiv(window - 1, block_size)`` consecutive cached blocks ending at the hit
    boundary; earlier positions are the null block. Found scanning right to left.
    """

    name = "sliding_window"

    def __init__(self, spec: SlidingWindowSpec) -> None:
        super().__init__(spec)
        self.window = spec.sliding_window
        self.extra = spec.extra_retained_tokens

    def skipped_tokens(self, n: int) -> int:
        return max(0, n - self.window + 1 - self.extra)

    def admission_cap(self, max_in_flight_tokens, max_model_len):
        return self.spec.max_admission_blocks_per_request(max_in_flight_tokens, max_model_len)

    def blocks_for_hit(self, use_eagle: bool = False) -> int:
        """Consecutive cached blocks a hit needs (one more with EAGLE, which then drops one)."""
        return cdiv(self.window - 1, self.block_size) + (1 if use_eagle else 0)

    def find_hit(self, pool, fine, hash_block_size, max_length, group_ids, alignment, drop_eagle=False) -> Hit:
        bs = self.block_size
        hashes = coarse_hashes(fine, hash_block_size, bs)
        n = max_length // bs
        need = self.blocks_for_hit(drop_eagle)
        found: dict[int, list[int]] = {}   # position -> block per group
        run = 0
        end = None
        for i in range(n - 1, -1, -1):
            got = pool.get_cached_block(hashes[i], group_ids)
            if got is None:
                run = 0
                continue
            # A run must end on an alignment boundary (after the EAGLE drop, if any).
            if run == 0 and bs != alignment and (((i if drop_eagle else i + 1) * bs) % alignment):
                continue
            found[i] = got
            run += 1
            if run >= need:
                end = i + run
                break
        if end is None:
            # No full window anywhere: only a run reaching position 0 counts (prefix < window).
            end = run
            while bs != alignment and (end * bs) % alignment:
                end -= 1
        first = end - run if end >= run else 0
        if drop_eagle and end > 0:
            end -= 1
            while bs != alignment and (end * bs) % alignment:
                end -= 1
        out = [[NULL_BLOCK_ID] * end for _ in group_ids]
        for i in range(first, end):
            for lst, b in zip(out, found[i]):
                lst[i] = b
        return out, end * bs

    def cache_mask(self, start: int, end: int, alignment: int, use_eagle: bool = False) -> list[bool] | None:
        bs = self.block_size
        if alignment % bs:
            return None
        per_segment = alignment // bs
        need = self.blocks_for_hit(use_eagle)
        if need >= per_segment:
            return None
        # Only the ``need`` blocks ending on each alignment boundary (one further with EAGLE's
        # peek block) can ever serve a hit.
        shift = 1 if use_eagle else 0
        return [i >= shift and (i - shift) % per_segment >= per_segment - need for i in range(start, end)]


class ChunkedLocalKind(GroupKind):
    """A token sees only its own ``attention_chunk_size`` chunk; earlier chunks are skipped."""

    name = "chunked_local"

    def __init__(self, spec: ChunkedLocalAttentionSpec) -> None:
        super().__init__(spec)
        self.chunk = spec.attention_chunk_size

    def skipped_tokens(self, n: int) -> int:
        return n // self.chunk * self.chunk

    def admission_cap(self, max_in_flight_tokens, max_model_len):
        return self.spec.max_admission_blocks_per_request(max_in_flight_tokens, max_model_len)

    def find_hit(self, pool, fine, hash_block_size, max_length, group_ids, alignment, drop_eagle=False) -> Hit:
        assert not drop_eagle, "EAGLE with chunked local attention is rejected at construction"
        bs = self.block_size
        hashes = coarse_hashes(fine, hash_block_size, bs)
        start = (max_length // self.chunk * self.chunk if max_length > 0 else 0) // bs
        out = [[NULL_BLOCK_ID] * start for _ in group_ids]
        for i in range(start, max_length // bs):
            got = pool.get_cached_block(hashes[i], group_ids)
            if got is None:
                break
            for lst, b in zip(out, got):
                lst.append(b)
        return out, len(out[0]) * bs


class MambaKind(GroupKind):
    """Recurrent state: only the block holding the last computed token's state is kept
    (``get_num_skipped_tokens(n) = n - 1``); ``num_speculative_blocks`` extra blocks ride along
    for MTP/EAGLE drafts. Without prefix caching there are no hits to look up."""

    name = "mamba"

    def skipped_tokens(self, n: int) -> int:
        return n - 1

    def extra_slot_tokens(self) -> int:
        return self.block_size * self.spec.num_speculative_blocks

    def find_hit(self, pool, fine, hash_block_size, max_length, group_ids, alignment, drop_eagle=False) -> Hit:
        raise AssertionError("Mamba groups are only modelled with prefix caching disabled")


def kind_for(spec: KVCacheSpec) -> GroupKind | None:
    """The rules for ``spec``, or None if the torch implementation does not model it."""
    if isinstance(spec, MambaSpec):
        return MambaKind(spec) if spec.mamba_cache_mode != "align" else None
    if isinstance(spec, SlidingWindowSpec):
        return SlidingWindowKind(spec)
    if isinstance(spec, ChunkedLocalAttentionSpec):
        return ChunkedLocalKind(spec)
    if isinstance(spec, FullAttentionSpec):
        return FullAttentionKind(spec)
    return None
