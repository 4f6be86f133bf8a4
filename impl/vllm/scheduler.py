"""Drive vLLM 0.33.0's own ``Scheduler`` (or ``AsyncScheduler``) through kvref's scheduler interface.

The conformance state machine feeds this adapter and the reference scheduler the same calls
(``add_request``, ``schedule``, ``update_from_output``, ``finish_requests``) and compares their
``SchedulerOutput`` and ``SchedulerSnapshot`` after each one. vLLM is imported lazily: importing
this module costs nothing; :func:`load_vllm` (about 6 s) and the first :class:`VllmEnv` (a
``VllmConfig`` on a local ``config.json``, a few seconds) are paid once per process.

Async scheduling on CPU: ``CpuPlatform`` forces ``scheduler_config.async_scheduling=False`` while
the ``VllmConfig`` is built. The adapter sets the flag back to True *after* construction (so
``VllmConfig.max_concurrent_batches`` is 2 and ``max_in_flight_tokens`` doubles, exactly what the
KVCacheManager's sliding-window cap then sees) and instantiates ``AsyncScheduler`` directly, which
is the class the engine core picks for async scheduling. The engine's batch queue (schedule step
N+1 before the output of step N is processed) is the driver's job: it may call ``schedule`` twice
before ``update_from_output``.
"""

from __future__ import annotations

from typing import Any

from kvref.impl.interface import BlockIds, PoolConfig
from kvref.impl.scheduler_types import (
    PRIORITY,
    check_scheduler_pool,
    DraftTokenIds,
    ModelOutput,
    RequestSpecDecodeMetrics,
    RequestState,
    ScheduledRequest,
    SchedulerConfig,
    SchedulerOutput,
    SchedulerSnapshot,
    SpecDecodingStats,
)
from kvref.impl.request import Request
from kvref.impl.vllm.allocation_watch import AllocationWatch
from kvref.impl.vllm.kv_cache_manager import VllmKVCacheManager
from kvref.impl.vllm.loader import load_vllm
from kvref.impl.vllm.scratch import tiny_llama_dir
from kvref.impl.vllm.specs import to_vllm_kv_cache_config, to_vllm_spec
from kvref.impl.vllm.vrequest import SCHEDULER_CARRY, vllm_request_from
from kvref.spec import kv_cache_interface as ks
from kvref.spec.errors import InvalidFieldError


_STATUS = {
    "WAITING": "waiting", "RUNNING": "running", "PREEMPTED": "preempted",
    "FINISHED_STOPPED": "finished", "FINISHED_LENGTH_CAPPED": "finished", "FINISHED_ABORTED": "finished",
    "FINISHED_ERROR": "finished",  # a KV load failed under kv_load_failure_policy="fail"
    "FINISHED_REPETITION": "finished",  # check_stop's repetition detection
    "WAITING_FOR_STREAMING_REQ": "waiting",  # a session waiting for input (kvref: WAITING + SessionState)
    # a structured-output request whose grammar is not ready (kvref: WAITING + snapshot.waiting_for_grammar)
    "WAITING_FOR_STRUCTURED_OUTPUT_GRAMMAR": "waiting",
}
_REASON = {"FINISHED_STOPPED": "stop", "FINISHED_LENGTH_CAPPED": "length", "FINISHED_ABORTED": "abort",
           "FINISHED_ERROR": "error", "FINISHED_REPETITION": "repetition"}


def tiny_moe_dir() -> str:
    """A fresh model directory holding only the ``config.json`` of a tiny Mixtral (the tiny Llama's
    shapes, 4 local experts, 2 per token): an MoE model, which vLLM's aux-output connector requires
    (``ModelConfig.is_moe``); no weights are read."""
    import json
    import os

    from .scratch import scratch_dir

    path = scratch_dir("tiny_moe_")
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump({"architectures": ["MixtralForCausalLM"], "model_type": "mixtral", "hidden_size": 64,
                   "intermediate_size": 128, "num_attention_heads": 4, "num_key_value_heads": 2,
                   "num_hidden_layers": 2, "vocab_size": 1000, "max_position_embeddings": 1 << 16,
                   "torch_dtype": "float16", "num_local_experts": 4, "num_experts_per_tok": 2}, f)
    return path


def _plain_aux_metadata(meta) -> dict:
    """vLLM's ``AuxOutputConnectorMetadata`` as plain values (the reference's form: packed hashes as
    tuples of hashes)."""
    def hashes(packed):
        return () if packed is None else tuple(packed)

    return {"generation": meta.generation, "requests": dict(meta.requests),
            "block_hashes": {r: hashes(p) for r, p in meta.block_hashes.items()},
            "finished_requests": tuple(meta.finished_requests),
            "retained_block_hashes": hashes(meta.retained_block_hashes),
            "released_block_hashes": hashes(meta.released_block_hashes)}


def _spec_metrics(m: Any) -> RequestSpecDecodeMetrics:
    """kvref's value of vLLM's ``RequestSpecDecodeMetrics``."""
    return RequestSpecDecodeMetrics(tuple(m.histogram), m.num_draft_tokens, tuple(m.per_step_accepted),
                                    tuple(m.per_step_drafted))


class VllmEnv:
    """One ``VllmConfig`` per process, re-targeted for each scheduler (building one costs seconds).

    Only one scheduler built from an env may be in use at a time: the config is mutated in place.

    ``aux_output``: ``--enable-return-routed-experts`` (vLLM's aux-output connector in the
    scheduler). vLLM accepts it only for an MoE model on the V2 model runner with prefix caching
    (``VllmConfig._verify_aux_output_compatibility``), so this env is built on a tiny Mixtral
    (4 experts, 2 per token) with ``VLLM_USE_V2_MODEL_RUNNER=1`` set while the config is checked:
    the legal setup, validated by vLLM itself. The scheduler's own V2 flag is set per scheduler
    (``VllmScheduler(use_v2_model_runner=...)``).
    """

    def __init__(self, aux_output: bool = False) -> None:
        if not isinstance(aux_output, bool):
            raise InvalidFieldError("aux_output", aux_output, "True or False")
        v = load_vllm()
        v["init_none_hash"](v["sha256"])
        self.aux_output = aux_output
        d = tiny_moe_dir() if aux_output else tiny_llama_dir(num_hidden_layers=2, max_position_embeddings=1 << 16)
        mc = v["ModelConfig"](model=d, tokenizer=d, skip_tokenizer_init=True, max_model_len=4096,
                              dtype="float16")
        extra: dict[str, Any] = {}
        if aux_output:
            from vllm.config import AuxOutputConfig

            extra["aux_output_config"] = AuxOutputConfig(enable_return_routed_experts=True)
        import os

        saved = os.environ.get("VLLM_USE_V2_MODEL_RUNNER")
        if aux_output:
            os.environ["VLLM_USE_V2_MODEL_RUNNER"] = "1"
        try:
            self.vllm_config = v["VllmConfig"](
                model_config=mc, cache_config=v["CacheConfig"](block_size=16, enable_prefix_caching=True),
                scheduler_config=v["VSchedulerConfig"](max_num_batched_tokens=4096, max_num_seqs=8,
                                                       max_model_len=4096, is_encoder_decoder=False,
                                                       enable_chunked_prefill=True), **extra)
        finally:
            if aux_output:
                if saved is None:
                    os.environ.pop("VLLM_USE_V2_MODEL_RUNNER", None)
                else:
                    os.environ["VLLM_USE_V2_MODEL_RUNNER"] = saved
        assert self.vllm_config.aux_output_config.enabled == aux_output

    def configure(self, pool: PoolConfig, config: SchedulerConfig) -> Any:
        vc = self.vllm_config
        sc = vc.scheduler_config
        vc.model_config.max_model_len = pool.max_model_len
        sc.max_model_len = pool.max_model_len
        sc.max_num_batched_tokens = config.max_num_batched_tokens
        sc.max_num_scheduled_tokens = config.max_num_scheduled_tokens  # None: the Scheduler takes the input budget
        sc.max_num_seqs = config.max_num_seqs
        sc.max_num_active_seqs = config.max_num_active_seqs
        sc.long_prefill_token_threshold = config.long_prefill_token_threshold
        sc.enable_chunked_prefill = config.enable_chunked_prefill
        sc.policy = config.policy
        sc.scheduler_reserve_full_isl = config.scheduler_reserve_full_isl
        sc.long_prefill_token_threshold_adaptive = config.long_prefill_token_threshold_adaptive
        sc.prefill_schedule_interval = config.prefill_schedule_interval  # local cadence: no DP here
        sc.watermark = pool.watermark
        sc.disable_chunked_mm_input = False  # VllmScheduler sets it for an encoder budget
        # CpuPlatform forced this to False at construction; set it after (see module docstring).
        sc.async_scheduling = config.async_scheduling
        vc.cache_config.enable_prefix_caching = pool.enable_caching
        vc.cache_config.num_gpu_blocks = pool.num_blocks
        modes = {g.kv_cache_spec.mamba_cache_mode for g in pool.groups if isinstance(g.kv_cache_spec, ks.MambaSpec)}
        vc.cache_config.mamba_cache_mode = modes.pop() if modes else "none"
        # "align": cache_config.block_size is the Mamba block, which the chunk split reads
        vc.cache_config.block_size = next((g.kv_cache_spec.block_size for g in pool.groups
                                           if isinstance(g.kv_cache_spec, ks.MambaSpec)
                                           and g.kv_cache_spec.mamba_cache_mode == "align"), 16)
        vc.speculative_config = self._speculative_config(pool, config)
        # per-request spec-decode metrics (RequestSpecDecodeMetrics), read by the Scheduler's __init__
        vc.observability_config.per_request_spec_decode_metrics = config.spec_decode_metrics_level
        assert vc.max_in_flight_tokens == config.max_in_flight_tokens
        assert vc.num_lookahead_tokens == config.num_lookahead_tokens
        assert pool.num_prefill_lookahead <= 1 or vc.num_prefill_lookahead_tokens == pool.num_prefill_lookahead
        return vc

    def _speculative_config(self, pool: PoolConfig, config: SchedulerConfig) -> Any:
        """vLLM's ``SpeculativeConfig`` for ``config`` (None when speculative decoding is off).

        Built as vLLM's own scheduler tests build it (``tests/v1/core/utils.py``): an n-gram config,
        which needs no draft model. For an EAGLE-like drafter the method is then switched to
        ``"eagle"`` in place, as vLLM's tests do for drafters whose model cannot be resolved: the
        scheduler only reads ``use_eagle()``, ``use_eagle_block_drop()`` and the lookahead counts,
        which follow from the method. ``disable_lookahead_block_hashes`` follows
        ``pool.num_hash_lookahead_tokens`` (0: EAGLE drops the trailing hit block instead).
        """
        k = config.num_speculative_tokens
        if not k:
            return None
        key = (k, config.speculative_method, pool.num_hash_lookahead_tokens, pool.num_prefill_lookahead)
        cache = self.__dict__.setdefault("_spec_configs", {})
        if key not in cache:
            from vllm.config import SpeculativeConfig

            sc = SpeculativeConfig(method="ngram", num_speculative_tokens=k, prompt_lookup_max=k,
                                   prompt_lookup_min=1)
            if config.speculative_method != "ngram":
                object.__setattr__(sc, "method", config.speculative_method)
                object.__setattr__(sc, "disable_lookahead_block_hashes", not pool.num_hash_lookahead_tokens)
            if pool.num_prefill_lookahead > 1:
                # multi-module MTP (#28): method "mtp" with num_nextn_predict_layers modules, which
                # makes VllmConfig.num_prefill_lookahead_tokens = k (the scheduler's
                # _reserve_prefill_lookahead and the manager's re-prefillable tail read it)
                from types import SimpleNamespace

                object.__setattr__(sc, "method", "mtp")
                object.__setattr__(sc, "draft_model_config", SimpleNamespace(
                    hf_config=SimpleNamespace(num_nextn_predict_layers=pool.num_prefill_lookahead)))
            cache[key] = sc
        return cache[key]


class _CapturingPublisher:
    """Stands in for vLLM's ``EventPublisher`` (``publish(batch)``, ``shutdown()``): keeps each
    batch's events, decoded to plain dicts (:mod:`kvref.impl.vllm.kv_events`)."""

    def __init__(self) -> None:
        self.batches: list[list[dict]] = []

    def publish(self, batch) -> None:
        from .kv_events import vllm_event_to_plain

        self.batches.append([vllm_event_to_plain(e) for e in batch.events])

    def shutdown(self) -> None:
        pass

    def take(self) -> list[list[dict]]:
        out, self.batches = self.batches, []
        return out


class VllmScheduler:
    """vLLM's scheduler behind kvref's scheduler interface (see :mod:`kvref.impl.reference.scheduler`).

    Args:
        pool: the KV cache plan (``max_in_flight_tokens`` must be ``config.max_in_flight_tokens``:
            vLLM's scheduler derives it from its config).
        config: scheduler settings.
        env: a :class:`VllmEnv` (shared per process; built when None).
        scheduler_cls: a ``--scheduler-cls`` string (e.g. ``kvref.record.RecordingScheduler``),
            resolved by vLLM's ``SchedulerConfig.get_scheduler_cls()`` as the engine core does;
            None: vLLM's ``Scheduler`` / ``AsyncScheduler`` by ``config.async_scheduling``.
        diffusion: vLLM's ``DiffusionScheduler`` / ``DiffusionAsyncScheduler`` instead (diffusion
            LMs: drafts and in-flight placeholders cut to a request's canvas width, by default
            the served ``num_speculative_tokens``); for requests without the diffusion
            ``extra_args`` they must behave as the plain schedulers (docs/differences.md).
        grammar_oracle: a :class:`~kvref.impl.reference.scheduler_structured_output.GrammarOracle`:
            the scheduler's ``structured_output_manager`` and its structured-output requests'
            grammars answer from it (:mod:`.structured_output`); None: vLLM's own manager, and a
            request with ``use_structured_output`` is refused (nothing would compile its grammar).
    """

    def __init__(self, pool: PoolConfig, config: SchedulerConfig, env: VllmEnv | None = None,
                 scheduler_cls: str | None = None, connector=None, diffusion: bool = False,
                 encoder_budget=None, max_loras: int | None = None, use_v2_model_runner: bool = False,
                 include_finished_set: bool = False, kv_cache_metrics_sample: float | None = None,
                 grammar_oracle=None) -> None:
        check_scheduler_pool(pool, config)  # the pool <-> scheduler rules, shared with the reference
        v = self._v = load_vllm()
        self.env = env or VllmEnv()
        vc = self.env.configure(pool, config)
        kv_cfg = to_vllm_kv_cache_config(pool)
        if not isinstance(diffusion, bool) or (diffusion and scheduler_cls is not None):
            raise InvalidFieldError("diffusion", diffusion, "True or False (True only without scheduler_cls)")
        if diffusion:  # the diffusion-LM schedulers: canvas widths on top of speculative decoding
            from vllm.v1.core.sched import diffusion_scheduler as ds

            cls = ds.DiffusionAsyncScheduler if config.async_scheduling else ds.DiffusionScheduler
            extra: dict[str, Any] = {}
        elif scheduler_cls is None:
            cls = v["AsyncScheduler"] if config.async_scheduling else v["Scheduler"]
            extra = {}
        else:  # a class string resolved as vLLM's engine core resolves --scheduler-cls
            vc.scheduler_config.scheduler_cls = scheduler_cls
            try:
                cls = vc.scheduler_config.get_scheduler_cls()
            finally:
                vc.scheduler_config.scheduler_cls = None  # the env is shared
            extra = dict(include_finished_set=False, log_stats=False)  # the engine core's arguments
        if scheduler_cls is None and (config.num_speculative_tokens or pool.log_stats):
            extra["log_stats"] = True  # SpecDecodingStats and prefix-cache stats are only made with stats on
        if include_finished_set:  # the engine core's choice with several data-parallel engines
            extra["include_finished_set"] = True
        #: ``EngineCoreOutputs.finished_requests`` of the last ``update_from_output`` (one client)
        self.finished_requests = None
        #: the connector's prefix-cache stats in the last ``update_from_output``'s ``SchedulerStats``
        self.output_connector_prefix_cache_stats: dict | None = None
        shared = vc
        saved_events_config = vc.kv_events_config
        saved_transfer_config = vc.kv_transfer_config
        if connector is not None:  # kvref's scripted connector, built by vLLM's factory by name
            import copy

            from .connector import kv_transfer_config

            # the scheduler keeps its own (shallow) copy of the config: it reads kv_transfer_config
            # again at runtime (a producer's finish-time partial tails in _connector_finished),
            # while the shared env's config gets its own back below
            vc = copy.copy(vc)
            vc.kv_transfer_config = kv_transfer_config(connector)
            if connector.config.hisparse_host_pool:  # a HiSparse host pool: vLLM defers async loads too
                kv_cfg.hisparse_host_num_blocks = pool.num_blocks
            if not all(c.config.supports_hma for c in getattr(connector, "children", [connector])):
                # vLLM's factory refuses a connector without SupportsHMA unless the engine runs with
                # --disable-hybrid-kv-cache-manager (the pool has one group: nothing else changes)
                vc.scheduler_config = copy.copy(vc.scheduler_config)
                vc.scheduler_config.disable_hybrid_kv_cache_manager = True
        if pool.enable_kv_cache_events:  # vLLM's own switch; the publisher is replaced below
            from vllm.config.kv_events import KVEventsConfig

            vc.kv_events_config = KVEventsConfig(enable_kv_cache_events=True, publisher="null")
        # Where the hash block size is the scheduler's block size, it is left to vLLM's default
        # (``Scheduler.__init__``'s ``hash_block_size=None`` means ``block_size``: what a caller
        # that does not pass it gets), so the traces check that default against the request
        # hasher's size; unequal sizes are passed, as the engine core passes the size its
        # ``resolve_kv_cache_block_sizes`` chose.
        hash_block_size = None if pool.hash_block_size == pool.scheduler_block_size else pool.hash_block_size
        # --kv-cache-metrics: the Scheduler builds its own KVCacheMetricsCollector at this sample
        # rate and hands it to its KVCacheManager (read in __init__ only; the env's config is shared)
        obs = vc.observability_config
        saved_metrics = (obs.kv_cache_metrics, obs.kv_cache_metrics_sample)
        if kv_cache_metrics_sample is not None:
            if isinstance(kv_cache_metrics_sample, bool) or not isinstance(kv_cache_metrics_sample, (int, float)) \
                    or not 0 < kv_cache_metrics_sample <= 1:
                raise InvalidFieldError("kv_cache_metrics_sample", kv_cache_metrics_sample, "None or a number in (0, 1]")
            obs.kv_cache_metrics, obs.kv_cache_metrics_sample = True, float(kv_cache_metrics_sample)
        if grammar_oracle is not None and connector is not None:
            raise InvalidFieldError("grammar_oracle", grammar_oracle, "None with a KV connector")
        self.grammar_oracle = grammar_oracle
        if grammar_oracle is not None:
            from .structured_output import ScriptedStructuredOutputManager

            so_manager = ScriptedStructuredOutputManager(grammar_oracle)
        else:
            so_manager = v["StructuredOutputManager"](vc)
        try:
            self.scheduler = cls(vllm_config=vc, kv_cache_config=kv_cfg,
                                 structured_output_manager=so_manager,
                                 block_size=pool.scheduler_block_size, hash_block_size=hash_block_size,
                                 **extra)
        finally:
            shared.kv_events_config = saved_events_config  # the env is shared
            shared.kv_transfer_config = saved_transfer_config
            obs.kv_cache_metrics, obs.kv_cache_metrics_sample = saved_metrics
        self.connector = connector
        self._encoder_output: dict = {"scheduled_encoder_inputs": {}, "free_encoder_mm_hashes": (),
                                      "encoder_input_updates": {}}
        if encoder_budget is not None:
            self._set_encoder_budget(encoder_budget)
        if max_loras is not None:
            self._set_max_loras(max_loras)
        if not isinstance(use_v2_model_runner, bool):
            raise InvalidFieldError("use_v2_model_runner", use_v2_model_runner, "True or False")
        # the CPU config picks the V1 runner (no Triton); GPU deployments run V2, whose scheduler
        # output differs (resumed requests sent as new, encoder-input updates): set as V2 sets it
        self.scheduler.use_v2_model_runner = use_v2_model_runner
        # V2: items carry data the workers install (a placeholder: only its presence is read)
        self._mm_data = {"kvref": True} if use_v2_model_runner else None
        if config.num_speculative_tokens:
            # GPU deployments run the V2 model runner, which lets a drafter with lookahead slots
            # skip useless drafts; the CPU config picks the V1 runner (no Triton), so the flag is
            # set as the V2 runner sets it (see SchedulerConfig.skip_unused_drafts)
            self.scheduler.can_skip_drafts = config.can_skip_drafts
        self._spec_decoding_stats = None
        self._finished_spec_metrics: dict[str, RequestSpecDecodeMetrics] = {}
        self._allocation_watch = AllocationWatch(self.scheduler.kv_cache_manager)
        self._published = _CapturingPublisher()
        if pool.enable_kv_cache_events:
            self.scheduler.kv_event_publisher = self._published
        # EAGLE with lookahead hashes: a block's hash covers the token after it (the engine's hasher)
        self._hasher = v["get_request_block_hasher"](pool.hash_block_size, v["sha256"], pool.num_hash_lookahead_tokens)
        self.pool = pool
        self.config = config
        self._reqs: dict[str, Any] = {}  # every request ever added (finished ones too)
        self._outputs: dict[int, Any] = {}  # id(SchedulerOutput) -> vLLM SchedulerOutput
        self.last_aux_metadata: dict | None = None  # the aux-output connector's last step metadata

    def _set_encoder_budget(self, budget) -> None:
        """A multimodal model's encoder limits on the text model's scheduler (the tiny Llama has
        no ``MultiModalBudget``): vLLM's own ``EncoderCacheManager`` of ``encoder_cache_size``
        embeddings, ``max_num_encoder_input_tokens`` and ``disable_chunked_mm_input``, what
        ``Scheduler.__init__`` derives from a multimodal model's budget."""
        from vllm.v1.core.encoder_cache_manager import EncoderCacheManager

        from kvref.impl.reference.scheduler_encoder import EncoderBudget

        if not isinstance(budget, EncoderBudget):
            raise InvalidFieldError("encoder_budget", budget, "an EncoderBudget")
        if self.connector is not None:
            raise InvalidFieldError("encoder_budget", budget, "None with a KV connector")
        self.scheduler.max_num_encoder_input_tokens = budget.encoder_compute_budget
        self.scheduler.encoder_cache_manager = EncoderCacheManager(cache_size=budget.encoder_cache_size)
        self.scheduler.scheduler_config.disable_chunked_mm_input = budget.disable_chunked_mm_input

    def _set_max_loras(self, max_loras: int) -> None:
        """LoRA on: vLLM's ``LoRAConfig(max_loras=...)`` as the scheduler's ``lora_config`` (the
        scheduler reads only ``max_loras``; the tiny Llama has no LoRA layers to build)."""
        from vllm.config import LoRAConfig

        from kvref.impl.reference.scheduler_lora import check_max_loras

        check_max_loras(max_loras)
        if self.connector is not None:
            raise InvalidFieldError("max_loras", max_loras, "None with a KV connector")
        self.scheduler.lora_config = LoRAConfig(max_loras=max_loras)

    def encoder_view(self) -> dict:
        """vLLM's encoder cache and the last step's encoder inputs, in the reference's form
        (:meth:`kvref.impl.reference.scheduler.Scheduler.encoder_view`)."""
        m = self.scheduler.encoder_cache_manager
        cache = {"num_free_slots": m.num_free_slots, "num_freeable_slots": m.num_freeable_slots,
                 "cached": {h: frozenset(r) for h, r in m.cached.items()},
                 "freeable": tuple(m.freeable.items()),
                 "request_cached_ids": {r: frozenset(i) for r, i in m.request_cached_ids.items()}}
        return {"cache": cache, **self._encoder_output}

    # ---- calls -------------------------------------------------------------------------------
    def add_request(self, request: Request) -> None:
        """vLLM's ``Scheduler.add_request`` with the request as the engine's input processor builds
        it (:func:`.vrequest.vllm_request_from` with :data:`.vrequest.SCHEDULER_CARRY`: the stop
        rules, EOS by ``update_from_generation_config``); block hashes only with prefix caching."""
        if request.use_structured_output and self.grammar_oracle is None:
            raise InvalidFieldError("request.use_structured_output", True,
                                    "False unless the scheduler has a grammar_oracle")
        vr = vllm_request_from(request, carry=SCHEDULER_CARRY, mm_data=self._mm_data,
                               block_hasher=self._hasher if self.pool.enable_caching else None)
        if request.use_structured_output:  # the grammar answers from the oracle
            from .structured_output import scripted_structured_output_request

            scripted_structured_output_request(vr, self.grammar_oracle)
        if request.request_id not in self.scheduler.requests:  # an update keeps the session's own request
            self._reqs[request.request_id] = vr
        self.scheduler.add_request(vr)

    def schedule(self) -> SchedulerOutput:
        so = self.scheduler.schedule()
        sched = []
        new_ids = {nr.req_id: nr for nr in so.scheduled_new_reqs}
        cached = so.scheduled_cached_reqs
        cached_blocks = dict(zip(cached.req_ids, cached.new_block_ids))
        spec_tokens = so.scheduled_spec_decode_tokens
        for rid, n in so.num_scheduled_tokens.items():
            vr = self._reqs[rid]
            if rid in new_ids:
                kind, blocks = "new", new_ids[rid].block_ids
            else:
                kind = "resumed" if rid in cached.resumed_req_ids else "running"
                blocks = cached_blocks[rid]
            sched.append(ScheduledRequest(
                request_id=rid, kind=kind, num_scheduled_tokens=n,
                num_computed_tokens=vr.num_computed_tokens - n,
                block_ids=_ids(blocks, len(self.pool.groups)), is_prefill_chunk=vr.is_prefill_chunk,
                spec_token_ids=tuple(int(t) for t in spec_tokens.get(rid, ()))))
        self._encoder_output = {
            "scheduled_encoder_inputs": {r: tuple(i) for r, i in so.scheduled_encoder_inputs.items()},
            "free_encoder_mm_hashes": tuple(so.free_encoder_mm_hashes),
            "encoder_input_updates": {r: {i: "release" if d is None else "install" for i, d in u.items()}
                                      for r, u in (so.encoder_input_updates or {}).items()}}
        meta = getattr(so, "aux_output_connector_metadata", None)
        if meta is not None:
            self.last_aux_metadata = _plain_aux_metadata(meta)
        out = SchedulerOutput(scheduled=tuple(sched), preempted_req_ids=frozenset(so.preempted_req_ids),
                              finished_req_ids=frozenset(so.finished_req_ids), skip_drafts=bool(so.skip_drafts))
        self._outputs[id(out)] = (out, so)
        return out

    def update_from_output(self, output: SchedulerOutput, model_output: ModelOutput,
                           kv_connector_output=None) -> None:
        entry = self._outputs.pop(id(output), None)
        if entry is None:
            raise InvalidFieldError("output", output, "a SchedulerOutput this scheduler returned, not yet updated")
        so = entry[1]
        rids = list(so.num_scheduled_tokens)
        mro = self._v["ModelRunnerOutput"](
            req_ids=rids, req_id_to_index={r: i for i, r in enumerate(rids)},
            sampled_token_ids=[list(model_output.sampled_token_ids.get(r, [])) for r in rids])
        if self.connector is not None:  # the worker's connector report, as the model runner hands it
            from .connector import to_vllm_output

            mro.kv_connector_output = to_vllm_output(kv_connector_output)
        if self.scheduler.aux_output_connector is not None:
            mro.aux_output_connector_output = self._aux_rows(rids)
        outputs = self.scheduler.update_from_output(so, mro)
        # the per-request spec-decode metrics vLLM reports with each finishing output
        self._finished_spec_metrics = {o.request_id: _spec_metrics(o.spec_decode_metrics)
                                       for eco in (outputs or {}).values() for o in getattr(eco, "outputs", ())
                                       if getattr(o, "spec_decode_metrics", None) is not None}
        eco = (outputs or {}).get(0)
        finished = getattr(eco, "finished_requests", None) if eco is not None else None
        self.finished_requests = frozenset(finished) if finished else None
        stats = next((eco.scheduler_stats for eco in (outputs or {}).values()
                      if getattr(eco, "scheduler_stats", None) is not None), None)
        conn = getattr(stats, "connector_prefix_cache_stats", None)
        if conn is not None:  # what a KV connector's loads added in this step (the reference's output view)
            from kvref.impl.reference.scheduler_connector_stats import CONNECTOR_PREFIX_CACHE_STATS_FIELDS

            self.output_connector_prefix_cache_stats = {f: getattr(conn, f) for f in CONNECTOR_PREFIX_CACHE_STATS_FIELDS}
        sd = getattr(stats, "spec_decoding_stats", None)
        self._spec_decoding_stats = None if sd is None else SpecDecodingStats(
            sd.num_spec_tokens, sd.num_drafts, sd.num_draft_tokens, sd.num_accepted_tokens,
            tuple(sd.num_accepted_tokens_per_pos), tuple(sd.num_draft_tokens_per_pos))

    def _aux_rows(self, rids) -> dict:
        """The worker's routed-experts rows for a step (``aux_output_connector_output``): for each
        scheduled request, rows from position 0 past every token the update can accept (its tokens,
        one sampled and the drafts: ``take_output`` keeps the first ``num_tokens - 1``). The rows'
        content is never read by the scheduler."""
        import numpy as np

        from vllm.distributed.aux_output_connector.connector import AuxRequestOutput

        extra = 1 + self.config.num_speculative_tokens
        return {r: AuxRequestOutput(0, np.zeros((self._reqs[r].num_tokens + extra, 1), dtype=np.int16))
                for r in rids}

    def aux_output_view(self) -> dict | None:
        """vLLM's aux-output connector as the reference's
        :meth:`~kvref.impl.reference.scheduler_aux_output.AuxOutputControl.view` shows it: the
        retained blocks in LRU order (``_kv_cached``), the held loads, the generation and the last
        step's metadata; None without the connector."""
        aux = self.scheduler.aux_output_connector
        if aux is None:
            return None
        return {"retained": tuple(aux._kv_cached), "loading": {r: frozenset(b) for r, b in aux._loading.items()},
                "generation": aux._generation, "metadata": self.last_aux_metadata}

    def update_draft_token_ids(self, draft_token_ids: DraftTokenIds) -> None:
        """vLLM's ``Scheduler.update_draft_token_ids`` (what the engine core calls after a
        synchronous step with the drafts the runner proposed)."""
        self.scheduler.update_draft_token_ids(self._v["VDraftTokenIds"](
            list(draft_token_ids.req_ids), [list(d) for d in draft_token_ids.draft_token_ids]))

    def update_draft_token_ids_in_output(self, draft_token_ids: DraftTokenIds, output: SchedulerOutput) -> None:
        """vLLM's ``Scheduler.update_draft_token_ids_in_output`` on the step ``output`` (in flight)."""
        entry = self._outputs.get(id(output))
        if entry is None:
            raise InvalidFieldError("output", output, "a SchedulerOutput this scheduler returned, not yet updated")
        self.scheduler.update_draft_token_ids_in_output(self._v["VDraftTokenIds"](
            list(draft_token_ids.req_ids), [list(d) for d in draft_token_ids.draft_token_ids]), entry[1])

    @property
    def spec_decoding_stats(self) -> SpecDecodingStats | None:
        """The ``SpecDecodingStats`` vLLM's last ``update_from_output`` reported (its ``SchedulerStats``)."""
        return self._spec_decoding_stats

    @property
    def request_spec_decode_metrics(self) -> dict[str, RequestSpecDecodeMetrics]:
        """vLLM's per-request ``RequestSpecDecodeMetrics``: the live requests' and those the last
        ``update_from_output`` reported with finishing outputs."""
        live = {rid: _spec_metrics(r.spec_decode_metrics) for rid, r in self.scheduler.requests.items()
                if r.spec_decode_metrics is not None}
        return {**live, **self._finished_spec_metrics}

    def finish_requests(self, request_ids) -> None:
        self.scheduler.finish_requests(request_ids, self._v["VStatus"].FINISHED_ABORTED)

    def reset_prefix_cache(self, reset_running_requests: bool = False, reset_connector: bool = False) -> bool:
        """vLLM's ``Scheduler.reset_prefix_cache`` (what the engine's ``/reset_prefix_cache`` calls)."""
        return self.scheduler.reset_prefix_cache(reset_running_requests=reset_running_requests,
                                                 reset_connector=reset_connector)

    def set_pause_state(self, pause_state) -> None:
        """vLLM ``Scheduler.set_pause_state`` (a kvref ``PauseState`` or its int value)."""
        from vllm.v1.core.sched.interface import PauseState as VPauseState

        from kvref.impl.reference.scheduler_pause import as_pause_state

        self.scheduler.set_pause_state(VPauseState(int(as_pause_state(pause_state))))

    def get_request_counts(self) -> tuple[int, int]:
        return tuple(self.scheduler.get_request_counts())

    def get_num_unfinished_requests(self) -> int:
        return self.scheduler.get_num_unfinished_requests()

    def has_finished_requests(self) -> bool:
        return self.scheduler.has_finished_requests()

    def get_kv_cache_usage(self) -> float:
        return self.scheduler.get_kv_cache_usage()

    def has_request(self, request_id: str) -> bool:
        return self.scheduler.has_request(request_id)

    def has_requests(self) -> bool:
        return self.scheduler.has_requests()

    @property
    def pause_state(self):
        """vLLM ``Scheduler.pause_state`` as kvref's ``PauseState``."""
        from kvref.impl.reference.scheduler_pause import as_pause_state

        return as_pause_state(int(self.scheduler.pause_state))

    @property
    def kv_metrics_collector(self):
        """vLLM's own ``KVCacheMetricsCollector`` of this scheduler (None without
        ``kv_cache_metrics_sample``)."""
        return self.scheduler.kv_metrics_collector

    def make_stats(self) -> dict | None:
        """The KV-cache part of vLLM's ``Scheduler.make_stats()`` (None without ``log_stats``), in
        the reference's form (:meth:`kvref.impl.reference.scheduler.Scheduler.make_stats`)."""
        from kvref.impl.reference.scheduler import PREFIX_CACHE_STATS_FIELDS

        from kvref.impl.reference.scheduler_connector_stats import CONNECTOR_PREFIX_CACHE_STATS_FIELDS

        stats = self.scheduler.make_stats()
        if stats is None:
            return None
        conn = stats.connector_prefix_cache_stats
        return {"num_running_reqs": stats.num_running_reqs, "num_waiting_reqs": stats.num_waiting_reqs,
                "kv_cache_usage": stats.kv_cache_usage,
                "prefix_cache_stats": {f: getattr(stats.prefix_cache_stats, f) for f in PREFIX_CACHE_STATS_FIELDS},
                "num_skipped_waiting_reqs": stats.num_skipped_waiting_reqs,
                "num_kv_fetch_reqs_by_stage": dict(stats.num_kv_fetch_reqs_by_stage),
                "connector_prefix_cache_stats": None if conn is None else {
                    f: getattr(conn, f) for f in CONNECTOR_PREFIX_CACHE_STATS_FIELDS}}

    def shutdown(self) -> None:
        """vLLM ``Scheduler.shutdown`` (the engine core's exit: the KV-event publisher and the
        connector shut down)."""
        self.scheduler.shutdown()

    def take_published_kv_events(self) -> list[list[dict]]:
        """The ``KVEventBatch`` es vLLM's scheduler published since the last call (its
        ``update_from_output`` publishes one per step with events), each as plain event dicts."""
        return self._published.take()

    # ---- observation ----------------------------------------------------------------------------
    def snapshot(self) -> SchedulerSnapshot:
        s = self.scheduler
        kv = s.kv_cache_manager
        states = {rid: _state(vr, live=rid in s.requests) for rid, vr in self._reqs.items()}
        blocks = {}
        for rid in self._reqs:
            if rid in s.requests and any(rid in m.req_to_blocks for m in kv.coordinator.single_type_managers):
                ids = _ids(kv.get_block_ids(rid), len(self.pool.groups))
                if any(ids):
                    blocks[rid] = ids
        return SchedulerSnapshot(waiting=tuple(r.request_id for r in s.waiting),
                                 running=tuple(r.request_id for r in s.running),
                                 requests=states, block_ids=blocks,
                                 num_free_blocks=kv.block_pool.get_num_free_blocks(),
                                 free_block_queue=_free_queue(kv),
                                 kv_holding_waiting=tuple(r.request_id for r in s.kv_holding_waiting),
                                 waiting_for_grammar=tuple(sorted(
                                     rid for rid, r in s.requests.items()
                                     if r.status.name == "WAITING_FOR_STRUCTURED_OUTPUT_GRAMMAR")))

    def has_unfinished_requests(self) -> bool:
        return bool(self.scheduler.get_num_unfinished_requests())

    def check_invariants(self) -> None:
        """kvref's scheduler and pool invariants on vLLM's own ``Scheduler`` state after every call
        (:func:`kvref.impl.vllm.invariants.check_scheduler`): queues, statuses, preempted requests
        without KV, running requests' tables, ref counts, free-queue links, the hash map."""
        from kvref.impl.vllm.invariants import check_scheduler

        s = self.scheduler
        assert self.connector is not None or all(r.resumable for r in s.kv_holding_waiting), \
            "KV-holding waiting requests come only from a KV connector or streaming sessions"
        check_scheduler(s, max_num_seqs=self.config.max_num_seqs)
        self._allocation_watch.check()


def _free_queue(kv) -> tuple[int, ...]:
    return tuple(b.block_id for b in kv.block_pool.free_block_queue.get_all_free_blocks())


def _ids(blocks, num_groups: int) -> BlockIds:
    if blocks is None:
        return tuple(() for _ in range(num_groups))
    return tuple(tuple(int(b) for b in g) for g in blocks)


def _state(vr, live: bool = True) -> RequestState:
    name = vr.status.name
    return RequestState(request_id=vr.request_id, status=_STATUS.get(name, name.lower()),
                        num_computed_tokens=vr.num_computed_tokens,
                        num_in_flight_tokens=vr.num_in_flight_tokens,
                        num_output_placeholders=vr.num_output_placeholders,
                        num_stale_output_tokens=vr.num_stale_output_tokens,
                        output_token_ids=tuple(vr.output_token_ids),
                        num_preemptions=vr.num_preemptions, finish_reason=_REASON.get(name),
                        spec_token_ids=tuple(int(t) for t in vr.spec_token_ids) if live and not vr.is_finished() else ())


__all__ = ["VllmEnv", "VllmScheduler", "load_vllm", "to_vllm_spec", "PRIORITY"]


class VllmKVCacheManagerShim:
    """vLLM's own ``KVCacheManager`` as a :class:`~kvref.impl.interface.KVCacheManagerLike` on kvref
    requests, so the reference *scheduler* can run on vLLM's block management.

    Comparing "reference scheduler on this shim" with vLLM's ``Scheduler`` isolates scheduling
    rules from block-management differences. Each kvref request has a vLLM twin, synced before
    every call by the KV cache manager adapter's one request mirror
    (:meth:`~kvref.impl.vllm.kv_cache_manager.VllmKVCacheManager.vllm_request`, #26: this class kept
    a copy of it); the shim keeps its own narrower surface (the reference scheduler probes its
    manager's methods) and hands a hit's ``KVCacheBlocks`` back to ``allocate_slots`` as vLLM gave them.
    """

    def __init__(self, pool: PoolConfig, env: VllmEnv | None = None) -> None:
        self._kv = VllmKVCacheManager(pool)
        self.mgr = self._kv.vllm_manager
        self._twin = self._kv.vllm_request
        self.pool = pool
        self.num_groups = len(pool.groups)
        self._hits: dict[str, Any] = {}

    def get_computed_blocks(self, request: Request):
        blocks, n, _ = self.mgr.get_computed_blocks(self._twin(request))
        self._hits[request.request_id] = blocks
        return _ids(blocks.get_block_ids(), self.num_groups), n

    def allocate_slots(self, request: Request, num_new_tokens: int, num_new_computed_tokens: int = 0,
                       new_computed_block_ids=None, num_lookahead_tokens: int = 0,
                       num_external_computed_tokens: int = 0, delay_cache_blocks: bool = False,
                       full_sequence_must_fit: bool = False, reserved_blocks: int = 0,
                       has_scheduled_reqs: bool = True):
        hits = None
        if new_computed_block_ids is not None:
            hits = self._hits.pop(request.request_id)
            assert _ids(hits.get_block_ids(), self.num_groups) == tuple(tuple(g) for g in new_computed_block_ids)
        out = self.mgr.allocate_slots(self._twin(request), num_new_tokens, num_new_computed_tokens, hits,
                                      num_lookahead_tokens, num_external_computed_tokens, delay_cache_blocks,
                                      full_sequence_must_fit=full_sequence_must_fit,
                                      reserved_blocks=reserved_blocks, has_scheduled_reqs=has_scheduled_reqs)
        return None if out is None else _ids(out.get_block_ids(), self.num_groups)

    def cache_blocks(self, request: Request, num_computed_tokens: int) -> None:
        self.mgr.cache_blocks(self._twin(request), num_computed_tokens)

    def new_step_starts(self) -> None:
        self.mgr.new_step_starts()

    def free(self, request: Request) -> None:
        self.mgr.free(self._twin(request))

    def get_block_ids(self, request_id: str) -> BlockIds:
        if not any(request_id in m.req_to_blocks for m in self.mgr.coordinator.single_type_managers):
            return tuple(() for _ in range(self.num_groups))
        return _ids(self.mgr.get_block_ids(request_id), self.num_groups)

    def take_kv_events(self) -> list[dict]:
        """vLLM's ``KVCacheManager.take_events()`` as plain dicts: what the reference scheduler
        publishes after each ``update_from_output`` when it runs on this shim."""
        from .kv_events import vllm_event_to_plain

        return [vllm_event_to_plain(e) for e in self.mgr.take_events()]

    def get_num_free_blocks(self) -> int:
        return self.mgr.block_pool.get_num_free_blocks()

    def free_block_queue(self) -> tuple[int, ...]:
        return _free_queue(self.mgr)

    def check_invariants(self) -> None:
        # the pool, managers and allocation order only: the requests' tables are the scheduler's to check
        self._kv.check_invariants(held_tables=False)
