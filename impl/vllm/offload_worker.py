"""vLLM 0.33.0's whole ``OffloadingConnector``: its SCHEDULER role and one WORKER role per rank,
built from a ``VllmConfig`` with ``kv_transfer_config`` as vLLM's ``KVConnectorFactory`` builds
them, and driven through ``KVConnectorBase_V1``'s public calls only.

Scheduler side: ``on_new_request`` → ``get_num_new_matched_tokens`` → ``update_state_after_alloc``
→ ``build_connector_meta`` → ``update_connector_output`` → ``request_finished_all_groups`` /
``reset_cache``, answering the same calls as :class:`kvref.impl.vllm.offload.OffloadingVllmBackend`
(so the offload world compares it with the reference backend). Worker side, per step and rank, in
the model runner's order (``v1/worker/kv_connector_model_runner_mixin.py``, ``gpu_model_runner``):
``bind_connector_metadata`` → ``handle_preemptions`` → ``start_load_kv`` → (forward) →
``wait_for_save`` → ``get_finished`` → ``build_connector_worker_meta``; the ranks' outputs are
merged by vLLM's own ``KVOutputAggregator`` before the scheduler sees them.

The KV caches are CPU tensors registered with ``register_kv_caches`` (vLLM derives the canonical
block views and mappings from them: ``offloading/worker.py``, ``canonical_mapping.py``). vLLM's
only byte mover, ``CPUOffloadingWorker`` (``kv_offload/cpu/gpu_worker.py``), needs CUDA streams
and CUDA tensors (``gpu_tensor.is_cuda``), and ``CPUOffloadingSpec.get_worker`` refuses a non-CUDA
platform; :class:`KvrefCPUOffloadingSpec` is vLLM's ``CPUOffloadingSpec`` (sizing, manager,
metrics: all vLLM's) with only ``get_worker`` answered by :class:`HostOffloadingWorker`, which
moves the bytes the way the transfer specs describe (``GPULoadStoreSpec.group_sizes`` /
``block_indices``, chunk ids, the refs of ``CanonicalKVCaches``). It is loaded through
``OffloadingSpecFactory``'s out-of-tree path (``spec_name`` / ``spec_module_path``), as a user's
spec would be.

A transfer is *executed* as late as vLLM allows: when the worker is told to wait for it
(``wait``: flushed stores, sync loads) or when the driver reports it finished
(:meth:`HostOffloadingWorker.release`). A store therefore reads its GPU blocks at the last moment
the scheduler's fence (vLLM #41228) promises them unchanged, and a load reads a CPU chunk at the
last moment the manager promises it, so a broken fence or a chunk reused too early shows up as
wrong bytes in the loaded blocks.
"""

from __future__ import annotations

import copy
import itertools
import os
import time
from dataclasses import dataclass, field
from typing import Any

from kvref.impl.vllm.offload import OffloadingVllmBackend, vllm_kv_cache_manager

MODULE_PATH = __name__
SPEC_NAME = "KvrefCPUOffloadingSpec"
_BASE_CONFIG: list[Any] = []
_engines = itertools.count()


def base_vllm_config() -> Any:
    """One ``VllmConfig`` per process (a tiny Llama, 2 KV heads, on CpuPlatform); building one
    costs seconds. Every connector gets a copy with its own cache, parallel and transfer configs."""
    if not _BASE_CONFIG:
        from kvref.impl.vllm.scheduler import VllmEnv

        _BASE_CONFIG.append(VllmEnv().vllm_config)
    return _BASE_CONFIG[0]


def offloading_vllm_config(cfg: Any, kv_cache_config: Any, rank: int = 0, engine_id: str = "kvref",
                           canonical_layout: bool = False) -> Any:
    """A ``VllmConfig`` selecting vLLM's ``OffloadingConnector`` for ``cfg`` (an
    :class:`~kvref.models.offload.offloading_connector_world.OffloadingConfig`): ``cfg.num_workers``
    tensor-parallel ranks, ``cpu_bytes_to_use`` sized so that ``CPUOffloadingSpec`` computes
    exactly ``cfg.num_cpu_chunks`` chunks, ``cfg.cache_policy`` as ``eviction_policy``."""
    from vllm.config import KVTransferConfig
    from vllm.config.kv_events import KVEventsConfig
    from vllm.utils.math_utils import round_up
    from vllm.v1.kv_offload.cpu.spec import CPUOffloadingSpec

    base = base_vllm_config()
    vc = copy.copy(base)
    vc.cache_config = copy.copy(base.cache_config)
    vc.cache_config.block_size = cfg.block_size
    vc.cache_config.enable_prefix_caching = True
    # dense retention, as the GPU KVCacheConfig of vllm_kv_cache_manager and the reference
    # (sparse retention, vLLM's default 0, is compared on the scheduler side by conform-offload:
    # models/offload/offloading_retention.py; docs/differences.md)
    vc.cache_config.prefix_cache_retention_interval = None
    # the layout OffloadingConnector.get_required_kvcache_layout asks the engine for
    vc.cache_config.kv_cache_layout = "LBHNC"
    vc.parallel_config = copy.copy(base.parallel_config)
    pc = vc.parallel_config
    pc.tensor_parallel_size = cfg.num_workers
    pc.world_size = cfg.num_workers
    pc.rank = rank
    # the CPU tier's KV events (OffloadingConnector.take_events), published by the engine core
    vc.kv_events_config = KVEventsConfig(enable_kv_cache_events=True, publisher="null")
    vc.model_config = copy.copy(base.model_config)
    vc.model_config.max_model_len = cfg.max_model_len
    bytes_per_block = kv_cache_config.kv_cache_tensors[0].size // kv_cache_config.num_blocks
    chunk = round_up(bytes_per_block * cfg.num_workers * cfg.blocks_per_chunk, CPUOffloadingSpec.BLOCK_SIZE_ALIGNMENT)
    vc.kv_transfer_config = KVTransferConfig(
        kv_connector="OffloadingConnector", kv_role="kv_both", engine_id=engine_id,
        kv_connector_extra_config={"cpu_bytes_to_use": chunk * cfg.num_cpu_chunks,
                                   "blocks_per_chunk": cfg.blocks_per_chunk, "eviction_policy": cfg.cache_policy,
                                   "offload_prompt_only": cfg.offload_prompt_only,
                                   "store_threshold": getattr(cfg, "store_threshold", 0),
                                   "max_tracker_size": getattr(cfg, "max_tracker_size", 64_000),
                                   "sync_load_budget_bytes": getattr(cfg, "sync_load_budget_bytes", 0),
                                   "canonical_layout": canonical_layout,
                                   "spec_name": SPEC_NAME, "spec_module_path": MODULE_PATH})
    return vc


def vllm_offloading_chunk_config(cfg: Any, kv_cache_config: Any, chunk_options: dict) -> tuple[int, tuple]:
    """vLLM's ``build_offloading_config`` for ``cfg`` with the chunk options ``chunk_options``
    (``blocks_per_chunk`` / ``block_size`` in ``kv_connector_extra_config``, replacing the config's
    own): ``(blocks_per_chunk, each group's sliding_window_size_in_chunks)``; vLLM's refusal
    (ValueError, AssertionError, TypeError) propagates."""
    from vllm.distributed.kv_transfer.kv_connector.v1.offloading.config import build_offloading_config

    vc = offloading_vllm_config(cfg, kv_cache_config)
    extra = dict(vc.kv_transfer_config.kv_connector_extra_config)
    extra.pop("blocks_per_chunk", None)
    extra.update(chunk_options)
    vc.kv_transfer_config = copy.copy(vc.kv_transfer_config)
    vc.kv_transfer_config.kv_connector_extra_config = extra
    out = build_offloading_config(vc, kv_cache_config)
    return out.cache.blocks_per_chunk, tuple(g.sliding_window_size_in_chunks for g in out.groups)


@dataclass
class _Job:
    store: bool
    src: Any
    dst: Any
    executed: bool = False
    released: bool = False


@dataclass
class HostWorkerLog:
    """What one rank's worker was asked to do, for the driver's checks."""

    submitted: list[int] = field(default_factory=list)
    executed: list[int] = field(default_factory=list)
    expedited: list[int] = field(default_factory=list)


def _make_classes() -> dict[str, type]:
    import numpy as np
    import torch
    from vllm.utils.math_utils import cdiv
    from vllm.v1.kv_offload.base import GPULoadStoreSpec, OffloadingWorker, TransferResult
    from vllm.v1.kv_offload.cpu.gpu_worker import _build_copy_plan, _canonical_block_sizes, compute_sub_block_ptrs
    from vllm.v1.kv_offload.cpu.shared_offload_region import SharedOffloadRegion
    from vllm.v1.kv_offload.cpu.spec import CPUOffloadingSpec

    class HostOffloadingWorker(OffloadingWorker):
        """kvref's host-side byte mover for one rank, from the facts of vLLM's transfer specs.

        The CPU medium holds, per canonical KV tensor, ``num_chunks`` rows of ``blocks_per_chunk``
        pages. Group ``g``'s ``group_sizes[g]`` GPU blocks are logical blocks ``block_indices[g]``
        onward of a request; logical block ``i`` lives in sub-page ``i % blocks_per_chunk`` of the
        group's ``(i // blocks_per_chunk - block_indices[g] // blocks_per_chunk)``-th chunk of the
        CPU spec (chunks listed group by group). Each ref of the group copies its un-padded
        ``page_size_bytes`` of the page.
        """

        def __init__(self, kv_caches: Any, blocks_per_chunk: int, region: Any, canonical: bool = False) -> None:
            self.kv_caches = kv_caches
            self.blocks_per_chunk = blocks_per_chunk
            self.region = region
            self.canonical = canonical
            if canonical:
                # canonical layout: every rank's chunk rows are one shared canonical page per tensor,
                # as wide as the widest mapping of a ref on that tensor
                width = [0] * len(kv_caches.tensors)
                for refs in kv_caches.group_data_refs:
                    for ref in refs:
                        width[ref.tensor_idx] = max(width[ref.tensor_idx], ref.mapping.canonical_page_size_bytes)
                got = _canonical_block_sizes(kv_caches.group_data_refs, len(kv_caches.tensors))
                assert got == width, f"vLLM's canonical page sizes {got}, the refs' mappings say {width}"
                self.host = [region.create_next_canonical_view(w * blocks_per_chunk) for w in width]
            else:
                # this rank's slot of every chunk row of vLLM's shared /dev/shm region, one view per tensor
                self.host = [region.create_next_worker_view(t.page_size_bytes * blocks_per_chunk)
                             for t in kv_caches.tensors]
            self.jobs: dict[int, _Job] = {}
            self._results: list[int] = []
            self.log = HostWorkerLog()

        def submit_store(self, job_id, src_spec, dst_spec) -> bool:
            assert job_id not in self.jobs, f"job {job_id} submitted twice"
            self.jobs[job_id] = _Job(True, src_spec, dst_spec)
            self.log.submitted.append(job_id)
            return True

        def submit_load(self, job_id, src_spec, dst_spec, expedited: bool = False) -> bool:
            assert job_id not in self.jobs, f"job {job_id} submitted twice"
            self.jobs[job_id] = _Job(False, src_spec, dst_spec)
            self.log.submitted.append(job_id)
            if expedited:
                self.log.expedited.append(job_id)
            return True

        def _groups(self, gpu: Any, chunks: Any):
            """(group, its GPU blocks, its CPU chunks, sub-pages to skip in the first chunk)."""
            bpc = self.blocks_per_chunk
            blocks, chunk_ids = gpu.block_ids.tolist(), chunks.block_ids.tolist()
            b_off = c_off = 0
            for g, (size, first) in enumerate(zip(gpu.group_sizes, gpu.block_indices)):
                if size == 0:
                    continue
                skip = first % bpc
                n_chunks = cdiv(size + skip, bpc)
                yield g, blocks[b_off:b_off + size], chunk_ids[c_off:c_off + n_chunks], skip
                b_off += size
                c_off += n_chunks
            assert b_off == len(blocks) and c_off == len(chunk_ids), (
                f"spec sizes {list(gpu.group_sizes)} / {list(gpu.block_indices)} do not cover "
                f"{len(blocks)} GPU blocks and {len(chunk_ids)} chunks")

        def _pairs(self, gpu: Any, chunks: Any):
            """(group, GPU block, CPU chunk, sub-page) per block the transfer moves."""
            bpc = self.blocks_per_chunk
            for g, blocks, chunk_ids, skip in self._groups(gpu, chunks):
                for i, block in enumerate(blocks):
                    yield g, block, chunk_ids[(skip + i) // bpc], (skip + i) % bpc

        def _check_pointers(self, gpu: Any, chunks: Any) -> None:
            """vLLM's ``compute_sub_block_ptrs`` (the address arithmetic of its CUDA copy) must name
            the same bytes as this worker copies: block ``b`` of a tensor at ``b * row_stride``, sub-page
            ``s`` of a chunk ``s * page`` further."""
            bpc = self.blocks_per_chunk
            for g, blocks, chunk_ids, skip in self._groups(gpu, chunks):
                for ref in self.kv_caches.group_data_refs[g]:
                    dev, host = self.kv_caches.tensors[ref.tensor_idx].tensor, self.host[ref.tensor_idx]
                    page = host.shape[1] // bpc
                    want_host = [host.data_ptr() + chunk_ids[(skip + i) // bpc] * host.stride(0)
                                 + ((skip + i) % bpc) * page for i in range(len(blocks))]
                    want_dev = [dev.data_ptr() + b * dev.stride(0) for b in blocks]
                    got_host, got_dev = np.zeros(len(blocks), np.uint64), np.zeros(len(blocks), np.uint64)
                    compute_sub_block_ptrs(np.array(chunk_ids, np.int64), bpc, got_host, host, skip_count=skip)
                    compute_sub_block_ptrs(np.array(blocks, np.int64), 1, got_dev, dev)
                    assert got_host.tolist() == want_host and got_dev.tolist() == want_dev, (
                        f"compute_sub_block_ptrs names other bytes than group {g}'s blocks {blocks} / chunks "
                        f"{chunk_ids} (skip {skip})")

        def _execute(self, job_id: int) -> None:
            job = self.jobs[job_id]
            if job.executed:
                return
            gpu, cpu = (job.src, job.dst) if job.store else (job.dst, job.src)
            assert isinstance(gpu, GPULoadStoreSpec)
            self._check_pointers(gpu, cpu)
            for g, block, chunk, sub in self._pairs(gpu, cpu):
                for ref in self.kv_caches.group_data_refs[g]:
                    t = self.kv_caches.tensors[ref.tensor_idx]
                    if self.canonical:
                        self._copy_canonical(ref, block, chunk, sub, job.store)
                        continue
                    lo = sub * t.page_size_bytes
                    host = self.host[ref.tensor_idx][chunk, lo:lo + ref.page_size_bytes]
                    dev = t.tensor[block, :ref.page_size_bytes]
                    (host if job.store else dev).copy_(dev if job.store else host)
            job.executed = True
            self.log.executed.append(job_id)

        def _copy_canonical(self, ref: Any, block: int, chunk: int, sub: int, store: bool) -> None:
            """One ref of one block through its canonical mapping: each run's fragments between their
            local and canonical offsets. A store writes only the canonical pages this rank is elected
            for (``is_writer`` of the page's id, chunk * blocks_per_chunk + sub: the same on every
            rank); a load reads back every local byte."""
            m = ref.mapping
            frags = [(r.local_offset + i * r.local_stride, r.canonical_offset + i * r.canonical_stride,
                      r.fragment_size) for r in m.runs for i in range(r.num_fragments)]
            plan = _build_copy_plan(ref, store)  # vLLM's unrolled copy plan must name the same fragments
            src, dst = ([f[0] for f in frags], [f[1] for f in frags]) if store else \
                ([f[1] for f in frags], [f[0] for f in frags])
            assert (plan.frag_offsets_src.tolist(), plan.frag_offsets_dst.tolist(), plan.frag_sizes.tolist()) == \
                (src, dst, [f[2] for f in frags]), "vLLM's canonical copy plan differs from the mapping's runs"
            page_id = chunk * self.blocks_per_chunk + sub
            if store and not m.is_writer(page_id):
                return
            dev = self.kv_caches.tensors[ref.tensor_idx].tensor[block]
            host = self.host[ref.tensor_idx][chunk]
            base = sub * (host.shape[0] // self.blocks_per_chunk)
            for local, canon, size in frags:
                h = host[base + canon:base + canon + size]
                d = dev[local:local + size]
                (h if store else d).copy_(d if store else h)

        def release(self, job_id: int, write: bool = True) -> None:
            """The transfer finished on this rank: execute it (if not yet) and report it at the next
            ``get_finished``. ``write=False``: report it without moving bytes (a load whose request
            the driver already freed: vLLM defers that free until the load ends, the driver does not)."""
            job = self.jobs[job_id]
            assert not job.released, f"job {job_id} released twice"
            if write:
                self._execute(job_id)
            else:
                job.executed = True
            job.released = True
            self._results.append(job_id)

        def get_finished(self):
            out = [TransferResult(j, True, transfer_size=64, transfer_time=0.001) for j in self._results]
            for j in self._results:
                del self.jobs[j]
            self._results = []
            return out

        def wait(self, job_ids) -> None:
            for j in sorted(job_ids):
                if j in self.jobs:
                    self._execute(j)

        def shutdown(self) -> None:
            self.jobs.clear()
            self._results.clear()
            self.host = []
            if self.region is not None:
                self.region.cleanup()  # the creating rank unlinks the /dev/shm files
                self.region = None

    class KvrefCPUOffloadingSpec(CPUOffloadingSpec):
        """vLLM's ``CPUOffloadingSpec`` whose worker is :class:`HostOffloadingWorker` (vLLM's needs
        CUDA). Sizing, the manager, metrics and events stay vLLM's."""

        def get_worker(self, kv_caches):
            if self._worker is None:
                # the host memory CPUOffloadingSpec.create_worker gives a CUDA worker: vLLM's shared
                # region, this rank's slots (no barrier: the ranks are built one after the other here)
                region = SharedOffloadRegion(
                    engine_id=self.config.engine_id, num_chunks=self.num_chunks, rank=self.config.parallel.rank,
                    kv_bytes_per_chunk=self.kv_bytes_per_chunk, cpu_page_size=self.cpu_page_size_per_worker,
                    barrier=None, num_segments=2)
                self._worker = HostOffloadingWorker(kv_caches, self.blocks_per_chunk, region,
                                                    canonical=self.config.canonical_layout)
            return self._worker

    return {"HostOffloadingWorker": HostOffloadingWorker, SPEC_NAME: KvrefCPUOffloadingSpec}


_CLASSES: dict[str, type] = {}


def __getattr__(name: str):
    # OffloadingSpecFactory does getattr(module, spec_name): build the classes (importing vLLM) on demand
    if name in ("HostOffloadingWorker", SPEC_NAME):
        if not _CLASSES:
            _CLASSES.update(_make_classes())
        return _CLASSES[name]
    raise AttributeError(name)


class OffloadingConnectorVllmBackend(OffloadingVllmBackend):
    """vLLM 0.33.0's ``OffloadingConnector`` in both roles over its GPU ``KVCacheManager``.

    ``workers[r]`` is rank ``r``'s WORKER-role connector, ``kv[r]`` its KV cache tensor (all layers
    share it, as the groups of :func:`vllm_kv_cache_manager`'s ``KVCacheConfig`` do) and
    ``host[r]`` its :class:`HostOffloadingWorker`.
    """

    name = "vllm-connector"

    def __init__(self, cfg: Any, canonical_layout: bool = False) -> None:  # noqa: D107 - the parent's is replaced
        import torch
        from vllm.distributed.kv_transfer.kv_connector.utils import KVOutputAggregator
        from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
        from vllm.distributed.kv_transfer.kv_connector.v1.offloading_connector import OffloadingConnector

        self.cfg = cfg
        self._hasher, kcfg, self.mgr = vllm_kv_cache_manager(cfg)
        self.kv_cache_config = kcfg
        # the engine id names the ranks' shared /dev/shm region: one per world, process and time
        engine = f"kvref-{os.getpid()}-{next(_engines)}-{time.time_ns()}"
        self.conn = OffloadingConnector(offloading_vllm_config(cfg, kcfg, 0, engine, canonical_layout),
                                        KVConnectorRole.SCHEDULER, kcfg)
        self.conn.bind_kv_cache_manager(self.mgr)
        # a best-effort cache: a lost store is a later miss, so the scheduler must not wait for delivery
        assert self.conn.requires_kv_delivery is False
        self.manager = self.conn.scheduler.manager
        self.gpu_pool = self.mgr.block_pool
        self.page = kcfg.kv_cache_tensors[0].size // kcfg.num_blocks
        self.unloaded = b"\xa5" * self.page  # what a load's GPU block holds until the load writes it
        self.workers, self.kv, self.host = [], [], []
        for rank in range(cfg.num_workers):
            w = OffloadingConnector(offloading_vllm_config(cfg, kcfg, rank, engine, canonical_layout),
                                    KVConnectorRole.WORKER, kcfg)
            # vLLM's attention layout for these specs: (blocks, K/V, block_size, heads, head_size)
            t = torch.zeros(kcfg.num_blocks, 2, cfg.block_size, 1, 1, dtype=torch.float32)
            w.register_kv_caches({name: t for g in kcfg.kv_cache_groups for name in g.layer_names})
            self.workers.append(w)
            self.kv.append(t)
            self.host.append(w.connector_worker.worker)
        self.aggregator = KVOutputAggregator(cfg.num_workers)
        self.reported: dict[int, int] = {}  # job -> ranks that reported it
        self.write_next = True
        self.finished_recving: list[set[str]] = []

    # --- scheduler role through KVConnectorBase_V1 -------------------------------------------

    def build_meta(self, step):
        meta = self.conn.build_connector_meta(_scheduler_output(step))
        jobs = self.conn.scheduler._jobs
        keys = lambda j: tuple(jobs[j].keys) if j in jobs else ()  # noqa: E731
        from kvref.impl.offload_backends import norm_offloading_meta

        loads = {j: (t.req_id, keys(j), tuple(t.dst_spec.block_ids.tolist()), tuple(t.src_spec.block_ids.tolist()))
                 for j, t in meta.load_jobs.items()}
        stores = {j: (t.req_id, keys(j), tuple(t.src_spec.block_ids.tolist()), tuple(t.dst_spec.block_ids.tolist()))
                  for j, t in meta.store_jobs.items()}
        out = norm_offloading_meta(loads, stores, meta.jobs_to_flush or ())
        # worker role: each rank gets its own copy, as each deserializes its own SchedulerOutput
        for rank, w in enumerate(self.workers):
            w.clear_connector_metadata()  # the previous step's (kept bound for get_finished between steps)
            m = copy.deepcopy(meta)
            w.bind_connector_metadata(m)
            w.handle_preemptions(m)  # flushed stores read their blocks here
            # then a load's GPU blocks are scrubbed before the rank runs it: bytes an earlier owner of
            # the same content left there would hide a load that never wrote them (a sync load not
            # waited for)
            for t in meta.load_jobs.values():
                for block in t.dst_spec.block_ids.tolist():
                    self.write_block(rank, block, self.unloaded)
            w.start_load_kv(None)
        return out

    def after_forward(self) -> None:
        """The step's forward pass on every rank, as the attention layers call the connector (each
        layer waits for its load, then hands its KV to save: no-ops for this connector, whose loads
        run before the forward and whose stores are jobs), then its end: stores are queued for the
        next step."""
        for w, kv in zip(self.workers, self.kv):
            for g in self.kv_cache_config.kv_cache_groups:
                for name in g.layer_names:
                    w.wait_for_layer_load(name)
                    w.save_kv_layer(name, kv, None)
            w.wait_for_save()

    def submitted(self, job: int, rank: int) -> bool:
        return job in self.host[rank].jobs

    def complete(self, jobs):
        """Deliver ``jobs`` (``{job: count}``) from the next ``count`` ranks; with ``write_next``
        False (set by the driver for a load whose request it already freed) the ranks report the
        load without writing its bytes."""
        from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput

        write, self.write_next = self.write_next, True
        ((j, count),) = jobs.items()
        first = self.reported.get(j, 0)
        for rank in range(first, first + count):
            assert self.submitted(j, rank), f"worker rank {rank} was never given job {j} to run"
            self.host[rank].release(j, write)
        self.reported[j] = first + count
        outs = []
        for w in self.workers:
            transfer = w.get_transfer_results(set())
            outs.append(ModelRunnerOutput(req_ids=[], req_id_to_index={}, kv_connector_output=KVConnectorOutput(
                finished_sending=transfer.finished_sending, finished_recving=transfer.finished_recving,
                kv_connector_worker_meta=w.build_connector_worker_meta())))
        merged = self.aggregator.aggregate(outs).kv_connector_output
        got = dict(merged.kv_connector_worker_meta.completed_jobs) if merged.kv_connector_worker_meta else {}
        assert got == {j: count}, f"the workers reported completions {got}, expected {{{j}: {count}}}"
        assert not merged.finished_sending, f"offload workers never finish sending: {merged.finished_sending}"
        self.finished_recving.append(set(merged.finished_recving or ()))
        if self.reported[j] >= self.cfg.num_workers:
            del self.reported[j]
        self.conn.update_connector_output(merged)

    def finished(self, req, aborted):
        table = self.table(req.request_id)
        if len(table) == 1 and sum(map(ord, req.request_id)) % 2:
            # what a MultiConnector calls on a one-group pool beside a non-HMA child: the same answer
            self.conn.request_finished(req, table[0])
        else:
            self.conn.request_finished_all_groups(req, table)

    def file_mappers(self, root: str, blocks_per_file: int, parallel_agnostic: bool) -> list[dict]:
        """Each rank's ``FileMapper.from_offloading_spec`` over its live spec (base path, run config,
        rank), as a file-backed tier would place this engine's chunks."""
        from kvref.impl.vllm.file_mapper import vllm_file_mapper_from_spec

        return [vllm_file_mapper_from_spec(root, w.connector_worker.spec, blocks_per_file, parallel_agnostic)
                for w in self.workers]

    def take_kv_events(self) -> list:
        """The connector's KV cache events since the last call (vLLM's objects)."""
        return list(self.conn.take_events())

    def block_bytes(self, rank: int, block: int) -> bytes:
        import torch

        return self.kv[rank].view(self.kv[rank].shape[0], -1).view(torch.int8)[block].numpy().tobytes()

    def write_block(self, rank: int, block: int, data: bytes) -> None:
        import torch

        row = self.kv[rank].view(self.kv[rank].shape[0], -1).view(torch.int8)[block]
        row.copy_(torch.frombuffer(bytearray(data), dtype=torch.int8))

    def shutdown(self) -> None:
        for w in self.workers:
            w.shutdown()
        self.conn.shutdown()


def _scheduler_output(step):
    from kvref.impl.vllm.offload import vllm_scheduler_output

    return vllm_scheduler_output(step)
