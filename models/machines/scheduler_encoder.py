"""Multimodal requests in the scheduler: the encoder budget and cache that cut how many tokens a
step schedules (issue #22; :mod:`kvref.impl.reference.scheduler_encoder`). Part of
``conform-scheduler``.

:class:`EncoderMachine` is :class:`~kvref.models.machines.scheduler.SchedulerMachine` on setups with
a multimodal model's encoder limits (:class:`EncoderBudget`: a per-step compute budget and a cache
of a few items, ``disable_chunked_mm_input`` in half) and arrivals that carry image items drawn
from a small pool of identifiers (each always the same size): items shared between requests (the
encoder cache hits, unreferenced entries are evicted oldest first), repeated inside one request
(encoded once per step), repeated prompts (a prefix-cache hit that ends inside an item the encoder
cache no longer holds schedules nothing) and budgets a single step cannot cover (a chunk ends
before the item; a waiting request cut to nothing is skipped, not head-of-line blocking). After
every operation the main machine's comparison runs (outputs, queues, request states, block ids,
free queue, KV events) and, beside it, the encoder cache (free and freeable slots, references,
the freeable order) and the step's ``scheduled_encoder_inputs`` / ``free_encoder_mm_hashes``; in
half the setups the workers run the V2 model runner (resumed requests sent as new ones, the
step's encoder-input installs and releases compared too).

Liveness is not asserted (a request whose items together outgrow the cache waits forever in vLLM
too); teardown runs a bounded drain under the same comparison.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, replace
from typing import Callable

from hypothesis import strategies as st
from hypothesis.stateful import initialize, precondition, rule

from kvref.impl.reference.scheduler_encoder import EncoderBudget
from kvref.impl.request import MultiModalFeatureSpec, PlaceholderRange, Request
from kvref.models.machines.counted_lockstep import run_counted
from kvref.models.machines.scheduler import (
    COVERAGE,
    MAX_REQUESTS,
    Lockstep,
    RequestSpec,
    SchedulerMachine,
    SchedulerRun,
    _diverge,
    request_specs,
    run_lockstep_machine,
    scheduler_setups,
)

#: image identifiers and their sizes (embeddings = placeholder tokens): one identifier, one size
ITEM_SIZES = {"img0": 2, "img1": 3, "img2": 4, "img3": 5, "img4": 6, "img5": 8}
#: the placeholder token of an image in the prompt
IMAGE_TOKEN = 9
#: engine steps a teardown drain runs at most
DRAIN_STEPS = 60


@dataclass(frozen=True)
class EncoderRequestSpec(RequestSpec):
    """A :class:`RequestSpec` with image items: ``(identifier, offset)`` pairs, sorted.
    ``sizes``, when given, are the items' embedding counts (one per item); an item whose size is
    not its identifier's :data:`ITEM_SIZES` entry is a client-provided UUID reused for other
    content (vLLM rejects the request once the encoder cache or the step holds the other size)."""

    items: tuple[tuple[str, int], ...] = ()
    sizes: tuple[int, ...] = ()

    def item_size(self, k: int) -> int:
        return self.sizes[k] if self.sizes else ITEM_SIZES[self.items[k][0]]

    def make(self) -> Request:
        return Request(self.request_id, list(self.prompt), max_tokens=self.max_tokens, priority=self.priority,
                       arrival_time=self.arrival_time, stop_token_ids=self.stop_token_ids,
                       mm_features=tuple(MultiModalFeatureSpec(ident, PlaceholderRange(offset, self.item_size(k)))
                                         for k, (ident, offset) in enumerate(self.items)))


@st.composite
def encoder_budgets(draw, item_max: int):
    """A compute budget of one to two of the largest items, a cache of one to three."""
    return EncoderBudget(encoder_compute_budget=draw(st.integers(item_max, 2 * item_max)),
                         encoder_cache_size=draw(st.integers(item_max, 3 * item_max)),
                         disable_chunked_mm_input=draw(st.booleans()))


@st.composite
def encoder_setups(draw):
    """``(pool, config, budget, item_max, use_v2_model_runner)``: the main machine's
    startup-consistent setups (no speculative decoding), long enough for a few items; items never
    outgrow one step's tokens (vLLM's startup budget); the V2 model runner in half."""
    pool, cfg = draw(scheduler_setups(consistent=True, spec=False).filter(lambda s: s[0].max_model_len >= 24))
    limit = min(cfg.step_token_budget, cfg.long_prefill_token_threshold or cfg.step_token_budget)
    item_max = max(s for s in ITEM_SIZES.values() if s <= max(2, limit)) if limit >= 2 else 2
    if limit < 2:
        cfg = replace(cfg, long_prefill_token_threshold=0)
    if not cfg.enable_chunked_prefill and cfg.max_num_batched_tokens < pool.max_model_len:
        cfg = replace(cfg, enable_chunked_prefill=True)  # whole prompts with images must fit a step
    return pool, cfg, draw(encoder_budgets(item_max)), item_max, draw(st.booleans())


def _place_items(rng: random.Random, length: int, sizes: list[tuple[str, int]]) -> tuple[tuple[str, int], ...]:
    """Sorted, non-overlapping offsets for as many of ``sizes`` as fit ``length`` tokens."""
    items, pos = [], rng.randrange(0, 3)
    for k, (ident, size) in enumerate(sizes):
        if pos + size > length:
            break
        items.append((ident, pos))
        # a repeated image right behind the first: one step's window covers both
        repeat = k + 1 < len(sizes) and sizes[k + 1][0] == ident
        pos += size + (0 if repeat else rng.randrange(0, 4))
    return tuple(items)


@st.composite
def encoder_request_specs(draw, index: int, max_model_len: int, item_max: int, earlier: tuple = ()):
    """A request with one to three images (one in eight without), or (one in four) an earlier
    request's prompt and images again, for prefix-cache hits through image blocks."""
    if earlier and draw(st.integers(0, 3)) == 0:
        base = draw(st.sampled_from(earlier))
        return replace(base, request_id=f"r{index}", arrival_time=float(index))
    spec = draw(request_specs(index, max_model_len, min_length=min(12, max_model_len - 1)))
    rng = random.Random(draw(st.integers(0, 2**16)))
    fitting = [i for i, s in ITEM_SIZES.items() if s <= item_max]
    n = draw(st.sampled_from((0, 1, 1, 2, 2, 2, 3, 3)))
    idents = [rng.choice(fitting) for _ in range(n)]
    if n > 1 and rng.randrange(2) == 0:
        idents[0] = idents[1] = "img0"  # the same small image twice in one prompt: encoded once per step
    sizes = [(ident, ITEM_SIZES[ident]) for ident in idents]
    if n and rng.randrange(4) == 0:
        # a reused UUID: one item (the repeated image's second occurrence, if any) with another size
        k = n - 1
        other = [z for z in (ITEM_SIZES[idents[k]] - 1, ITEM_SIZES[idents[k]] + 1) if 1 <= z <= item_max]
        if other:
            sizes[k] = (idents[k], rng.choice(other))
    items = _place_items(rng, len(spec.prompt), sizes)
    item_sizes = tuple(size for _, size in sizes[:len(items)])
    prompt = list(spec.prompt)
    for (ident, offset), size in zip(items, item_sizes):
        prompt[offset:offset + size] = [IMAGE_TOKEN] * size
    return EncoderRequestSpec(**{**spec.__dict__, "prompt": tuple(prompt)}, items=items, sizes=item_sizes)


class EncoderLockstep(Lockstep):
    """:class:`Lockstep` that also compares every target's :meth:`encoder_view` and tallies the
    encoder paths the reference took."""

    def compare(self, what: str) -> None:
        super().compare(what)
        views = {name: t.encoder_view() for name, t in self.targets.items()}
        (n0, v0), *rest = views.items()
        for name, v in rest:
            if v != v0:
                keys = [k for k in v0 if v0[k] != v.get(k)]
                if "cache" in keys:
                    keys = [f"cache.{k}" for k in v0["cache"] if v0["cache"][k] != v["cache"].get(k)] + \
                        [k for k in keys if k != "cache"]
                _diverge(f"after {what} (step {self.num_steps}): encoder state differs in {keys}\n"
                         f"  {n0}: {v0}\n  {name}: {v}", f"after {what}: encoder {', '.join(keys)} differ")

    def _check_whole_prompts(self, out):
        """The whole-prompt rule holds for requests without images only: vLLM's encoder gate runs
        after the chunked-prefill stop, so with chunked prefill off a prompt is still cut before
        an image the encoder budget or cache cannot take (both schedulers cut it the same way)."""
        super()._check_whole_prompts(replace(out, scheduled=tuple(
            s for s in out.scheduled if not getattr(self.specs[s.request_id], "items", ()))))

    def schedule(self):
        out = super().schedule()
        view = self.targets["ref"].encoder_view() if "ref" in self.targets else None
        if view is not None:
            COVERAGE["encoder_inputs_scheduled"] += sum(len(i) for i in view["scheduled_encoder_inputs"].values())
            COVERAGE["encoder_evictions"] += len(view["free_encoder_mm_hashes"])
            for updates in view["encoder_input_updates"].values():
                for kind in updates.values():
                    COVERAGE[f"encoder_v2_{kind}s"] += 1
            ref = self.targets["ref"]
            for s in out.scheduled:
                r = ref.requests.get(s.request_id)
                if r is None or not r.mm_features:
                    continue
                end = s.num_computed_tokens + s.num_scheduled_tokens
                if any(f.mm_position.offset == end for f in r.mm_features) and end < r.num_tokens:
                    COVERAGE["encoder_chunk_ends_at_item"] += 1
        return out


class EncoderMachine(SchedulerMachine):
    """The scheduler machine with image-carrying arrivals on an encoder budget."""

    driver_class: type = EncoderLockstep
    check_liveness = False
    #: (budget, use_v2_model_runner) -> ``name -> (pool, config) -> target``
    factories_for: Callable = None

    @initialize(setup=encoder_setups())
    def init(self, setup):
        pool, config, budget, self.item_max, v2 = setup
        self.budget = budget
        self.driver = self.driver_class(pool, config, type(self).factories_for(budget, v2))
        self.num_added = 0
        self.drawn: list[EncoderRequestSpec] = []

    @precondition(lambda self: self.num_added < MAX_REQUESTS)
    @rule(data=st.data())
    def add_request(self, data):
        spec = data.draw(encoder_request_specs(self.num_added, self.driver.pool.max_model_len, self.item_max,
                                               tuple(self.drawn)))
        self.num_added += 1
        self.drawn.append(spec)
        COVERAGE["encoder_arrivals_with_items"] += bool(spec.items)
        self.driver.add(spec)

    def teardown(self):
        driver = getattr(self, "driver", None)
        if driver is None:
            return
        for _ in range(DRAIN_STEPS):
            if not (driver.unfinished() or driver.num_in_flight()):
                break
            driver.engine_step()


def tallying_reference(scheduler):
    """Wrap a reference scheduler's encoder gate to tally the paths it takes (the comparison
    with vLLM is unchanged): chunks cut by the encoder limits, to nothing (a waiting request is
    then skipped), by a prefix hit that ends inside an item not encoded; items found in the cache
    or repeated inside a request."""
    state = scheduler.encoder
    original = state.try_schedule

    original_unschedule = state.unschedule

    def unschedule(request):
        # a PRIORITY preemption of a request this step scheduled with encoder inputs
        COVERAGE["encoder_preempted_inputs_restored"] += bool(state.step_inputs.get(request.request_id))
        return original_unschedule(request)

    state.unschedule = unschedule

    def try_schedule(request, num_computed_tokens, num_new_tokens):
        before = set(state.manager.get_cached_input_ids(request))
        cut, pending = original(request, num_computed_tokens, num_new_tokens)
        if not request.mm_features or num_new_tokens <= 0:
            return cut, pending
        inputs, duplicates, _ = pending
        COVERAGE["encoder_chunks_cut"] += cut < num_new_tokens
        if cut == 0:
            COVERAGE["encoder_waiting_skipped" if request.status.value in ("waiting", "preempted")
                     else "encoder_running_held"] += 1
            if any(f.mm_position.offset < num_computed_tokens < f.mm_position.offset + f.mm_position.length
                   for f in request.mm_features):
                COVERAGE["encoder_hit_inside_item"] += 1
        if state.budget.disable_chunked_mm_input and cut < num_new_tokens and any(
                f.mm_position.offset == num_computed_tokens + cut for f in request.mm_features):
            COVERAGE["encoder_unchunked_rollback"] += 1
        COVERAGE["encoder_duplicate_inputs"] += len(duplicates)
        COVERAGE["encoder_embed_mismatch_rejected"] += request.request_id in state.encoder_cache_mismatch_reqs
        # referenced by this lookup, not encoded: found in the cache (check_and_update_cache)
        COVERAGE["encoder_cache_hits"] += len(set(state.manager.get_cached_input_ids(request)) - before)
        return cut, pending

    state.try_schedule = try_schedule
    return scheduler


def run_encoder_machine(examples: int, reproducible: bool = False, shrink: bool = True,
                        seed: int | None = None) -> SchedulerRun:
    """The reference scheduler in lock step with vLLM 0.33.0's on :class:`EncoderMachine` traces
    (at least 30 operations each)."""
    from kvref.impl.reference.scheduler import Scheduler
    from kvref.impl.vllm.scheduler import VllmEnv, VllmScheduler

    env = VllmEnv()

    def factories_for(budget: EncoderBudget, v2: bool) -> dict[str, Callable]:
        return {"vllm": lambda p, c: VllmScheduler(p, c, env, encoder_budget=budget, use_v2_model_runner=v2),
                "ref": lambda p, c: tallying_reference(Scheduler(p, c, encoder_budget=budget,
                                                                 use_v2_model_runner=v2))}

    def machine_for(counting: type):
        return type("EncoderRun", (EncoderMachine,), {"driver_class": counting,
                                                      "factories_for": staticmethod(factories_for)})

    run = SchedulerRun(**run_counted(
        machine_for, EncoderLockstep,
        lambda machine: run_lockstep_machine(machine, max(1, examples), steps=45, min_steps=31, seed=seed,
                                             reproducible=reproducible, shrink=shrink), COVERAGE))
    if not run.ok:
        return run
    # PRIORITY preemptions of a request scheduled earlier in the same step with an image: the
    # machine's traces almost never line them up
    try:
        cases = run_priority_preemption_cases(max(1, examples), factories_for, seed=seed, reproducible=reproducible)
    except AssertionError as e:
        return replace(run, ok=False, coverage=dict(COVERAGE), failure=f"Divergence: {e}",
                       signature=getattr(e, "signature", None))
    return replace(run, traces=run.traces + cases, coverage=dict(COVERAGE))


@st.composite
def priority_preemption_cases(draw):
    """A PRIORITY step that preempts a request it already scheduled with an image: a low-priority
    request ``a`` is admitted alone (a whole-budget chunk), a higher-priority ``b`` arrives and is
    admitted beside it (both on ``long_prefill_token_threshold``-token chunks), and on the next step
    ``a``'s chunk encodes its image while ``b``'s decode needs a block the pool (sized to the
    token, one block more in some cases) no longer has: ``b`` preempts ``a``, whose encoder
    inputs give their compute budget back (vLLM ``schedule``'s restore of ``encoder_compute_budget``).
    Returns ``(pool, config, budget, v2, a, b)``."""
    from kvref.impl.interface import PoolConfig
    from kvref.impl.scheduler_types import PRIORITY, SchedulerConfig
    from kvref.models.machines.scheduler import _attn
    from kvref.spec.kv_cache_interface import FullAttentionSpec, KVCacheGroupSpec

    bs = draw(st.sampled_from((2, 4)))
    chunk = draw(st.integers(4, 6))
    ident = draw(st.sampled_from([i for i, s in ITEM_SIZES.items() if s <= chunk]))
    size = ITEM_SIZES[ident]
    offset = 3 * chunk + draw(st.integers(0, chunk - size))  # inside a's third chunk
    prompt_a = tuple(range(1, offset + 1)) + (IMAGE_TOKEN,) * size + tuple(range(40, 40 + draw(st.integers(1, 6))))
    len_b = bs * draw(st.integers(1, chunk // bs))  # a full last block: its first decode needs a new one
    cfg = SchedulerConfig(max_num_batched_tokens=2 * chunk, max_num_seqs=2, long_prefill_token_threshold=chunk,
                          policy=PRIORITY, async_scheduling=draw(st.booleans()))
    a_blocks = -(-min(len(prompt_a), 4 * chunk) // bs)
    b_blocks = len_b // bs
    slack = draw(st.sampled_from((1, 1, 1, 2)))  # one block is the pool's null block
    pool = PoolConfig.off_plan("a priority preemption across an image", num_blocks=a_blocks + b_blocks + slack,
                               groups=(KVCacheGroupSpec(("full",), _attn(FullAttentionSpec, bs)),), max_model_len=64,
                               scheduler_block_size=bs, hash_block_size=bs,
                               max_in_flight_tokens=cfg.max_in_flight_tokens, enable_caching=draw(st.booleans()))
    budget = EncoderBudget(encoder_compute_budget=draw(st.integers(size, 2 * size)),
                           encoder_cache_size=draw(st.integers(size, 3 * size)))
    a = EncoderRequestSpec("a", prompt_a, draw(st.integers(1, 4)), draw(st.integers(1, 3)), 0.0,
                           items=((ident, offset),))
    b = RequestSpec("b", tuple(range(60, 60 + len_b)), draw(st.integers(1, 4)), 0, 1.0)
    return pool, cfg, budget, draw(st.booleans()), a, b


def run_priority_preemption_cases(examples: int, factories_for: Callable, seed: int | None = None,
                                  reproducible: bool = False) -> int:
    """``examples`` :func:`priority_preemption_cases`, each run to the end (at most
    :data:`DRAIN_STEPS` engine steps) under :class:`EncoderLockstep`'s comparison after every
    call; an ``AssertionError`` is the divergence. Returns the cases run."""
    from hypothesis import HealthCheck, Phase, given, settings

    from kvref.models.hypothesis_runs.reproducible import seeded

    ran = [0]

    @settings(max_examples=examples, deadline=None, database=None, derandomize=reproducible,
              suppress_health_check=list(HealthCheck), phases=[Phase.explicit, Phase.generate])
    @given(priority_preemption_cases())
    def run(case):
        pool, cfg, budget, v2, a, b = case
        ran[0] += 1
        d = EncoderLockstep(pool, cfg, factories_for(budget, v2))
        d.add(a)
        d.engine_step()
        d.add(b)
        for _ in range(DRAIN_STEPS):
            if not (d.unfinished() or d.num_in_flight()):
                break
            d.engine_step()

    with seeded(seed, same_inputs=reproducible):
        run()
    return ran[0]
