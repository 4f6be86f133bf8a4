"""Generated tiering spec configs built by vLLM's own front door, against the reference's verdict.

Each case draws a ``TieringOffloadingSpec`` extra config: one to three secondary tiers (example,
fs, kvref's out-of-tree request-level tier; sometimes one with no or an unknown type, an
out-of-tree module or class that does not exist, or keyword arguments the tier does not take),
back-pressure at the top level and per tier (partial overrides, ``{}``, short and dotted class
names, policies, field overrides, and configs the detector refuses), ``store_threshold``, the
eviction policy, and a ``secondary_tiers`` that is not a list.
:func:`~kvref.impl.reference.offload.tiering.tier_configs.resolve_secondary_tiers` says what vLLM
must build or why it must refuse; vLLM's ``TieringOffloadingSpec(...)`` + ``get_manager()`` must
then raise that exception, leaving no thread of the tiers it built before and no shared region
behind, or build every tier with exactly the detector (class, water marks, smoothing, warm-up,
decay, cool-down, failure threshold, policy, ramp) the reference resolved (issue #22).
"""

from __future__ import annotations

import copy
import glob
import os
import random
import threading

from kvref.impl.reference.offload.tiering.clock import VirtualClock
from kvref.impl.reference.offload.tiering.tier_configs import resolve_secondary_tiers

_BP = "vllm.v1.kv_offload.tiering.backpressure"
OUT_OF_TREE = "kvref.impl.vllm.tiering_tiers"
#: words vLLM's ValueError names, by the rule the reference reports
_KEYWORD = {"secondary_tiers": "secondary_tiers", "store_threshold": "store_threshold",
            "eviction_policy": "cache policy", "type": "tier", "backpressure_cls": "backpressure_cls",
            "backpressure": "", "tier": "", "locality": "Locality"}


class SpecConfigDivergence(AssertionError):
    """vLLM built or refused a tiering spec config differently from the reference's verdict."""


def _backpressure(rng: random.Random, top: bool) -> dict:
    bp: dict = {}
    if top or rng.random() < 0.85:
        bp["backpressure_cls"] = rng.choice(("EMABackpressureDetector", "EMABackpressureDetector",
                                             f"{_BP}.EMABackpressureDetector", "NoSuchDetector",
                                             "kvref_missing_module.Detector") if rng.random() < 0.15 else
                                            ("EMABackpressureDetector", f"{_BP}.EMABackpressureDetector"))
    if rng.random() < 0.5:
        bp["policy_cls"] = rng.choice(("DropStorePolicy", "ThrottledDropPolicy", f"{_BP}.DropStorePolicy")
                                      + (("NoSuchPolicy",) if rng.random() < 0.2 else ()))
    for _ in range(rng.choice((0, 1, 2))):
        k, v = rng.choice((("alpha", (0.5, 0.3)), ("warmup_completions", (3, 5)), ("high_water_s", (0.02, 0.04)),
                           ("cooldown_s", (0.0, 0.5)), ("decay_half_life_s", (1.0, 3.0)), ("failure_threshold", (1, 2)),
                           ("low_water_s", (0.001, 0.0005))))
        bp[k] = rng.choice(v)
    if rng.random() < 0.08:
        bp[rng.choice(("alpha", "bogus"))] = 2.0  # refused: alpha out of (0, 1], or a field it does not take
    return bp


def _tier(rng: random.Random) -> dict:
    r = rng.random()
    if r < 0.06:
        cfg = rng.choice(({}, {"type": ""}, {"type": "nosuch"}, {"type": "NoSuchTier", "module_path": OUT_OF_TREE},
                          {"type": "Tier", "module_path": "kvref_missing_module"}))
    elif r < 0.4:
        cfg = {"type": "example"}
        if rng.random() < 0.3:
            cfg["custom_param"] = 3
        if rng.random() < 0.06:
            cfg[rng.choice(("locality", "bogus"))] = "REMOTE"  # the example tier takes neither
    elif r < 0.75:
        cfg = {"type": "fs", "n_read_threads": 1, "n_write_threads": 1}
        if rng.random() < 0.5:
            cfg["locality"] = rng.choice(("REMOTE", "local", "LOCAL"))
    else:
        cfg = {"type": "RequestLevelTier", "module_path": OUT_OF_TREE}
        if rng.random() < 0.3:  # its shutdown fails: vLLM's clean-up after a later tier fails goes on
            cfg["fail_shutdown"] = True
    r = rng.random()
    if r < 0.08:
        cfg["backpressure"] = {}
    elif r < 0.55:
        cfg["backpressure"] = _backpressure(rng, False)
    return cfg


def random_case(rng: random.Random) -> tuple[list, dict, str]:
    """(tiers, more extra config, eviction policy)."""
    tiers = [_tier(rng) for _ in range(rng.randint(1, 3))]
    extra: dict = {}
    if rng.random() < 0.4:
        extra["backpressure"] = _backpressure(rng, True)
    if rng.random() < 0.08:
        extra["store_threshold"] = rng.choice((1, 2, 3))
    if rng.random() < 0.04:
        extra["secondary_tiers"] = rng.choice(("fs", {"type": "fs"}))
    policy = "bogus" if rng.random() < 0.04 else rng.choice(("lru", "arc"))
    return tiers, extra, policy


def _regions() -> set[str]:
    """This process's shared regions (build_vllm_tiering names its engines after the pid; other
    processes may be building their own meanwhile)."""
    return set(glob.glob(f"/dev/shm/vllm_offload_kvref-tiering-{os.getpid()}-*.mmap"))


def run_case(tiers: list, extra: dict, policy: str, counts: dict) -> None:
    from kvref.impl.vllm.tiering import build_vllm_tiering, virtual_time
    from kvref.impl.vllm.tiering_backpressure import describe

    seen = {"secondary_tiers": copy.deepcopy(tiers), "eviction_policy": policy, **copy.deepcopy(extra)}
    want, built = resolve_secondary_tiers(seen)
    threads = {t.ident for t in threading.enumerate()}
    regions = _regions()
    clock = VirtualClock()
    with virtual_time(clock):
        try:
            world = build_vllm_tiering(2, copy.deepcopy(tiers), clock, policy, enable_events=False,
                                       extra=copy.deepcopy(extra))
        except Exception as exc:  # noqa: BLE001 - compared with the reference's verdict
            names = {c.__name__ for c in type(exc).__mro__}
            if want is None or want[0] not in names or (
                    want[0] == "ValueError" and _KEYWORD[want[1]] not in str(exc)):
                raise SpecConfigDivergence(f"tiering config tiers={tiers} extra={extra} eviction_policy={policy!r}: "
                                           f"reference {want}, vLLM raised {type(exc).__name__}: {exc}") from None
            left = [t.name for t in threading.enumerate() if t.ident not in threads and t.is_alive()]
            stale = sorted(_regions() - regions)
            if left or stale:
                raise SpecConfigDivergence(f"tiering config tiers={tiers} extra={extra} refused ({want}), but the "
                                           f"tiers built before it left threads {left} and shared regions {stale}")
            counts["spec_configs_refused"] = counts.get("spec_configs_refused", 0) + 1
            counts[f"spec_refused_{want[1]}"] = counts.get(f"spec_refused_{want[1]}", 0) + 1
            return
        try:
            got = [(t.tier_type, describe(t.bp_detector)) for t in world.tiers]
        finally:
            world.shutdown()
    if want is not None or got != built:
        raise SpecConfigDivergence(f"tiering config tiers={tiers} extra={extra} eviction_policy={policy!r}: "
                                   f"reference {want or built}, vLLM built {got}")
    counts["spec_configs_built"] = counts.get("spec_configs_built", 0) + 1
    counts["spec_detectors"] = counts.get("spec_detectors", 0) + sum(d is not None for _, d in got)


def run_spec_cases(seed: int, n: int) -> dict:
    """``n`` generated spec configs (seeded by ``seed``); returns counts of built and refused ones."""
    rng = random.Random(f"conform-tiering-spec-{seed}")
    counts: dict = {"spec_configs": 0}
    for _ in range(n):
        run_case(*random_case(rng), counts)
        counts["spec_configs"] += 1
    return counts


__all__ = ["SpecConfigDivergence", "random_case", "run_case", "run_spec_cases"]
