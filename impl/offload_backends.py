"""kvref's two CPU-offload connectors behind the backend interface the offload worlds drive.

A backend is an engine (:class:`kvref.impl.offload_engine.ReferenceEngine`) plus a connector:
:class:`SimpleCPUReferenceBackend` (``SimpleCPUOffloadScheduler``) and
:class:`OffloadingReferenceBackend` (the ``OffloadingConnector``'s scheduler over a
``CPUOffloadingManager``). vLLM's twins, answering the same calls, are in
:mod:`kvref.impl.vllm.offload`. The configs are duck-typed (``cfg.block_size``, ``cfg.num_gpu_blocks``…:
:class:`kvref.models.offload.simple_cpu_world.SimpleOffloadConfig`, :class:`kvref.models.offload.offloading_connector_world.OffloadingConfig`).
"""

from __future__ import annotations

from typing import Any


from kvref.impl.offload_engine import ReferenceEngine, kvref_kv_cache_manager
from kvref.impl.reference.offload.cpu_offloading_manager import CPUOffloadingManager
from kvref.impl.reference.kv_events import use_int_block_hashes
from kvref.impl.reference.offload.offload_event_tracker import OffloadingEventsTracker, event_group_specs
from kvref.impl.reference.offload.offloading_scheduler import OffloadingConnectorScheduler
from kvref.impl.reference.offload.simple_cpu_offload_scheduler import SimpleCPUOffloadScheduler, SimpleOffloadStep


class SimpleCPUReferenceBackend(ReferenceEngine):
    """kvref's KVCacheManager + SimpleCPUOffloadScheduler. ``variant``: ``"reference"`` (vLLM
    0.33.0) or ``"fix_42903"`` (open vLLM PR 42903's within-scan dedup, a proposed fix). Historic
    behaviour is not a variant here: it is patched in by the mutants of :mod:`kvref.models.mutants`
    (``offload.in_flight_not_deduped`` for #41289)."""

    name = "reference"
    VARIANTS = {"reference": {}, "fix_42903": {"dedup_within_scan": True}}

    def __init__(self, cfg: Any, variant: str = "reference") -> None:
        groups = cfg.kvref_groups()
        self.mgr = kvref_kv_cache_manager(cfg, groups)
        self.conn = SimpleCPUOffloadScheduler(
            groups, cfg.num_cpu_blocks, cfg.max_model_len, cfg.block_size, cfg.block_size, lazy_offload=cfg.lazy,
            world_size=cfg.world_size, max_num_batched_tokens=cfg.max_num_batched_tokens,
            block_hasher=self.mgr.block_hashes, enable_kv_cache_events=getattr(cfg, "kv_events", False),
            **self.VARIANTS[variant])
        self.conn.bind_gpu_block_pool(self.mgr.block_pool)
        self.gpu_pool = self.mgr.block_pool
        self.cpu_pool = self.conn.cpu_block_pool
        self.non_hma_sibling = bool(getattr(cfg, "non_hma_sibling", False))

    def after_alloc(self, req, n_ext) -> None:
        self.conn.update_state_after_alloc(req, self.table(req.request_id), n_ext)

    def build_meta(self, step: SimpleOffloadStep):
        m = self.conn.build_connector_meta(step)
        return (m.load_event, list(m.load_gpu_blocks), list(m.load_cpu_blocks), m.store_event,
                list(m.store_gpu_blocks), list(m.store_cpu_blocks), m.need_flush)

    def complete(self, recv: set[str], events: dict[int, int]) -> None:
        self.conn.update_connector_output(recv, events)

    def finished(self, req, table) -> None:
        # beside a non-HMA sibling the finish carries no flush (SimpleOffloadConfig.non_hma_sibling)
        self.conn.request_finished(req, () if getattr(self, "non_hma_sibling", False) else table)

    def reset(self) -> bool:
        return self.conn.reset()

    def stats(self) -> tuple[dict[str, int], dict, bool]:
        """(the connector's interval stats, its boundary save outcomes, has_pending_stores()):
        boundary hand-offs are not modelled, so no outcome is ever counted."""
        return self.conn.get_stats(), {}, self.conn.has_pending_stores()

    def take_kv_events(self) -> list[dict]:
        """The connector's KV cache events since the last call, as plain dicts (every field)."""
        from kvref.impl.reference.kv_events import event_to_plain

        return [event_to_plain(e) for e in self.conn.take_events()]

    def in_flight_set(self) -> set[int]:
        return set(self.conn._in_flight_store_gpu_blocks)

    def tokens(self, req) -> list[int]:
        return list(req.all_token_ids)

    def connector_state(self) -> dict:
        """The connector's per-request state, as vLLM's SimpleCPU scheduler keeps it too: eager
        store cursors with the connector's copy of each block table, pinned CPU hits (length and
        the local prefix they follow) and loads (GPU/CPU blocks, event). A drift here (a cursor not
        reset on preemption, a hit one block too long) shows before it changes a transfer."""
        c = self.conn
        return {"stores": {rid: (list(st.num_stored_blocks), [list(g) for g in st.block_ids], st.finished,
                                 sorted(st.store_events)) for rid, st in c._reqs_to_store.items()},
                "hits": {rid: p[1:] for rid, p in c._pending_cpu_hits.items()},
                "loads": {rid: (list(self._transfer(ls).gpu_block_ids), list(self._transfer(ls).cpu_block_ids),
                                ls.load_event, ls.finished) for rid, ls in c._reqs_to_load.items()}}

    @staticmethod
    def _transfer(load_state):
        return load_state.transfer

    def check_invariants(self) -> None:
        self.conn.check_invariants()
        self.mgr.check_invariants(strict_ref_counts=False)


def norm_offloading_meta(load_jobs, store_jobs, flush) -> tuple:
    return (sorted((j, r, sorted(k), list(b), list(c)) for j, (r, k, b, c) in load_jobs.items()),
            sorted((j, r, sorted(k), list(b), list(c)) for j, (r, k, b, c) in store_jobs.items()),
            sorted(flush))


class OffloadingReferenceBackend(ReferenceEngine):
    """kvref's KVCacheManager + OffloadingConnectorScheduler over a CPUOffloadingManager."""

    name = "reference"

    def __init__(self, cfg: Any) -> None:
        groups = cfg.kvref_groups()
        self.mgr = kvref_kv_cache_manager(cfg, groups)
        kv_events = getattr(cfg, "kv_events", "off")  # "off", "placeholder" or "self_describing"
        self.manager = CPUOffloadingManager(cfg.num_cpu_chunks, cfg.cache_policy, enable_events=kv_events != "off",
                                            store_threshold=max(1, getattr(cfg, "store_threshold", 1)),
                                            max_tracker_size=getattr(cfg, "max_tracker_size", 64_000))
        specs = [g.kv_cache_spec for g in groups]
        tracker = OffloadingEventsTracker(kv_events != "off", kv_events == "self_describing", event_group_specs(specs),
                                          use_int_block_hashes())
        # vLLM's kv_bytes_per_token: every offloaded group's bytes per block on one worker, per token
        per_token = sum(g.kv_cache_spec.page_size_bytes * len(g.layer_names) // cfg.block_size for g in groups)
        self.conn = OffloadingConnectorScheduler(specs, self.manager, getattr(cfg, "hash_block_size", None) or cfg.block_size,
                                                 cfg.blocks_per_chunk, cfg.num_workers, cfg.offload_prompt_only,
                                                 block_hasher=self.mgr.block_hashes, events_tracker=tracker,
                                                 sync_load_budget_bytes=getattr(cfg, "sync_load_budget_bytes", 0),
                                                 kv_bytes_per_token=per_token,
                                                 retention_interval=getattr(cfg, "prefix_cache_retention_interval", None),
                                                 eagle_groups=[i for i, g in enumerate(groups) if g.is_eagle_group])
        self.gpu_pool = self.mgr.block_pool

    def on_new_request(self, req, kv_transfer_params=None):
        self.conn.on_new_request(req, kv_transfer_params)

    def hit_sources(self, req, n_ext):
        """``get_external_cache_hit_sources`` as sorted (source, tokens) pairs."""
        return sorted(self.conn.get_external_cache_hit_sources(req, n_ext).items())

    def connector_stats(self):
        """``get_stats`` since the last call, as {metric: value} (histograms of delays: counts)."""
        return self.conn.get_stats()

    def pending_push_work(self) -> bool:
        """``has_pending_push_work``: must the engine keep stepping with nothing scheduled?"""
        return self.conn.has_pending_push_work()

    def request_offload_state(self, rid):
        """What the connector parsed from a request's ``kv_transfer_params``: its load tier filter
        ("ALL", or its (medium, locality) matchers) and load / store caps; None once untracked."""
        st = self.conn._req_status.get(rid)
        if st is None:
            return None
        f = st.load_tier_filter
        return ("ALL" if f.everything else f.matchers, st.max_load_tokens, st.max_offload_tokens)

    def after_alloc(self, req, n_ext):
        blocks = self.mgr.get_blocks(req.request_id).blocks
        self.conn.update_state_after_alloc(req, [[(b.block_id, b.block_hash is not None) for b in g] for g in blocks],
                                           n_ext)

    def build_meta(self, step):
        m = self.conn.build_connector_meta(step)
        f = lambda jobs: {j: (t.req_id, t.keys, t.block_ids, t.chunk_ids) for j, t in jobs.items()}  # noqa: E731
        return norm_offloading_meta(f(m.load_jobs), f(m.store_jobs), m.jobs_to_flush)

    def complete(self, jobs):
        self.conn.update_connector_output(jobs)

    def finished(self, req, aborted):
        self.conn.request_finished(req, aborted)

    def reset(self):
        self.conn.reset_cache()

    def chunk_state(self):
        return self.manager.chunk_state()

    def take_kv_events(self) -> list[dict]:
        """The connector's KV cache events since the last call, as plain dicts (every field)."""
        from kvref.impl.reference.kv_events import event_to_plain

        return [event_to_plain(e) for e in self.conn.take_events()]

    def check_invariants(self):
        self.conn.check_invariants()
        self.mgr.check_invariants(strict_ref_counts=False)
