"""The installed vLLM's engine side of the offload worlds, and both of its CPU-offload connectors.

:class:`VllmEngine` answers the calls of :class:`kvref.impl.offload_engine.ReferenceEngine` with
vLLM's ``KVCacheManager`` and ``Request``; :class:`SimpleCPUVllmBackend` adds vLLM's
``SimpleCPUOffloadScheduler`` and :class:`OffloadingVllmBackend` the ``OffloadingConnector``'s
scheduler over its ``CPUOffloadingManager``, so each world compares them call by call with the
reference backends of :mod:`kvref.impl.offload_backends`.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any, Callable

from kvref.impl.offload_backends import OffloadingReferenceBackend, SimpleCPUReferenceBackend, norm_offloading_meta
from kvref.impl.offload_engine import ReferenceEngine


def vllm_kv_cache_manager(cfg: Any) -> tuple[Callable, Any, Any]:
    """vLLM 0.33.0's GPU ``KVCacheManager`` for ``cfg.kvref_groups()``, spec by spec.

    Returns ``(block_hasher, kv_cache_config, kv_cache_manager)``: requests must be built with
    that hasher, and the connector is configured from that ``KVCacheConfig``.
    """
    import torch
    from vllm.utils.hashing import sha256
    from vllm.v1.core.kv_cache_manager import KVCacheManager as VKVCacheManager
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
    from vllm.v1.kv_cache_interface import ChunkedLocalAttentionSpec as VLocal
    from vllm.v1.kv_cache_interface import FullAttentionSpec as VFull
    from vllm.v1.kv_cache_interface import KVCacheConfig, KVCacheTensor
    from vllm.v1.kv_cache_interface import KVCacheGroupSpec as VGroup
    from vllm.v1.kv_cache_interface import SlidingWindowSpec as VSWA

    from kvref.impl.vllm.specs import to_vllm_spec
    from kvref.spec.kv_cache_interface import ChunkedLocalAttentionSpec, MambaSpec, SlidingWindowSpec

    init_none_hash(sha256)
    hash_block_size = getattr(cfg, "hash_block_size", None) or cfg.block_size  # finer hashes: partial tails
    hasher = get_request_block_hasher(hash_block_size, sha256)
    kw = dict(block_size=cfg.block_size, num_kv_heads=1, head_size=1, dtype=torch.float32)

    def vllm_spec(spec):  # cfg.kvref_groups(): full attention, sliding window (+ extra retained), chunked local,
        if isinstance(spec, MambaSpec):  # Mamba "align"
            return to_vllm_spec(spec)
        if isinstance(spec, SlidingWindowSpec):
            return VSWA(sliding_window=spec.sliding_window, extra_retained_tokens=spec.extra_retained_tokens, **kw)
        if isinstance(spec, ChunkedLocalAttentionSpec):
            return VLocal(attention_chunk_size=spec.attention_chunk_size, **kw)
        return VFull(**kw)

    groups = [VGroup(list(g.layer_names), vllm_spec(g.kv_cache_spec), is_eagle_group=g.is_eagle_group)
              for g in cfg.kvref_groups()]
    page = groups[0].kv_cache_spec.page_size_bytes
    kcfg = KVCacheConfig(num_blocks=cfg.num_gpu_blocks,
                         kv_cache_tensors=[KVCacheTensor(size=page * cfg.num_gpu_blocks,
                                                         layers=[g.layer_names[0] for g in groups],
                                                         layer_stride=page, block_stride=page)],
                         kv_cache_groups=groups,
                         prefix_cache_retention_interval=getattr(cfg, "prefix_cache_retention_interval", None))
    # as vLLM's EngineCore sets them on the scheduler's config before the connector is built: the
    # connector's EAGLE proof margin on a partial-tail pool is one hash where hits are fine-grained
    # (OffloadingConnectorScheduler.__init__ reads cache_hit_alignment_tokens), else one block
    kcfg.hash_block_size = hash_block_size
    kcfg.cache_hit_alignment_tokens = _cache_hit_alignment_tokens(kcfg, cfg.block_size, hash_block_size)
    mgr = VKVCacheManager(kcfg, max_model_len=cfg.max_model_len, scheduler_block_size=cfg.block_size,
                          hash_block_size=hash_block_size, enable_caching=True,
                          use_eagle=any(g.is_eagle_group for g in groups) or bool(getattr(cfg, "speculative_eagle", False)))
    return hasher, kcfg, mgr


def _cache_hit_alignment_tokens(kcfg, block_size: int, hash_block_size: int) -> int:
    """vLLM 0.33.0 ``resolve_cache_hit_alignment_tokens`` for ``kcfg`` as ``EngineCore`` calls it
    (prefix caching on, no decode context parallelism): the hash size where aligned Mamba states
    allow sub-block hits and every group's manager supports fine-grained lookups, else the block
    size."""
    from vllm.v1.core.kv_cache_utils import resolve_cache_hit_alignment_tokens

    vcfg = SimpleNamespace(cache_config=SimpleNamespace(enable_prefix_caching=True),
                           parallel_config=SimpleNamespace(decode_context_parallel_size=1))
    return resolve_cache_hit_alignment_tokens(kcfg, vcfg, block_size, hash_block_size)


class VllmEngine(ReferenceEngine):
    """vLLM 0.33.0's ``KVCacheManager`` and ``Request`` (built by :func:`vllm_kv_cache_manager`).

    Both vLLM connectors take ``update_state_after_alloc`` with the request's ``KVCacheBlocks``,
    as vLLM's ``Scheduler`` passes them, and a ``SchedulerOutput`` (:func:`vllm_scheduler_output`).
    """

    _hasher: Callable

    def make_request(self, rid, prompt, max_tokens, prompt_logprobs=False):
        from kvref.impl.vllm.vrequest import vllm_request, vllm_sampling_params

        return vllm_request(rid, list(prompt), vllm_sampling_params(max_tokens=max_tokens,
                                                                    prompt_logprobs=prompt_logprobs),
                            block_hasher=self._hasher)

    def append_token(self, req, tok):
        req.append_output_token_ids(tok)

    def block_hashes(self, req):
        return list(req.block_hashes)

    def set_status(self, req, status):
        from vllm.v1.request import RequestStatus as VS

        req.status = {"waiting": VS.WAITING, "running": VS.RUNNING, "preempted": VS.PREEMPTED,
                      "finished": VS.FINISHED_STOPPED, "aborted": VS.FINISHED_ABORTED,
                      "loading": VS.WAITING_FOR_REMOTE_KVS}[status]

    def get_computed_blocks(self, req):
        from kvref.impl.offload_engine import note_shared_prefix_boundary

        out = self.mgr.get_computed_blocks(req)
        note_shared_prefix_boundary(req, out[2], self.mgr.coordinator.retention_interval)
        return out[0], out[1]

    def cache_blocks(self, req, n):
        self.mgr.cache_blocks(req, n)

    def after_alloc(self, req, n_ext):
        self.conn.update_state_after_alloc(req, self.mgr.get_blocks(req.request_id), n_ext)

    def release_kv_cache_block_copies(self):
        copies, retained = self.mgr.take_kv_cache_block_copies()
        if retained:
            self.mgr.block_pool.free_blocks(retained)
        return [(c.src_block_id, c.dst_block_id) for c in copies]

    def check_invariants(self):
        """kvref's pool and manager invariants on the GPU ``KVCacheManager`` under the connector
        (:mod:`kvref.impl.vllm.invariants`). Ref counts may exceed the table slots: both offload
        schedulers pin (``touch``) the GPU blocks a store is still reading."""
        from kvref.impl.vllm.invariants import check_block_pool, check_kv_cache_manager

        check_kv_cache_manager(self.mgr, exact_ref_counts=False)
        cpu_pool = getattr(self, "cpu_pool", None)  # SimpleCPU: the CPU side is a vLLM BlockPool too
        if cpu_pool is not None:
            check_block_pool(cpu_pool)


def vllm_scheduler_output(step: Any) -> SimpleNamespace:
    """The fields of vLLM's ``SchedulerOutput`` a connector's ``build_connector_meta`` reads, from a
    kvref step (``SimpleOffloadStep`` / ``OffloadingStep``: same fields)."""
    new = [SimpleNamespace(req_id=rid, block_ids=ids) for rid, ids, full in step.scheduled if full]
    cached = [(rid, ids) for rid, ids, full in step.scheduled if not full]
    return SimpleNamespace(
        scheduled_new_reqs=new,
        scheduled_cached_reqs=SimpleNamespace(req_ids=[r for r, _ in cached], new_block_ids=[i for _, i in cached],
                                              resumed_req_ids=set()),
        num_scheduled_tokens=dict(step.num_scheduled_tokens), finished_req_ids=step.finished_req_ids,
        preempted_req_ids=set(step.preempted_req_ids),
        kv_connector_block_state=SimpleNamespace(boundary_state_offloads=dict(getattr(step, "boundary_state_offloads", {}))),
        kv_cache_block_copies=[SimpleNamespace(src_block_id=s, dst_block_id=d)
                               for s, d in getattr(step, "kv_cache_block_copies", ())] or None)


def merged_worker_meta(events: dict[int, int]) -> Any:
    """The scheduler's ``kv_connector_worker_meta`` for store completions ``events`` (store event ->
    how many workers report it now): one ``SimpleCPUOffloadWorkerMetadata`` per reporting rank (rank
    ``r`` reports the events more than ``r`` workers finish), merged with its ``aggregate`` as
    vLLM's ``KVOutputAggregator`` merges the ranks' outputs; None when no store completed (#22)."""
    from functools import reduce

    from vllm.v1.simple_kv_offload.metadata import SimpleCPUOffloadWorkerMetadata

    ranks = [SimpleCPUOffloadWorkerMetadata({ev: 1 for ev, n in events.items() if n > r})
             for r in range(max(events.values(), default=0))]
    # a worker with no completed store reports no metadata (``build_connector_worker_meta``: None)
    return reduce(lambda a, b: a.aggregate(b), ranks) if ranks else None


class SimpleCPUVllmBackend(VllmEngine, SimpleCPUReferenceBackend):
    """vLLM 0.33.0's KVCacheManager + SimpleCPUOffloadScheduler bound to its GPU block pool."""

    name = "vllm"

    def __init__(self, cfg: Any, variant: str = "reference") -> None:  # noqa: D107
        from vllm.v1.simple_kv_offload.manager import SimpleCPUOffloadScheduler as VSched

        assert variant == "reference", "vLLM runs as released"
        self._hasher, kcfg, self.mgr = vllm_kv_cache_manager(cfg)
        vcfg = SimpleNamespace(
            kv_events_config=SimpleNamespace(enable_kv_cache_events=bool(getattr(cfg, "kv_events", False))), speculative_config=None, max_in_flight_tokens=cfg.max_model_len,
            num_prefill_lookahead_tokens=0,
            parallel_config=SimpleNamespace(decode_context_parallel_size=1, world_size=cfg.world_size),
            model_config=SimpleNamespace(max_model_len=cfg.max_model_len),
            scheduler_config=SimpleNamespace(max_num_batched_tokens=cfg.max_num_batched_tokens))
        self.conn = VSched(vcfg, kcfg, cpu_capacity_bytes=10**12, scheduler_block_size=cfg.block_size,
                           hash_block_size=cfg.block_size, lazy_offload=cfg.lazy, num_cpu_blocks=cfg.num_cpu_blocks)
        self.conn.bind_gpu_block_pool(self.mgr.block_pool)
        self.gpu_pool = self.mgr.block_pool
        self.cpu_pool = self.conn.cpu_block_pool
        self.non_hma_sibling = bool(getattr(cfg, "non_hma_sibling", False))

    def build_meta(self, step):
        m = self.conn.build_connector_meta(vllm_scheduler_output(step))
        return (m.load_event, list(m.load_gpu_blocks), list(m.load_cpu_blocks), m.store_event,
                list(m.store_gpu_blocks), list(m.store_cpu_blocks), m.need_flush)

    def complete(self, recv, events):
        from vllm.v1.outputs import KVConnectorOutput
        self.conn.update_connector_output(KVConnectorOutput(
            finished_recving=set(recv), kv_connector_worker_meta=merged_worker_meta(events)))

    def finished(self, req, table):
        if getattr(self, "non_hma_sibling", False):  # what MultiConnector calls beside a non-HMA child (one group)
            self.conn.request_finished(req, table[0])
        else:
            self.conn.request_finished_all_groups(req, table)

    def stats(self):
        from vllm.v1.simple_kv_offload.metrics import MetricName as M

        values = self.conn.get_stats().data["data"]
        return ({"load_blocks": values.get(M.LOAD_BLOCKS, {}).get((), 0),
                 "used_blocks": values[M.USED_BLOCKS][()], "pending_store_blocks": values[M.PENDING_STORE_BLOCKS][()]},
                dict(values.get(M.SAVE_OUTCOMES, {})), self.conn.has_pending_stores())

    def take_kv_events(self):
        from kvref.impl.vllm.kv_events import vllm_event_to_plain

        return [vllm_event_to_plain(e) for e in self.conn.take_events()]

    @staticmethod
    def _transfer(load_state):
        return load_state.transfer_meta


def vllm_offloading_config(cfg: Any, kcfg: Any, get_manager: Callable) -> tuple[Any, Any]:
    """The ``OffloadingSpec`` and ``VllmConfig`` fields vLLM's ``OffloadingConnectorScheduler`` (and
    its ``SchedulerOffloadConfig.from_spec``) reads, for an offload world's ``cfg`` over the GPU
    cache config ``kcfg``; ``get_manager`` returns the CPU offloading manager."""
    from vllm.distributed.kv_transfer.kv_connector.v1.offloading.config import get_sliding_window_size_in_chunks
    from vllm.v1.kv_offload.base import OffloadingKVEventsConfig

    groups = kcfg.kv_cache_groups
    kv_events = getattr(cfg, "kv_events", "off")  # "off", "placeholder" or "self_describing"
    tpc = cfg.block_size * cfg.blocks_per_chunk
    spec = SimpleNamespace(
        config=SimpleNamespace(groups=[SimpleNamespace(
            group_id=i, tokens_per_block=cfg.block_size,
            sliding_window_size_in_chunks=get_sliding_window_size_in_chunks(g.kv_cache_spec, tpc))
            for i, g in enumerate(groups)]),
        blocks_per_chunk=cfg.blocks_per_chunk, tokens_per_hash=getattr(cfg, "hash_block_size", None) or cfg.block_size,
        tokens_per_block=tuple(cfg.block_size for _ in groups), offload_prompt_only=cfg.offload_prompt_only,
        extra_config={"sync_load_budget_bytes": getattr(cfg, "sync_load_budget_bytes", 0)},
        kv_events_config=OffloadingKVEventsConfig(kv_events != "off", kv_events == "self_describing"),
        get_manager=get_manager)
    vcfg = SimpleNamespace(
        cache_config=SimpleNamespace(prefix_cache_retention_interval=getattr(cfg, "prefix_cache_retention_interval", None),
                                     enable_prefix_caching=True),
        # EAGLE-style speculative decoding: what from_spec asks of it (its block drop on)
        speculative_config=SimpleNamespace(use_eagle_block_drop=lambda: True)
        if getattr(cfg, "eagle_group", None) is not None or getattr(cfg, "speculative_eagle", False) else None,
        parallel_config=SimpleNamespace(world_size=cfg.num_workers, decode_context_parallel_size=1))
    return spec, vcfg


def vllm_offloading_config_refusal(cfg: Any) -> str | None:
    """Why vLLM's ``SchedulerOffloadConfig.from_spec`` refuses ``cfg``'s connector configuration
    (its ``ValueError``), or None when it accepts it. Only the connector decides: the GPU cache is
    built without the retention interval (its own coordinator refuses some values first)."""
    from dataclasses import replace

    from vllm.distributed.kv_transfer.kv_connector.v1.offloading.scheduler import SchedulerOffloadConfig

    _, kcfg, _ = vllm_kv_cache_manager(replace(cfg, prefix_cache_retention_interval=None))
    spec, vcfg = vllm_offloading_config(cfg, kcfg, lambda: None)
    try:
        SchedulerOffloadConfig.from_spec(spec, vcfg, kcfg)
    except ValueError as exc:
        return str(exc)
    return None


class OffloadingVllmBackend(VllmEngine, OffloadingReferenceBackend):
    """vLLM 0.33.0's KVCacheManager + OffloadingConnectorScheduler over its CPUOffloadingManager."""

    name = "vllm"

    def __init__(self, cfg: Any) -> None:  # noqa: D107
        from vllm.distributed.kv_transfer.kv_connector.v1.offloading.scheduler import (
            OffloadingConnectorScheduler as VSched,
        )
        from vllm.v1.kv_offload.cpu.manager import CPUOffloadingManager as VManager

        self._hasher, kcfg, self.mgr = vllm_kv_cache_manager(cfg)
        kv_events = getattr(cfg, "kv_events", "off")  # "off", "placeholder" or "self_describing"
        self.manager = VManager(cfg.num_cpu_chunks, cache_policy=cfg.cache_policy, enable_events=kv_events != "off",
                                store_threshold=getattr(cfg, "store_threshold", 0),
                                max_tracker_size=getattr(cfg, "max_tracker_size", 64_000))
        spec, vcfg = vllm_offloading_config(cfg, kcfg, lambda: self.manager)
        self.conn = VSched(spec, vcfg, kcfg)
        self.gpu_pool = self.mgr.block_pool

    def build_meta(self, step):
        m = self.conn.build_connector_meta(vllm_scheduler_output(step))
        keys = lambda j: tuple(self.conn._jobs[j].keys) if j in self.conn._jobs else ()  # noqa: E731
        loads = {j: (t.req_id, keys(j), tuple(t.dst_spec.block_ids.tolist()), tuple(t.src_spec.block_ids.tolist()))
                 for j, t in m.load_jobs.items()}
        stores = {j: (t.req_id, keys(j), tuple(t.src_spec.block_ids.tolist()), tuple(t.dst_spec.block_ids.tolist()))
                  for j, t in m.store_jobs.items()}
        return norm_offloading_meta(loads, stores, m.jobs_to_flush)

    def complete(self, jobs):
        from vllm.distributed.kv_transfer.kv_connector.v1.offloading.common import OffloadingWorkerMetadata
        from vllm.v1.outputs import KVConnectorOutput

        meta = OffloadingWorkerMetadata(completed_jobs=dict(jobs))  # already aggregated over workers
        self.conn.update_connector_output(KVConnectorOutput(kv_connector_worker_meta=meta))

    def finished(self, req, aborted):
        self.conn.request_finished(req)

    def reset(self):
        self.conn.reset_cache()

    def on_new_request(self, req, kv_transfer_params=None):
        req.kv_transfer_params = kv_transfer_params  # vLLM reads it from SamplingParams.extra_args
        self.conn.on_new_request(req)

    @property
    def _sched(self):
        """The scheduler side: ``self.conn``, or the whole connector's ``scheduler`` (conform-offload-worker)."""
        return getattr(self.conn, "scheduler", self.conn)

    def hit_sources(self, req, n_ext):
        # the whole connector (conform-offload-worker) forwards to its scheduler, as vLLM's Scheduler calls it
        return sorted((s.value, n) for s, n in self.conn.get_external_cache_hit_sources(req, n_ext).items())

    def pending_push_work(self) -> bool:
        # the scheduler's, or the whole connector's (conform-offload-worker), which forwards to it
        return self.conn.has_pending_push_work()

    def connector_stats(self):
        # the whole connector's get_kv_connector_stats (conform-offload-worker), as vLLM's Scheduler polls it
        get = getattr(self.conn, "get_kv_connector_stats", None)
        stats = get() if get is not None else self._sched.get_stats()
        if stats is None:
            return {}
        import copy

        # the raw payloads too: what the metrics endpoint aggregates over an interval (offload_stats, #22)
        vars(self).setdefault("stats_payloads", []).append(copy.deepcopy(stats.data))
        types, values = stats.data["types"], stats.data["data"]
        out = {}
        for name, by_labels in values.items():
            value = by_labels[()]
            short = name.removeprefix("vllm:kv_offload_")
            if types[name] == "histogram" and name.endswith("_delay_seconds"):
                value = len(value)  # timings: compare how many were observed
            out[short] = value
        if stats.data.get("info") is not None:
            out["info"] = stats.data["info"]
        return out

    def request_offload_state(self, rid):
        from vllm.v1.kv_offload.base import TierFilter

        st = self._sched._req_status.get(rid)
        if st is None:
            return None
        f = st.req_context.load_tier_filter
        matchers = "ALL" if f is TierFilter.ALL else tuple(
            (m.medium.value if m.medium else None, m.locality.value if m.locality else None) for m in f.matchers)
        return (matchers, st.max_load_tokens, st.max_offload_tokens)

    def take_kv_events(self):
        from kvref.impl.vllm.kv_events import vllm_event_to_plain

        return [vllm_event_to_plain(e) for e in self.conn.take_events()]

    def chunk_state(self):
        pol = self.manager._policy
        items = pol.chunks.items() if hasattr(pol, "chunks") else list(pol.t1.items()) + list(pol.t2.items())
        return {k: (c.chunk_id, c.ref_cnt) for k, c in items}
