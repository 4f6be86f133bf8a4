"""A HiSparse pool behind the whole ``KVCacheManager``: vLLM 0.33.0's vs the reference's (#22/#23).

The HiSparse programs (models/machines/hisparse_pool.py) call the managers one by one; here
requests on shared prompts go through ``get_computed_blocks`` -> ``allocate_slots`` -> the
coordinator's write-back planning -> the offload command -> the workers' reports -> ``free``. With
prefix caching the host source keeps a longer hit than the GPU groups, and ``allocate_slots``
trims it to the tokens the request reuses (vLLM's ``retained_hit_group_ids``). After every step the
hit, the new block ids of every group, the page transfers and the whole pool state (tables,
both pools' free queues, the coordinator's records) must agree. With KV cache events on, both
managers' queued events (the host pool's, medium CPU, share the device pool's queue) must agree
after every operation, in both report modes: ``"full"`` announces a prefix hit's blocks, but only
a hit of more than 0 tokens (a lookup that finds the prefix on the host tier alone announces
nothing). Run inside ``conform-kv-manager``.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from typing import Any

from hypothesis import strategies as st

from kvref.impl.hisparse_calls import HiSparseWholeManagerCalls
from kvref.impl.interface import PoolConfig
from kvref.impl.reference.hisparse_pool import HiSparsePool
from kvref.impl.reference.kv_cache_manager import KVCacheManager
from kvref.impl.reference.kv_events import event_to_plain
from kvref.impl.request import Request, RequestStatus
from kvref.spec.errors import InvalidFieldError
from kvref.spec.hisparse import HiSparsePoolConfig
from kvref.spec.kv_cache_interface import FullAttentionSpec, KVCacheGroupSpec

from kvref.models.machines.hisparse_pool import prompt_of


def _pool_config(config: HiSparsePoolConfig, enable_kv_cache_events: bool = False) -> PoolConfig:
    fa = FullAttentionSpec(block_size=config.block_size, num_kv_heads=1, head_size=1, dtype="float32")
    groups = [KVCacheGroupSpec(("source",), fa), KVCacheGroupSpec(("indexer",), fa)]
    for i in range(config.num_resident_groups):
        groups += [KVCacheGroupSpec((f"resident_{i}",), config.resident_spec()),
                   KVCacheGroupSpec((f"hot_{i}",), config.hot_spec())]
    roles = ("hisparse_source", "hisparse_indexer") + ("default", "default") * config.num_resident_groups
    return PoolConfig.off_plan("a HiSparse pool as vLLM's tests build it, field by field",
                               num_blocks=config.num_gpu_blocks, groups=tuple(groups),
                               max_model_len=config.max_model_len, scheduler_block_size=config.block_size,
                               hash_block_size=config.block_size, enable_caching=config.enable_caching,
                               max_in_flight_tokens=config.max_in_flight_tokens, group_roles=roles,
                               hisparse_host_num_blocks=config.host_num_blocks,
                               enable_kv_cache_events=enable_kv_cache_events)


class ReferenceHiSparseKVCacheManager(HiSparseWholeManagerCalls, HiSparsePool):
    """The reference ``KVCacheManager`` over the same pool, answering the calls of
    :class:`kvref.impl.vllm.hisparse_kv_manager.VllmHiSparseKVCacheManager` (and, through the
    coordinator it builds, those of :class:`HiSparsePool`: the offload command, reports, state)."""

    def __init__(self, config: HiSparsePoolConfig, enable_kv_cache_events: bool = False) -> None:
        if not isinstance(config, HiSparsePoolConfig):
            raise InvalidFieldError("config", config, "a kvref.spec.hisparse.HiSparsePoolConfig")
        self.config = config
        self._mgr = KVCacheManager(_pool_config(config, enable_kv_cache_events))
        self.coordinator = self._mgr.coordinator.hisparse_coordinator
        self.managers = tuple(self._mgr.coordinator.single_type_managers)
        self.gpu_pool = self._mgr.block_pool
        self.host_pool = self.managers[0].block_pool
        self.resident_managers = self.coordinator.resident_managers
        self.hot_managers = self.coordinator.hot_managers
        self.requests: dict[str, Request] = {}
        self._whole_hits: dict[str, Any] = {}

    def _status(self, name: str) -> RequestStatus:
        return RequestStatus[name]

    def check_invariants(self) -> None:
        self._mgr.check_invariants()

    def take_kv_events(self) -> list[dict[str, Any]]:
        """The manager's queued KV cache events (the host pool's, medium CPU, share the device
        pool's queue) as plain dicts, the form vLLM's are compared in; [] with events off."""
        return [event_to_plain(e) for e in self._mgr.take_events()]


#: (request index, chunk, finish after the step, complete the step's transfers)
STEPS = st.lists(st.tuples(st.integers(0, 2), st.integers(1, 24), st.booleans(), st.booleans()),
                 min_size=4, max_size=24)

#: vLLM 0.33.0's ``kv_cache_report_mode`` values (``Request`` reads ``extra_args``): ``"full"`` makes
#: ``get_computed_blocks`` announce a prefix hit's blocks in ``BlockStored`` events
REPORT_MODES = ("incremental", "full")
#: (``enable_kv_cache_events``, the report mode of each of the three requests); events off keeps
#: the pools' other paths drawn too
EVENTS = st.tuples(st.sampled_from((True, True, False)),
                   st.lists(st.sampled_from(REPORT_MODES), min_size=3, max_size=3).map(tuple))
NO_EVENTS = (False, ("incremental",) * 3)

#: each request's prompt: ``"shared"`` (one token stream, so a request finds another's or its own
#: earlier pages), ``"half"`` (leaves that stream half-way) or ``"own"`` (a stream of its own, whose
#: allocations evict the GPU copies of the shared prefix while the host tier may keep them: the GPU
#: groups then hit nothing while the host source still does)
PROMPT_KINDS = ("shared", "half", "own")
PROMPTS = st.lists(st.sampled_from(PROMPT_KINDS), min_size=3, max_size=3).map(tuple)
#: what the programs ran before prompts were drawn (``prompt_of``: r0, r1 shared, r2 half-way)
DEFAULT_PROMPTS = ("shared", "shared", "half")
#: the prompt lengths of the three requests (cut to ``max_model_len``)
LENGTHS = st.lists(st.integers(8, 48), min_size=3, max_size=3)


def whole_prompt(idx: int, length: int, kind: str) -> list[int]:
    """Request ``idx``'s prompt of ``length`` tokens, of kind ``kind`` (:data:`PROMPT_KINDS`)."""
    if kind == "own":
        return [2000 + 100 * idx + t for t in range(length)]
    return prompt_of(0 if kind == "shared" else 2, length)


@st.composite
def whole_manager_configs(draw) -> HiSparsePoolConfig:
    bs = draw(st.sampled_from((2, 4)))
    max_model_len = draw(st.sampled_from((32, 48)))
    return HiSparsePoolConfig(block_size=bs, num_gpu_blocks=draw(st.integers(12, 48)),
                              host_num_blocks=draw(st.integers(8, 48)), blocks_per_request=draw(st.integers(1, 2)),
                              num_resident_groups=draw(st.sampled_from((1, 1, 2))), max_model_len=max_model_len,
                              max_in_flight_tokens=max_model_len, enable_caching=draw(st.sampled_from((True, True, False))))


@st.composite
def _host_keeps_gpu_loses(draw) -> dict[str, Any]:
    """A shared prompt written back to the host and finished (r0), a long request on a stream of its
    own filling the GPU pool in chunks (r2: its allocations evict the GPU copies of r0's pages, the
    prefix last, while the larger host pool keeps r0's), then the shared prompt again (r1), then
    any steps. r1 then often finds the prefix on the host only: the GPU groups hit 0 tokens while the
    host source (``retains_longer_hit``) hits, the lookup vLLM guards with ``num_new_computed_tokens > 0``."""
    bs = draw(st.sampled_from((2, 4)))
    max_model_len = 48
    len0 = draw(st.integers(2 * bs, 24))
    # room for r0 (its pages on the indexer and resident group), not for r0 and r2; odd, so the GPU
    # pool's free blocks (less the null block) are even: r2 takes two a page (indexer, resident)
    # and so also the last one, r0's prefix, before the pool refuses it
    gpu = 2 * draw(st.integers(len0 // bs // 2 + 3, max_model_len // bs // 2 + 1)) + 1
    config = HiSparsePoolConfig(block_size=bs, num_gpu_blocks=gpu, host_num_blocks=gpu + len0 // bs + draw(st.integers(0, 8)),
                                blocks_per_request=draw(st.integers(1, 2)), num_resident_groups=1,
                                max_model_len=max_model_len, max_in_flight_tokens=max_model_len, enable_caching=True)
    steps = [(0, len0, True, True)]
    # r2 runs a page or two a step (to its end or until the GPU pool refuses it): the steps take
    # the GPU's free blocks one by one, so r0's prefix (freed last in the queue) goes before a refusal
    chunk = draw(st.sampled_from((bs, bs, 2 * bs)))
    steps += [(2, chunk, False, draw(st.booleans())) for _ in range(-(-max_model_len // chunk))]
    steps += [(1, draw(st.integers(1, 24)), draw(st.booleans()), True)] + draw(STEPS)[:6]
    # r1's lookup is the one that may meet the host-only hit: events on, mostly announced ("full")
    mode = st.sampled_from(REPORT_MODES)
    events = (True, (draw(mode), draw(st.sampled_from(("full", "full", "full", "incremental"))), draw(mode)))
    lengths = [len0, draw(st.integers(len0, max_model_len)), max_model_len]
    return dict(config=config, lengths=lengths, steps=steps, prompts=("shared", "shared", "own"), events=events)


@st.composite
def whole_manager_programs(draw) -> dict[str, Any]:
    """The keyword arguments of :func:`run_whole_manager_program` but ``make_vllm``: random steps
    on drawn prompts, or (a third of the programs) :func:`_host_keeps_gpu_loses`; KV cache events
    (on in two random programs of three, always in the host-only ones) and each request's report
    mode drawn."""
    if draw(st.integers(0, 2)) == 0:
        return draw(_host_keeps_gpu_loses())
    return dict(config=draw(whole_manager_configs()), lengths=draw(LENGTHS), steps=draw(STEPS),
                prompts=draw(PROMPTS), events=draw(EVENTS))


def _check_prompts(prompts: tuple) -> tuple[str, ...]:
    if not (isinstance(prompts, (tuple, list)) and len(prompts) == 3 and all(k in PROMPT_KINDS for k in prompts)):
        raise InvalidFieldError("prompts", prompts, f"three prompt kinds, each one of {PROMPT_KINDS}")
    return tuple(prompts)


def _check_events(events: tuple) -> tuple[bool, tuple[str, ...]]:
    if not (isinstance(events, tuple) and len(events) == 2 and isinstance(events[0], bool)
            and isinstance(events[1], (tuple, list))):
        raise InvalidFieldError("events", events, "(enable_kv_cache_events: bool, report modes per request)")
    modes = tuple(events[1])
    if len(modes) != 3 or any(m not in REPORT_MODES for m in modes):
        raise InvalidFieldError("events", events, f"three report modes, each one of {REPORT_MODES}")
    return events[0], modes


def same_kv_events(ref: Any, vll: Any, where: str, seen: Counter) -> None:
    """Take both managers' queued KV cache events; they must be equal event by event (the
    comparison ``conform-kv-manager``'s differential makes for other pools, docs/kv_events.md).
    Counts the event kinds, the host pool's (medium CPU) apart."""
    ours, theirs = ref.take_kv_events(), vll.take_kv_events()
    if ours != theirs:
        i = next((i for i, (x, y) in enumerate(zip(ours, theirs)) if x != y), min(len(ours), len(theirs)))
        raise AssertionError(f"{where}: KV cache events kvref {ours[i:i + 2]} != vLLM {theirs[i:i + 2]} "
                             f"(first difference at event {i}; {len(ours)} vs {len(theirs)} events)")
    for e in ours:
        seen[f"event_{e['type']}" + ("_cpu" if e.get("medium") == "CPU" else "")] += 1


def run_whole_manager_program(config: HiSparsePoolConfig, lengths: list[int], steps: list[tuple],
                              make_vllm: Callable[..., Any], events: tuple = NO_EVENTS,
                              prompts: tuple = DEFAULT_PROMPTS) -> Counter:
    """Run ``steps`` on both managers; AssertionError at the first difference. Returns the paths taken.

    ``events`` (:data:`EVENTS`): with KV cache events on, both managers' queued events are
    compared after every operation; a request drawn with report mode ``"full"`` also announces its
    prefix hit. The path ``full_source_only_hit`` is vLLM's guard ``num_new_computed_tokens > 0``:
    the GPU groups hit nothing while the host source (``retains_longer_hit``, never truncated by
    ``HybridKVCacheCoordinator.find_longest_cache_hit``) still holds the prompt's prefix, so no
    ``BlockStored`` may be announced for a hit the request does not use."""
    enabled, modes = _check_events(events)
    kinds = _check_prompts(prompts)
    ref, vll = ReferenceHiSparseKVCacheManager(config, enabled), make_vllm(config, enable_kv_cache_events=enabled)
    seen: Counter = Counter()
    computed: dict[str, int] = {}
    for n, (idx, chunk, finish, complete) in enumerate(steps):
        rid = f"r{idx}"
        length = min(lengths[idx], config.max_model_len)
        where = f"step {n} ({rid}, chunk {chunk})"
        num_hit = 0
        if rid not in computed:
            prompt = whole_prompt(idx, length, kinds[idx])
            hit, theirs = ref.manager_hit(rid, prompt, modes[idx]), vll.manager_hit(rid, prompt, modes[idx])
            assert hit == theirs, f"{where}: hit kvref {hit} != vLLM {theirs}"
            same_kv_events(ref, vll, f"{where} after get_computed_blocks", seen)
            num_hit = hit[0]
            # the host source's hit is longer than the indexer's (it keeps pages the GPU lost):
            # allocate_slots then trims it to the reused prefix
            seen["longer_source_hit"] += len(hit[1][0]) > len(hit[1][1])
            seen["hit"] += bool(num_hit)
            source_only = not num_hit and bool(hit[1][0])
            seen["source_only_hit"] += source_only
            if enabled and modes[idx] == "full":
                seen["full_hit"] += bool(num_hit)
                seen["full_source_only_hit"] += source_only
        done = computed.get(rid, 0) + num_hit
        num_new = min(chunk, length - done)
        if num_new <= 0:
            continue
        got = ref.manager_allocate(rid, num_new)
        theirs = vll.manager_allocate(rid, num_new)
        assert got == theirs, f"{where}: new blocks per group kvref {got} != vLLM {theirs}"
        same_kv_events(ref, vll, f"{where} after allocate_slots", seen)
        if got is None:
            seen["refused"] += 1
            if rid not in computed:  # a refused admission leaves nothing behind
                ref.manager_free(rid)
                vll.manager_free(rid)
                same_kv_events(ref, vll, f"{where} after a refused admission's free", seen)
            continue
        seen["allocated"] += 1
        done += num_new
        computed[rid] = done
        ref.manager_computed(rid, done)
        vll.manager_computed(rid, done)
        ref.advance_scheduled([(rid, done)])
        vll.advance_scheduled([(rid, done)])
        transfers = ref.build_offload_command()
        assert transfers == vll.build_offload_command(), f"{where}: page transfers"
        same_kv_events(ref, vll, f"{where} after the offload command", seen)
        if complete and transfers:
            counts = {t[0]: 1 for t in transfers}
            ref.update_spills(counts, counts)
            vll.update_spills(counts, counts)
            seen["transfers_done"] += len(counts)
            same_kv_events(ref, vll, f"{where} after the workers' reports", seen)
        if finish or done == length:
            ref.manager_free(rid)
            vll.manager_free(rid)
            computed.pop(rid)
            seen["freed"] += 1
            same_kv_events(ref, vll, f"{where} after free", seen)
        ref.check_invariants()
        state = ref.observe()
        assert state == vll.observe(), f"{where}: state kvref {state} != vLLM {vll.observe()}"
    return seen
