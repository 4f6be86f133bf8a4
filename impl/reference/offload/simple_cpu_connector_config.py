"""What vLLM 0.33.0's ``SimpleCPUOffloadConnector`` makes of its ``kv_connector_extra_config``
(``kv_connector/v1/simple_cpu_offload_connector.py``, ``simple_kv_offload/manager.py``): the
per-rank budget, the offload pool's size, the store mode and the backend, or the error a server
reports at startup.

Rules:

* ``cpu_bytes_to_use`` (default 8 GiB) is the budget of the whole server, split evenly over the
  ``world_size`` ranks; ``cpu_bytes_to_use_per_rank`` replaces the split value;
* ``num_cpu_blocks``, when given, must be an ``int`` > 0 and at most what the budget holds
  (``num_gpu_blocks * budget // gpu_total_bytes``); without it the pool takes the count the workers
  agreed on (``cache_config.simple_cpu_offload_num_blocks``) or else what the budget holds (at least
  one block);
* ``kv_offload_backend`` is ``"cpu"`` or ``"disk"``; the disk backend needs ``disk_path`` and a
  ``disk_capacity_bytes`` > 0 (default 100 GiB), which then replaces the CPU budget for sizing,
  and its stored blocks are a ``STORAGE`` medium (``CPU`` otherwise) and disk cache hits; under
  ``"cpu"`` the disk-only keys are ignored;
* ``lazy_offload`` picks the lazy store mode (a cursor over the GPU free queue) over the eager one;
* without prefix caching the connector offloads nothing (no scheduler manager, no worker handler).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from kvref.spec.errors import InvalidFieldError

DEFAULT_CPU_CAPACITY_BYTES = 8 * 1024**3
DEFAULT_DISK_CAPACITY_BYTES = 100 * 1024**3
BACKENDS = ("cpu", "disk")


@dataclass(frozen=True)
class SimpleCPUConnectorSettings:
    """The connector's settings for one rank; ``num_cpu_blocks`` is None when offloading is off
    (prefix caching disabled)."""

    cpu_capacity_per_rank: int
    num_cpu_blocks_override: int | None
    num_cpu_blocks: int | None
    lazy_offload: bool
    disk_mode: bool
    disk_path: str | None
    disk_capacity_bytes: int
    disk_buffer_slots: int
    use_page_cache: bool

    @property
    def kv_event_medium(self) -> str:
        return "STORAGE" if self.disk_mode else "CPU"

    @property
    def cache_hit_source(self) -> str:
        return "DISK" if self.disk_mode else "HOST"


def _as_int(extra: Mapping[str, Any], key: str, default: int) -> int:
    value = extra.get(key, default)
    try:
        return int(value)
    except (TypeError, ValueError):
        raise InvalidFieldError(f"kv_connector_extra_config[{key!r}]", value, "an integer") from None


def simple_cpu_connector_settings(extra: Mapping[str, Any], *, world_size: int, enable_prefix_caching: bool,
                                  num_gpu_blocks: int, gpu_total_bytes: int,
                                  aligned_num_cpu_blocks: int | None = None,
                                  check_capacity: bool = True) -> SimpleCPUConnectorSettings:
    """The settings vLLM's connector derives from ``extra`` (its ``kv_connector_extra_config``).

    Args:
        world_size: the parallel config's world size (the ranks sharing ``cpu_bytes_to_use``).
        enable_prefix_caching: the cache config's switch; offloading needs it.
        num_gpu_blocks, gpu_total_bytes: the GPU pool (``KVCacheConfig.num_blocks`` and the size of
            its backing allocation), which the budget is compared with.
        aligned_num_cpu_blocks: ``cache_config.simple_cpu_offload_num_blocks``.
        check_capacity: size the pool (the scheduler role does at construction; a worker sizes its
            pool only when its KV caches are registered, so ``num_cpu_blocks`` is None for it).

    Raises:
        InvalidFieldError: for a configuration vLLM refuses at startup (naming the key).
    """
    if not isinstance(extra, Mapping):
        raise InvalidFieldError("extra", extra, "a mapping (kv_connector_extra_config)")
    for name, value, least in (("world_size", world_size, 1), ("num_gpu_blocks", num_gpu_blocks, 1),
                               ("gpu_total_bytes", gpu_total_bytes, 1)):
        if type(value) is not int or value < least:
            raise InvalidFieldError(name, value, f"an int >= {least}")
    if not isinstance(enable_prefix_caching, bool):
        raise InvalidFieldError("enable_prefix_caching", enable_prefix_caching, "True or False")
    if aligned_num_cpu_blocks is not None and (type(aligned_num_cpu_blocks) is not int or aligned_num_cpu_blocks < 1):
        raise InvalidFieldError("aligned_num_cpu_blocks", aligned_num_cpu_blocks, "None or an int >= 1")
    per_rank = _as_int(extra, "cpu_bytes_to_use", DEFAULT_CPU_CAPACITY_BYTES) // world_size
    if "cpu_bytes_to_use_per_rank" in extra:
        per_rank = _as_int(extra, "cpu_bytes_to_use_per_rank", 0)
    override = extra.get("num_cpu_blocks")
    if override is not None and (type(override) is not int or override <= 0):
        raise InvalidFieldError("kv_connector_extra_config['num_cpu_blocks']", override, "a positive integer")
    lazy = bool(extra.get("lazy_offload", False))
    backend = str(extra.get("kv_offload_backend", "cpu"))
    if backend not in BACKENDS:
        raise InvalidFieldError("kv_connector_extra_config['kv_offload_backend']", backend, f"one of {BACKENDS}")
    disk_mode = backend == "disk"
    disk_path = extra.get("disk_path", None) or None
    disk_bytes = _as_int(extra, "disk_capacity_bytes", DEFAULT_DISK_CAPACITY_BYTES)
    slots = max(1, _as_int(extra, "disk_buffer_slots", 2))
    page_cache = bool(extra.get("use_page_cache", False))
    if disk_mode and disk_path is None:
        raise InvalidFieldError("kv_connector_extra_config['disk_path']", disk_path,
                                'a path (kv_offload_backend="disk" needs one)')
    if disk_mode and disk_bytes <= 0:
        raise InvalidFieldError("kv_connector_extra_config['disk_capacity_bytes']", disk_bytes,
                                'an int > 0 under kv_offload_backend="disk"')
    if not disk_mode:
        disk_path = None
    if not isinstance(check_capacity, bool):
        raise InvalidFieldError("check_capacity", check_capacity, "True or False")
    num_blocks = None
    if enable_prefix_caching and check_capacity:
        capacity = disk_bytes if disk_mode else per_rank
        local = num_gpu_blocks * capacity // gpu_total_bytes
        if override is None:
            num_blocks = aligned_num_cpu_blocks if aligned_num_cpu_blocks is not None else max(1, local)
        elif override > local:
            raise InvalidFieldError("kv_connector_extra_config['num_cpu_blocks']", override,
                                    f"between 1 and the local offload capacity {local}")
        else:
            num_blocks = override
    return SimpleCPUConnectorSettings(per_rank, override, num_blocks, lazy, disk_mode, disk_path, disk_bytes, slots,
                                      page_cache)


__all__ = ["SimpleCPUConnectorSettings", "simple_cpu_connector_settings"]


def simple_cpu_role_answers(role: str) -> dict[str, Any]:
    """What a connector of ``role`` answers to the other role's calls (vLLM builds one object per
    process with one side set): the worker role has no scheduler side, so a lookup finds nothing
    (``(0, False)``), metadata carries no load or store (events ``-1``, no flush), finishing never
    delays the free (``(False, None)``), nothing is pending, no event is published and a reset
    reports nothing (``None``); the scheduler role has no worker side, so it knows no pool size the
    workers agreed on (``None``), has no finished transfers to report (``(None, None)``: neither
    sending nor receiving tracked) and no worker metadata (``None``)."""
    if role not in ("scheduler", "worker"):
        raise InvalidFieldError("role", role, "'scheduler' or 'worker'")
    if role == "scheduler":
        return {"aligned_num_cpu_blocks": None, "worker_finished": (None, None), "worker_meta": None}
    return {"match": (0, False), "alloc": None, "meta": (-1, [], [], -1, [], [], False), "output": None,
            "finished": (False, None), "finished_all_groups": (False, None), "pending": False, "events": [],
            "reset": None, "bind": None, "boundary_stats": None, "stats": None}


def agreed_num_cpu_blocks(local_counts: list[int]) -> list[int]:
    """Per rank, the CPU pool size the ranks agree on: the smallest rank's own count (each rank
    sizes from its own budget; a larger pool on one rank would hold block ids the others lack). One
    rank keeps its own."""
    if not isinstance(local_counts, list) or not local_counts or any(
            type(c) is not int or c < 1 for c in local_counts):
        raise InvalidFieldError("local_counts", local_counts, "a non-empty list of block counts (ints >= 1)")
    return [min(local_counts)] * len(local_counts)
