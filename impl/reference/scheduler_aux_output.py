"""The scheduler-side control plane of vLLM 0.33.0's auxiliary-output connector (routed-experts
capture, "R3": ``vllm/distributed/aux_output_connector/connector.py``
``AuxOutputSchedulerConnector``), which the scheduler builds when
``vllm_config.aux_output_config.enabled`` (``--enable-return-routed-experts``; MoE models on the V2
model runner with prefix caching).

Why it is KV-cache behaviour: a prefix hit skips the forward pass of its tokens, so the routing of
those tokens (which experts each MoE layer chose) must come from a store the worker keeps per KV
block. The connector therefore caps every prefix hit at the blocks whose routing it can still
serve, and keeps ("retains") the routing of blocks that were GPU-cached when their request left:

* **retained blocks** (``_kv_cached``): an LRU, keyed by the full-attention group's block hash (the
  last ``hash_block_size`` hash of a block, as ``maybe_convert_block_hash`` gives it: vLLM
  ``_kv_blocks``),
  holding each block's fine hashes. ``request_finished`` (at a preemption, vLLM
  ``Scheduler._preempt_request``, and at a finish, ``_free_request``) adds each of the request's
  computed full blocks that is still GPU-cached in the full-attention group and not yet retained;
  then ``_release_unheld`` trims the LRU to ``capacity`` (``KVCacheConfig.num_blocks``, doubled with
  a KV connector) by releasing, oldest first, blocks that are neither in an async load
  (``request_loading``) nor GPU-cached.
* **max_cache_hit** (the local look-up's ``max_cache_hit_length``): the request's blocks in order,
  each either retained (moved to the LRU's end) or GPU-cached in the full-attention group, stopping
  at the first that is neither; at most ``num_tokens - 1`` tokens.
* **cap_external_hit**: a KV connector's external tokens are kept only when the local plus external
  hit ends on a block boundary and within ``max_cache_hit`` (asked again: a second LRU touch);
  otherwise none, and an async load is then not started (``load_kv_async &= ext > 0``).
* **request_loading**: the blocks an async load covers are held against release until the request
  is next scheduled (``build_connector_meta`` pops them) or leaves.
* **reset** (after a successful ``reset_prefix_cache``): every retained block is released, the
  generation advances, every request's hashes are sent again.
* **build_connector_meta** (each ``schedule()``, before ``_update_after_schedule``): the worker's
  step metadata: the generation, each scheduled request's routing start, the block hashes newly
  keyed for each request (also for requests not scheduled, after a settled token completed a
  block), the requests finished since the last step (with their last hashes), and the hashes
  retained and released since the last step.

Not modelled: ``take_output`` (which rows of the worker's routing output a request returns: no KV
effect; kvref's fake model hands vLLM rows covering every computed token) and the per-request
``routed_experts_prompt_start`` (kvref requests take the default 0). See docs/differences.md.
"""

from __future__ import annotations

from collections import OrderedDict
from itertools import islice
from typing import TYPE_CHECKING, Iterator, Sequence

from kvref.impl.request import Request
from kvref.spec.errors import InvalidFieldError, check_int
from kvref.spec.kv_cache_interface import FullAttentionSpec

from .kv_events import ExternalBlockHash, to_external_block_hash, use_int_block_hashes

if TYPE_CHECKING:
    from kvref.impl.interface import PoolConfig


def full_attention_group_id(pool: "PoolConfig") -> int:
    """The group whose blocks key the routing store: vLLM takes the hybrid coordinator's
    ``full_attention_group_id`` (the first full-attention group, after sorting full attention
    first), or 0 when there is none (one group, or no full attention)."""
    return next((i for i, g in enumerate(pool.groups) if isinstance(g.kv_cache_spec, FullAttentionSpec)), 0)


class AuxOutputControl:
    """vLLM ``AuxOutputSchedulerConnector`` over the reference KV cache manager.

    Args:
        kv_cache_manager: the reference manager (a ``ReferenceKVCacheManager``: its ``.manager``
            gives the request block hashes and the block pool the GPU-cached check reads).
        pool: the KV cache plan (``num_blocks``, the groups, ``hash_block_size``).
        with_kv_connector: a KV connector is configured (the LRU's capacity doubles).
    """

    def __init__(self, kv_cache_manager, pool: "PoolConfig", with_kv_connector: bool) -> None:
        manager = getattr(kv_cache_manager, "manager", None)
        if manager is None or not hasattr(manager, "block_hashes"):
            raise InvalidFieldError("kv_cache_manager", type(kv_cache_manager).__name__,
                                    "the reference KV cache manager (aux output needs its block hashes)")
        if not pool.enable_caching:
            raise InvalidFieldError("pool.enable_caching", pool.enable_caching,
                                    "True (vLLM: AuxOutput Connector requires prefix caching)")
        if not isinstance(with_kv_connector, bool):
            raise InvalidFieldError("with_kv_connector", with_kv_connector, "True or False")
        self._manager = manager
        self.group_id = full_attention_group_id(pool)
        self.block_size = pool.groups[self.group_id].kv_cache_spec.block_size
        self.hash_block_size = pool.hash_block_size
        #: vLLM ``_capacity``: ``KVCacheConfig.num_blocks``, x2 with a KV connector
        self.capacity = pool.num_blocks * (2 if with_kv_connector else 1)
        self.sent_hash_counts: dict[str, int] = {}
        self.finished_requests: dict[str, tuple[bytes, ...] | None] = {}
        self.generation = 0
        #: the retained blocks, least recently used first: block hash -> its fine hashes
        self.kv_cached: OrderedDict[ExternalBlockHash, tuple[bytes, ...]] = OrderedDict()
        self.loading: dict[str, set[ExternalBlockHash]] = {}
        self.retained_hashes: list[bytes] = []
        self.released_hashes: list[bytes] = []
        #: the metadata of the last ``build_connector_meta`` (what the worker was sent)
        self.last_metadata: dict | None = None

    # ---- helpers ----------------------------------------------------------------------------
    def _hashes(self, request: Request) -> list[bytes]:
        return self._manager.block_hashes(request)

    def _gpu_cached(self, block_hash: bytes) -> bool:
        """The block is in the pool's hash map for the full-attention group (held or free)."""
        return self._manager.block_pool.get_cached_block(block_hash, [self.group_id]) is not None

    def _kv_blocks(self, hashes: Sequence[bytes]) -> Iterator[tuple[ExternalBlockHash, tuple[bytes, ...]]]:
        """(block key, its fine hashes) for each whole full-attention block of ``hashes``; the key is
        the block's last hash as vLLM's ``maybe_convert_block_hash`` gives it (by default its low 64
        bits as an int: ``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES``, read at each call as vLLM does)."""
        step = self.block_size // self.hash_block_size
        use_int = use_int_block_hashes()
        for end in range(step, len(hashes) + 1, step):
            yield to_external_block_hash(hashes[end - 1], use_int), tuple(hashes[end - step:end])

    def _take_new_hashes(self, request: Request, num_computed_tokens: int) -> tuple[bytes, ...] | None:
        hashes = self._hashes(request)
        num_sent = self.sent_hash_counts[request.request_id]
        assert num_sent <= len(hashes), "KV block-hash history shrank"
        num_keyed = min(len(hashes), num_computed_tokens // self.hash_block_size)
        if num_keyed <= num_sent:
            return None
        self.sent_hash_counts[request.request_id] = num_keyed
        return tuple(hashes[num_sent:num_keyed])

    # ---- the scheduler's calls ----------------------------------------------------------------
    def max_cache_hit(self, request: Request) -> int:
        """vLLM ``max_cache_hit``: the longest prefix whose routing is retained or GPU-cached."""
        num_blocks = 0
        for block, keys in self._kv_blocks(self._hashes(request)):
            if block in self.kv_cached:
                self.kv_cached.move_to_end(block)
            elif not self._gpu_cached(keys[-1]):
                break
            num_blocks += 1
        return min(num_blocks * self.block_size, request.num_tokens - 1)

    def cap_external_hit(self, request: Request, num_local: int, num_external: int) -> int:
        """vLLM ``cap_external_hit``: the external tokens, or 0 unless the whole hit is
        block-aligned and within :meth:`max_cache_hit`."""
        check_int("num_local", num_local, minimum=0)
        check_int("num_external", num_external, minimum=0)
        num_hit = num_local + num_external
        if num_hit % self.block_size == 0 and num_hit <= self.max_cache_hit(request):
            return num_external
        return 0

    def request_loading(self, request: Request, num_tokens: int) -> None:
        """vLLM ``request_loading``: an async load's blocks are held against release."""
        check_int("num_tokens", num_tokens, minimum=0)
        blocks = islice(self._kv_blocks(self._hashes(request)), num_tokens // self.block_size)
        self.loading[request.request_id] = {block for block, _ in blocks}

    def request_finished(self, request: Request) -> None:
        """vLLM ``request_finished`` (preemption and free): retain the request's GPU-cached
        computed blocks, trim the LRU, queue its terminal event with its last hashes."""
        rid = request.request_id
        self.loading.pop(rid, None)
        num_blocks = request.num_computed_tokens // self.block_size
        for block, keys in islice(self._kv_blocks(self._hashes(request)), num_blocks):
            if block not in self.kv_cached and self._gpu_cached(keys[-1]):
                self.kv_cached[block] = keys
                self.retained_hashes.extend(keys)
        self._release_unheld()
        if rid not in self.sent_hash_counts:
            return
        self.finished_requests[rid] = self._take_new_hashes(request, request.num_computed_tokens)
        del self.sent_hash_counts[rid]

    def _release_unheld(self) -> None:
        excess = len(self.kv_cached) - self.capacity
        if excess <= 0:
            return
        loading = set().union(*self.loading.values())
        victims = []
        for block, keys in self.kv_cached.items():
            if block not in loading and not self._gpu_cached(keys[-1]):
                victims.append(block)
                if len(victims) == excess:
                    break
        for block in victims:
            self.released_hashes.extend(self.kv_cached.pop(block))

    def build_connector_meta(self, scheduled: Sequence[tuple[str, int]], requests: dict[str, Request]) -> dict:
        """vLLM ``build_connector_meta``: one step's worker metadata (``scheduled``: each scheduled
        request id with its token count, in the step's order; counts before
        ``_update_after_schedule``)."""
        scheduled_requests: dict[str, int] = {}
        block_hashes: dict[str, tuple[bytes, ...]] = {}
        for rid, num_tokens in scheduled:
            self.sent_hash_counts.setdefault(rid, 0)
            request = requests[rid]
            packed = self._take_new_hashes(request, request.num_computed_tokens + num_tokens)
            if packed is not None:
                block_hashes[rid] = packed
            self.loading.pop(rid, None)
            # vLLM: max(min(routed_experts_prompt_start (0 here), num_prompt_tokens),
            # 0 before any output, else num_tokens - 1)
            scheduled_requests[rid] = 0 if request.num_output_tokens == 0 else request.num_tokens - 1
        if len(self.sent_hash_counts) != len(scheduled_requests):
            for rid in self.sent_hash_counts:
                if rid in scheduled_requests:
                    continue
                packed = self._take_new_hashes(requests[rid], requests[rid].num_computed_tokens)
                if packed is not None:
                    block_hashes[rid] = packed
        finished = tuple(self.finished_requests)
        block_hashes.update((rid, h) for rid, h in self.finished_requests.items() if h is not None)
        self.finished_requests = {}
        meta = {"generation": self.generation, "requests": scheduled_requests, "block_hashes": block_hashes,
                "finished_requests": finished, "retained_block_hashes": tuple(self.retained_hashes),
                "released_block_hashes": tuple(self.released_hashes)}
        self.retained_hashes, self.released_hashes = [], []
        self.last_metadata = meta
        return meta

    def reset(self) -> None:
        """vLLM ``reset`` (after a successful prefix-cache reset): a new generation, every retained
        block released, every request's hashes to be sent again."""
        self.sent_hash_counts.clear()
        self.finished_requests.clear()
        self.generation += 1
        for keys in self.kv_cached.values():
            self.released_hashes.extend(keys)
        self.kv_cached.clear()

    # ---- observation --------------------------------------------------------------------------
    def view(self) -> dict:
        """What the lock step compares with vLLM's connector: the retained blocks in LRU order,
        the held loads, the generation and the last step's metadata."""
        return {"retained": tuple(self.kv_cached), "loading": {r: frozenset(b) for r, b in self.loading.items()},
                "generation": self.generation, "metadata": self.last_metadata}

    def check_invariants(self, live_request_ids) -> None:
        """A1: each retained block's key is its last fine hash and it has ``block_size //
        hash_block_size`` of them; A2: loads are held only for live requests; A3: hashes are sent
        only to live requests; A4: a finished request's event is queued once (not live)."""
        step = self.block_size // self.hash_block_size
        live = set(live_request_ids)
        for block, keys in self.kv_cached.items():
            assert len(keys) == step and to_external_block_hash(keys[-1], isinstance(block, int)) == block, \
                "A1: a retained block keyed by another hash"
        assert set(self.loading) <= live, f"A2: loads held for gone requests {sorted(set(self.loading) - live)}"
        assert set(self.sent_hash_counts) <= live, \
            f"A3: hashes tracked for gone requests {sorted(set(self.sent_hash_counts) - live)}"
        assert not set(self.finished_requests) & set(self.sent_hash_counts), \
            "A4: a request both finished and still tracked"
