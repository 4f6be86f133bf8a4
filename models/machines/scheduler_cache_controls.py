"""Scheduler traces with per-request prefix-cache controls, prefix-cache resets and Mamba "align"
pools: the second half of ``conform-scheduler`` (issue #22).

:class:`CacheControlsMachine` is :class:`~kvref.models.machines.scheduler.SchedulerMachine` with

* arrivals that carry vLLM's per-request cache controls: a ``cache_salt`` (hashed into the first
  block only, so equal prompts with different salts never share a block) and
  ``skip_reading_prefix_cache`` (vLLM sets it for prompt-logprobs requests: the request writes the
  cache but never reads a hit from it);
* ``reset_prefix_cache(reset_running_requests, reset_connector)`` through the *scheduler*, as the
  engine's ``/reset_prefix_cache`` calls it: with ``reset_running_requests`` every running request
  is preempted first (its in-flight output dropped), then the pool forgets every cached block (or
  refuses while blocks are held); the result, the queues and the published ``AllBlocksCleared``
  batch are compared;
* multi-turn follow-ups (an earlier turn's prompt and output, then a new tail) and, under
  PRIORITY, urgent arrivals admitted behind less urgent running requests;
* setups (:func:`cache_controls_setups`) drawn three in seven from the FA + Mamba "align" pools
  (:data:`MAMBA_ALIGN_KINDS`), where vLLM's ``Scheduler._mamba_block_aligned_split`` clips every
  prefill chunk to Mamba state boundaries and the Mamba manager caches partial tails and copies
  states on write; two in seven with speculative decoding, where vLLM runs as its diffusion-LM
  scheduler (``DiffusionScheduler`` / ``DiffusionAsyncScheduler``), which for requests without a
  canvas of their own must schedule as the plain one; the rest as the main machine's, or tight
  PRIORITY pools.

It is a separate machine (and a separate, smaller run) so that the main machine's rules and
setups draw nothing new: its derandomized traces, and the tests that assert rare paths on them,
stay as they are.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Callable

from hypothesis import strategies as st
from hypothesis.stateful import precondition, rule

from kvref.impl.scheduler_types import PRIORITY

from kvref.models.machines.counted_lockstep import run_counted
from kvref.models.machines.scheduler import (
    COVERAGE,
    MAMBA_ALIGN_KINDS,
    MAX_REQUESTS,
    Lockstep,
    SchedulerMachine,
    SchedulerRun,
    _diverge,
    machine_with,
    request_specs,
    run_lockstep_machine,
    scheduler_setups,
)

#: salts drawn for arrivals (None most often: unsalted requests share prefixes with each other)
SALTS = (None, None, None, "tenant-a", "tenant-b")
#: at most this many prefix-cache resets per trace (a reset empties the cache the hits need)
MAX_RESETS = 1
#: follow-ups (multi-turn arrivals) come on top of the main machine's MAX_REQUESTS arrivals
MAX_FOLLOW_UPS = 6


def _finished(driver: Lockstep) -> list[str]:
    """The finished requests at the last comparison, by id (the turns a follow-up continues)."""
    snap = driver.last_snapshot
    return sorted(rid for rid, s in snap.requests.items() if s.status == "finished") if snap else []


class CacheControlsLockstep(Lockstep):
    """:class:`Lockstep` with ``reset_prefix_cache`` sent to every target."""

    num_resets = 0

    def reset_prefix_cache(self, reset_running_requests: bool, reset_connector: bool) -> None:
        """vLLM ``Scheduler.reset_prefix_cache`` on every target: the same result (or the same
        error), then the same queues, states and pool."""
        results = {}
        for name, t in self.targets.items():
            try:
                results[name] = ("ok", t.reset_prefix_cache(reset_running_requests, reset_connector))
            except RuntimeError:
                results[name] = ("RuntimeError", None)
        (n0, r0), *rest = results.items()
        what = f"reset_prefix_cache({reset_running_requests}, {reset_connector})"
        for name, r in rest:
            if r != r0:
                _diverge(f"{what} (step {self.num_steps}): {n0} -> {r0}, {name} -> {r}",
                         "reset_prefix_cache: results differ")
        self.num_steps += 1
        self.num_resets += 1
        COVERAGE["reset_prefix_cache_done" if r0 == ("ok", True) else "reset_prefix_cache_refused"] += 1
        if reset_running_requests and self.last_snapshot is not None and self.last_snapshot.running:
            COVERAGE["reset_preempted_running"] += 1
        self.compare(what)


class CacheControlsMachine(SchedulerMachine):
    """The scheduler machine with salted / cache-skipping arrivals and prefix-cache resets."""

    driver_class: type = CacheControlsLockstep

    @precondition(lambda self: self.num_added < MAX_REQUESTS)
    @rule(data=st.data())
    def add_request(self, data):
        # prompts of two blocks at least (a shorter one caches no block to hit) and at most half the
        # context, so that a follow-up can extend the whole turn (a Mamba group keeps only the
        # state where the turn stopped: a follow-up that cuts the turn cannot hit it)
        pool = self.driver.pool
        spec = data.draw(request_specs(self.num_added, pool.max_model_len // 2 + 1,
                                       min_length=2 * pool.scheduler_block_size))
        spec = replace(spec, cache_salt=data.draw(st.sampled_from(SALTS)),
                       skip_reading_prefix_cache=data.draw(st.sampled_from((False, False, False, True))))
        COVERAGE["salted_arrivals"] += spec.cache_salt is not None
        COVERAGE["skip_reading_arrivals"] += spec.skip_reading_prefix_cache
        self.num_added += 1
        self.driver.add(spec)

    @precondition(lambda self: self.num_added < MAX_REQUESTS + MAX_FOLLOW_UPS and _finished(self.driver))
    @rule(data=st.data())
    def follow_up(self, data):
        """A multi-turn follow-up: an earlier request's prompt and output so far, then a new tail,
        under the same salt or another (a hit only under the same salt), reading the cache or
        skipping it. Independent arrivals share prefixes too rarely to reach Mamba's partial
        hits and their copy-on-write, or to show a salt that fails to isolate."""
        states = self.driver.last_snapshot.requests
        # a finished turn mostly: its blocks are cached (freed, hashed) for the follow-up to hit
        rid = data.draw(st.sampled_from(_finished(self.driver))) if data.draw(st.integers(0, 3)) else \
            f"r{data.draw(st.integers(0, self.num_added - 1))}"
        prev = self.driver.specs[rid]
        state = states.get(rid)
        turn = prev.prompt + (state.output_token_ids if state is not None else ())
        room = self.driver.pool.max_model_len - 1 - len(turn)
        if room < 1:
            turn, room = turn[: self.driver.pool.max_model_len - 2], 1
        tail = tuple(data.draw(st.lists(st.integers(0, 49), min_size=1, max_size=min(room, 8))))
        salt = prev.cache_salt if data.draw(st.integers(0, 3)) else data.draw(st.sampled_from(SALTS))
        spec = replace(prev, request_id=f"r{self.num_added}", prompt=turn + tail, arrival_time=float(self.num_added),
                       cache_salt=salt, skip_reading_prefix_cache=data.draw(st.sampled_from((False, False, True))))
        COVERAGE["follow_ups"] += 1
        COVERAGE["salted_arrivals"] += spec.cache_salt is not None
        COVERAGE["skip_reading_arrivals"] += spec.skip_reading_prefix_cache
        self.num_added += 1
        self.driver.add(spec)

    @precondition(lambda self: self.num_added < MAX_REQUESTS + MAX_FOLLOW_UPS and self.driver.config.policy == PRIORITY
                  and self.driver.last_snapshot is not None and self.driver.last_snapshot.running)
    @rule(data=st.data())
    def urgent_arrival(self, data):
        """PRIORITY: a request more urgent than every running one arrives while they decode. It is
        admitted behind them in the running queue, so when it cannot grow on a dry pool vLLM's
        victim (the least urgent, latest) sits *before* it and was already scheduled this step:
        vLLM takes that request's tokens back into the budget (arrivals of random priority are
        admitted mostly in priority order and seldom get there)."""
        pool = self.driver.pool
        spec = data.draw(request_specs(self.num_added, pool.max_model_len // 2 + 1,
                                       min_length=2 * pool.scheduler_block_size))
        urgent = min(s.priority for s in self.driver.specs.values()) - 1
        spec = replace(spec, priority=urgent)
        COVERAGE["urgent_arrivals"] += 1
        self.num_added += 1
        self.driver.add(spec)

    @precondition(lambda self: self.driver.num_resets < MAX_RESETS)
    @rule(reset_running_requests=st.booleans(), reset_connector=st.booleans())
    def reset_prefix_cache(self, reset_running_requests, reset_connector):
        self.driver.reset_prefix_cache(reset_running_requests, reset_connector)


def _roomy(setup):
    """The pool with three times the blocks: cached turns survive until their follow-ups arrive
    (the main machine's pools are mostly tight, so a finished turn's blocks are evicted first)."""
    pool, config = setup
    return replace(pool, num_blocks=3 * pool.num_blocks), config


def cache_controls_setups():
    """FA + Mamba "align" pools (three in seven), the main machine's setups, speculative decoding
    (synchronous in one draw, async in another: the drafts the runner proposes after each step
    go to ``update_draft_token_ids``, which the spec-decode machine's mostly async setups seldom
    reach), or tight PRIORITY pools (the main machine's storms are FCFS: here a victim of lower
    priority may have been scheduled earlier in the same step, and vLLM gives its tokens back to
    the budget); prefix caching on; as drawn or roomy."""
    mamba = scheduler_setups(kinds=MAMBA_ALIGN_KINDS)  # thrice: their partial hits and copies need traces
    drawn = st.one_of(mamba, mamba, mamba, scheduler_setups(),
                      scheduler_setups(spec=True, async_scheduling=False),
                      scheduler_setups(spec=True, async_scheduling=True),
                      scheduler_setups(policy=PRIORITY, tight=True)).filter(_cacheable)
    return st.one_of(drawn, drawn.map(_roomy))


def _cacheable(setup) -> bool:
    """Prefix caching on, and contexts of four blocks at least (the controls act on cache hits;
    Hypothesis favours the smallest contexts, whose prompts fill no block)."""
    pool, _ = setup
    return pool.enable_caching and pool.max_model_len >= 4 * pool.scheduler_block_size


def run_cache_controls_machine(examples: int, reproducible: bool = False, shrink: bool = True,
                               seed: int | None = None) -> SchedulerRun:
    """The reference scheduler in lock step with vLLM 0.33.0's on :class:`CacheControlsMachine`
    traces (at least 30 operations each; liveness drained at teardown as in the main machine)."""
    from kvref.impl.reference.scheduler import Scheduler
    from kvref.impl.vllm.scheduler import VllmEnv, VllmScheduler

    env = VllmEnv()
    # with speculative decoding vLLM runs as its diffusion-LM scheduler: for requests that ask no
    # canvas of their own it must schedule as the plain one (the reference)
    factories: dict[str, Callable] = {
        "vllm": lambda p, c: VllmScheduler(p, c, env, diffusion=bool(c.num_speculative_tokens)),
        "ref": lambda p, c: Scheduler(p, c)}
    base = machine_with(factories, setups=cache_controls_setups(), name="CacheControlsBase")
    return SchedulerRun(**run_counted(
        lambda counting: type("CacheControlsRun", (CacheControlsMachine, base), {"driver_class": counting}),
        CacheControlsLockstep,
        lambda machine: run_lockstep_machine(machine, examples, steps=45, min_steps=31, seed=seed,
                                             reproducible=reproducible, shrink=shrink), COVERAGE))
