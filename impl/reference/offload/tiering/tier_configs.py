"""What vLLM 0.33.0 builds from a ``TieringOffloadingSpec``'s extra config, or why it refuses it
(``tiering/spec.py``'s ``__init__`` and ``get_manager``, ``tiering/factory.py``), as a pure function.

The back-pressure settings a tier ends up with decide what reaches it, so their resolution is
behaviour: the top-level ``backpressure`` dict is overlaid field by field by the tier's own (a
partial tier override keeps the top-level fields it does not name; a tier with a ``backpressure``
key, even ``{}``, is configured, one without stays unconfigured unless there are top-level
defaults), ``backpressure_cls`` is required, class names without a dot are looked up in vLLM's
back-pressure module, and the detector's medium defaults (:func:`backpressure.default_config`, by
tier type and the tier's ``locality``) fill what is still missing.

Refusals, in vLLM's order (the first one is reported): ``secondary_tiers`` not a list (ValueError);
``store_threshold`` >= 2 (ValueError); an eviction policy that is not a cache policy (ValueError);
then tier by tier: no ``type`` (ValueError), a type neither built in nor given a ``module_path``
(ValueError), a ``module_path`` that does not import (ImportError) or lacks the class
(AttributeError); a ``backpressure`` dict without ``backpressure_cls`` (ValueError); a policy or
detector class that does not resolve (ImportError / AttributeError); a detector config its
constructor refuses (ValueError) or does not take (TypeError); tier keyword arguments the tier
class does not take (TypeError); an fs tier ``locality`` other than ``"LOCAL"``/``"REMOTE"`` (ValueError:
vLLM's ``Locality`` enum, although the detector's defaults read the locality in any case). When a tier fails, vLLM shuts down the tiers it built before it
and the primary tier (whose shared region goes with it), then raises.
"""

from __future__ import annotations

import importlib
from typing import Callable

from kvref.spec.errors import InvalidFieldError

from .backpressure import POLICIES, EMABackpressureDetector, default_config

BUILTIN_TIERS = ("example", "fs", "p2p", "obj", "kvcr")
CACHE_POLICIES = ("lru", "arc")
DETECTORS = ("EMABackpressureDetector",)
_BP_MODULE = "vllm.v1.kv_offload.tiering.backpressure"
#: keyword arguments each tier class takes besides what the factory passes (the vLLM tiers kvref
#: builds here, and kvref's out-of-tree tiers, which take the example tier's)
TIER_KWARGS = {"example": ("custom_param",), "fs": ("root_dir", "n_read_threads", "n_write_threads",
                                                     "enable_kv_events", "locality"),
               "RequestLevelTier": ("custom_param", "fail_shutdown"), "PolledTier": ("custom_param",)}


def _default_resolve(module_path: str, name: str) -> str | None:
    """How vLLM's factory fares importing ``module_path`` and taking ``name`` from it."""
    try:
        module = importlib.import_module(module_path)
    except ImportError:
        return "ImportError"
    try:
        getattr(module, name)
    except AttributeError:
        return "AttributeError"
    return None


def _class_error(name: str, kinds: tuple[str, ...]) -> tuple[str, str] | tuple[None, str]:
    """(error, None) or (None, the class's short name) for a back-pressure class name."""
    module, _, short = name.rpartition(".") if "." in name else (_BP_MODULE, "", name)
    if module != _BP_MODULE:
        return ("ImportError" if _default_resolve(module, short) == "ImportError" else "AttributeError",
                "backpressure")
    if short not in kinds:
        return ("AttributeError", "backpressure")
    return (None, short)


def resolve_backpressure(tier_cfg: dict, top_level) -> dict | None:
    """The merged ``backpressure`` dict vLLM's spec hands the factory for ``tier_cfg`` (or None)."""
    if not isinstance(tier_cfg, dict):
        raise InvalidFieldError("tier_cfg", tier_cfg, "a secondary tier config (a dict)")
    if top_level is not None and not isinstance(top_level, dict):
        raise InvalidFieldError("top_level", top_level, "None or the spec's top-level backpressure dict")
    if tier_cfg.get("backpressure") is not None and not isinstance(tier_cfg["backpressure"], dict):
        raise InvalidFieldError("tier_cfg", tier_cfg, "backpressure None or a dict")
    merged: dict = {}
    for source in (top_level, tier_cfg.get("backpressure")):
        if source:
            merged.update(source)
    return merged if merged or "backpressure" in tier_cfg else None


def resolve_secondary_tiers(extra_config: dict,
                            resolve_class: Callable[[str, str], str | None] = _default_resolve,
                            ) -> tuple[tuple[str, str] | None, list[tuple]]:
    """Returns ``(error, built)``: ``error`` is ``(exception class name, what)`` for the first rule
    broken, or None; ``built`` lists, for each tier built (all of them, or those before the one
    that failed), ``(tier type, detector)`` where detector is None or ``(detector class, high, low,
    alpha, warmup, decay half-life, cool-down, failure threshold, policy class, ramp factor)``.
    ``resolve_class(module_path, name)`` says how importing an out-of-tree tier class fares."""
    if not isinstance(extra_config, dict):
        raise InvalidFieldError("extra_config", extra_config, "a dict (the spec's extra config)")
    if not callable(resolve_class):
        raise InvalidFieldError("resolve_class", resolve_class, "a callable (module_path, name) -> error or None")
    tiers = extra_config.get("secondary_tiers", [])
    if not isinstance(tiers, list):
        return ("ValueError", "secondary_tiers"), []
    if any(not isinstance(t, dict) for t in tiers):
        raise InvalidFieldError("extra_config", extra_config, "secondary_tiers a list of dicts")
    top = extra_config.get("backpressure")
    if top is not None and not isinstance(top, dict):
        raise InvalidFieldError("extra_config", extra_config, "backpressure None or a dict")
    threshold = extra_config.get("store_threshold", 0)
    if isinstance(threshold, bool) or not isinstance(threshold, int):
        raise InvalidFieldError("extra_config", extra_config, "store_threshold an int")
    if threshold >= 2:
        return ("ValueError", "store_threshold"), []
    if extra_config.get("eviction_policy", "lru") not in CACHE_POLICIES:
        return ("ValueError", "eviction_policy"), []
    built: list[tuple] = []
    for cfg in tiers:
        err, entry = _build_tier(cfg, resolve_backpressure(cfg, top), resolve_class)
        if err is not None:
            return err, built
        built.append(entry)
    return None, built


def _build_tier(cfg: dict, bp, resolve_class) -> tuple[tuple[str, str] | None, tuple | None]:
    tier_type = cfg.get("type")
    if not tier_type:
        return ("ValueError", "type"), None
    if tier_type not in BUILTIN_TIERS:
        if cfg.get("module_path") is None:
            return ("ValueError", "type"), None
        err = resolve_class(cfg["module_path"], tier_type)
        if err is not None:
            return (err, "module_path"), None
    kwargs = {k: v for k, v in cfg.items() if k not in ("type", "module_path", "backpressure")}
    detector = None
    if bp is not None:
        bp = dict(bp)
        det_name = bp.pop("backpressure_cls", None)
        if det_name is None:
            return ("ValueError", "backpressure_cls"), None
        pol_name = bp.pop("policy_cls", None)
        pol_short = None
        if pol_name:
            err, pol_short = _class_error(pol_name, tuple(POLICIES))
            if err is not None:
                return (err, pol_short), None
        err, det_short = _class_error(det_name, DETECTORS)
        if err is not None:
            return (err, det_short), None
        for k, v in default_config(tier_type, cfg.get("locality")).items():
            bp.setdefault(k, v)
        policy = POLICIES[pol_short]() if pol_short else None
        try:
            det = EMABackpressureDetector(**bp, policy=policy, clock=lambda: 0.0)
        except TypeError:
            return ("TypeError", "backpressure"), None
        except ValueError:
            return ("ValueError", "backpressure"), None
        detector = (det_short, det.high_water_s, det.low_water_s, det.alpha, det.warmup_completions,
                    det.decay_half_life_s, det.cooldown_s, det.failure_threshold, type(det.policy).__name__,
                    getattr(det.policy, "ramp_factor", None))
    allowed = TIER_KWARGS.get(tier_type)
    if allowed is None:
        raise InvalidFieldError("type", tier_type, f"a tier whose keyword arguments the reference knows ({sorted(TIER_KWARGS)})")
    if any(k not in allowed for k in kwargs):
        return ("TypeError", "tier"), None
    if tier_type == "fs" and kwargs.get("locality") not in (None, "LOCAL", "REMOTE"):
        # the fs tier takes vLLM's Locality values only, while the detector's medium defaults
        # read any case ("remote" gets network marks): a lower-case locality is refused here
        return ("ValueError", "locality"), None
    return None, (tier_type, detector)


__all__ = ["BUILTIN_TIERS", "CACHE_POLICIES", "TIER_KWARGS", "resolve_backpressure", "resolve_secondary_tiers"]
