"""Which KVCR tier configurations vLLM 0.33.0 refuses (``tiering/kvcr/manager.py::__init__`` and
what kvcr 0.1.1 checks when it starts), and why: a pure function of the tier's config.

vLLM checks in this order, and the first failing rule is the one reported:

1. ``policy``: None, a built-in name (``fifo``, ``lru``, ``g3_fifo``, ``g3_lru``), or a dotted
   ``module.Class`` path to a ``KVCachePolicy`` subclass; another plain name is a ValueError, an
   import that fails an ImportError, an object that is not such a class a TypeError.
2. ``kvcr_service_socket_path`` and ``compatibility_digest`` come together (ValueError).
3. ``router_capabilities`` includes ``router_hint`` (ValueError).
4. With KV events on, a local DRAM tier (``secondary_g2_slots`` > 0) needs
   ``self_describing_kv_events`` (ValueError).
5. With no local data-parallel rank, ``control_ports`` has exactly one port; every port is in
   1..65535 (ValueError).
6. ``secondary_g2_slots`` >= 0 (ValueError).
7. kvcr itself: a ``g3_*`` policy needs a G3 (file) tier, which kvref never configures (ValueError).
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


def kvcr_config_error(cfg: dict, events: bool, self_describing: bool) -> tuple[str, str] | None:
    """``(exception class name, the field at fault)`` for the first rule ``cfg`` breaks, or None.

    Args:
        cfg: the tier's config as vLLM's factory receives it (``type`` and the keyword arguments).
        events: KV-cache events are enabled for the offloading spec.
        self_describing: ``self_describing_kv_events`` is set in the spec's extra config.
    """
    if not isinstance(cfg, dict) or cfg.get("type") != "kvcr":
        raise InvalidFieldError("cfg", cfg, "a KVCR tier config (a dict with type 'kvcr')")
    for name, flag in (("events", events), ("self_describing", self_describing)):
        if not isinstance(flag, bool):
            raise InvalidFieldError(name, flag, "a bool")
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
    err = _policy_error(cfg.get("policy"))
    if err:
        return err
    if (cfg.get("kvcr_service_socket_path") is None) != (cfg.get("compatibility_digest") is None):
        return ("ValueError", "kvcr_service_socket_path")
    if "router_hint" not in set(cfg.get("router_capabilities") or ()):
        return ("ValueError", "router_capabilities")
    if events and (slots > 0 or cfg.get("kvcr_service_socket_path") is not None) and not self_describing:
        return ("ValueError", "self_describing_kv_events")
    if ports is None or len(ports) != 1:
        return ("ValueError", "control_ports")
    if any(not 1 <= p <= 65535 for p in ports):
        return ("ValueError", "control_ports")
    if slots < 0:
        return ("ValueError", "secondary_g2_slots")
    if cfg.get("policy") in ("g3_fifo", "g3_lru"):
        return ("ValueError", "policy")
    return None
