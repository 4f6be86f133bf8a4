"""Tier back-pressure: kvref's reference detector vs vLLM 0.33.0's ``EMABackpressureDetector``, in lock-step.

Back-pressure decides whether a store reaches a secondary tier at all, so it decides what the tier
caches. The tiering traces (:mod:`kvref.models.machines.tiering`) drive it only as fast as their
fs/obj jobs complete, which rarely pushes the EMA past a water mark. Here each program drives the
two detectors directly with one generated sequence of what a tier sees: store completions with
latencies drawn around the water marks (0, below low, between, just above high, 1.5x, 2.5x, 4x,
10x), failed stores, time passing (idle decay, cool-down), store decisions for any number of
blocks, pressure queries, ``pop_stores_dropped`` and ``reset``. The configuration is drawn too:
tier type and locality (vLLM's ``default_config`` is compared with the reference's), smoothing
factor, warm-up length (0 included), decay half-life and cool-down (0 included), failure threshold,
policy (drop or throttled, with its ramp), zero water marks, and configs vLLM refuses (alpha out of
(0, 1], low above high, a failure threshold of 0), which the reference must refuse as well.

After every operation the answer and the whole detector state (EMA to the last bit, pressure flag,
completions, healthy streak, cool-down clock and count, failure streak and trip, last update,
dropped stores and blocks, the throttle's accumulator) must agree, and the reference's invariants
hold. :func:`run_programs` counts the decision paths reached (cool-down drop, throttled fraction,
throttled all/none, zero high mark, decay that clears pressure, a failure trip during warm-up...).
"""

from __future__ import annotations

import random

from kvref.impl.reference.offload.tiering.backpressure import POLICIES, EMABackpressureDetector, default_config
from kvref.impl.reference.offload.tiering.clock import VirtualClock
from kvref.spec.errors import InvalidFieldError

MIB = 1 << 20
#: latency samples (s/MiB) as multiples of the high water mark (``"low"``: half the low mark)
SAMPLE_FACTORS = (0.0, "low", "mid", 1.01, 1.5, 2.5, 4.0, 10.0)
PATHS = ("healthy_fast_path", "cooldown_drop", "throttle_fraction", "throttle_fraction_drop", "throttle_all",
         "throttle_none", "drop_policy_drop", "zero_high_drop", "decay_cleared", "failure_trip",
         "failure_trip_in_warmup", "ignored_empty_store", "refused_config", "reset")


class BackpressureDivergence(AssertionError):
    """kvref's reference detector and vLLM's disagree."""


def random_config(rng: random.Random) -> dict:
    """A detector config as a tier's ``"backpressure"`` entry would build it (maybe one vLLM refuses)."""
    tier_type = rng.choice(("fs", "fs", "obj", "example"))
    locality = rng.choice((None, None, "REMOTE", "local", "LOCAL"))
    kwargs = dict(default_config(tier_type, locality))
    kwargs.update(alpha=rng.choice((0.15, 0.5, 1.0)), warmup_completions=rng.choice((0, 1, 2, 3, 10)),
                  decay_half_life_s=rng.choice((0.0, 0.5, 2.0)), cooldown_s=rng.choice((0.0, 0.3, 1.0)))
    if rng.random() < 0.3:
        kwargs["failure_threshold"] = rng.choice((None, 1, 2))
    if rng.random() < 0.1:
        kwargs["high_water_s"] = kwargs["low_water_s"] = 0.0
    if rng.random() < 0.1:  # a config vLLM refuses
        bad = rng.randrange(3)
        if bad == 0:
            kwargs["alpha"] = rng.choice((0.0, 1.5))
        elif bad == 1:
            kwargs["low_water_s"] = kwargs["high_water_s"] * 2 + 0.001
        else:
            kwargs["failure_threshold"] = 0
    policy = rng.choice(("ThrottledDropPolicy", "ThrottledDropPolicy", "DropStorePolicy"))
    ramp = rng.choice((None, 0.5, 1.0, 4.0)) if policy == "ThrottledDropPolicy" else None
    return {"tier_type": tier_type, "locality": locality, "kwargs": kwargs, "policy": policy, "ramp_factor": ramp}


def random_program(rng: random.Random, n_ops: int) -> list[tuple]:
    ops: list[tuple] = []
    weights = (("complete", 8), ("fail", 2), ("should_store", 6), ("pressure", 2), ("advance", 3), ("pop", 1),
               ("reset", 0.3), ("stats", 1), ("empty_store", 0.3))
    names, w = zip(*weights)
    burst = None  # runs of same-latency completions push the EMA across a mark
    for _ in range(n_ops):
        op = rng.choices(names, w)[0]
        if op == "complete":
            if burst is None or rng.random() < 0.2:
                burst = rng.choice(SAMPLE_FACTORS)
            ops.append(("complete", burst, rng.choice((1, 2, 8)) * (MIB // 4), rng.random() < 0.5))
        elif op == "should_store":
            ops.append(("should_store", rng.randint(1, 4)))
        elif op == "advance":
            ops.append(("advance", rng.choice((0.0, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0, 20.0))))
        else:
            ops.append((op,))
    return ops


def _sample(factor, kwargs: dict) -> float:
    high, low = kwargs["high_water_s"], kwargs["low_water_s"]
    if factor == "low":
        return low / 2 if high > 0 else 0.0
    if factor == "mid":
        return (low + high) / 2 if high > 0 else 0.001
    return factor * high if high > 0 else factor * 0.001


class _Pair:
    """One program's two detectors and the clock both read."""

    def __init__(self, cfg: dict, clock: VirtualClock, counts: dict, ref, vllm) -> None:
        from kvref.impl.vllm import tiering_backpressure as vbp

        self.cfg, self.clock, self.counts, self.ref, self.vllm = cfg, clock, counts, ref, vllm
        self.snapshot = vbp.snapshot

    def hit(self, path: str) -> None:
        self.counts[path] = self.counts.get(path, 0) + 1

    def compare(self, what: str, ref_answer, vllm_answer) -> None:
        self.ref.check_invariants()
        rs, vs = self.ref.snapshot(), self.snapshot(self.vllm)
        if ref_answer != vllm_answer or rs != vs:
            raise BackpressureDivergence(
                f"{what}: reference answered {ref_answer!r}, vLLM {vllm_answer!r}; detector state (ema, pressure, "
                f"completions, healthy streak, cleared at, cool-down count, failures, tripped, last update, "
                f"stores dropped, blocks dropped, accumulator) reference {rs}, vLLM {vs} (config {self.cfg})")

    def apply(self, op: tuple) -> None:
        name, ref, vd = op[0], self.ref, self.vllm
        before = ref.snapshot()
        if name == "complete":
            _, factor, nbytes, via_update = op
            elapsed = _sample(factor, self.cfg["kwargs"]) * (nbytes / MIB)
            if via_update:  # the manager's path: a job's submit time, read against the clock now
                submit = self.clock.monotonic() - elapsed
                r, v = ref.update(submit, nbytes), vd.update(submit, nbytes)
            else:
                r, v = ref.on_store_completed(elapsed, nbytes), vd.on_store_completed(elapsed, nbytes)
        elif name == "empty_store":
            r, v = ref.update(self.clock.monotonic(), 0), vd.update(self.clock.monotonic(), 0)
            self.hit("ignored_empty_store")
        elif name == "fail":
            r, v = ref.on_store_failed(), vd.on_store_failed()
            if ref.failure_tripped and not before[7]:
                self.hit("failure_trip")
                if ref.completions < ref.warmup_completions:
                    self.hit("failure_trip_in_warmup")
        elif name == "should_store":
            r, v = ref.should_store(op[1]), vd.should_store(op[1])
            self._classify(before, r)
        elif name == "pressure":
            r, v = ref.is_under_pressure(), vd.is_under_pressure()
            if before[1] and not r:
                self.hit("decay_cleared")
        elif name == "advance":
            self.clock.advance(op[1])
            r = v = None
        elif name == "pop":
            r, v = ref.policy.pop_stores_dropped(), vd.policy.pop_stores_dropped()
        elif name == "reset":
            r, v = ref.reset(), vd.reset()
            self.hit("reset")
        elif name == "stats":
            r, v = ref.stats, vd.stats
        else:
            raise InvalidFieldError("op", op, "a back-pressure program operation")
        self.compare(repr(op), r, v)

    def _classify(self, before: tuple, allowed: bool) -> None:
        ref = self.ref
        if before[1] and not ref.under_pressure:
            self.hit("decay_cleared")
        if ref.is_healthy():
            self.hit("healthy_fast_path")
            return
        if not allowed and ref.cooldown_count != before[5] and ref.cooldown_count % 2 == 0:
            self.hit("cooldown_drop")
            return
        if not ref.under_pressure:
            return
        if ref.high_water_s <= 0:
            self.hit("zero_high_drop")
        elif self.cfg["policy"] == "DropStorePolicy":
            self.hit("drop_policy_drop")
        elif ref.policy.drop_accumulator != before[11] or (not allowed and ref.policy.drop_accumulator < before[11]):
            self.hit("throttle_fraction_drop" if not allowed else "throttle_fraction")
        else:
            self.hit("throttle_none" if allowed else "throttle_all")


def run_program(cfg: dict, ops: list[tuple], counts: dict) -> int:
    """Runs one program; returns the number of operations compared (0 for a refused config)."""
    from kvref.impl.vllm import tiering_backpressure as vbp
    from kvref.impl.vllm.tiering import virtual_time

    want = default_config(cfg["tier_type"], cfg["locality"])
    got = vbp.default_config(cfg["tier_type"], cfg["locality"])
    if want != got:
        raise BackpressureDivergence(f"default_config({cfg['tier_type']!r}, locality={cfg['locality']!r}): "
                                     f"reference {want}, vLLM {got}")
    clock = VirtualClock()
    with virtual_time(clock):
        kw, policy, ramp = cfg["kwargs"], cfg["policy"], cfg["ramp_factor"]
        built, errors = [], []
        for side, build in (
                ("reference", lambda: EMABackpressureDetector(
                    **kw, policy=POLICIES[policy]() if ramp is None else POLICIES[policy](ramp), clock=clock.monotonic)),
                ("vLLM", lambda: vbp.build_detector(kw, policy, ramp))):
            try:
                built.append(build())
            except ValueError as exc:  # the reference's InvalidFieldError is one
                errors.append(f"{side}: {type(exc).__name__}: {exc}")
        if errors:
            if len(errors) != 2:
                raise BackpressureDivergence(f"config {cfg}: only one side refused it ({errors})")
            counts["refused_config"] = counts.get("refused_config", 0) + 1
            return 0
        pair = _Pair(cfg, clock, counts, *built)
        for op in ops:
            pair.apply(op)
    return len(ops)


def run_programs(seed: int, n: int, n_ops: tuple[int, int] = (30, 90)) -> dict:
    """``n`` generated configs and programs (seeded by ``seed``); returns op and path counts."""
    rng = random.Random(f"conform-tiering-backpressure-{seed}")
    counts: dict = {"bp_programs": 0, "bp_ops": 0}
    for _ in range(n):
        cfg = random_config(rng)
        counts["bp_ops"] += run_program(cfg, random_program(rng, rng.randint(*n_ops)), counts)
        counts["bp_programs"] += 1
    return counts


__all__ = ["BackpressureDivergence", "PATHS", "random_config", "random_program", "run_program", "run_programs"]
