"""Run one trace on the reference and on vLLM's KVCacheManager side by side (test helper).

Every operation is applied to both and everything observable is compared right after: the
admission decision, hit length and hit block ids, the new block ids, every live request's block
table, the free queue (order included) and the cached hashes (bytes). Needs vLLM.
"""

from __future__ import annotations

from kvref.impl.interface import PoolConfig
from kvref.impl.reference.adapter import ReferenceKVCacheManager
from kvref.impl.request import Request, RequestStatus
from kvref.impl.vllm.kv_cache_manager import VllmKVCacheManager


def _ids(kv_blocks) -> tuple[tuple[int, ...], ...]:
    return tuple(tuple(ids) for ids in kv_blocks.get_block_ids())


class TracePair:
    def __init__(self, cfg: PoolConfig) -> None:
        self.cfg = cfg
        self.ref = ReferenceKVCacheManager(cfg)
        # vLLM's own manager behind the adapter, whose request mirror is the one every vLLM driver
        # uses (#26: no test-side copy); the pair calls the manager itself (``vllm_manager``) so the
        # hit's KVCacheBlocks go back to allocate_slots as vLLM handed them out
        self.twin = VllmKVCacheManager(cfg)
        self.live: dict[str, Request] = {}

    def lookup(self, req: Request):
        ids, n = self.ref.get_computed_blocks(req)
        vblocks, vn, _ = self.twin.vllm_manager.get_computed_blocks(self.twin.vllm_request(req))
        assert (n, ids) == (vn, _ids(vblocks)), f"hit differs: ref {n} {ids} vllm {vn} {_ids(vblocks)}"
        return ids, n, vblocks

    def allocate(self, req: Request, num_new_tokens: int, num_hit: int = 0, hit_ids=None, vhits=None,
                 **kw) -> bool:
        out = self.ref.allocate_slots(req, num_new_tokens, num_hit, hit_ids, **kw)
        vout = self.twin.vllm_manager.allocate_slots(self.twin.vllm_request(req), num_new_tokens, num_hit, vhits, **kw)
        assert (out is None) == (vout is None), f"admission differs: ref {out} vllm {vout}"
        if out is not None:
            assert out == _ids(vout), f"new blocks differ: ref {out} vllm {_ids(vout)}"
            self.live[req.request_id] = req
        self.compare()
        return out is not None

    def free(self, req: Request) -> None:
        self.ref.free(req)
        self.twin.vllm_manager.free(self.twin.vllm_request(req))
        self.live.pop(req.request_id, None)
        self.compare()

    def new_step(self) -> None:
        self.ref.new_step_starts()
        self.twin.vllm_manager.new_step_starts()

    def reset_prefix_cache(self) -> None:
        assert self.ref.manager.reset_prefix_cache() == self.twin.vllm_manager.reset_prefix_cache()
        self.compare()

    def evict(self, block_ids: set[int]) -> None:
        self.ref.manager.evict_blocks(block_ids)
        self.twin.vllm_manager.evict_blocks(block_ids)
        self.compare()

    def compare(self) -> None:
        assert self.ref.free_block_queue() == self.twin.free_block_queue(), \
            f"free queue differs:\n ref   {self.ref.free_block_queue()}\n vllm  {self.twin.free_block_queue()}"
        assert self.ref.cached_blocks() == self.twin.cached_blocks(), "cached hashes differ"
        for rid in self.live:
            ref_ids = self.ref.get_block_ids(rid)
            v_ids = tuple(tuple(x) for x in self.twin.vllm_manager.get_block_ids(rid))
            assert ref_ids == v_ids, f"table of {rid} differs: ref {ref_ids} vllm {v_ids}"
        assert abs(self.ref.manager.usage - self.twin.vllm_manager.usage) < 1e-12
        self.ref.check_invariants()

    # -------------------------------------------------------------- scheduler-like helpers

    def admit(self, req: Request, chunk: int | None = None, external: int = 0, **kw) -> bool:
        """Lookup + first allocation of (a chunk of) the prompt, like the scheduler's waiting path.
        ``external``: tokens a KV connector offers after the hit (rounded down to whole scheduler
        blocks, never the last token)."""
        hit_ids, n, vhits = self.lookup(req)
        if external:
            sbs = self.cfg.scheduler_block_size
            end = min(n + external, req.num_tokens - 1)
            external = max(0, end - end % sbs - n)
        remaining = req.num_tokens - req.num_computed_tokens - n - external
        num_new = remaining if chunk is None else max(1, min(chunk, remaining))
        ok = self.allocate(req, num_new, n, hit_ids, vhits, num_external_computed_tokens=external, **kw)
        if ok:
            req.num_computed_tokens += n + external + num_new
            req.status = RequestStatus.RUNNING
        return ok

    def advance(self, req: Request, chunk: int | None = None, new_token: int = 1, **kw) -> bool:
        """Next prefill chunk, or one decode token (appended first)."""
        if req.num_computed_tokens >= req.num_tokens:
            req.output_token_ids.append(new_token)
        remaining = req.num_tokens - req.num_computed_tokens
        num_new = remaining if chunk is None else max(1, min(chunk, remaining))
        ok = self.allocate(req, num_new, **kw)
        if ok:
            req.num_computed_tokens += num_new
        return ok
