"""``TorchKVCacheManager``: vLLM 0.33.0's ``KVCacheManager`` semantics, state in tensors.

Independent of ``kvref.impl.reference``: the pool is a priority-key free queue with int tensors
(:mod:`.block_pool`), block tables are int32 device tensors (:mod:`.block_table`), and the
coordinator (unitary / hybrid fixed point / no prefix cache) is folded into this class. Block ids
come out identical to vLLM's because every choice that decides an id follows vLLM's order:
the free queue front is popped, unhashed frees go to the front and hashed ones to the back in
the order given, requests free their tail first, out-of-window blocks are freed highest index
first, and hits are touched for all groups before anything is allocated (vLLM #33775).

Modelled: full attention (incl. MLA), sliding window, chunked local, Mamba without prefix
caching (modes "none"/"all", speculative blocks); one group or several
(hybrid); prefix caching with ``hash_block_size`` <= block sizes (incl. the full-attention
partial-tail entry); the full-sequence admission gate with the per-request admission caps
(vLLM #40946, single source of truth with startup sizing); watermark; ``reserved_blocks``;
external (connector) computed tokens; EAGLE (the last hit block dropped, one block cached
further). Not modelled (rejected with ``InvalidFieldError``): EAGLE with chunked local attention
(vLLM asserts), Mamba "align" mode (Mamba prefix caching), cross-attention groups, partial (mid-block) local hits,
prefix-cache retention.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvref.impl.interface import BlockIds, PoolConfig
from kvref.impl.request import Request, RequestStatus
from kvref.spec.errors import InvalidFieldError, check_int
from kvref.spec.kv_cache_interface import FullAttentionSpec
from kvref.spec.mathutil import cdiv, round_down

from .block_pool import NULL_BLOCK_ID, TorchBlockPool, group_key
from .block_table import BlockTables
from .group_kinds import ChunkedLocalKind, FullAttentionKind, GroupKind, MambaKind, kind_for
from .hashing import RequestHashes


def resolve_device(device: str | torch.device | None) -> torch.device:
    """``None`` picks CUDA when present, else CPU."""
    if device is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError) as exc:
        raise InvalidFieldError("device", device, "None, 'cpu', 'cuda' or 'cuda:N'") from exc
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise InvalidFieldError("device", device, "'cpu' (no CUDA device on this machine)")
    return dev


@dataclass
class _Group:
    gid: int
    kind: GroupKind
    tables: BlockTables
    cap: int | None
    num_cached_block: dict[str, int]
    use_eagle: bool = False  # the group's hits drop the EAGLE block; caching looks one block further

    @property
    def block_size(self) -> int:
        return self.kind.block_size


@dataclass
class _SpecGroup:
    """Groups with equal specs, looked up together (a hit must hit in every one)."""

    kind: GroupKind
    group_ids: list[int]
    use_eagle: bool = False


class TorchKVCacheManager:
    """vLLM's ``KVCacheManager`` surface (:class:`kvref.impl.interface.KVCacheManagerLike`)."""

    def __init__(self, pool_config: PoolConfig, device: str | torch.device | None = None) -> None:
        if not isinstance(pool_config, PoolConfig):
            raise InvalidFieldError("pool_config", pool_config, "a kvref.impl.interface.PoolConfig")
        cfg = pool_config
        if not cfg.groups:
            raise InvalidFieldError("groups", cfg.groups, "at least one KV cache group")
        if cfg.prefix_cache_retention_interval is not None:
            raise InvalidFieldError("prefix_cache_retention_interval", cfg.prefix_cache_retention_interval,
                                    "None (dense retention; the torch implementation does not model sparse "
                                    "retention)")
        for field_name in ("dcp_world_size", "pcp_world_size"):  # issue #23: the reference models them
            if getattr(cfg, field_name) != 1:
                raise InvalidFieldError(field_name, getattr(cfg, field_name),
                                        "1 (the torch implementation does not model context parallelism)")
        kinds: list[GroupKind] = []
        for i, g in enumerate(cfg.groups):
            kind = kind_for(g.kv_cache_spec)
            if kind is None:
                raise InvalidFieldError(f"groups[{i}].kv_cache_spec", type(g.kv_cache_spec).__name__,
                                        "FullAttentionSpec, MLAAttentionSpec, SlidingWindowSpec, "
                                        "ChunkedLocalAttentionSpec or MambaSpec (mode 'none'/'all')")
            if isinstance(kind, MambaKind) and cfg.enable_caching:
                raise InvalidFieldError("enable_caching", True,
                                        "False with a Mamba group (vLLM needs mamba_cache_mode='align' "
                                        "for Mamba prefix caching, which the torch implementation does not model)")
            if cfg.use_eagle and isinstance(kind, ChunkedLocalKind):
                raise InvalidFieldError("use_eagle", True,
                                        "False with a chunked-local group (vLLM asserts: no EAGLE with "
                                        "chunked local attention)")
            kinds.append(kind)
        hybrid = len(kinds) > 1
        if cfg.enable_caching:
            for i, k in enumerate(kinds):
                if not hybrid and k.block_size != cfg.hash_block_size:
                    raise InvalidFieldError("hash_block_size", cfg.hash_block_size,
                                            f"the block size {k.block_size} of the only group (vLLM's "
                                            "UnitaryKVCacheCoordinator)")
                if hybrid and k.block_size % cfg.hash_block_size:
                    raise InvalidFieldError("hash_block_size", cfg.hash_block_size,
                                            f"a divisor of group {i}'s block_size={k.block_size}")
                if hybrid and isinstance(k, ChunkedLocalKind) and k.block_size != cfg.scheduler_block_size:
                    raise InvalidFieldError("scheduler_block_size", cfg.scheduler_block_size,
                                            f"group {i}'s block_size={k.block_size} (chunked local attention "
                                            "in a hybrid model needs equal block sizes)")
        self.config = cfg
        self.device = resolve_device(device)
        self.max_model_len = cfg.max_model_len
        self.max_in_flight_tokens = cfg.effective_max_in_flight_tokens
        self.enable_caching = cfg.enable_caching
        self.scheduler_block_size = cfg.scheduler_block_size
        self.hash_block_size = cfg.hash_block_size
        self.watermark_blocks = int(cfg.watermark * cfg.num_blocks)
        self.pool = TorchBlockPool(cfg.num_blocks, cfg.enable_caching, self.device)
        self.hashes = RequestHashes(cfg.hash_block_size)
        self.groups = [
            _Group(i, k, BlockTables(cdiv(cfg.max_model_len, k.block_size), self.device),
                   k.admission_cap(self.max_in_flight_tokens, cfg.max_model_len), {})
            for i, k in enumerate(kinds)
        ]
        self.num_groups = len(self.groups)
        self.hybrid = hybrid
        # Lookup alignment: a single group aligns to its block size; a hybrid model to the scheduler
        # block (no fine-grained hits without an aligned Mamba group).
        self.alignment = cfg.scheduler_block_size if hybrid else kinds[0].block_size
        # EAGLE: the flagged groups (all groups if none is flagged) drop their last hit block.
        eagle_ids = {i for i, g in enumerate(cfg.groups) if g.is_eagle_group}
        if cfg.use_eagle and not eagle_ids:
            eagle_ids = set(range(len(kinds)))
        self.drop_eagle_ids = eagle_ids if cfg.use_eagle else set()
        spec_groups: list[_SpecGroup] = []
        for i, k in enumerate(kinds):
            for sg in spec_groups:
                if sg.kind.spec == k.spec and type(sg.kind) is type(k):
                    sg.group_ids.append(i)
                    sg.use_eagle = sg.use_eagle or i in self.drop_eagle_ids
                    break
            else:
                spec_groups.append(_SpecGroup(k, [i], i in self.drop_eagle_ids))
        spec_groups.sort(key=lambda sg: not isinstance(sg.kind.spec, FullAttentionSpec))
        self.spec_groups = spec_groups
        if hybrid:
            for sg in spec_groups:
                for gid in sg.group_ids:
                    self.groups[gid].use_eagle = sg.use_eagle
        else:
            self.groups[0].use_eagle = 0 in self.drop_eagle_ids

    # ================================================================ lookups
    def _check_request(self, request: object) -> Request:
        if not isinstance(request, Request):
            raise InvalidFieldError("request", request, "a kvref.impl.request.Request")
        return request

    def _find_longest_cache_hit(self, fine: list[bytes], max_length: int) -> tuple[list[list[int]], int]:
        if not self.hybrid:
            g = self.groups[0]
            return g.kind.find_hit(self.pool, fine, self.hash_block_size, max_length, [0], self.alignment,
                                   drop_eagle=0 in self.drop_eagle_ids)
        # Fixed point: every spec group accepts the candidate length or shortens it; repeat until
        # no group shortens it (one pass for "full attention + one other").
        hit = max_length
        by_group: list[list[int] | None] = [None] * self.num_groups
        len_by_group = [0] * self.num_groups
        simple = len(self.spec_groups) == 2 and isinstance(self.spec_groups[0].kind.spec, FullAttentionSpec)
        verified: set[int] = set()  # spec groups whose EAGLE drop holds at the current length (#32802)
        while True:
            curr = hit
            for idx, sg in enumerate(self.spec_groups):
                first = sg.group_ids[0]
                if isinstance(sg.kind, FullAttentionKind) and by_group[first] is not None:
                    curr = min(curr, len_by_group[first])  # a full-attention hit is downward closed
                    continue
                drop = sg.use_eagle and idx not in verified
                limit = curr
                if drop and not isinstance(sg.kind, MambaKind):
                    # match one block past the candidate, then drop it
                    limit = min(curr + sg.kind.block_size, len(fine) * self.hash_block_size)
                blocks, new = sg.kind.find_hit(self.pool, fine, self.hash_block_size, limit,
                                               sg.group_ids, self.alignment, drop_eagle=drop)
                if drop:
                    verified.add(idx)
                elif new < curr:
                    verified.clear()
                curr = new
                for gid, b in zip(sg.group_ids, blocks):
                    by_group[gid] = b
                    len_by_group[gid] = curr
            if curr >= hit:
                break
            hit = curr
            if simple:
                break
        for sg in self.spec_groups:
            if isinstance(sg.kind, FullAttentionKind):
                n = cdiv(hit, sg.kind.block_size)
                for gid in sg.group_ids:
                    if by_group[gid] is not None:
                        by_group[gid] = by_group[gid][:n]
        return [b if b is not None else [] for b in by_group], hit

    def get_computed_blocks(self, request: Request) -> tuple[BlockIds, int]:
        """Prefix-cache hit: block ids per group and hit tokens (at most ``num_tokens - 1``)."""
        request = self._check_request(request)
        if not self.enable_caching:
            return tuple(() for _ in self.groups), 0
        fine = self.hashes.get(request)
        blocks, hit = self._find_longest_cache_hit(fine, request.num_tokens - 1)
        return tuple(tuple(b) for b in blocks), hit

    # ================================================================ per-group steps
    def _num_blocks_to_allocate(self, g: _Group, rid: str, num_tokens: int, hits: list[int],
                                total_computed: int, num_local_computed: int, apply_cap: bool) -> int:
        required = cdiv(num_tokens + g.kind.extra_slot_tokens(), g.block_size)
        if apply_cap and g.cap is not None:
            required = min(required, g.cap)
        held = g.tables.num_blocks(rid)
        if rid in g.num_cached_block:
            assert not hits, "a running request has no new prefix hits"
            return max(required - held, 0)
        skipped = g.kind.skipped_tokens(total_computed) // g.block_size
        new = max(required - max(skipped, len(hits) + held), 0)
        rest = hits[max(0, skipped - held):]
        if rest:
            t = torch.tensor(rest, dtype=torch.int64, device=self.device)
            evictable = int(((self.pool.ref_cnt[t] == 0) & (t != NULL_BLOCK_ID)).sum())
        else:
            evictable = 0
        return new + evictable

    def _add_hits(self, g: _Group, rid: str, hits: list[int], num_local: int, num_external: int) -> None:
        assert g.tables.num_blocks(rid) == 0
        skipped = g.kind.skipped_tokens(num_local + num_external) // g.block_size
        kept = hits[skipped:] if skipped > 0 else hits
        if self.enable_caching:
            self.pool.touch(kept)
        g.tables.extend(rid, [NULL_BLOCK_ID] * skipped + list(kept))
        g.num_cached_block[rid] = g.tables.num_blocks(rid)

    def _allocate_external(self, g: _Group, rid: str, num_local: int, num_external: int) -> None:
        total = num_local + num_external
        skipped = g.kind.skipped_tokens(total)
        if skipped > 0:
            num_external = min(total - skipped, num_external)
        if num_external <= 0:
            return
        n = max(0, cdiv(total, g.block_size) - g.tables.num_blocks(rid))
        g.tables.extend(rid, self.pool.get_new_blocks(n))

    def _allocate_new(self, g: _Group, rid: str, num_tokens: int) -> list[int]:
        n = cdiv(num_tokens + g.kind.extra_slot_tokens(), g.block_size) - g.tables.num_blocks(rid)
        if n <= 0:
            return []
        new = self.pool.get_new_blocks(n)
        g.tables.extend(rid, new)
        return new

    def _remove_skipped(self, g: _Group, rid: str, processed: int) -> None:
        """Free the blocks wholly before the window, highest index first (vLLM walks down from the
        last skipped block and stops at the first null; nulls always form the row's prefix)."""
        skipped = g.kind.skipped_tokens(processed)
        if skipped <= 0:
            return
        g.tables.touch_row(rid)
        freed = g.tables.clear_front(rid, skipped // g.block_size)
        self.pool._free_blocks(freed[::-1])

    def _cacheable_tokens(self, g: _Group, n: int) -> int:
        """Tokens group ``g`` may cache: all (one group) or scheduler-block aligned (hybrid); an
        EAGLE group caches one block further, since its lookups match that block and drop it."""
        if not self.hybrid:
            return n
        aligned = round_down(n, self.scheduler_block_size)
        if g.use_eagle and aligned > 0:
            return min(n, aligned + g.block_size)
        return aligned

    def _cache_blocks(self, g: _Group, request: Request, fine: list[bytes], num_tokens: int) -> None:
        rid = request.request_id
        bs = g.block_size
        hbs = self.hash_block_size
        done = g.num_cached_block.get(rid, 0)
        full = min(num_tokens, len(fine) * hbs) // bs
        if done < full:
            mask = g.kind.cache_mask(done, full, self.alignment, g.use_eagle)
            table = g.tables.slice(rid, done, full)
            k = bs // hbs
            for i in range(done, full):
                b = table[i - done]
                if b == NULL_BLOCK_ID or (mask is not None and not mask[i - done]):
                    continue
                self.pool.cache_full_block(group_key(fine[(i + 1) * k - 1], g.gid), b, (i + 1) * bs)
            g.num_cached_block[rid] = full
        if isinstance(g.kind, FullAttentionKind) and bs != hbs:
            self._cache_partial_tail(g, request, fine, num_tokens)

    def _cache_partial_tail(self, g: _Group, request: Request, fine: list[bytes], num_tokens: int) -> None:
        """Full attention with blocks bigger than hash blocks also registers the prompt's last hash
        boundary inside a block, so a later request with the same prompt can find it."""
        hbs = self.hash_block_size
        limit = request.num_prompt_tokens if g.use_eagle else request.num_prompt_tokens - 1
        boundary = min(limit // hbs, len(fine)) * hbs
        if boundary == 0 or boundary > num_tokens or boundary % g.block_size == 0:
            return
        idx = boundary // g.block_size
        entry = g.tables.slice(request.request_id, idx, idx + 1)
        if not entry or entry[0] == NULL_BLOCK_ID:
            return
        self.pool.cache_partial_block(group_key(fine[boundary // hbs - 1], g.gid), entry[0], boundary)

    # ================================================================ allocate / free
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
        """vLLM's ``allocate_slots``: new block ids per group, or None when they do not fit."""
        request = self._check_request(request)
        check_int("num_new_tokens", num_new_tokens, minimum=0)
        check_int("num_new_computed_tokens", num_new_computed_tokens, minimum=0)
        check_int("num_lookahead_tokens", num_lookahead_tokens, minimum=0)
        check_int("num_external_computed_tokens", num_external_computed_tokens, minimum=0)
        check_int("reserved_blocks", reserved_blocks, minimum=0)
        for name, flag in (("delay_cache_blocks", delay_cache_blocks),
                           ("full_sequence_must_fit", full_sequence_must_fit),
                           ("has_scheduled_reqs", has_scheduled_reqs)):
            if not isinstance(flag, bool):
                raise InvalidFieldError(name, flag, "True or False")
        if num_new_tokens == 0 and num_external_computed_tokens == 0 and num_new_computed_tokens == 0:
            raise InvalidFieldError("num_new_tokens", 0,
                                    "> 0 when there are no computed tokens to adopt")
        hits = self._validate_hits(request, num_new_computed_tokens, new_computed_block_ids)
        rid = request.request_id
        have_hits = any(hits)
        num_local = request.num_computed_tokens + num_new_computed_tokens
        total = min(num_local + num_external_computed_tokens, self.max_model_len)
        watermark = 0
        if has_scheduled_reqs and request.status in (RequestStatus.WAITING, RequestStatus.PREEMPTED):
            watermark = self.watermark_blocks

        if full_sequence_must_fit:
            full = min(request.num_tokens, self.max_model_len)
            need = sum(self._num_blocks_to_allocate(g, rid, full, hits[g.gid], total, num_local, True)
                       for g in self.groups)
            if need + watermark > self.pool.num_free:
                return None

        main = total + num_new_tokens
        need_slot = min(main + num_lookahead_tokens, self.max_model_len)
        # Out-of-window blocks go back before the check, even if the check then fails, on the
        # processed-token basis (in-flight steps still read below the optimistic boundary).
        processed = max(0, total - request.num_in_flight_tokens)
        for g in self.groups:
            self._remove_skipped(g, rid, processed)
        need = sum(self._num_blocks_to_allocate(g, rid, need_slot, hits[g.gid],
                                                num_local + num_external_computed_tokens, num_local, False)
                   for g in self.groups)
        if need + watermark > self.pool.num_free - reserved_blocks:
            return None

        if have_hits or num_external_computed_tokens > 0:
            if not any(rid in g.num_cached_block for g in self.groups):
                for g in self.groups:  # touch every group's hits before allocating (#33775)
                    self._add_hits(g, rid, hits[g.gid], num_local, num_external_computed_tokens)
                if num_external_computed_tokens > 0:
                    for g in self.groups:
                        self._allocate_external(g, rid, num_local, num_external_computed_tokens)
            else:
                assert not have_hits
        new = [self._allocate_new(g, rid, need_slot) for g in self.groups]
        if not delay_cache_blocks and self.enable_caching:
            fine = self.hashes.get(request)
            n_cache = min(total + num_new_tokens, request.num_tokens)
            for g in self.groups:
                self._cache_blocks(g, request, fine, self._cacheable_tokens(g, n_cache))
        return tuple(tuple(b) for b in new)

    def _validate_hits(self, request: Request, num_new_computed_tokens: int,
                       ids: BlockIds | None) -> list[list[int]]:
        if ids is None:
            return [[] for _ in self.groups]
        if not isinstance(ids, (tuple, list)) or len(ids) != self.num_groups:
            raise InvalidFieldError("new_computed_block_ids", ids,
                                    f"None or one sequence of block ids per group ({self.num_groups})")
        out = []
        for gi, seq in enumerate(ids):
            if not isinstance(seq, (tuple, list)):
                raise InvalidFieldError(f"new_computed_block_ids[{gi}]", seq, "a sequence of block ids")
            for b in seq:
                if isinstance(b, bool) or not isinstance(b, int) or not 0 <= b < self.config.num_blocks:
                    raise InvalidFieldError(f"new_computed_block_ids[{gi}]", b,
                                            f"block ids in [0, {self.config.num_blocks})")
            if seq and num_new_computed_tokens % self.groups[gi].block_size:
                raise InvalidFieldError("num_new_computed_tokens", num_new_computed_tokens,
                                        f"a multiple of group {gi}'s block_size (partial hits are not modelled)")
            out.append(list(seq))
        if any(out) and not self.enable_caching:
            raise InvalidFieldError("new_computed_block_ids", ids, "empty when prefix caching is disabled")
        # A hit is what get_computed_blocks returned: cached blocks (null only as a skipped
        # placeholder) for a positive number of hit tokens, as the reference's allocate_slots checks.
        if any(out):
            if not num_new_computed_tokens:
                raise InvalidFieldError("num_new_computed_tokens", 0,
                                        "the hit's token count (> 0) when new_computed_block_ids holds blocks")
            cached = self.pool.has_hash
            for gi, seq in enumerate(out):
                spec = self.config.groups[gi].kv_cache_spec
                expected = -(-num_new_computed_tokens // spec.block_size) if spec.prefix_cacheable else 0
                if len(seq) != expected:
                    raise InvalidFieldError("num_new_computed_tokens", num_new_computed_tokens,
                                            f"a hit length matching new_computed_block_ids (group {gi} has "
                                            f"{len(seq)} blocks of {spec.block_size} tokens)")
                full = isinstance(spec, FullAttentionSpec)
                if any((b == NULL_BLOCK_ID and full) or (b != NULL_BLOCK_ID and not bool(cached[b])) for b in seq):
                    raise InvalidFieldError(f"new_computed_block_ids[{gi}]", seq,
                                            "cached blocks (a prefix-cache hit; null only where a windowed group "
                                            "skips a block)")
        return out

    def cache_blocks(self, request: Request, num_computed_tokens: int) -> None:
        """vLLM ``KVCacheManager.cache_blocks``: publish the request's full blocks up to
        ``num_computed_tokens``.

        With async scheduling the block that holds a step's sampled token cannot be hashed when
        the next step allocates (the token is a placeholder then); the scheduler publishes it here
        once the output arrives. Without this the block stays uncached and is freed to the *head*
        of the free queue instead of the tail (found by the exhaustive conformance explorer,
        ``kvref.models.explorer.conformance``, at scope ``whole-prompts``).
        """
        request = self._check_request(request)
        check_int("num_computed_tokens", num_computed_tokens, minimum=0)
        rid = request.request_id
        for g in self.groups:
            allocated = g.tables.num_blocks(rid) * g.block_size
            if num_computed_tokens > allocated and not isinstance(g.kind, MambaKind):
                raise InvalidFieldError("num_computed_tokens", num_computed_tokens,
                                        f"at most the {allocated} tokens group {g.gid} has blocks for")
        if not self.enable_caching:
            return
        fine = self.hashes.get(request)
        n = min(num_computed_tokens, request.num_tokens)
        for g in self.groups:
            self._cache_blocks(g, request, fine, self._cacheable_tokens(g, n))

    def free(self, request: Request) -> None:
        """Release the request's blocks, tail first (so the tail is evicted first)."""
        request = self._check_request(request)
        rid = request.request_id
        for g in self.groups:
            head = g.tables.null_head(rid)
            table = g.tables.pop(rid)
            g.num_cached_block.pop(rid, None)
            self.pool._free_blocks(table[head:][::-1])

    def new_step_starts(self) -> None:
        """A scheduler step begins. Nothing is per-step for the modelled group types."""

    def forget(self, request_id: str) -> None:
        """The request is gone for good: drop its memoised block hashes."""
        if not isinstance(request_id, str):
            raise InvalidFieldError("request_id", request_id, "a request id (str)")
        self.hashes.forget(request_id)

    # ================================================================ observation
    def get_block_ids(self, request_id: str) -> BlockIds:
        if not isinstance(request_id, str):
            raise InvalidFieldError("request_id", request_id, "a request id (str)")
        return tuple(tuple(g.tables.get(request_id)) for g in self.groups)

    def get_num_free_blocks(self) -> int:
        return self.pool.num_free

    def free_block_queue(self) -> tuple[int, ...]:
        return tuple(self.pool.free_queue())

    def cached_blocks(self) -> dict[tuple[int, int], bytes]:
        """``{(group_id, block_id): primary hash}`` (hash bytes without the group suffix)."""
        return {(int.from_bytes(k[-4:], "big"), b): k[:-4] for b, k in self.pool.cached_blocks().items()}

    def hash_index(self) -> dict[bytes, tuple[int, ...]]:
        """The prefix-cache map: key (hash + group id) -> block ids, first = the one a lookup returns."""
        return {k: tuple(v) for k, v in self.pool._map.items()}

    def ref_counts(self) -> list[int]:
        return self.pool.ref_cnt.tolist()

    def batch_block_tables(self, group_id: int, request_ids: list[str]) -> tuple[torch.Tensor, torch.Tensor]:
        """``(int32 [B, W] block table, int32 [B] lengths)`` of one group for a step's requests."""
        check_int("group_id", group_id, minimum=0)
        if group_id >= self.num_groups:
            raise InvalidFieldError("group_id", group_id, f"< {self.num_groups}")
        for r in request_ids:
            if r not in self.groups[group_id].tables:
                raise InvalidFieldError("request_ids", r, "ids of requests holding blocks")
        return self.groups[group_id].tables.batch(request_ids)

    def check_invariants(self) -> None:
        """The pool's rules and I9 (reference counts = table slots), docs/invariants.md."""
        self.pool.check_invariants()
        ref = torch.zeros(self.config.num_blocks, dtype=torch.int32)
        for g in self.groups:
            g.tables.check_invariants()
            for rid in g.tables.request_ids():
                for b in g.tables.get(rid):
                    if b != NULL_BLOCK_ID:
                        ref[b] += 1
        pool_ref = self.pool.ref_cnt.cpu()
        ref[NULL_BLOCK_ID] = pool_ref[NULL_BLOCK_ID]
        assert torch.equal(ref, pool_ref), "I9: ref counts differ from the block tables' references"
