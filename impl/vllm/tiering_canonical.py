"""vLLM 0.33.0's tiering worker front door (``TieringOffloadingSpec.create_worker``) on generated layer
references: does it refuse them for canonical offload, what does it record, and what does it leave.

:func:`create_tiering_worker` builds vLLM's ``TieringOffloadingSpec`` (no secondary tier: the worker
side does not build tiers) for a parallel config and hands ``create_worker`` a ``CanonicalKVCaches``
whose layer references carry, or lack, a ``CanonicalPageMapping`` with the given
``parallelism_agnostic``. vLLM's ``CPUOffloadingWorker`` copies between GPU tensors and pinned host
memory on CUDA streams (excluded from reach as needs-gpu); for the call, ``create_worker`` is handed
:class:`_RecordingWorker` in its place, which records what vLLM passes it (and fails when asked, as
pinning or a stream can), so the spec's own code runs the same on any machine. What it reports:

* ``outcome``: ``"worker"`` when vLLM built its worker, ``"worker_failed"`` when the worker's
  construction failed (the exception propagates), ``"refused"`` with vLLM's exception when the spec
  refused the references before building the worker;
* ``worker``: what vLLM handed its worker (``canonical_layout``, ``blocks_per_chunk``,
  ``num_cpu_chunks``, the shared-region slot's rank), None when refused;
* ``all_layers_portable`` and ``replicated_layout`` as the spec recorded them;
* ``leftover``: the shared-region files of this engine left in ``/dev/shm`` after the built worker
  is shut down (``create_worker`` releases the worker's mapping when it fails).
"""

from __future__ import annotations

import glob
import itertools
import os
from dataclasses import dataclass

from kvref.spec.errors import InvalidFieldError, check_int

_ENGINES = itertools.count()


class _RecordingWorker:
    """Stands in for vLLM's ``CPUOffloadingWorker`` (CUDA-only): records its arguments; owns the
    shared region once built (released at ``shutdown``, as vLLM's worker does); fails when
    :data:`fail` is set, before taking the region."""

    fail = False
    last: tuple | None = None

    def __init__(self, kv_caches, blocks_per_chunk, num_cpu_chunks, mmap_region=None, canonical_layout=False):
        type(self).last = (canonical_layout, blocks_per_chunk, num_cpu_chunks,
                           None if mmap_region is None else mmap_region.rank)
        if type(self).fail:
            raise RuntimeError("kvref: the worker could not be built (pinning failed)")
        self._mmap_region = mmap_region

    def shutdown(self) -> None:
        if self._mmap_region is not None:
            self._mmap_region.cleanup()
            self._mmap_region = None
_PAGE = 64


@dataclass(frozen=True)
class WorkerOutcome:
    outcome: str  # "worker" or "refused"
    error: str | None  # "ExceptionClass: message" when refused
    all_layers_portable: bool | None
    replicated_layout: bool
    worker: tuple | None  # (canonical_layout, blocks_per_chunk, num_cpu_chunks, region rank) handed over
    leftover: tuple[str, ...]


def _check_portable(portable) -> None:
    if isinstance(portable, (str, bytes)) or not isinstance(portable, (list, tuple)) or any(
            not isinstance(g, (list, tuple)) or any(p is not None and not isinstance(p, bool) for p in g)
            for g in portable):
        raise InvalidFieldError("portable", portable, "a list of groups, each a list of None/bool per layer ref")


def create_tiering_worker(canonical_layout: bool, is_parallelism_agnostic: bool, portable,
                          world_size: int = 1, rank: int = 0, replicated_layout: bool = False,
                          worker_fails: bool = False) -> WorkerOutcome:
    """Run vLLM's ``create_worker`` once (see the module docstring); ``portable`` per group, per ref:
    None (no mapping) or the mapping's ``parallelism_agnostic``; ``worker_fails``: the worker's
    construction fails."""
    for name, flag in (("canonical_layout", canonical_layout), ("is_parallelism_agnostic", is_parallelism_agnostic),
                       ("replicated_layout", replicated_layout), ("worker_fails", worker_fails)):
        if not isinstance(flag, bool):
            raise InvalidFieldError(name, flag, "a bool")
    _check_portable(portable)
    check_int("world_size", world_size, minimum=1)
    check_int("rank", rank, minimum=0)
    if rank >= world_size:
        raise InvalidFieldError("rank", rank, f"an int < world_size ({world_size})")
    import torch
    from vllm.v1.kv_offload.base import (
        CanonicalKVCacheRef,
        CanonicalKVCaches,
        CanonicalKVCacheTensor,
        CanonicalPageMapping,
        CopyRun,
    )
    from vllm.v1.kv_offload.config import (
        OffloadingCacheConfig,
        OffloadingConfig,
        OffloadingGroupConfig,
        OffloadingModelConfig,
        OffloadingParallelConfig,
    )
    from vllm.v1.kv_offload.tiering import spec as tiering_spec

    engine = f"kvref-tierwork-{os.getpid()}-{next(_ENGINES)}"
    ocfg = OffloadingConfig(
        groups=tuple(OffloadingGroupConfig(16, (f"layer{g}",), g) for g in range(max(1, len(portable)))),
        worker_kv_bytes_per_block=_PAGE, enable_kv_cache_events=False,
        extra_config={"spec_name": "TieringOffloadingSpec", "cpu_bytes_to_use": 2 * 4096, "secondary_tiers": []},
        engine_id=engine,
        model=OffloadingModelConfig(name="kvref", dtype="float16", max_model_len=4096),
        cache=OffloadingCacheConfig(tokens_per_hash=16, blocks_per_chunk=1),
        parallel=OffloadingParallelConfig(rank=rank, world_size=world_size, tp_size=world_size, pp_size=1,
                                          pcp_size=1, dcp_size=1, data_parallel_index=0, data_parallel_size=1,
                                          data_parallel_rank_local=None,
                                          is_parallelism_agnostic=is_parallelism_agnostic),
        replicated_layout=replicated_layout, canonical_layout=canonical_layout)
    spec = tiering_spec.TieringOffloadingSpec(ocfg)
    tensors, refs = [], []
    for group in portable:
        group_refs = []
        for p in group:
            mapping = None if p is None else CanonicalPageMapping(
                canonical_page_size_bytes=_PAGE, local_page_size_bytes=_PAGE,
                runs=(CopyRun(0, 0, _PAGE, 1, _PAGE, _PAGE),), num_writers=1, writer_index=0,
                parallelism_agnostic=p)
            group_refs.append(CanonicalKVCacheRef(tensor_idx=len(tensors), page_size_bytes=_PAGE, mapping=mapping))
            tensors.append(CanonicalKVCacheTensor(tensor=torch.zeros(4, _PAGE, dtype=torch.int8),
                                                  page_size_bytes=_PAGE))
        refs.append(group_refs)
    real = tiering_spec.CPUOffloadingWorker
    tiering_spec.CPUOffloadingWorker = _RecordingWorker
    _RecordingWorker.fail, _RecordingWorker.last = worker_fails, None
    worker = None
    try:
        worker = spec.create_worker(CanonicalKVCaches(tensors=tensors, group_data_refs=refs))
        outcome, error = "worker", None
    except Exception as exc:  # noqa: BLE001 - the outcome is what is compared
        failed = _RecordingWorker.last is not None
        outcome, error = ("worker_failed" if failed else "refused"), f"{type(exc).__name__}: {exc}"
    finally:
        tiering_spec.CPUOffloadingWorker = real
    try:
        if worker is not None:
            worker.shutdown()
        leftover = tuple(sorted(glob.glob(f"/dev/shm/vllm_offload_{engine}.mmap*")))
        return WorkerOutcome(outcome, error, spec.all_layers_portable, spec.replicated_layout,
                             _RecordingWorker.last, leftover)
    finally:
        for path in glob.glob(f"/dev/shm/vllm_offload_{engine}.mmap*"):
            os.remove(path)

__all__ = ["WorkerOutcome", "create_tiering_worker"]
