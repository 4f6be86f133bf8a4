"""Demo workloads for the real-run path: serve a realistic request stream on a scheduler, as an engine.

``kvref demo record`` (and the detection campaign, :mod:`.campaign`) drive vLLM's own
``Scheduler`` / ``AsyncScheduler`` — built from the recording class's qualified name through
``scheduler_cls`` exactly as a server builds it (:func:`kvref.impl.vllm.record.recorded_vllm_scheduler`)
— with a fake model on CPU whose tokens are drawn deterministically from a seed. This module is the
engine side, independent of vLLM: the workloads, the pools they run on (planned by
:func:`kvref.spec.planning.plan_kv_cache`, the windowed ones at the smallest size startup accepts)
and the engine loop (vLLM's ``step_with_batch_queue`` shape: schedule while a batch slot is free and
requests remain, else settle the oldest batch). The target is anything with the kvref scheduler
interface (``add_request``, ``schedule``, ``update_from_output``, ``finish_requests``,
``has_unfinished_requests``).

Workloads (``WORKLOADS``): ``prefix-sharing`` (system prompts shared on a full + sliding-window
pool), ``multi-turn`` (each turn's prompt is the conversation so far), ``n-burst`` (n > 1 parallel
sampling: n requests with one prompt at once), ``aborts`` (clients abort waiting and running
requests), ``preemption-storm`` (the smallest full-attention pool, long prompts arriving fast),
``sliding-window`` and ``chunked-local`` (windowed pools at the smallest size startup accepts, long
prompts, a long-prefill threshold), ``priority`` (the priority policy with mixed priorities),
``spec-decode`` (n-gram speculative decoding: the fake runner proposes drafts after every synchronous
step and accepts a seeded number of them), ``spec-decode-eagle`` (the same with an EAGLE-like drafter:
lookahead slots reserved past every step, the trailing block of a prefix hit dropped), ``cadence``
(vLLM's local prefill cadence, the adaptive long-prefill threshold and ``max_num_active_seqs``),
``multimodal`` (image items under an encoder budget and cache), ``lora`` (adapters under
``max_loras``), ``eagle-lookahead-hash`` (an EAGLE-like drafter with lookahead block hashes),
``stop-conditions`` (vLLM's ``check_stop`` inputs: EOS, stop ids, ``min_tokens``, repetition
detection, over a fake model with a small output vocabulary so that every rule fires).
"""

from __future__ import annotations

import random
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, replace

from kvref.impl.interface import PoolConfig
from kvref.impl.reference.scheduler_encoder import EncoderBudget
from kvref.impl.reference.scheduler_stop import ends_in_repetition
from kvref.impl.request import LoRARequest, MultiModalFeatureSpec, PlaceholderRange, RepetitionDetectionParams, Request
from kvref.impl.scheduler_types import DraftTokenIds, ModelOutput, SchedulerConfig, SchedulerOutput
from kvref.spec import EngineConfig, plan_kv_cache
from kvref.spec import kv_cache_interface as ks
from kvref.spec.errors import InsufficientKVCacheError, InvalidFieldError

_ATTN = dict(num_kv_heads=1, head_size=8, dtype="float16")
VOCAB = 500
STOP_TOKEN = VOCAB - 1


@dataclass(frozen=True)
class Workload:
    """One demo workload: a pool recipe and a request script."""

    name: str
    description: str
    layers: Callable[[int], dict]  # block size -> layer name -> spec
    block_size: int
    max_model_len: int
    budget: int
    max_num_seqs: int
    pool_scale: float  # blocks: this times the smallest pool startup accepts
    script: Callable[[random.Random, "DemoClient", int], None]  # called once per engine tick
    policy: str = "fcfs"
    long_prefill_token_threshold: int = 0
    num_speculative_tokens: int = 0  # speculative decoding (drafts from the fake runner)
    #: "ngram", or "eagle" (an EAGLE-like drafter: lookahead slots, the trailing hit block dropped)
    speculative_method: str = "ngram"
    #: vLLM's local prefill cadence, adaptive long-prefill threshold and admission cap into running
    #: (``SchedulerConfig`` fields of those names; replayed by check-run, #28)
    prefill_schedule_interval: int = 1
    long_prefill_token_threshold_adaptive: bool = False
    max_num_active_seqs: int | None = None
    #: multi-module MTP (vLLM's ``num_prefill_lookahead_tokens`` = ``num_speculative_tokens``): no
    #: prefill chunk ends within it of the prompt's end, the KV manager keeps the last ``- 1``
    #: computed tokens unpublished (0: another drafter's; replayed by check-run, #28)
    num_prefill_lookahead: int = 0
    #: a multimodal model's encoder limits (None: a text model), LoRA's max_loras (None: off), and an
    #: EAGLE-like drafter's lookahead block hashes instead of the trailing-block drop (replayed by
    #: check-run since session 13, #28)
    encoder_budget: EncoderBudget | None = None
    max_loras: int | None = None
    hash_lookahead: bool = False
    #: the fake model samples output tokens in ``[1, output_vocab)``: a small vocabulary makes EOS,
    #: stop ids and repeated n-grams frequent (the ``stop-conditions`` workload, #28)
    output_vocab: int = VOCAB


def _full(bs: int) -> dict:
    return {"full": ks.FullAttentionSpec(block_size=bs, **_ATTN)}


def _swa(window: int) -> Callable[[int], dict]:
    return lambda bs: {"full": ks.FullAttentionSpec(block_size=bs, **_ATTN),
                       "swa": ks.SlidingWindowSpec(block_size=bs, sliding_window=window, **_ATTN)}


def _chunked(chunk: int) -> Callable[[int], dict]:
    return lambda bs: {"full": ks.FullAttentionSpec(block_size=bs, **_ATTN),
                       "local": ks.ChunkedLocalAttentionSpec(block_size=bs, attention_chunk_size=chunk, **_ATTN)}


def plan_pool(workload: Workload, async_scheduling: bool) -> tuple[PoolConfig, SchedulerConfig]:
    """The workload's pool as startup plans it: the smallest block count ``plan_kv_cache`` accepts
    (it refuses a pool that cannot hold one ``max_model_len`` request), scaled by ``pool_scale``."""
    cfg = SchedulerConfig(max_num_batched_tokens=workload.budget, max_num_seqs=workload.max_num_seqs,
                          policy=workload.policy, async_scheduling=async_scheduling,
                          long_prefill_token_threshold=workload.long_prefill_token_threshold,
                          num_speculative_tokens=workload.num_speculative_tokens,
                          speculative_method=workload.speculative_method,
                          prefill_schedule_interval=workload.prefill_schedule_interval,
                          long_prefill_token_threshold_adaptive=workload.long_prefill_token_threshold_adaptive,
                          max_num_active_seqs=workload.max_num_active_seqs)
    layers = workload.layers(workload.block_size)

    def plan(n: int):
        return plan_kv_cache(layers, EngineConfig(
            block_size=workload.block_size, max_model_len=workload.max_model_len, num_gpu_blocks_override=n,
            **cfg.engine_settings()), 0)

    lo, hi = 2, 4096
    while lo < hi:  # smallest n startup accepts
        mid = (lo + hi) // 2
        try:
            plan(mid)
            hi = mid
        except InsufficientKVCacheError:
            lo = mid + 1
    pool = PoolConfig.from_plan(plan(max(lo, int(lo * workload.pool_scale))), use_eagle=cfg.use_eagle)
    if workload.num_prefill_lookahead:  # the drafter's setting, not the plan's
        pool = replace(pool, num_prefill_lookahead=workload.num_prefill_lookahead)
    if workload.hash_lookahead:  # each block's hash covers the token after it: no trailing-block drop
        pool = replace(pool, use_eagle=False, num_hash_lookahead_tokens=max(1, workload.num_prefill_lookahead))
    return pool, cfg


class DemoClient:
    """What a workload script may do on one tick: send requests, abort them, read their outputs."""

    def __init__(self, engine: "DemoEngine") -> None:
        self._engine = engine

    def add(self, prompt, max_tokens: int, priority: int = 0, request_id: str | None = None,
            stop: bool = False, items=(), adapter: str | None = None, eos: int | None = None,
            min_tokens: int = 0, repetition: tuple[int, int, int] | None = None, stop_ids=()) -> str:
        """Send a request; ``items``: ``(identifier, offset, length)`` multimodal items of the prompt
        (dropped where the prompt was cut short of them); ``adapter``: a LoRA adapter's name; ``eos``,
        ``min_tokens`` and ``repetition`` (``(max_pattern_size, min_pattern_size, min_count)``): the
        sampling parameters vLLM's ``check_stop`` reads (``min_tokens`` is cut to ``max_tokens``),
        ``stop_ids`` stop token ids besides ``stop``'s."""
        if adapter is not None and adapter not in _ADAPTERS:
            raise InvalidFieldError("adapter", adapter, "None or one of " + ", ".join(_ADAPTERS))
        e = self._engine
        rid = request_id or f"req-{e.num_added}"
        e.num_added += 1
        prompt = [int(t) for t in prompt][: e.pool.max_model_len - 1]
        max_tokens = max(1, min(max_tokens, e.pool.max_model_len - len(prompt)))
        mm = tuple(MultiModalFeatureSpec(ident, PlaceholderRange(off, n)) for ident, off, n in items
                   if off + n <= len(prompt))
        lora = None if adapter is None else LoRARequest(adapter, _ADAPTERS.index(adapter) + 1, f"/adapters/{adapter}")
        rd = None if repetition is None else RepetitionDetectionParams(*repetition)
        r = Request(rid, prompt, max_tokens=max_tokens, priority=priority, arrival_time=float(e.tick),
                    stop_token_ids=((STOP_TOKEN,) if stop else ()) + tuple(int(t) for t in stop_ids), mm_features=mm, lora_request=lora,
                    eos_token_id=eos, min_tokens=min(min_tokens, max_tokens), repetition_detection=rd)
        e.target.add_request(r)
        e.live[rid] = r
        e.outputs[rid] = []
        return rid

    def abort(self, rid: str) -> None:
        e = self._engine
        if rid in e.live:
            e.target.finish_requests([rid])
            e.forget(rid)

    def live(self) -> list[str]:
        return list(self._engine.live)

    def finished_outputs(self) -> list[tuple[str, list[int], list[int]]]:
        """Requests that finished since the last call: ``(id, prompt, outputs)``."""
        out, self._engine.just_finished = self._engine.just_finished, []
        return out


class DemoEngine:
    """The engine loop around one scheduler target, with a seeded fake model."""

    def __init__(self, target, pool: PoolConfig, config: SchedulerConfig, seed: int = 0) -> None:
        self.target, self.pool, self.config, self.seed = target, pool, config, seed
        self.live: dict[str, Request] = {}
        self.outputs: dict[str, list[int]] = {}
        self.just_finished: list = []
        self.in_flight: deque = deque()
        self.num_added = 0
        self.tick = 0
        self.num_schedules = 0
        self.idle_schedules = 0  # schedule calls in a row that scheduled nothing
        self.vocab = VOCAB  # output tokens are drawn in [1, vocab): the workload's output_vocab

    def client(self) -> DemoClient:
        """What a workload script (or a test) uses to send and abort requests on this engine."""
        return DemoClient(self)

    def forget(self, rid: str) -> None:
        r = self.live.pop(rid, None)
        if r is not None:
            self.just_finished.append((rid, list(r.prompt_token_ids), self.outputs.pop(rid, [])))

    def _token(self, rid: str, k: int) -> int:
        return random.Random(f"{self.seed}:{rid}:{k}").randrange(1, self.vocab)

    def _settle(self) -> None:
        out: SchedulerOutput = self.in_flight.popleft()
        sampled = {}
        for s in out.scheduled:
            if not s.is_prefill_chunk and s.request_id in self.live:
                toks = self.outputs[s.request_id]
                # speculative decoding: 1 + accepted tokens, the acceptance drawn from the seed
                n = 1 + (random.Random(f"{self.seed}:accept:{s.request_id}:{len(toks)}").randint(
                    0, len(s.spec_token_ids)) if s.spec_token_ids else 0)
                sampled[s.request_id] = [self._token(s.request_id, len(toks) + i) for i in range(n)]
                toks.extend(sampled[s.request_id])
        self.target.update_from_output(out, ModelOutput(sampled))
        k = self.config.num_speculative_tokens
        if k and not self.config.async_scheduling and not out.skip_drafts:
            # the synchronous runner proposes drafts after the step (async: the scheduler's placeholders)
            ids = tuple(rid for rid in sampled if rid in self.live)
            self.target.update_draft_token_ids(DraftTokenIds(ids, tuple(
                tuple(self._token(rid, 10_000 + len(self.outputs[rid]) + i) for i in range(k)) for rid in ids)))
        for rid in list(self.live):
            r = self.live[rid]
            toks = self.outputs[rid]
            if toks and self._stopped(r, toks):
                self.forget(rid)

    def _stopped(self, r: Request, toks: list) -> bool:
        """Whether the engine sees ``r`` finished by its outputs ``toks`` (vLLM's ``check_stop`` on
        the last token; the engine only forgets it, the scheduler decides)."""
        last = toks[-1]
        if last == r.eos_token_id or last in r.stop_token_ids:
            return True
        if len(toks) >= r.max_tokens or len(r.prompt_token_ids) + len(toks) >= self.pool.max_model_len:
            return True
        rd = r.repetition_detection
        return len(toks) >= r.min_tokens and rd is not None and ends_in_repetition(toks, rd)

    def step(self) -> None:
        """One engine iteration (vLLM's ``step_with_batch_queue``)."""
        depth = self.config.max_concurrent_batches
        if len(self.in_flight) < depth and self.target.has_unfinished_requests():
            out = self.target.schedule()
            self.in_flight.append(out)
            self.num_schedules += 1
            self.idle_schedules = 0 if out.scheduled else self.idle_schedules + 1
            if len(self.in_flight) < depth and self.target.has_unfinished_requests():
                return
        if self.in_flight:
            self._settle()

    def serve(self, workload: Workload, ticks: int) -> None:
        """Run ``ticks`` engine iterations with the workload's arrivals, then drain what is left."""
        rng = random.Random(self.seed)
        self.vocab = workload.output_vocab
        client = self.client()
        for self.tick in range(ticks):
            workload.script(rng, client, self.tick)
            self.step()
        for _ in range(20 * ticks):  # drain; a hung run (nothing scheduled for 50 calls) ends too
            if not self.in_flight and not self.target.has_unfinished_requests() or self.idle_schedules >= 50:
                break
            self.step()


# ---- scripts ----------------------------------------------------------------------------------------
def _tokens(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(1, VOCAB - 1) for _ in range(n)]


def _prefix_sharing(rng, c, tick) -> None:
    systems = [[(7 * s + i) % (VOCAB - 2) + 1 for i in range(40)] for s in range(3)]
    if rng.random() < 0.45:
        c.add(systems[rng.randrange(3)] + _tokens(rng, rng.randint(3, 30)), rng.randint(2, 12),
              stop=rng.random() < 0.2)


def _multi_turn(rng, c, tick) -> None:
    for rid, prompt, outputs in c.finished_outputs():
        turn = int(rid.rsplit("-t", 1)[1]) if "-t" in rid else 0
        if turn < 4 and rng.random() < 0.9:
            c.add(prompt + outputs + _tokens(rng, rng.randint(2, 10)), rng.randint(3, 10),
                  request_id=f"{rid.rsplit('-t', 1)[0]}-t{turn + 1}")
    if tick % 6 == 0:
        c.add(_tokens(rng, rng.randint(8, 24)), rng.randint(3, 10), request_id=f"conv{tick}-t0")


def _n_burst(rng, c, tick) -> None:
    if rng.random() < 0.2:
        prompt = _tokens(rng, rng.choice([16, 20, 24, 31]))
        for j in range(rng.choice([2, 4, 4, 6])):
            c.add(prompt, rng.randint(3, 12), request_id=f"burst{tick}_{j}")


def _aborts(rng, c, tick) -> None:
    if rng.random() < 0.45:
        c.add(_tokens(rng, rng.randint(5, 60)), rng.randint(4, 20))
    live = c.live()
    if live and rng.random() < 0.12:
        c.abort(rng.choice(live))


def _storm(rng, c, tick) -> None:
    if rng.random() < 0.5:
        c.add([1, 2, 3, 4] * 3 + _tokens(rng, rng.randint(10, 100)), rng.randint(4, 24))


def _long_prompts(rng, c, tick) -> None:
    if rng.random() < 0.35:
        c.add(_tokens(rng, rng.randint(20, 180)), rng.randint(2, 16))


def _priority(rng, c, tick) -> None:
    if rng.random() < 0.45:
        c.add(_tokens(rng, rng.randint(5, 70)), rng.randint(3, 16), priority=rng.choice([0, 1, 1, 2, 2, 2]))


#: the demo's LoRA adapters (id = position + 1)
_ADAPTERS = ("sql", "chat", "code")
#: the demo's images: identifier -> placeholder tokens (one size per identifier)
_IMAGES = {"cat": 6, "dog": 10, "chart": 16, "scan": 24}
IMAGE_TOKEN = 7


def _multimodal(rng, c, tick) -> None:
    """Chat turns with one or two images from a small set (shared, repeated), behind a system prompt."""
    if rng.random() < 0.45:
        system = [(5 * i) % (VOCAB - 2) + 1 for i in range(12)]
        prompt, items = list(system), []
        for ident in rng.sample(sorted(_IMAGES), rng.choice([1, 1, 2])):
            prompt += _tokens(rng, rng.randint(0, 6))
            items.append((ident, len(prompt), _IMAGES[ident]))
            prompt += [IMAGE_TOKEN] * _IMAGES[ident]
        c.add(prompt + _tokens(rng, rng.randint(2, 12)), rng.randint(2, 10), items=items)


def _lora(rng, c, tick) -> None:
    """Three adapters (and the base model) over shared system prompts: max_loras holds some back."""
    systems = [[(11 * s + i) % (VOCAB - 2) + 1 for i in range(24)] for s in range(2)]
    if rng.random() < 0.5:
        c.add(systems[rng.randrange(2)] + _tokens(rng, rng.randint(3, 24)), rng.randint(3, 14),
              adapter=rng.choice((None,) + _ADAPTERS))


#: the ``stop-conditions`` workload's EOS token, stop id and output vocabulary (tokens 1..4)
EOS_TOKEN = 3
_STOP_ID = 4
_STOP_VOCAB = 5


def _stop_conditions(rng, c, tick) -> None:
    """Requests with vLLM's stop inputs drawn together over a 4-token output vocabulary: the EOS id
    (or ``ignore_eos``), a stop id, ``min_tokens`` (which holds back only the repetition rule) and
    repetition detection (n-grams of 1 to 3 tokens repeated 3 or 4 times), behind shared prompts."""
    systems = [[(13 * s + i) % (VOCAB - 2) + 1 for i in range(20)] for s in range(2)]
    if rng.random() < 0.5:
        max_tokens = rng.randint(2, 20)
        c.add(systems[rng.randrange(2)] + _tokens(rng, rng.randint(2, 20)), max_tokens,
              eos=EOS_TOKEN if rng.random() < 0.4 else None,
              min_tokens=rng.choice([0, 2, rng.randint(0, max_tokens), rng.randint(0, max_tokens)]),
              repetition=rng.choice([None, (2, 0, 3), (3, 2, 3), (1, 1, 4)]))
    elif rng.random() < 0.4:  # a stop id inside the output vocabulary: vLLM's stop_token_ids
        c.add(_tokens(rng, rng.randint(4, 30)), rng.randint(2, 16), eos=EOS_TOKEN, min_tokens=rng.randint(0, 2),
              stop_ids=(_STOP_ID,))


WORKLOADS: dict[str, Workload] = {w.name: w for w in (
    Workload("prefix-sharing", "three system prompts shared by most requests, full + sliding-window pool",
             _swa(16), 4, 128, 32, 6, 2.0, _prefix_sharing),
    Workload("multi-turn", "conversations: each turn's prompt is the whole conversation so far",
             _full, 4, 128, 32, 6, 2.0, _multi_turn),
    Workload("n-burst", "parallel sampling (n > 1): n requests with one prompt arriving together",
             _full, 4, 96, 32, 8, 1.5, _n_burst),
    Workload("aborts", "clients abort waiting and running requests, full + sliding-window pool",
             _swa(12), 4, 96, 32, 6, 1.5, _aborts),
    Workload("preemption-storm", "long prompts arriving fast on the smallest full-attention pool",
             _full, 4, 128, 32, 6, 1.0, _storm),
    Workload("sliding-window", "long prompts on the smallest full + sliding-window pool startup accepts",
             _swa(16), 4, 192, 32, 6, 1.0, _long_prompts),
    Workload("chunked-local", "long prompts on the smallest full + chunked-local pool, long-prefill threshold",
             _chunked(16), 4, 192, 32, 6, 1.0, _long_prompts, long_prefill_token_threshold=12),
    Workload("priority", "priority policy, mixed priorities, preemption of the lowest priority",
             _full, 4, 96, 32, 6, 1.0, _priority, policy="priority"),
    Workload("spec-decode", "n-gram speculative decoding (3 drafts a step, acceptance drawn per step), shared "
             "prefixes, a tight full-attention pool", _full, 4, 128, 32, 6, 1.5, _prefix_sharing,
             num_speculative_tokens=3),
    Workload("spec-decode-eagle", "EAGLE-like speculative decoding (2 drafts a step written into lookahead slots, "
             "the trailing block of every prefix hit dropped), shared prefixes, a tight full + sliding-window "
             "pool", _swa(16), 4, 128, 32, 6, 1.5, _prefix_sharing, num_speculative_tokens=2,
             speculative_method="eagle"),
    Workload("spec-decode-mtp", "multi-module MTP speculative decoding (3 drafts, 3 MTP modules: no prefill chunk "
             "ends within 3 tokens of the prompt's end, the last 2 computed tokens are never published), long "
             "prompts cut by a long-prefill threshold on a full-attention pool", _full, 4, 160, 32, 6, 1.5,
             _long_prompts, long_prefill_token_threshold=8, num_speculative_tokens=3, speculative_method="eagle",
             num_prefill_lookahead=3),
    Workload("cadence", "a prefill cadence of 3 steps, an adaptive long-prefill threshold and at most 4 of 8 "
             "runner slots active: decodes run while prefill waits its turn, long prompts on a full + "
             "sliding-window pool", _swa(16), 4, 160, 32, 8, 1.5, _long_prompts, long_prefill_token_threshold=8,
             prefill_schedule_interval=3, long_prefill_token_threshold_adaptive=True, max_num_active_seqs=4),
    Workload("multimodal", "image chat: one or two of four images per request (shared, so the encoder cache "
             "hits and evicts), an encoder budget of 32 embeddings a step, a cache of 40, a tight full-attention "
             "pool", _full, 4, 128, 32, 6, 1.5, _multimodal,
             encoder_budget=EncoderBudget(encoder_compute_budget=32, encoder_cache_size=40)),
    Workload("lora", "three LoRA adapters and the base model over shared system prompts, max_loras 2 (adapters "
             "held back), prefix hits within an adapter only, full + sliding-window pool", _swa(16), 4, 128, 32, 6,
             1.5, _lora, max_loras=2),
    Workload("eagle-lookahead-hash", "EAGLE-like speculative decoding with lookahead block hashes (each block's "
             "hash covers the token after it, no trailing-block drop), shared prefixes, a tight full-attention "
             "pool", _full, 4, 128, 32, 6, 1.5, _prefix_sharing, num_speculative_tokens=2, speculative_method="eagle",
             hash_lookahead=True),
    Workload("stop-conditions", "vLLM's check_stop inputs together: an EOS id (or ignore_eos), stop ids, "
             "min_tokens and repetition detection over a 4-token output vocabulary (every rule fires), shared "
             "prompts on a full + sliding-window pool", _swa(16), 4, 128, 32, 6, 1.5, _stop_conditions,
             output_vocab=_STOP_VOCAB),
)}


def workload(name: str) -> Workload:
    """The workload called ``name`` (InvalidFieldError naming the known ones otherwise)."""
    w = WORKLOADS.get(name) if isinstance(name, str) else None
    if w is None:
        raise InvalidFieldError("--workload", name, "one of " + ", ".join(WORKLOADS))
    return w


__all__ = ["DemoClient", "DemoEngine", "WORKLOADS", "Workload", "plan_pool", "workload"]
