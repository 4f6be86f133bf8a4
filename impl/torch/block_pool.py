"""The block pool with its state in tensors: ref counts, free-queue priority keys, hash flags.

vLLM keeps the free queue as an intrusive doubly-linked list (``FreeKVCacheBlockQueue``). Here it
is a priority key per block (int64 tensor): the queue is the set of blocks whose key is not
``NOT_FREE``, in increasing key order. Popping n blocks takes the n smallest keys; appending gives
new keys above the current maximum; prepending gives new keys below the current minimum, in order.
Keys are never reused, so ties are impossible and the order is total.

Semantics mirrored from ``vllm/v1/core/block_pool.py`` (0.33.0):

* block 0 is the null block: never queued, never cached, its ref count not maintained;
* ``get_new_blocks`` pops from the front and evicts the popped blocks' hashes;
* ``touch`` takes a zero-ref cached block out of the queue (it was an eviction candidate);
* ``free_blocks`` (order = eviction priority) prepends blocks without a hash (scratch is reused
  first, LIFO) and appends hashed blocks (LRU for cached content). Older vLLM appended everything.
* the hash map allows the same key in several blocks (block tables are append-only, never
  re-pointed to a deduplicated block); a lookup returns the earliest inserted block still mapped.
"""

from __future__ import annotations

import torch

from kvref.impl.interface import MAX_NUM_BLOCKS
from kvref.spec.errors import InvalidFieldError, check_int

NOT_FREE = torch.iinfo(torch.int64).max
NULL_BLOCK_ID = 0


def group_key(block_hash: bytes, group_id: int) -> bytes:
    """vLLM's ``BlockHashWithGroupId``: hash bytes + 4-byte big-endian group id."""
    return block_hash + group_id.to_bytes(4, "big", signed=False)


def as_device(field: str, device: object) -> torch.device:
    """``device`` as a ``torch.device``, or InvalidFieldError (torch raises RuntimeError/TypeError)."""
    if isinstance(device, torch.device):
        return device
    if not isinstance(device, str):
        raise InvalidFieldError(field, device, "a torch.device or a device string such as 'cpu' or 'cuda:0'")
    try:
        return torch.device(device)
    except (RuntimeError, TypeError) as exc:
        raise InvalidFieldError(field, device, f"a device string such as 'cpu' or 'cuda:0' ({exc})") from None


class TorchBlockPool:
    """``num_blocks`` blocks (block 0 = null) on ``device``."""

    def __init__(self, num_blocks: int, enable_caching: bool, device: torch.device) -> None:
        check_int("num_blocks", num_blocks, minimum=1)
        if num_blocks > MAX_NUM_BLOCKS:
            raise InvalidFieldError("num_blocks", num_blocks, f"an int in [1, {MAX_NUM_BLOCKS}]")
        if not isinstance(enable_caching, bool):
            raise InvalidFieldError("enable_caching", enable_caching, "True or False")
        device = as_device("device", device)
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.device = device
        self.ref_cnt = torch.zeros(num_blocks, dtype=torch.int32, device=device)
        keys = torch.arange(num_blocks, dtype=torch.int64, device=device)
        keys[NULL_BLOCK_ID] = NOT_FREE
        self.queue_key = keys
        self.has_hash = torch.zeros(num_blocks, dtype=torch.bool, device=device)
        self._min_key = 1
        self._max_key = num_blocks - 1
        self.num_free = num_blocks - 1
        # Hash index. ``_map[key]`` is an insertion-ordered dict of block ids (get_one = first).
        self._map: dict[bytes, dict[int, None]] = {}
        self._primary: dict[int, tuple[bytes, int]] = {}   # block -> (key, num tokens it covers)
        self._secondary: dict[int, set[bytes]] = {}        # block -> extra (partial) keys

    # ----------------------------------------------------------------- queue
    def free_queue(self) -> list[int]:
        """Block ids in queue order, front (next to be allocated) first."""
        order = torch.argsort(self.queue_key)[: self.num_free]
        return order.tolist()

    def _take_front(self, n: int) -> torch.Tensor:
        if n == 0:
            return torch.empty(0, dtype=torch.int64, device=self.device)
        return torch.topk(self.queue_key, n, largest=False, sorted=True).indices

    def _append(self, ids: torch.Tensor) -> None:
        n = ids.numel()
        if n:
            self.queue_key[ids] = torch.arange(self._max_key + 1, self._max_key + 1 + n,
                                               dtype=torch.int64, device=self.device)
            self._max_key += n
            self.num_free += n

    def _prepend(self, ids: torch.Tensor) -> None:
        n = ids.numel()
        if n:
            self.queue_key[ids] = torch.arange(self._min_key - n, self._min_key,
                                               dtype=torch.int64, device=self.device)
            self._min_key -= n
            self.num_free += n

    # ----------------------------------------------------------------- allocation
    def get_new_blocks(self, n: int) -> list[int]:
        """Pop ``n`` blocks from the front, drop their cached hashes, ref count 1."""
        check_int("num_blocks", n, minimum=0)
        if n > self.num_free:
            raise InvalidFieldError("num_blocks", n, f"at most the {self.num_free} free blocks")
        ids = self._take_front(n)
        if n == 0:
            return []
        self.queue_key[ids] = NOT_FREE
        self.num_free -= n
        id_list = ids.tolist()
        if self.enable_caching:
            hashed = self.has_hash[ids]
            if bool(hashed.any()):
                for b in ids[hashed].tolist():
                    self._remove_hashes(b)
        self.ref_cnt[ids] = 1
        return id_list

    def touch(self, block_ids: list[int]) -> None:
        """Add a reference to each block (a prefix hit); zero-ref blocks leave the queue."""
        self._check_ids("block_ids", block_ids)
        ids = [b for b in block_ids if b != NULL_BLOCK_ID]
        if not ids:
            return
        t = torch.tensor(ids, dtype=torch.int64, device=self.device)
        uniq = torch.unique(t)
        leaving = uniq[self.ref_cnt[uniq] == 0]
        if leaving.numel():
            self.queue_key[leaving] = NOT_FREE
            self.num_free -= leaving.numel()
        self.ref_cnt.index_add_(0, t, torch.ones_like(t, dtype=torch.int32))

    def free_blocks(self, ordered_block_ids: list[int]) -> None:
        """Drop one reference per block; ``ordered_block_ids`` is eviction priority (first = first).

        Checked: ids of this pool, each held at least as often as it is listed (freeing a free
        block used to leave ``check_invariants()`` failing). The manager calls the unchecked
        :meth:`_free_blocks` with its own tables."""
        self._check_ids("ordered_block_ids", ordered_block_ids)
        ids = [b for b in ordered_block_ids if b != NULL_BLOCK_ID]
        if not ids:
            return
        need: dict[int, int] = {}
        for b in ids:
            need[b] = need.get(b, 0) + 1
        have = self.ref_cnt[torch.tensor(list(need), dtype=torch.int64, device=self.device)].tolist()
        if any(h < n for h, n in zip(have, need.values())):
            raise InvalidFieldError("ordered_block_ids", ordered_block_ids,
                                    "ids of blocks in use, each at most as often as it is referenced")
        if len(need) != len(ids):
            raise InvalidFieldError("ordered_block_ids", ordered_block_ids,
                                    "distinct block ids (one request's table in one group)")
        self._free_blocks(ids)

    def _free_blocks(self, ordered_block_ids: list[int]) -> None:
        ids = [b for b in ordered_block_ids if b != NULL_BLOCK_ID]
        if not ids:
            return
        t = torch.tensor(ids, dtype=torch.int64, device=self.device)
        # A block appears at most once per call (one request's table in one group).
        self.ref_cnt[t] -= 1
        released = t[self.ref_cnt[t] == 0]
        if released.numel() == 0:
            return
        if self.enable_caching:
            hashed = self.has_hash[released]
            self._prepend(released[~hashed])
            self._append(released[hashed])
        else:
            self._prepend(released)

    def _check_ids(self, field: str, ids: object) -> None:
        """A list of block ids of this pool (O(len), before anything changes)."""
        n = len(self.ref_cnt)
        if not isinstance(ids, (list, tuple)) or not all(type(b) is int and 0 <= b < n for b in ids):
            raise InvalidFieldError(field, ids, f"a list of block ids (ints in [0, {n}))")

    # ----------------------------------------------------------------- hashes
    def get_one_block(self, key: bytes) -> int | None:
        blocks = self._map.get(key)
        return next(iter(blocks)) if blocks else None

    def get_cached_block(self, block_hash: bytes, group_ids: list[int]) -> list[int] | None:
        """One block per group for ``block_hash``, or None if any group misses."""
        if not isinstance(block_hash, bytes):
            raise InvalidFieldError("block_hash", block_hash, "a block hash (bytes)")
        if not isinstance(group_ids, (list, tuple)) or not all(type(g) is int and 0 <= g < 2**32 for g in group_ids):
            raise InvalidFieldError("group_ids", group_ids, "a list of KV cache group ids (ints in [0, 2**32))")
        out = []
        for g in group_ids:
            b = self.get_one_block(group_key(block_hash, g))
            if b is None:
                return None
            out.append(b)
        return out

    def primary(self, block_id: int) -> tuple[bytes, int] | None:
        return self._primary.get(block_id)

    def _remove_hashes(self, block_id: int) -> None:
        keys = []
        p = self._primary.pop(block_id, None)
        if p is not None:
            keys.append(p[0])
        keys.extend(self._secondary.pop(block_id, ()))
        for k in keys:
            blocks = self._map.get(k)
            if blocks is not None and block_id in blocks:
                del blocks[block_id]
                if not blocks:
                    del self._map[k]
        self.has_hash[block_id] = False

    def insert_hash(self, key: bytes, block_id: int, num_tokens: int) -> None:
        """First key of a block becomes its primary hash; later keys are secondary (partial)."""
        p = self._primary.get(block_id)
        if p is not None and p[0] == key:
            return
        blocks = self._map.get(key)
        if blocks is not None and block_id in blocks:
            return
        if p is None:
            self._primary[block_id] = (key, num_tokens)
            self.has_hash[block_id] = True
        else:
            self._secondary.setdefault(block_id, set()).add(key)
        self._map.setdefault(key, {})[block_id] = None

    def cache_full_block(self, key: bytes, block_id: int, num_tokens: int) -> None:
        """``cache_full_blocks`` for one block: a partial entry is promoted to the full one."""
        p = self._primary.get(block_id)
        if p is not None:
            assert p[1] < num_tokens, f"block {block_id} already cached with {p[1]} >= {num_tokens} tokens"
            self._remove_hashes(block_id)
        self.insert_hash(key, block_id, num_tokens)

    def cache_partial_block(self, key: bytes, block_id: int, num_tokens: int) -> None:
        """``cache_partial_block``: register a prefix boundary inside a block (never null)."""
        p = self._primary.get(block_id)
        already = (p is not None and p[0] == key) or block_id in self._map.get(key, {})
        if not already and p is not None and p[1] < num_tokens:
            self._remove_hashes(block_id)
        self.insert_hash(key, block_id, num_tokens)

    def cached_blocks(self) -> dict[int, bytes]:
        """Primary key (with group id) of every block in the hash map."""
        return {b: k for b, (k, _) in self._primary.items()}

    # ----------------------------------------------------------------- checks
    def check_invariants(self) -> None:
        """I2–I5 and I8's queue keys of docs/invariants.md, read from the tensors."""
        ref = self.ref_cnt.cpu()
        key = self.queue_key.cpu()
        assert key[NULL_BLOCK_ID] == NOT_FREE, "I2: null block is in the free queue"
        real = torch.arange(self.num_blocks) != NULL_BLOCK_ID
        assert bool((ref[real] >= 0).all()), "I4: negative ref count"
        queued = key != NOT_FREE
        assert bool((queued[real] == (ref[real] == 0)).all()), "I3: queued <=> ref_cnt == 0 broken"
        assert int(queued.sum()) == self.num_free, "I5: num_free drifted"
        qk = key[queued]
        assert qk.unique().numel() == qk.numel(), "I8: duplicate queue keys"
        if qk.numel():
            assert int(qk.min()) >= self._min_key and int(qk.max()) <= self._max_key, \
                f"I8: queue keys outside [{self._min_key}, {self._max_key}]"
        has = self.has_hash.cpu()
        assert set(torch.nonzero(has).flatten().tolist()) == set(self._primary), "I6: has_hash drifted"
        assert not bool(has[NULL_BLOCK_ID]), "I2: null block cached"
        assert set(self._secondary) <= set(self._primary), "I6: secondary key without primary"
        for k, blocks in self._map.items():
            assert blocks, f"I6: empty entry for {k.hex()}"
            for b in blocks:
                p = self._primary.get(b)
                assert p is not None and (p[0] == k or k in self._secondary.get(b, ())), \
                    f"I6: map entry {k.hex()} -> {b} not owned by the block"
        for b, (k, _) in self._primary.items():
            assert b in self._map.get(k, {}), f"I6: block {b}'s primary hash not in the map"
