"""vLLM 0.33.0's tiering worker front door (``TieringOffloadingSpec.create_worker``) on generated layer
references: does it refuse them for canonical offload, what does it record, and what does it leave.

:func:`create_tiering_worker` builds vLLM's ``TieringOffloadingSpec`` (no secondary tier: the worker
side does not build tiers) for a parallel config and hands ``create_worker`` a ``CanonicalKVCaches``
whose layer references carry, or lack, a ``CanonicalPageMapping`` with the given
``parallelism_agnostic``. What it reports:

* ``outcome``: ``"worker"`` when vLLM went on to build its ``CPUOffloadingWorker`` (the frame of
  ``CPUOffloadingWorker.__init__`` ran: the references passed; that worker needs CUDA, so on a CPU
  machine its construction fails there, and that failure is not a verdict on the references), or
  ``"refused"`` with vLLM's exception when the spec refused before building the worker;
* ``all_layers_portable`` and ``replicated_layout`` as the spec recorded them, and the rank of the
  shared-region slot the worker was handed (``worker_rank``, None when refused);
* ``leftover``: the shared-region files of this engine left in ``/dev/shm`` (``create_worker``
  releases the worker's mapping when it fails).
"""

from __future__ import annotations

import glob
import itertools
import logging
import os
from dataclasses import dataclass

from kvref.spec.errors import InvalidFieldError, check_int

_ENGINES = itertools.count()
_PAGE = 64
#: vLLM's module whose constructor marks "the references passed"
_WORKER_FILE = os.path.join("kv_offload", "cpu", "gpu_worker.py")


@dataclass(frozen=True)
class WorkerOutcome:
    outcome: str  # "worker" or "refused"
    error: str | None  # "ExceptionClass: message" when refused
    all_layers_portable: bool | None
    replicated_layout: bool
    worker_rank: int | None  # the rank of the shared-region slot vLLM handed its worker
    leftover: tuple[str, ...]


def _check_portable(portable) -> None:
    if isinstance(portable, (str, bytes)) or not isinstance(portable, (list, tuple)) or any(
            not isinstance(g, (list, tuple)) or any(p is not None and not isinstance(p, bool) for p in g)
            for g in portable):
        raise InvalidFieldError("portable", portable, "a list of groups, each a list of None/bool per layer ref")


def create_tiering_worker(canonical_layout: bool, is_parallelism_agnostic: bool, portable,
                          world_size: int = 1, rank: int = 0, replicated_layout: bool = False) -> WorkerOutcome:
    """Run vLLM's ``create_worker`` once (see the module docstring); ``portable`` per group, per ref:
    None (no mapping) or the mapping's ``parallelism_agnostic``."""
    for name, flag in (("canonical_layout", canonical_layout), ("is_parallelism_agnostic", is_parallelism_agnostic),
                       ("replicated_layout", replicated_layout)):
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
    from vllm.v1.kv_offload.tiering.spec import TieringOffloadingSpec

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
    spec = TieringOffloadingSpec(ocfg)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    tensors, refs = [], []
    for group in portable:
        group_refs = []
        for p in group:
            mapping = None if p is None else CanonicalPageMapping(
                canonical_page_size_bytes=_PAGE, local_page_size_bytes=_PAGE,
                runs=(CopyRun(0, 0, _PAGE, 1, _PAGE, _PAGE),), num_writers=1, writer_index=0,
                parallelism_agnostic=p)
            group_refs.append(CanonicalKVCacheRef(tensor_idx=len(tensors), page_size_bytes=_PAGE, mapping=mapping))
            tensors.append(CanonicalKVCacheTensor(tensor=torch.zeros(4, _PAGE, dtype=torch.int8, device=device),
                                                  page_size_bytes=_PAGE))
        refs.append(group_refs)
    region_log = logging.getLogger("vllm.v1.kv_offload.cpu.shared_offload_region")
    level = region_log.level
    region_log.setLevel(logging.ERROR)  # "Keeping ... mapped": the CPU machine's worker failure, expected
    worker = worker_rank = None
    try:
        worker = spec.create_worker(CanonicalKVCaches(tensors=tensors, group_data_refs=refs))
        outcome, error, worker_rank = "worker", None, worker._mmap_region.rank
    except Exception as exc:  # noqa: BLE001 - the outcome is what is compared
        tb, entered = exc.__traceback__, False
        while tb is not None:  # the worker's constructor ran: read the region it was handed
            if tb.tb_frame.f_code.co_filename.endswith(_WORKER_FILE) and tb.tb_frame.f_code.co_name == "__init__":
                region = tb.tb_frame.f_locals.get("mmap_region")
                entered, worker_rank = True, getattr(region, "rank", None)
                break
            tb = tb.tb_next
        outcome, error = ("worker", None) if entered else ("refused", f"{type(exc).__name__}: {exc}")
        del tb, exc
    finally:
        region_log.setLevel(level)
    try:
        leftover = tuple(sorted(glob.glob(f"/dev/shm/vllm_offload_{engine}.mmap*")))
        return WorkerOutcome(outcome, error, spec.all_layers_portable, spec.replicated_layout, worker_rank, leftover)
    finally:
        if worker is not None:
            worker.shutdown()
        for path in glob.glob(f"/dev/shm/vllm_offload_{engine}.mmap*"):
            os.remove(path)


__all__ = ["WorkerOutcome", "create_tiering_worker"]
