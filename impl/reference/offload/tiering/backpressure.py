"""Back-pressure on a secondary tier (vLLM ``tiering/backpressure.py``).

A tier whose stores slow down stops receiving cascades, so a congested disk or network does not
hold primary chunks pinned (each cascade pins its chunks until it completes) and delay the GPU's
own offloads. The detector keeps an exponential moving average (EMA) of store latency in seconds
per MiB: the first ``warmup_completions`` completions only seed it (their mean); above
``high_water_s`` the tier is *under pressure*, below ``low_water_s`` it recovers. Silence decays
the EMA (half-life ``decay_half_life_s``) so a tier that gets no stores can recover; after
recovery every second store is dropped for ``cooldown_s``; ``failure_threshold`` consecutive
failed stores trip pressure at once (a full file system, vLLM #49176's neighbour); ten
consecutive fast completions make the tier *healthy* and skip the policy.

The policy decides what pressure means: :class:`DropStorePolicy` drops every store,
:class:`ThrottledDropPolicy` (the default) drops a fraction that grows with how far the EMA is
above the high water mark (0 at the mark, all at ``1 + ramp_factor`` times it), carried in an
accumulator so the fraction is exact over a run of decisions.

Arithmetic is written term for term as vLLM computes it, so the EMA agrees to the last bit.
"""

from __future__ import annotations

from typing import Callable

import math

from kvref.spec.errors import InvalidFieldError, check_int

MIB = 1 << 20
HEALTHY_THRESHOLD = 10
FAILURE_EMA_FACTOR = 4.0


class DropStorePolicy:
    """Drop every store while the tier is under pressure; count what was dropped."""

    def __init__(self) -> None:
        self.stores_dropped = 0
        self.blocks_dropped = 0

    def should_store(self, detector: "EMABackpressureDetector") -> bool:
        return not detector.is_under_pressure()

    def on_store_skipped(self, num_blocks: int) -> None:
        self.stores_dropped += 1
        self.blocks_dropped += num_blocks

    def pop_stores_dropped(self) -> tuple[int, int]:
        out = (self.stores_dropped, self.blocks_dropped)
        self.stores_dropped = self.blocks_dropped = 0
        return out

    def reset(self) -> None:
        self.stores_dropped = self.blocks_dropped = 0


class ThrottledDropPolicy(DropStorePolicy):
    """Drop a share ``min(1, overshoot / ramp_factor)`` of stores, ``overshoot = (ema-high)/high``."""

    def __init__(self, ramp_factor: float = 2.0) -> None:
        _check_seconds("ramp_factor", ramp_factor, positive=True)
        super().__init__()
        self.ramp_factor = ramp_factor
        self.drop_accumulator = 0.0

    def should_store(self, detector: "EMABackpressureDetector") -> bool:
        if not detector.is_under_pressure():
            return True
        high = detector.high_water_s
        if high <= 0:
            return False
        overshoot = max(0.0, detector.ema - high) / high
        drop_rate = min(1.0, overshoot / self.ramp_factor)
        if drop_rate <= 0:
            return True
        if drop_rate >= 1.0:
            return False
        self.drop_accumulator += drop_rate
        if self.drop_accumulator >= 1.0:
            self.drop_accumulator -= 1.0
            return False
        return True

    def reset(self) -> None:
        super().reset()
        self.drop_accumulator = 0.0


def _check_seconds(name: str, value, positive: bool = False) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0 or (
            positive and value == 0):
        raise InvalidFieldError(name, value, "a finite number " + ("> 0" if positive else ">= 0"))


POLICIES = {"DropStorePolicy": DropStorePolicy, "ThrottledDropPolicy": ThrottledDropPolicy}


def default_config(tier_type: str, locality: str | None = None) -> dict:
    """Water marks by medium: network (obj, or ``locality="REMOTE"``) or local disk; storage
    tiers (fs, obj) also trip on 3 consecutive failures."""
    if not isinstance(tier_type, str) or not tier_type:
        raise InvalidFieldError("tier_type", tier_type, "a tier type name (\"fs\", \"obj\", ...)")
    if locality is not None and not isinstance(locality, str):
        raise InvalidFieldError("locality", locality, "\"LOCAL\", \"REMOTE\" or None")
    remote = locality is not None and locality.upper() == "REMOTE"
    cfg: dict = ({"high_water_s": 0.050, "low_water_s": 0.010} if remote or tier_type == "obj"
                 else {"high_water_s": 0.010, "low_water_s": 0.002})
    if tier_type in ("fs", "obj"):
        cfg["failure_threshold"] = 3
    return cfg


class EMABackpressureDetector:
    """Args as vLLM's ``EMABackpressureDetector``; ``clock`` is the monotonic clock to read."""

    def __init__(self, high_water_s: float, low_water_s: float, alpha: float = 0.15,
                 warmup_completions: int = 10, decay_half_life_s: float = 2.0, cooldown_s: float = 1.0,
                 failure_threshold: int | None = None, policy: DropStorePolicy | None = None,
                 clock: Callable[[], float] | None = None) -> None:
        _check_seconds("high_water_s", high_water_s)
        _check_seconds("low_water_s", low_water_s)
        _check_seconds("decay_half_life_s", decay_half_life_s)
        _check_seconds("cooldown_s", cooldown_s)
        if isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or not (0 < alpha <= 1):
            raise InvalidFieldError("alpha", alpha, "a number in (0, 1]")
        check_int("warmup_completions", warmup_completions, minimum=0)
        check_int("failure_threshold", failure_threshold, minimum=1, allow_none=True)
        if policy is not None and not isinstance(policy, DropStorePolicy):
            raise InvalidFieldError("policy", policy, "a DropStorePolicy or ThrottledDropPolicy, or None")
        if low_water_s > high_water_s:
            raise InvalidFieldError("low_water_s", low_water_s, f"<= high_water_s ({high_water_s})")
        if not callable(clock):
            raise InvalidFieldError("clock", clock, "a callable returning monotonic seconds")
        self.high_water_s, self.low_water_s, self.alpha = high_water_s, low_water_s, alpha
        self.warmup_completions, self.decay_half_life_s = warmup_completions, decay_half_life_s
        self.cooldown_s, self.failure_threshold = cooldown_s, failure_threshold
        self.policy = policy if policy is not None else ThrottledDropPolicy()
        self._clock = clock
        self.reset(reset_policy=False)

    def reset(self, reset_policy: bool = True) -> None:
        self.ema = 0.0
        self.under_pressure = False
        self.completions = 0
        self.warmup_samples: list[float] = []
        self.last_update = 0.0
        self.healthy_streak = 0
        self.pressure_cleared_at = 0.0
        self.cooldown_count = 0
        self.consecutive_failures = 0
        self.failure_tripped = False
        if reset_policy:
            self.policy.reset()

    # -- observations ------------------------------------------------------------------------

    def update(self, submit_time: float, num_bytes: int) -> None:
        """A store that started at ``submit_time`` wrote ``num_bytes`` (ignored when 0)."""
        if num_bytes <= 0:
            return
        self.on_store_completed(self._clock() - submit_time, num_bytes)

    def on_store_completed(self, elapsed_s: float, num_bytes: int) -> None:
        now = self._clock()
        sample = elapsed_s / (num_bytes / MIB)
        self.consecutive_failures = 0
        self.completions += 1
        if self.completions <= self.warmup_completions:
            self.warmup_samples.append(sample)
            if self.completions == self.warmup_completions:
                self.ema = sum(self.warmup_samples) / len(self.warmup_samples)
                self.last_update = now
            return
        self.ema = self.alpha * sample + (1 - self.alpha) * self.ema
        self.last_update = now
        if self.ema > self.high_water_s:
            self.under_pressure, self.pressure_cleared_at, self.healthy_streak = True, 0.0, 0
        elif self.ema < self.low_water_s:
            if self.under_pressure:
                self.pressure_cleared_at, self.cooldown_count = now, 0
            self.under_pressure = self.failure_tripped = False
            self.healthy_streak += 1
        else:
            self.healthy_streak = 0

    def on_store_failed(self) -> None:
        if self.failure_threshold is None:
            return
        self.consecutive_failures += 1
        self.healthy_streak = 0
        if self.consecutive_failures < self.failure_threshold:
            return
        self.ema = max(self.ema, self.high_water_s * FAILURE_EMA_FACTOR)
        self.last_update = self._clock()
        self.under_pressure = self.failure_tripped = True
        self.pressure_cleared_at = 0.0

    # -- decisions ---------------------------------------------------------------------------

    def is_under_pressure(self) -> bool:
        """Decays the EMA for the time since its last update before answering (a query moves
        ``last_update``, as in vLLM)."""
        if self.under_pressure and (self.completions >= self.warmup_completions or self.failure_tripped):
            now = self._clock()
            dt = now - self.last_update
            if dt > 0 and self.decay_half_life_s > 0:
                self.ema *= 0.5 ** (dt / self.decay_half_life_s)
                self.last_update = now
            if self.ema < self.low_water_s:
                self.under_pressure = self.failure_tripped = False
                self.pressure_cleared_at, self.cooldown_count = self._clock(), 0
        return self.under_pressure

    def is_healthy(self) -> bool:
        return not self.under_pressure and self.healthy_streak >= HEALTHY_THRESHOLD

    def should_store(self, num_blocks: int) -> bool:
        """Whether a cascade of ``num_blocks`` goes to this tier; a refusal is counted."""
        pressured = self.is_under_pressure()
        if self.is_healthy():
            return True
        if (not pressured and self.pressure_cleared_at > 0
                and self._clock() - self.pressure_cleared_at < self.cooldown_s):
            self.cooldown_count += 1
            if self.cooldown_count % 2 == 0:
                self.policy.on_store_skipped(num_blocks)
                return False
        if not self.policy.should_store(self):
            self.policy.on_store_skipped(num_blocks)
            return False
        return True

    @property
    def stats(self) -> dict[str, float]:
        return {"store_latency_ema": self.ema, "consecutive_store_failures": self.consecutive_failures}

    def snapshot(self) -> tuple:
        """Everything that decides future answers (compared with vLLM's detector after each step)."""
        acc = getattr(self.policy, "drop_accumulator", 0.0)
        return (self.ema, self.under_pressure, self.completions, self.healthy_streak, self.pressure_cleared_at,
                self.cooldown_count, self.consecutive_failures, self.failure_tripped, self.last_update,
                self.policy.stores_dropped, self.policy.blocks_dropped, acc)

    def check_invariants(self) -> None:
        assert self.ema >= 0.0, "T3: negative latency EMA"
        assert self.completions >= 0 and self.consecutive_failures >= 0, \
            f"T3: {self.completions} completions, {self.consecutive_failures} consecutive failures"
        assert not self.failure_tripped or self.under_pressure, "T3: tripped by failures but not under pressure"
        assert len(self.warmup_samples) == min(self.completions, self.warmup_completions), \
            f"T3: {len(self.warmup_samples)} warm-up samples after {self.completions} completions"
