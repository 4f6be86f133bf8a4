"""Which KVCR tier configurations vLLM 0.33.0 refuses (``tiering/kvcr/manager.py::__init__`` and
what kvcr 0.1.1 checks when it starts), and why: a pure function of the tier's config.

vLLM checks in this order, and the first failing rule is the one reported:

1. ``policy``: None, a built-in name (``fifo``, ``lru``, ``g3_fifo``, ``g3_lru``), or a dotted
   ``module.Class`` path to a ``KVCachePolicy`` subclass; another plain name is a ValueError, an
   import that fails an ImportError, an object that is not such a class a TypeError.
2. ``kvcr_service_socket_path`` and ``compatibility_digest`` come together (ValueError).
3. ``router_capabilities`` includes ``router_hint`` (ValueError).
4. With KV events on, a local inventory (``secondary_g2_slots`` > 0, a KVCR service, or a ``g3``
   file tier) needs ``self_describing_kv_events`` (ValueError).
5. ``control_ports``: with no local data-parallel rank, exactly one port (the rank is then 0);
   with one, a port at that index; every port in 1..65535 (ValueError).
6. ``secondary_g2_slots`` >= 0 (ValueError).
7. ``g3`` names its ``paths`` (vLLM reads them before kvcr starts: a KeyError otherwise).
8. kvcr itself, when vLLM starts it: a configured KVCR service must answer (kvref runs none, so a
   configured ``kvcr_service_socket_path`` is unreachable: kvcr's ``KVCRServiceError``);
   ``operation_timeout_ms`` > 0 and ``abandon_timeout_ms`` >= twice it (ValueError); the policy's
   tiers are configured (a ``g3_*`` policy, or None with no G3 tier, needs G3); a G3 tier needs the
   local DRAM tier (ValueError); and its NIXL ``backend`` must exist (kvref's machines have the
   ``POSIX`` backend; another name fails in NIXL after native work began: ``KVCRStartupError``,
   where vLLM keeps the buffers KVCR registered for the life of the process); so must the NIXL
   backends of the remote path (``remote_fw_dram_backend``, always) and of local DRAM
   (``local_dram_backend``, when vLLM configures local DRAM): kvref's machines have ``UCX``.
"""

from __future__ import annotations

import importlib

from kvref.spec.errors import InvalidFieldError

BUILTIN_POLICIES = ("fifo", "lru", "g3_fifo", "g3_lru")


def _policy_error(policy) -> tuple[str, str] | None:
    if policy is None or policy in BUILTIN_POLICIES:
        return None
    if not isinstance(policy, str):
        raise InvalidFieldError("policy", policy, "None or a policy name")
    if "." not in policy:
        return ("ValueError", "policy")
    module, _, name = policy.rpartition(".")
    try:
        obj = getattr(importlib.import_module(module), name)
    except ImportError:
        return ("ImportError", "policy")
    except AttributeError:
        return ("AttributeError", "policy")
    bases = [c.__module__ + "." + c.__qualname__ for c in getattr(obj, "__mro__", ())]
    if not isinstance(obj, type) or "kvcr.policy.KVCachePolicy" not in bases:
        return ("TypeError", "policy")
    return None


def kvcr_config_error(cfg: dict, events: bool, self_describing: bool,
                      dp_local_rank: int | None = None) -> tuple[str, str] | None:
    """``(exception class name, the field at fault)`` for the first rule ``cfg`` breaks, or None.

    Args:
        cfg: the tier's config as vLLM's factory receives it (``type`` and the keyword arguments).
        events: KV-cache events are enabled for the offloading spec.
        self_describing: ``self_describing_kv_events`` is set in the spec's extra config.
        dp_local_rank: the parallel config's ``data_parallel_rank_local`` (None: unset).
    """
    if not isinstance(cfg, dict) or cfg.get("type") != "kvcr":
        raise InvalidFieldError("cfg", cfg, "a KVCR tier config (a dict with type 'kvcr')")
    for name, flag in (("events", events), ("self_describing", self_describing)):
        if not isinstance(flag, bool):
            raise InvalidFieldError(name, flag, "a bool")
    if dp_local_rank is not None and (isinstance(dp_local_rank, bool) or not isinstance(dp_local_rank, int)
                                      or dp_local_rank < 0):
        raise InvalidFieldError("dp_local_rank", dp_local_rank, "None or an int >= 0")
    slots = cfg.get("secondary_g2_slots", 0)
    if isinstance(slots, bool) or not isinstance(slots, int):
        raise InvalidFieldError("cfg", cfg, "secondary_g2_slots an int")
    ports = cfg.get("control_ports")
    if ports is not None and (not isinstance(ports, (list, tuple)) or any(
            isinstance(p, bool) or not isinstance(p, int) for p in ports)):
        raise InvalidFieldError("cfg", cfg, "control_ports None or a list of ints")
    caps = cfg.get("router_capabilities")
    if caps is not None and (isinstance(caps, (str, bytes)) or not isinstance(caps, (list, tuple, set, frozenset))):
        raise InvalidFieldError("cfg", cfg, "router_capabilities None or a collection of names")
    g3 = cfg.get("g3")
    if g3 is not None and not isinstance(g3, dict):
        raise InvalidFieldError("cfg", cfg, "g3 None or a dict of kvcr's G3Options")
    timeouts = (cfg.get("operation_timeout_ms", 1000), cfg.get("abandon_timeout_ms", 5000))
    if any(isinstance(t, bool) or not isinstance(t, int) for t in timeouts):
        raise InvalidFieldError("cfg", cfg, "operation_timeout_ms and abandon_timeout_ms ints")
    err = _policy_error(cfg.get("policy"))
    if err:
        return err
    service = cfg.get("kvcr_service_socket_path")
    if (service is None) != (cfg.get("compatibility_digest") is None):
        return ("ValueError", "kvcr_service_socket_path")
    if "router_hint" not in set(cfg.get("router_capabilities") or ()):
        return ("ValueError", "router_capabilities")
    if events and (slots > 0 or service is not None or g3 is not None) and not self_describing:
        return ("ValueError", "self_describing_kv_events")
    if dp_local_rank is None:
        if ports is None or len(ports) != 1:
            return ("ValueError", "control_ports")
        dp_local_rank = 0
    if ports is None or not dp_local_rank < len(ports):
        return ("ValueError", "control_ports")
    if any(not 1 <= p <= 65535 for p in ports):
        return ("ValueError", "control_ports")
    if slots < 0:
        return ("ValueError", "secondary_g2_slots")
    if g3 is not None and "paths" not in g3:
        return ("KeyError", "g3")
    if service is not None:
        return ("KVCRServiceError", "kvcr_service_socket_path")
    if timeouts[0] <= 0:
        return ("ValueError", "operation_timeout_ms")
    if timeouts[1] < 2 * timeouts[0]:
        return ("ValueError", "abandon_timeout_ms")
    if g3 is None and cfg.get("policy") in ("g3_fifo", "g3_lru"):
        return ("ValueError", "policy")
    if g3 is not None and slots == 0:
        return ("ValueError", "g3")
    if g3 is not None and g3.get("backend", "GDS_MT") != "POSIX":
        return ("KVCRStartupError", "g3")
    local_dram = slots > 0 and service is None
    if cfg.get("remote_fw_dram_backend", "UCX") != "UCX" or (local_dram and cfg.get("local_dram_backend", "UCX") != "UCX"):
        return ("KVCRStartupError", "backend")
    return None


#: the metrics vLLM declares for a KVCR tier with ``enable_telemetry`` (kvcr's four, in vLLM's namespace)
KVCR_METRICS = ("vllm:kvcr_duration_seconds", "vllm:kvcr_state", "vllm:kvcr_transfer_blocks",
                "vllm:kvcr_transfer_bytes")
_POLICY_CLASSES = {"fifo": "FIFOPolicy", "lru": "LRUPolicy", "g3_fifo": "G3FIFOPolicy", "g3_lru": "G3LRUPolicy"}


def kvcr_built_tier(cfg: dict, events: bool, block_size_bytes: int, dp_local_rank: int | None = None) -> dict:
    """What vLLM hands kvcr for a config :func:`kvcr_config_error` accepts: the control port (the
    one at the local data-parallel rank, 0 when unset), the local DRAM bytes (one block per slot;
    None without slots, or when a KVCR service owns the pool), whether a G3 tier is configured, the
    policy class (None: ``G3LRUPolicy`` with a G3 tier, else ``LRUPolicy``), whether the tier's
    inventory is published (only with KV events on), and, with ``enable_telemetry`` only, the KVCR
    metrics the spec declares and KVCR's own stats (its state gauges) in the manager's stats."""
    if kvcr_config_error(cfg, events, True, dp_local_rank) is not None and \
            kvcr_config_error(cfg, events, False, dp_local_rank) is not None:
        raise InvalidFieldError("cfg", cfg, "a KVCR tier config vLLM accepts")
    if isinstance(block_size_bytes, bool) or not isinstance(block_size_bytes, int) or block_size_bytes < 1:
        raise InvalidFieldError("block_size_bytes", block_size_bytes, "an int >= 1")
    slots = cfg.get("secondary_g2_slots", 0)
    policy = cfg.get("policy")
    g3 = cfg.get("g3") is not None
    return {"control_port": cfg["control_ports"][dp_local_rank or 0],
            "local_dram_bytes": slots * block_size_bytes if slots and cfg.get("kvcr_service_socket_path") is None
            else None,
            "g3": g3,
            "policy": _POLICY_CLASSES.get(policy, policy.rpartition(".")[2]) if policy is not None
            else ("G3LRUPolicy" if g3 else "LRUPolicy"),
            "inventory": events,
            "metrics": KVCR_METRICS if cfg.get("enable_telemetry", False) else (),
            "reports_stats": bool(cfg.get("enable_telemetry", False))}
