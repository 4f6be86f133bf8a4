"""The parts of vLLM's API kvref binds to, listed once, and checked before a check drives vLLM.

A vLLM developer's checkout may have renamed a class, moved a module or changed a signature. Found
mid-run, that is a ``TypeError`` deep inside an adapter, indistinguishable from a behaviour change.
Found up front, it is one clear line: which symbol, what kvref expected (vLLM 0.33.0's shape), and
which checks cannot run because of it — while every check that does not need the symbol still runs.

Each :class:`Binding` names a module, an attribute path inside it and, for callables, the
parameter names kvref passes by keyword (or reads). :data:`AREAS` groups them by the adapter that
uses them; :data:`CHECK_AREAS` says which areas each vLLM-facing check of ``kvref verify`` drives.
The table is kept true by ``tests/impl/vllm/test_api.py``, which resolves every binding against the
installed vLLM and asserts that each adapter module only imports symbols the table lists.
"""

from __future__ import annotations

import importlib
import inspect
from dataclasses import dataclass


@dataclass(frozen=True)
class Binding:
    """``module:attr.path`` with the keyword parameters kvref passes (``params``) or fields it reads."""

    module: str
    attr: str
    params: tuple[str, ...] = ()

    @property
    def symbol(self) -> str:
        return f"{self.module}.{self.attr}"

    def problem(self) -> str | None:
        """None when the binding resolves on the installed vLLM, else what is wrong, in one line."""
        try:
            obj = importlib.import_module(self.module)
        except Exception as exc:  # a moved module, or one that fails to import
            return f"{self.module}: cannot import ({type(exc).__name__}: {exc}); kvref expected vLLM 0.33.0's module"
        for i, part in enumerate(self.attr.split(".")):
            if not hasattr(obj, part):
                where = ".".join([self.module, *self.attr.split(".")[:i]])
                return f"{self.symbol}: {where} has no attribute {part!r} (kvref binds to vLLM 0.33.0's name)"
            obj = getattr(obj, part)
        if not self.params:
            return None
        try:
            sig = inspect.signature(obj)
        except (TypeError, ValueError):
            return None  # builtins without a signature: nothing to compare
        names = set(sig.parameters)
        takes_kwargs = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in sig.parameters.values())
        missing = [p for p in self.params if p not in names]
        if missing and not takes_kwargs:
            return (f"{self.symbol}{sig}: no parameter {', '.join(map(repr, missing))} "
                    f"(kvref passes it as in vLLM 0.33.0)")
        return None


def _b(module: str, attr: str, *params: str) -> Binding:
    return Binding(module, attr, tuple(params))


_KCI = "vllm.v1.kv_cache_interface"
_MGR = "vllm.v1.core.kv_cache_manager"
_UTILS = "vllm.v1.core.kv_cache_utils"
_REQ = "vllm.v1.request"
_CONN_V1 = "vllm.distributed.kv_transfer.kv_connector.v1"
_OFF_BASE = "vllm.v1.kv_offload.base"
_OFF_CFG = "vllm.v1.kv_offload.config"
_SPEC = ("block_size", "num_kv_heads", "head_size", "dtype")

#: what each adapter area binds to (vLLM 0.33.0 names and keyword parameters)
AREAS: dict[str, tuple[Binding, ...]] = {
    "specs": (
        _b(_KCI, "FullAttentionSpec", *_SPEC, "sliding_window", "attention_chunk_size"),
        _b(_KCI, "MLAAttentionSpec", *_SPEC, "cache_dtype_str"),
        _b(_KCI, "HiddenStateCacheSpec", *_SPEC, "cache_dtype_str"),  # extract_hidden_states layers (#22)
        _b(_KCI, "SlidingWindowSpec", *_SPEC, "sliding_window"),
        _b(_KCI, "ChunkedLocalAttentionSpec", *_SPEC, "attention_chunk_size"),
        _b(_KCI, "CrossAttentionSpec", *_SPEC),
        _b(_KCI, "MambaSpec", "block_size", "shapes", "dtypes", "mamba_cache_mode"),
        _b(_KCI, "UniformTypeKVCacheSpecs", "block_size", "kv_cache_specs"),
        _b(_KCI, "KVCacheGroupSpec"),
        _b(_KCI, "KVCacheConfig", "num_blocks", "kv_cache_tensors", "kv_cache_groups"),
        _b(_KCI, "KVCacheTensor"),
        _b("vllm.utils.torch_utils", "STR_DTYPE_TO_TORCH_DTYPE"),
    ),
    "request": (
        # every keyword kvref.impl.vllm.vrequest (the one door to vLLM's Request, #26) passes
        _b(_REQ, "Request", "request_id", "prompt_token_ids", "sampling_params", "pooling_params",
           "arrival_time", "cache_salt", "priority", "block_hasher", "mm_features", "resumable", "prompt_embeds",
           "lora_request", "session_id"),
        _b("vllm.sampling_params", "SamplingParams.__init__", "max_tokens", "stop_token_ids", "ignore_eos",
           "min_tokens", "repetition_detection", "skip_reading_prefix_cache", "extra_args", "prompt_logprobs"),
        _b(_REQ, "Request.append_output_token_ids"),
        _b(_REQ, "RequestStatus"),
        _b("vllm.sampling_params", "SamplingParams"),
        _b("vllm.utils.hashing", "sha256"),
        _b(_UTILS, "get_request_block_hasher"),
        _b(_UTILS, "init_none_hash"),
        _b(_UTILS, "get_group_id"),
        _b(_UTILS, "get_block_hash"),
        # block-hash extra keys and hash functions (#23)
        _b("vllm.lora.request", "LoRARequest"),
        _b("vllm.multimodal.inputs", "MultiModalFeatureSpec"),
        _b("vllm.multimodal.inputs", "PlaceholderRange"),
        _b("vllm.utils.hashing", "get_hash_fn_by_name"),
    ),
    "kv-manager": (
        _b(_MGR, "KVCacheManager", "kv_cache_config", "max_model_len", "scheduler_block_size", "hash_block_size",
           "max_in_flight_tokens", "enable_caching", "use_eagle", "watermark", "enable_kv_cache_events"),
        _b(_MGR, "KVCacheManager.get_computed_blocks"),
        _b(_MGR, "KVCacheManager.allocate_slots", "num_new_computed_tokens", "new_computed_blocks",
           "num_lookahead_tokens", "num_external_computed_tokens", "delay_cache_blocks", "full_sequence_must_fit",
           "reserved_blocks", "has_scheduled_reqs"),
        _b(_MGR, "KVCacheManager.free"),
        _b(_MGR, "KVCacheManager.new_step_starts"),
        _b(_MGR, "KVCacheManager.get_block_ids"),
        _b(_MGR, "KVCacheManager.get_blocks"),
        _b(_MGR, "KVCacheManager.cache_blocks"),
        _b(_MGR, "KVCacheManager.take_events"),
        _b(_MGR, "KVCacheManager.reset_prefix_cache"),
        _b(_MGR, "KVCacheManager.evict_blocks"),
        # each manager's publication mask, called alone (kvref.impl.vllm.retention_masks, #22)
        *(_b("vllm.v1.core.single_type_kv_cache_manager", f"{cls}.reachable_block_mask", "start_block", "end_block",
             "alignment_tokens", "kv_cache_spec", "use_eagle", "retention_interval", "reachable_boundaries",
             "dcp_world_size", "final_segment_end_block")
          for cls in ("FullAttentionManager", "SlidingWindowManager", "MambaManager")),
        # the sink-attention manager built directly over its own pool (kvref.impl.vllm.sink_manager, #22)
        _b("vllm.v1.core.single_type_kv_cache_manager", "SinkFullAttentionManager", "kv_cache_spec", "block_pool",
           "enable_caching", "kv_cache_group_id", "scheduler_block_size", "dcp_world_size"),
        _b("vllm.v1.core.block_pool", "BlockPool", "num_gpu_blocks", "enable_caching", "hash_block_size"),
        _b(_MGR, "KVCacheBlocks"),
        _b("vllm.v1.core.block_pool", "BlockPool.get_num_free_blocks"),
        # the free block queue's own API, driven by generated programs (free_block_queue.py, #22)
        _b(_UTILS, "FreeKVCacheBlockQueue"),
        _b(_UTILS, "KVCacheBlock", "block_id"),
        # the prefix-cache index's own API, driven by generated programs (block_hash_map.py, #22)
        _b("vllm.v1.core.block_pool", "BlockHashToBlockMap"),
        *(_b("vllm.v1.core.block_pool", f"BlockHashToBlockMap.{m}", *args)
          for m, args in (("insert", ("key", "block")), ("pop", ("key", "block_id")), ("get_one_block", ("key",)),
                          ("contain", ("key", "block_id")))),
    ),
    "block-pool": (
        _b("vllm.v1.core.block_pool", "BlockPool"),
        _b("vllm.v1.core.block_pool", "BlockPool.get_new_blocks"),
        _b("vllm.v1.core.block_pool", "BlockPool.get_cached_block"),
        _b("vllm.v1.core.block_pool", "BlockPool.cache_full_blocks"),
        _b("vllm.v1.core.block_pool", "BlockPool.touch"),
        _b("vllm.v1.core.block_pool", "BlockPool.free_blocks"),
        _b("vllm.v1.core.block_pool", "BlockPool.evict_blocks"),
        _b("vllm.v1.core.block_pool", "BlockPool.reset_prefix_cache"),
    ),
    "kv-events": (
        _b("vllm.distributed.kv_events", "KVEventBatch", "ts", "events", "data_parallel_rank"),
        _b("vllm.distributed.kv_events", "BlockStored"),
        _b("vllm.distributed.kv_events", "BlockRemoved"),
        _b("vllm.distributed.kv_events", "AllBlocksCleared"),
        _b("vllm.distributed.kv_events", "ZmqEventPublisher", "data_parallel_rank", "endpoint", "replay_endpoint",
           "topic"),
        # kvref demo publish (demo_publish.py): vLLM's factory builds the publisher from a KVEventsConfig
        _b("vllm.distributed.kv_events", "EventPublisherFactory.create", "config"),
        _b("vllm.distributed.kv_events", "ZmqEventPublisher._is_bind_endpoint"),
        _b("vllm.v1.core.block_pool", "BlockPool", "enable_kv_cache_events"),
        _b("vllm.v1.core.block_pool", "BlockPool.take_events"),
        _b("vllm.v1.core.block_pool", "BlockPool.emit_cached_block_events"),
        _b("vllm.v1.core.block_pool", "BlockPool.cache_partial_block"),
    ),
    "scheduler": (
        _b("vllm.config", "VllmConfig", "model_config", "cache_config", "scheduler_config", "kv_events_config"),
        _b("vllm.config.kv_events", "KVEventsConfig", "enable_kv_cache_events", "publisher"),
        _b("vllm.config", "ModelConfig", "model", "tokenizer", "skip_tokenizer_init", "max_model_len", "dtype"),
        _b("vllm.config", "CacheConfig", "block_size", "enable_prefix_caching"),
        _b("vllm.config", "SchedulerConfig", "max_num_batched_tokens", "max_num_seqs", "max_model_len",
           "is_encoder_decoder", "enable_chunked_prefill"),
        _b("vllm.v1.core.sched.scheduler", "Scheduler", "vllm_config", "kv_cache_config",
           "structured_output_manager", "block_size", "hash_block_size"),
        _b("vllm.v1.core.sched.scheduler", "Scheduler.schedule"),
        _b("vllm.v1.core.sched.scheduler", "Scheduler.update_from_output"),
        _b("vllm.v1.core.sched.scheduler", "Scheduler.add_request"),
        _b("vllm.v1.core.sched.scheduler", "Scheduler.finish_requests"),
        # speculative decoding in the scheduler (#22)
        _b("vllm.config", "SpeculativeConfig"),
        _b("vllm.v1.outputs", "DraftTokenIds"),
        _b("vllm.v1.core.sched.async_scheduler", "AsyncScheduler"),
        _b("vllm.v1.outputs", "ModelRunnerOutput"),
        _b("vllm.v1.structured_output", "StructuredOutputManager"),
        # cache controls, metrics and the diffusion schedulers (models/machines/scheduler_cache_controls.py)
        _b("vllm.v1.core.sched.diffusion_scheduler", "DiffusionScheduler"),
        _b("vllm.v1.core.sched.diffusion_scheduler", "DiffusionAsyncScheduler"),
        _b("vllm.v1.core.kv_cache_metrics", "KVCacheMetricsCollector"),
        _b("vllm.v1.core.sched.interface", "PauseState"),
        _b("vllm.v1.core.sched.scheduler", "Scheduler.set_pause_state"),
        # encoder inputs of multimodal requests (models/machines/scheduler_encoder.py, #22)
        _b("vllm.v1.core.encoder_cache_manager", "EncoderCacheManager", "cache_size"),
        # LoRA's max_loras admission (models/machines/scheduler_lora.py, #22)
        _b("vllm.config", "LoRAConfig", "max_loras"),
        # a prompt-embeds request's rows as vLLM's hasher reads them (the recorder's add.embeds, #28)
        _b("vllm.v1.utils", "tensor_data"),
        # check_stop's EOS, min_tokens and repetition rules (models/machines/scheduler_stop.py, #22)
        _b("vllm.sampling_params", "SamplingParams.__init__", "max_tokens", "stop_token_ids", "ignore_eos",
           "min_tokens", "repetition_detection", "skip_reading_prefix_cache", "extra_args"),
        _b("vllm.sampling_params", "SamplingParams.update_from_generation_config"),
        _b("vllm.sampling_params", "RepetitionDetectionParams", "max_pattern_size", "min_pattern_size", "min_count"),
        # per-request spec-decode metrics (conform-spec-decode, #22)
        _b("vllm.config", "ObservabilityConfig", "per_request_spec_decode_metrics"),
        # --kv-cache-metrics on the scheduler (models/machines/scheduler_kv_metrics.py, #22)
        _b("vllm.config", "ObservabilityConfig", "kv_cache_metrics", "kv_cache_metrics_sample"),
        # the aux-output (routed-experts) connector in the scheduler (models/machines/scheduler_aux_output.py,
        # #22): its config, the worker rows the fake model hands it, its metadata and the LRU it keeps
        _b("vllm.config", "AuxOutputConfig", "enable_return_routed_experts"),
        _b("vllm.config", "VllmConfig", "aux_output_config"),
        _b("vllm.distributed.aux_output_connector.connector", "AuxRequestOutput", "token_start", "rows"),
        _b("vllm.distributed.aux_output_connector.connector", "AuxOutputConnectorMetadata", "generation", "requests",
           "block_hashes", "finished_requests", "retained_block_hashes", "released_block_hashes"),
        _b("vllm.distributed.aux_output_connector.connector", "AuxOutputSchedulerConnector", "kv_cache_manager",
           "kv_connector"),
        _b("vllm.v1.metrics.stats", "RequestSpecDecodeMetrics", "num_spec_tokens", "histogram", "num_draft_tokens",
           "per_step_accepted", "per_step_drafted"),
        # structured output (models/machines/scheduler_structured_output.py, #22/#28): JSON mode makes vLLM's
        # Request derive use_structured_output; the scripted grammar replaces its StructuredOutputRequest
        _b("vllm.sampling_params", "SamplingParams.__init__", "structured_outputs"),
        _b("vllm.sampling_params", "StructuredOutputsParams", "json_object"),
        _b("vllm.v1.structured_output.request", "StructuredOutputRequest", "params"),
        _b("vllm.v1.structured_output.utils", "strip_speculative_padding"),
        _b(_REQ, "RequestStatus.WAITING_FOR_STRUCTURED_OUTPUT_GRAMMAR"),
        # the waiting queues alone (models/machines/scheduler_queue.py, #22)
        _b("vllm.v1.core.sched.request_queue", "SchedulingPolicy"),
        _b("vllm.v1.core.sched.request_queue", "create_request_queue"),
        _b(_REQ, "Request", "request_id", "prompt_token_ids", "sampling_params", "pooling_params",
           "arrival_time", "priority"),
    ),
    "planning": (
        _b("vllm.config", "KVTransferConfig", "kv_connector", "kv_role"),
        _b("vllm.v1.attention.backends.utils", "resolve_kv_cache_layout"),
        _b("vllm.v1.core.kv_cache_planning", "get_global_kv_cache_groups"),
        _b("vllm.v1.core.kv_cache_planning", "get_kv_cache_configs"),
        _b(_UTILS, "generate_scheduler_kv_cache_config"),
        _b(_UTILS, "get_max_concurrency_for_kv_cache_config"),
        _b(_UTILS, "resolve_kv_cache_block_sizes"),
        _b(_UTILS, "resolve_cache_hit_alignment_tokens"),
        _b(_UTILS, "resolve_dcp_kv_cache_spec"),
        # the planned tensors, compared field by field with kvref.spec.kv_cache_tensors (#22)
        _b(_KCI, "KVCacheTensor", "size", "layers", "layer_stride", "block_stride", "offset", "host_resident"),
        # the packing chunk size and hidden-state block size, compared over their whole domain (#22)
        _b("vllm.v1.core.kv_cache_planning", "_approximate_gcd", "lower_bound"),
        _b("vllm.v1.core.kv_cache_planning", "_largest_divisor_at_most"),
    ),
    "simple-offload": (
        _b("vllm.v1.simple_kv_offload.manager", "SimpleCPUOffloadScheduler", "cpu_capacity_bytes",
           "scheduler_block_size", "hash_block_size", "lazy_offload", "num_cpu_blocks"),
        _b("vllm.v1.simple_kv_offload.manager", "SimpleCPUOffloadScheduler.build_connector_meta"),
        _b("vllm.v1.simple_kv_offload.manager", "SimpleCPUOffloadScheduler.update_connector_output"),
        _b("vllm.v1.simple_kv_offload.manager", "SimpleCPUOffloadScheduler.request_finished_all_groups"),
        _b("vllm.v1.simple_kv_offload.manager", "SimpleCPUOffloadScheduler.bind_gpu_block_pool"),
        _b("vllm.v1.simple_kv_offload.metadata", "SimpleCPUOffloadWorkerMetadata"),
        _b("vllm.v1.simple_kv_offload.metrics", "MetricName"),
        _b("vllm.v1.outputs", "KVConnectorOutput", "finished_recving", "kv_connector_worker_meta"),
        # Mamba "align" pools (simple_offload_mamba.py): the hand-offs ride in the SchedulerOutput
        _b("vllm.v1.core.sched.output", "KVConnectorBlockState", "req_ids", "resolve_block_ids",
           "boundary_state_offloads"),
        _b("vllm.v1.simple_kv_offload.manager", "SimpleCPUOffloadScheduler.get_boundary_store_stats"),
        _b(_MGR, "KVCacheManager.take_boundary_state_offloads"),
        _b(_MGR, "KVCacheManager.take_kv_cache_block_copies"),
        # the ranks' pool-size agreement (simple_offload_sizing.py): forked gloo ranks
        _b("vllm.distributed.parallel_state", "init_distributed_environment", "world_size", "rank",
           "distributed_init_method", "local_rank", "backend"),
        _b("vllm.v1.kv_offload.cpu.spec", "_all_workers_barrier"),
        _b("vllm.v1.simple_kv_offload.sizing", "sync_num_offload_blocks_across_workers"),
    ),
    "offloading-connector": (
        _b("vllm.distributed.kv_transfer.kv_connector.v1.offloading.scheduler", "OffloadingConnectorScheduler"),
        _b("vllm.distributed.kv_transfer.kv_connector.v1.offloading.scheduler",
           "OffloadingConnectorScheduler.build_connector_meta"),
        _b("vllm.distributed.kv_transfer.kv_connector.v1.offloading.scheduler",
           "OffloadingConnectorScheduler.update_connector_output"),
        _b("vllm.distributed.kv_transfer.kv_connector.v1.offloading.scheduler",
           "OffloadingConnectorScheduler.request_finished"),
        _b("vllm.distributed.kv_transfer.kv_connector.v1.offloading.config", "get_sliding_window_size_in_chunks"),
        # from_spec alone: conform-offload compares its refusals of retention intervals (#22)
        _b("vllm.distributed.kv_transfer.kv_connector.v1.offloading.scheduler", "SchedulerOffloadConfig.from_spec"),
        _b("vllm.distributed.kv_transfer.kv_connector.v1.offloading.common", "OffloadingWorkerMetadata",
           "completed_jobs"),
        _b("vllm.v1.kv_offload.base", "OffloadingKVEventsConfig"),
        _b("vllm.v1.kv_offload.base", "TierFilter"),
        _b("vllm.distributed.kv_transfer.kv_connector.v1.offloading.scheduler",
           "OffloadingConnectorScheduler.get_external_cache_hit_sources"),
        _b("vllm.distributed.kv_transfer.kv_connector.v1.offloading.scheduler", "OffloadingConnectorScheduler.take_events"),
        _b("vllm.distributed.kv_transfer.kv_connector.v1.offloading.scheduler", "OffloadingConnectorScheduler.get_stats"),
        _b("vllm.distributed.kv_transfer.kv_connector.v1.offloading.scheduler",
           "OffloadingConnectorScheduler.has_pending_push_work"),
        _b("vllm.v1.kv_offload.cpu.manager", "CPUOffloadingManager", "cache_policy", "enable_events"),
        _b("vllm.v1.outputs", "KVConnectorOutput", "kv_connector_worker_meta"),
    ),
    # kvref's scripted KV connector built by vLLM's Scheduler from its kv_transfer_config
    # (kvref.impl.vllm.connector), alone or under vLLM's MultiConnector
    "kv-connector": (
        _b("vllm.distributed.kv_transfer.kv_connector.v1.base", "KVConnectorBase_V1"),
        _b("vllm.distributed.kv_transfer.kv_connector.v1.base", "KVConnectorMetadata"),
        _b("vllm.distributed.kv_transfer.kv_connector.v1.base", "SupportsHMA"),
        _b("vllm.distributed.kv_transfer.kv_connector.v1.multi_connector", "MultiConnector"),
        _b("vllm.config", "KVTransferConfig", "kv_connector", "kv_connector_module_path", "kv_role",
           "kv_load_failure_policy", "kv_connector_extra_config"),
        _b("vllm.v1.outputs", "KVConnectorOutput", "finished_sending", "finished_recving", "failed_recving",
           "invalid_block_ids"),
        _b("vllm.v1.core.sched.scheduler", "Scheduler.reset_prefix_cache", "reset_running_requests",
           "reset_connector"),
        # a HiSparse host pool defers async loads (defer_async_loads, _drain_deferred_loads, #22)
        _b(_KCI, "KVCacheConfig", "hisparse_host_num_blocks"),
        # SWA bounded replay beside a connector: the groups a load restores (#22, session 20)
        _b("vllm.distributed.kv_transfer.kv_connector.v1.base", "KVConnectorBase_V1.get_loaded_kv_cache_group_ids",
           "request"),
        _b(_KCI, "KVCacheConfig.transfer_group_ids"),
        _b(_KCI, "KVCacheConfig.prefix_cacheable_group_ids"),
    ),
    # vLLM's MultiConnector in both roles over kvref's scripted children (kvref.impl.vllm.multi_connector_worker)
    "multi-connector-worker": (
        _b(_CONN_V1 + ".base", "KVConnectorBase_V1"),
        _b(_CONN_V1 + ".base", "KVConnectorMetadata"),
        _b(_CONN_V1 + ".base", "KVConnectorWorkerMetadata"),
        _b(_CONN_V1 + ".base", "SupportsHMA"),
        _b(_CONN_V1 + ".base", "KVConnectorRole"),
        _b(_CONN_V1 + ".multi_connector", "MultiConnector", "vllm_config", "role", "kv_cache_config"),
        _b(_CONN_V1 + ".multi_connector", "MultiConnector.get_transfer_results", "finished_req_ids"),
        _b(_CONN_V1 + ".multi_connector", "MultiConnector.build_connector_worker_meta"),
        _b(_CONN_V1 + ".multi_connector", "MultiConnector.get_finished_count"),
        _b(_CONN_V1 + ".multi_connector", "MultiConnector.handle_preemptions", "kv_connector_metadata"),
        _b(_CONN_V1 + ".multi_connector", "MultiConnector.register_finished_partial_tail", "request", "block_ids",
           "partial_tail_offloads"),
        _b(_CONN_V1 + ".multi_connector", "MultiConnector.sub_connectors"),
        _b(_CONN_V1 + ".simple_cpu_offload_connector", "_find_simple_cpu_offload_connector", "connector"),
        _b(_CONN_V1 + ".multi_connector", "MultiConnector.build_kv_connector_stats", "data"),
        _b(_CONN_V1 + ".multi_connector", "MultiConnector.get_kv_connector_stats"),
        _b(_CONN_V1 + ".metrics", "KVConnectorStats", "data"),
        # the stats' way to the logger and the metrics endpoint (models/machines/multi_connector_worker.py)
        _b(_CONN_V1 + ".metrics", "KVConnectorPromMetrics", "vllm_config", "metric_types", "labelnames",
           "per_engine_labelvalues"),
        _b(_CONN_V1 + ".metrics", "KVConnectorLogging", "kv_transfer_config"),
        _b(_CONN_V1 + ".metrics", "KVConnectorLogging.log", "log_fn"),
        _b(_CONN_V1 + ".metrics", "KVConnectorProm", "vllm_config", "labelnames", "per_engine_labelvalues"),
        _b("vllm.distributed.kv_transfer.kv_connector.factory", "KVConnectorFactory.register_connector", "name",
           "module_path", "class_name"),
        _b(_CONN_V1 + ".multi_connector", "MultiConnector.all_children_support_hma", "kv_transfer_config"),
        _b("vllm.config", "KVTransferConfig", "kv_connector", "kv_connector_module_path", "kv_role", "engine_id",
           "kv_connector_extra_config"),
        _b("vllm.distributed.kv_transfer.kv_connector.utils", "KVOutputAggregator.from_connector", "connector",
           "world_size"),
        _b("vllm.v1.outputs", "KVConnectorOutput", "finished_sending", "finished_recving", "invalid_block_ids",
           "kv_connector_worker_meta", "kv_connector_stats"),
        _b("vllm.v1.outputs", "ModelRunnerOutput", "req_ids", "req_id_to_index", "kv_connector_output"),
    ),
    # vLLM's whole OffloadingConnector, scheduler and worker roles, moving bytes (#22)
    "offload-worker": (
        _b(_CONN_V1 + ".offloading_connector", "OffloadingConnector"),
        _b(_CONN_V1 + ".offloading.canonical_mapping", "derive_canonical_mappings"),
        # the canonical mapping's generated layers: quantized, padded, MLA states, Mamba, HiSparse pages
        _b(_KCI, "KVQuantMode"),
        _b(_KCI, "FullAttentionSpec", *_SPEC, "kv_quant_mode", "page_size_padded"),
        _b(_KCI, "MLAAttentionSpec", *_SPEC, "kv_quant_mode", "tokens_per_state"),
        _b(_KCI, "MambaSpec", "block_size", "shapes", "dtypes", "page_size_padded"),
        _b(_KCI, "HiSparseResidentSpec", "block_size", "page_size"),
        _b(_KCI, "UniformTypeKVCacheSpecs", "block_size", "kv_cache_specs"),
        _b(_CONN_V1 + ".offloading.config", "build_offloading_config"),  # the chunk-option sweep
        # build_offloading_config's parallelism gate on generated layer sets (offload_layout_gate)
        _b("vllm.distributed.kv_transfer.kv_connector.utils", "get_kv_connector_cache_layout"),
        _b(_KCI, "SlidingWindowSpec", *_SPEC, "sliding_window", "kv_quant_mode", "page_size_padded"),
        _b(_KCI, "ChunkedLocalAttentionSpec", *_SPEC, "attention_chunk_size", "kv_quant_mode"),
        _b(_KCI, "CircularBufferSpec", *_SPEC, "kv_quant_mode", "page_size_padded"),
        _b(_KCI, "SlidingWindowMLASpec", *_SPEC, "sliding_window", "kv_quant_mode"),
        _b(_KCI, "HiddenStateCacheSpec", *_SPEC, "kv_quant_mode", "tokens_per_state"),
        _b(_KCI, "KVCacheTensor", "size", "layers", "layer_stride", "block_stride"),
        _b(_KCI, "KVCacheGroupSpec", "enable_kv_transfer"),
        _b(_KCI, "KVCacheConfig", "num_blocks", "kv_cache_tensors", "kv_cache_groups", "kv_tp_replicas"),
        _b(_CONN_V1 + ".base", "KVConnectorRole"),
        _b("vllm.distributed.kv_transfer.kv_connector.utils", "KVOutputAggregator"),
        _b("vllm.utils.math_utils", "cdiv"),
        _b("vllm.utils.math_utils", "round_up"),
        _b(_OFF_BASE, "GPULoadStoreSpec"),
        _b(_OFF_BASE, "OffloadingWorker"),
        _b(_OFF_BASE, "TransferResult"),
        _b("vllm.v1.kv_offload.cpu.gpu_worker", "_build_copy_plan"),
        _b("vllm.v1.kv_offload.cpu.gpu_worker", "_canonical_block_sizes"),
        _b("vllm.v1.kv_offload.cpu.gpu_worker", "compute_sub_block_ptrs"),
        _b("vllm.v1.kv_offload.cpu.shared_offload_region", "SharedOffloadRegion"),
        _b("vllm.v1.kv_offload.cpu.spec", "CPUOffloadingSpec"),
        _b("vllm.distributed.kv_events", "KVEventAggregator"),
        # the publisher's factory, no-op publisher and a connector's event container (kv_event_publisher_edges.py)
        _b("vllm.distributed.kv_events", "EventPublisherFactory.register_publisher", "name", "ctor"),
        _b("vllm.distributed.kv_events", "NullEventPublisher"),
        _b(_CONN_V1 + ".lmcache_connector", "LMCacheKVEvents"),
        _b(_CONN_V1 + ".simple_cpu_offload_connector", "SimpleCPUOffloadConnector"),
        # the CPU tier's cache policies driven call by call (offload_policies) and the connector's
        # stats merged and reduced over a trace (offload_stats), #22
        _b(_OFF_BASE, "ReqContext", "req_id"),
        _b("vllm.v1.kv_offload.cpu.policies.base", "CachePolicy"),
        _b("vllm.v1.kv_offload.cpu.policies.base", "ChunkStatus"),
        _b("vllm.v1.kv_offload.cpu.policies.factory", "CachePolicyFactory.get_cache_policy_cls", "name", "module_path"),
        _b("vllm.v1.kv_offload.cpu.policies.factory", "CachePolicyFactory.register_cache_policy", "name",
           "module_path", "class_name"),
        _b("vllm.v1.kv_offload.cpu.policies.lru", "LRUCachePolicy"),
        _b(_CONN_V1 + ".offloading.metrics", "OffloadingConnectorStats", "data"),
    ),
    # multi-tier offloading: TieringOffloadingManager with its file-system and example tiers (#22)
    "tiering": (
        _b("vllm.v1.kv_offload.tiering.spec", "TieringOffloadingSpec"),
        _b("vllm.v1.kv_offload.tiering.example.manager", "ExampleSecondaryTierManager"),
        _b("vllm.v1.kv_offload.tiering.base", "TransferJob"),
        _b("vllm.v1.kv_offload.tiering.base", "JobResult"),  # kvref's PolledTier reports peer pins (#22)
        _b("vllm.v1.kv_offload.tiering.backpressure", "EMABackpressureDetector"),  # back-pressure programs (#22)
        _b("vllm.v1.kv_offload.tiering.backpressure", "DropStorePolicy"),
        _b("vllm.v1.kv_offload.tiering.backpressure", "ThrottledDropPolicy"),
        _b("vllm.v1.kv_offload.tiering.manager", "_TIER_POLL_JOIN_TIMEOUT_S"),  # tier-poll programs (#22)
        _b("vllm.v1.kv_offload.tiering.manager", "TieringOffloadingManager._tier_poll_loop"),
        _b("vllm.v1.kv_offload.file_mapper", "FileMapper"),
        _b(_OFF_BASE, "make_offload_key"),
        _b(_OFF_BASE, "OffloadPolicy"),
        _b(_OFF_BASE, "RequestOffloadingContext"),
        _b(_OFF_BASE, "OffloadingGaugeMetadata"),
        _b(_OFF_BASE, "OffloadingHistogramMetadata"),
        _b(_OFF_BASE, "ReqContext"),
        _b(_OFF_BASE, "ScheduleEndContext"),
        _b(_OFF_BASE, "OffloadingSpec"),
        _b(_OFF_BASE, "TierFilter"),  # a request's load tier filter in tiering lookups (#22)
        _b(_OFF_BASE, "TierMatcher"),
        _b(_OFF_BASE, "Medium"),
        _b(_OFF_BASE, "Locality"),
        _b(_OFF_CFG, "OffloadingConfig"),
        _b(_OFF_CFG, "OffloadingCacheConfig"),
        _b(_OFF_CFG, "OffloadingGroupConfig"),
        _b(_OFF_CFG, "OffloadingModelConfig"),
        _b(_OFF_CFG, "OffloadingParallelConfig"),
        # the tiering worker's canonical-layout refs through create_worker (tiering_canonical, #22)
        _b(_OFF_BASE, "CanonicalKVCacheRef", "tensor_idx", "page_size_bytes", "mapping"),
        _b(_OFF_BASE, "CanonicalKVCaches", "tensors", "group_data_refs"),
        _b(_OFF_BASE, "CanonicalKVCacheTensor", "tensor", "page_size_bytes"),
        _b(_OFF_BASE, "CanonicalPageMapping", "canonical_page_size_bytes", "local_page_size_bytes", "runs",
           "num_writers", "writer_index", "parallelism_agnostic"),
        _b(_OFF_BASE, "CopyRun"),
        _b("vllm.v1.kv_offload.tiering.spec", "TieringOffloadingSpec.create_worker", "kv_caches"),
        _b("vllm.v1.kv_offload.tiering.spec", "CPUOffloadingWorker", "kv_caches", "blocks_per_chunk", "num_cpu_chunks",
           "mmap_region", "canonical_layout"),
        # the KVCR tier's native buffers kept after a startup failure (tiering_kvcr.retained_native_buffers, #22)
        _b("vllm.v1.kv_offload.tiering.kvcr.manager", "_RETAINED_NATIVE_BUFFERS"),
    ),
    # the P2P secondary tier: two tier managers over loopback ZMQ (#22)
    "p2p": (
        _b("vllm.v1.kv_offload.tiering.p2p.manager", "P2PSecondaryTierManager"),
        _b("vllm.v1.kv_offload.tiering.p2p.manager", "NixlTransport"),
        _b("vllm.v1.kv_offload.tiering.p2p.manager", "ZmqTransport"),
        _b("vllm.v1.kv_offload.tiering.p2p.control.zmq", "ZmqTransport"),
        _b("vllm.v1.kv_offload.tiering.p2p.data.nixl", "NixlTransport"),
        _b("vllm.v1.kv_offload.tiering.p2p.data.nixl", "_NixlAgent"),
        _b("vllm.v1.kv_offload.tiering.p2p.data", "nixl"),
        _b("vllm.distributed.nixl_utils", "NixlWrapper"),
        _b("vllm.distributed.nixl_utils", "nixl_agent_config"),
        _b("vllm.v1.kv_offload.tiering.p2p.manager", "envs"),
        _b("vllm.v1.kv_offload.base", "LookupResult"),
        _b("vllm.v1.kv_offload.tiering.base", "ParentManager"),
        _b("vllm.v1.kv_offload.tiering.p2p.session.session", "time"),
        _b("vllm.v1.kv_offload.tiering.p2p.session.client", "time"),
        _b("vllm.v1.kv_offload.tiering.p2p.session.server", "time"),
    ),
    # HiSparse's startup layout (kvref.impl.vllm.hisparse_layout), driven in conform-planning (#22/#23)
    "hisparse-layout": (
        _b("vllm.v1.hisparse.layout", "_lay_out_hisparse_groups"),
        _b("vllm.v1.hisparse.layout", "create_hisparse_layout"),
        _b(_KCI, "KVCacheGroupSpec"),
        _b(_KCI, "MLAAttentionSpec", "cache_role", "is_index_group_leader"),
        _b(_KCI, "SparseCacheRole"),
        _b(_KCI, "UniformTypeKVCacheSpecs.from_specs"),
    ),
    # HiSparse's whole startup sizing (kvref.impl.vllm.planning_hisparse), driven in conform-planning (#22/#23)
    "hisparse-planning": (
        _b("vllm.config.attention", "HiSparseConfig", "device_buffer_size"),
        _b("vllm.config", "KVTransferConfig", "kv_connector", "kv_role", "kv_connector_extra_config"),
        _b("vllm.v1.hisparse.layout", "get_hisparse_kv_cache_groups"),
        _b("vllm.v1.hisparse.layout", "get_hisparse_steady_state_concurrency"),
        _b(_KCI, "HiSparseHotSpec"),
        _b(_KCI, "HiSparseResidentSpec"),
        _b(_UTILS, "update_kv_cache_capacity"),
        _b("vllm.v1.core.kv_cache_planning", "_pool_bytes_per_block"),
    ),
    # HiSparse managers with their bound coordinator, driven in conform-kv-manager (#23)
    "hisparse": (
        _b("vllm.v1.hisparse.coordinator", "get_hisparse_coordinator"),
        _b(_KCI, "KVCacheGroupRole"),
    ),
    # vLLM's own reading of a model's config.json (kvref.impl.vllm.model_config; the HF-config
    # conformance tests compare kvref's derivation with it)
    # the classes kvref demo record --fault patches in-process (a planted fault, never a check)
    "demo-faults": (
        _b("vllm.v1.core.kv_cache_coordinator", "KVCacheCoordinator"),
        _b("vllm.v1.core.single_type_kv_cache_manager", "SlidingWindowManager"),
        _b("vllm.v1.core.single_type_kv_cache_manager", "ChunkedLocalAttentionManager"),
        # check-run's R-SWA and ring faults (record_faults.py, #28 session 20)
        _b("vllm.v1.core.single_type_kv_cache_manager", "RSWAManager"),
        _b("vllm.v1.core.single_type_kv_cache_manager", "CircularBufferManager"),
    ),
    "model-config": (
        _b("vllm.config.model", "_get_and_verify_max_len"),
        _b("vllm.transformers_utils.config", "get_config"),
        _b("vllm.transformers_utils.model_arch_config_convertor", "MODEL_ARCH_CONFIG_CONVERTORS"),
        _b("vllm.transformers_utils.model_arch_config_convertor", "ModelArchConfigConvertorBase"),
        _b("vllm.config", "CacheConfig"),
        _b("vllm.config", "ParallelConfig"),
        _b("vllm.platforms.interface", "Platform"),
        _b("vllm.v1.attention.backends.triton_attn", "TritonAttentionBackend"),
        _b("vllm.model_executor.models.config", "NemotronHForCausalLMConfig"),
        _b("vllm.model_executor.models", "ModelRegistry"),
        _b("vllm.model_executor.models.jamba", "JambaForCausalLM"),
        _b("vllm.model_executor.models.nemotron_h", "NemotronHForCausalLM"),
        _b("vllm.model_executor.layers.mamba.mamba_utils", "MambaStateDtypeCalculator"),
        _b("vllm.model_executor.layers.mamba.mamba_utils", "MambaStateShapeCalculator"),
        _b("vllm.config.model", "ModelConfig"),
        _b("vllm.distributed", "divide"),
        _b("vllm.transformers_utils.repo_utils", "with_retry"),
        _b("vllm.model_executor.models.falcon_h1", "FalconH1ForCausalLM"),
        _b("vllm.model_executor.models.granitemoehybrid", "GraniteMoeHybridForCausalLM"),
        _b("vllm.model_executor.models.mamba", "MambaForCausalLM"),
        _b("vllm.model_executor.models.mamba2", "Mamba2ForCausalLM"),
        _b("vllm.model_executor.models.zamba2", "Zamba2ForCausalLM"),
    ),
}

#: which areas each vLLM-facing check of ``kvref verify`` drives
CHECK_AREAS: dict[str, tuple[str, ...]] = {
    "startup-liveness": ("specs", "request", "kv-manager"),
    "conform-explorer": ("specs", "request", "scheduler"),
    "conform-kv-manager": ("specs", "request", "kv-manager", "hisparse"),
    "conform-scheduler": ("specs", "request", "scheduler"),
    "conform-offload": ("specs", "request", "kv-manager", "simple-offload", "offloading-connector"),
    "conform-planning": ("specs", "planning", "hisparse-layout", "hisparse-planning"),
    "conform-connector": ("specs", "request", "scheduler", "kv-connector", "multi-connector-worker"),
    "conform-spec-decode": ("specs", "request", "scheduler"),
    "conform-offload-worker": ("specs", "request", "kv-manager", "offloading-connector", "offload-worker"),
    "conform-tiering": ("specs", "tiering"),
    "conform-p2p": ("tiering", "p2p"),
}


def check_api(areas: tuple[str, ...] | list[str]) -> list[str]:
    """Every problem with the installed vLLM's API in ``areas`` (empty: all bindings resolve)."""
    problems: list[str] = []
    seen: set[Binding] = set()
    for area in areas:
        if area not in AREAS:
            from kvref.spec.errors import InvalidFieldError

            raise InvalidFieldError("area", area, "one of " + ", ".join(AREAS))
        for binding in AREAS[area]:
            if binding in seen:
                continue
            seen.add(binding)
            problem = binding.problem()
            if problem:
                problems.append(problem)
    return problems


def check_api_for(check_name: str) -> list[str]:
    """:func:`check_api` over the areas the ``kvref verify`` check ``check_name`` drives."""
    return check_api(CHECK_AREAS.get(check_name, ()))
