"""Every public entry point is fuzzed or excluded for a stated reason (issue #15).

:func:`tests.hardening.api_discovery.discover` walks the packages users import; each class,
method and function it finds must be in the fuzz catalogue (:mod:`tests.hardening.api_targets`)
or in :data:`EXCLUDED` below with a one-line reason. A new public entry point in neither fails
:func:`test_every_public_entry_point_is_fuzzed_or_excluded`; an exclusion that names nothing any
more, or something the catalogue now covers, fails :func:`test_exclusions_are_current`.
Methods and constructors that take no argument are excluded by rule (nothing to get wrong:
call-order misuse is the state machines' job, ``test_stateful_misuse.py``).
"""

from __future__ import annotations

import functools
import importlib
import inspect

from tests.hardening.api_discovery import discover as _discover
from tests.hardening.api_discovery import qualified
from tests.hardening.api_targets import ALIASES, constructors, functions, method_cases

_REF = "kvref.impl.reference"

#: building blocks inside the reference KV cache manager / block pool
INTERNAL = ("building block of KVCacheManager/BlockPool (vLLM's class of the same name is not called by users "
            "either); reached only through them, with checked arguments")
#: eviction policies
POLICY = ("eviction policy driven only by CPUOffloadingManager, which checks keys and ctx first (as vLLM's "
          "CachePolicy is); the policy constructors are fuzzed")
#: per-step hashing and arithmetic
HOT = ("per-step primitive on the hot path, the same bare expression as vLLM's; every public caller checks "
       "its values first (a check here would cost every step)")
#: what kvref hands out
RECORD = ("a result record kvref returns (read, not built by users); a forged one is rejected where it is "
          "passed back")
#: lookup/store planning of the connector
CONNECTOR_STEP = ("a step of OffloadingConnectorScheduler's lookup/store planning, called with the scheduler's "
                  "own checked state")
#: torch data-path internals
TORCH = ("torch data-path internal driven by TorchKVCacheManager/DataPathRunner with tensors it built; a check "
         "per call would cost a device sync")
#: trace record codecs
CODEC = "run-trace record codec used by TraceWriter/TraceReader after validate_record checked the record"
#: abstract bases and protocols
ABSTRACT = "abstract base / typing Protocol: the concrete classes are fuzzed"
#: owned elsewhere
HF = ("a layout's value object / an internal step of layout_from_hf_config (config fields reach it only "
      "through that, fuzzed here and field by field by cli_flag_fuzz)")
#: the reference scheduler's speculative-decoding rules
SPEC_STEP = ("a step of the reference Scheduler's speculative-decoding rules, called at its hooks with its own "
             "checked state; the entry points are SchedulerConfig, DraftTokenIds, Scheduler.update_draft_token_ids")
#: the scripted KV connector's scheduler-side API
CONNECTOR_API = ("the scripted KV connector's scheduler-side API (vLLM's KVConnectorBase_V1 methods of the same "
                 "names), called by the reference Scheduler and, through kvref.impl.vllm.connector, by vLLM's "
                 "Scheduler with their own checked state; users drive it through ScriptedConnector.set_hit")
VLLM = "binds to vLLM's own objects (a VllmConfig, vLLM events); built by vLLM's engine, covered by tests/record"
#: the P2P tier's reference building blocks
P2P = ("building block of the P2P tier's reference world (as vLLM's ClientRole/ServerRole/P2PSession/transports are "
       "driven only by P2PSecondaryTierManager): reached through P2PWorld, whose calls check their arguments")
_P2P = "kvref.impl.reference.offload.p2p"
#: the multi-tier offloading reference's building blocks
TIERING = ("building block of the tiering reference (as vLLM's secondary tiers, AsyncLookupManager and back-pressure "
           "policies are driven only by TieringOffloadingManager): called by the manager with its own checked "
           "arguments, or by the harness kvref.models.machines.tiering; the manager, the primary tier, the "
           "detector and the clock are fuzzed")
_TIER = "kvref.impl.reference.offload.tiering"


#: MultiConnector's both-sides reference (#22)
MULTI_WORKER = ("a call of MultiConnector's both-sides reference or of its scripted child, made only by the harness "
                "kvref.models.machines.multi_connector_worker with the children's scripted answers (as vLLM's "
                "MultiConnector methods are made only by the engine); the constructors are fuzzed")


def _each(module: str, names: str, reason: str) -> dict[str, str]:
    return {f"{module}.{n}": reason for n in names.split()}


EXCLUDED: dict[str, str] = {
    f"{_REF}.scheduler_streaming.SessionState.check_invariants": "an invariant checker: asserts by design",
    **_each(f"{_REF}.multi_connector_worker", "MultiConnectorModel.bind_connector_metadata "
            "MultiConnectorModel.build_connector_meta MultiConnectorModel.forward MultiConnectorModel.get_finished "
            "MultiConnectorModel.get_transfer_results MultiConnectorModel.handle_preemptions "
            "MultiConnectorModel.register_finished_partial_tail MultiConnectorModel.request_finished "
            "MultiConnectorModel.update_connector_output RankOutputAggregator.aggregate "
            "RankOutputAggregator.from_connector aggregate_multi_worker_meta aggregate_multi_stats", MULTI_WORKER),
    **_each(f"{_REF}.connector_worker_child", "ScriptedWorkerChild.call ScriptedWorkerChild.build_connector_meta "
            "aggregate_worker_meta aggregate_stats", MULTI_WORKER),
    f"{_REF}.offload.simple_cpu_connector_config.SimpleCPUConnectorSettings": RECORD,
    **_each(f"{_TIER}.async_lookup", "AsyncLookupManager AsyncLookupManager.cleanup AsyncLookupManager.lookup "
            "AsyncLookupManager.mark_miss LookupPhase LookupState", TIERING),
    **_each(f"{_TIER}.backpressure", "DropStorePolicy.on_store_skipped DropStorePolicy.should_store "
            "ThrottledDropPolicy.should_store EMABackpressureDetector.on_store_completed EMABackpressureDetector.reset "
            "EMABackpressureDetector.should_store EMABackpressureDetector.update", TIERING),
    **_each(f"{_TIER}.example_tier", "ExampleTier ExampleTier.lookup ExampleTier.submit_load ExampleTier.submit_store "
            "ExampleTier.on_new_request", TIERING),
    **_each(f"{_TIER}.lookup_metrics", "LookupMetrics LookupMetrics.on_lookup LookupMetrics.on_new_request "
            "LookupMetrics.on_request_allocated LookupMetrics.on_request_finished", TIERING),
    **_each(f"{_TIER}.fs_tier", "FileSystemTier FileSystemTier.finish_job FileSystemTier.lookup "
            "FileSystemTier.lose_file FileSystemTier.on_request_finished FileSystemTier.submit_load "
            "FileSystemTier.submit_store FileSystemTier.truncate_file", TIERING),
    **_each(f"{_TIER}.obj_tier", "ObjectStoreTier ObjectStoreTier.finish_job ObjectStoreTier.truncate_file "
            "ObjectStoreTier.arm ObjectStoreTier.submit_load ObjectStoreTier.submit_store", TIERING),
    **_each(f"{_TIER}.kvcr_tier", "KVCRTier KVCRTier.lookup KVCRTier.submit_load KVCRTier.submit_store "
            "KVCRTier.request_pin KVCRTier.serve_external_requests", TIERING),
    **_each(f"{_TIER}.example_tier", "PolledTier PolledTier.peer_request PolledTier.serve_external_requests",
            TIERING),
    f"{_TIER}.tier_base.SecondaryTier.serve_external_requests": TIERING,
    f"{_TIER}.manager.TieringOffloadingManager.create_store_job": TIERING + " (a tier serving a peer calls it and "
    "then owns the job it registers: alone, the job is one no tier knows)",
    **_each(f"{_TIER}.manager", "PendingPromotion RequestState", RECORD),
    **_each(f"{_TIER}.tier_base", "JobResult TransferJob TierEvent", RECORD),
    **_each(f"{_TIER}.tier_base", "PrimaryBuffer PrimaryBuffer.read PrimaryBuffer.write", TIERING),
    **_each(f"{_TIER}.tier_base", "SecondaryTier SecondaryTier.lookup SecondaryTier.on_new_request "
            "SecondaryTier.on_request_finished SecondaryTier.submit_load SecondaryTier.submit_store", ABSTRACT),
    **_each(f"{_REF}.block_hash_to_block_map", "BlockHashToBlockMap BlockHashToBlockMap.contain "
            "BlockHashToBlockMap.get_one_block BlockHashToBlockMap.insert BlockHashToBlockMap.pop", INTERNAL),
    **_each(f"{_REF}.free_block_queue", "FreeKVCacheBlockQueue FreeKVCacheBlockQueue.append "
            "FreeKVCacheBlockQueue.append_n FreeKVCacheBlockQueue.iter_blocks_after FreeKVCacheBlockQueue.popleft_n "
            "FreeKVCacheBlockQueue.prepend_n FreeKVCacheBlockQueue.remove", INTERNAL),
    **_each(f"{_REF}.kv_cache_block", "KVCacheBlock KVCacheBlock.set_block_hash", INTERNAL),
    **_each(f"{_REF}.single_type_manager", "SingleTypeKVCacheManager "
            "SingleTypeKVCacheManager.add_local_computed_blocks "
            "SingleTypeKVCacheManager.allocate_external_computed_blocks SingleTypeKVCacheManager.allocate_new_blocks "
            "SingleTypeKVCacheManager.cache_blocks SingleTypeKVCacheManager.find_longest_cache_hit "
            "SingleTypeKVCacheManager.free SingleTypeKVCacheManager.get_num_blocks_to_allocate "
            "SingleTypeKVCacheManager.get_num_skipped_tokens SingleTypeKVCacheManager.pop_blocks_for_free "
            "SingleTypeKVCacheManager.reachable_block_mask SingleTypeKVCacheManager.remove_skipped_blocks "
            "SingleTypeKVCacheManager.finalize_partial_tail_offload null_head_len", INTERNAL),
    **_each(f"{_REF}.full_attention_manager", "FullAttentionManager FullAttentionManager.cache_blocks "
            "FullAttentionManager.find_longest_cache_hit", INTERNAL),
    **_each(f"{_REF}.sliding_window_manager", "SlidingWindowManager SlidingWindowManager.find_longest_cache_hit "
            "SlidingWindowManager.get_num_skipped_tokens SlidingWindowManager.reachable_block_mask", INTERNAL),
    **_each(f"{_REF}.chunked_local_manager", "ChunkedLocalAttentionManager "
            "ChunkedLocalAttentionManager.find_longest_cache_hit ChunkedLocalAttentionManager.get_num_skipped_tokens",
            INTERNAL),
    **_each(f"{_REF}.cross_attention_manager", "CrossAttentionManager CrossAttentionManager.add_local_computed_blocks "
            "CrossAttentionManager.allocate_external_computed_blocks CrossAttentionManager.cache_blocks "
            "CrossAttentionManager.find_longest_cache_hit", INTERNAL),
    **_each(f"{_REF}.mamba_manager", "MambaManager MambaManager.allocate_new_blocks MambaManager.cache_blocks "
            "MambaManager.find_longest_cache_hit MambaManager.get_num_blocks_to_allocate "
            "MambaManager.get_num_skipped_tokens MambaManager.pop_blocks_for_free MambaManager.remove_skipped_blocks "
            "MambaManager.finalize_partial_tail_offload MambaManager.reachable_block_mask", INTERNAL),
    **_each(f"{_REF}.rswa_manager", "RSWAManager RSWAManager.remove_skipped_blocks", INTERNAL),
    **_each(f"{_REF}.scheduler_mamba_split", "scheduler_split_config split_scheduled_chunk store_shared_prefix_boundary",
            "the reference Scheduler's hooks into mamba_block_aligned_split (fuzzed itself), called with its "
            "own checked state"),
    **_each(f"{_REF}.scheduler_cadence", "adaptive_long_prefill_threshold PrefillCadence PrefillCadence.defer_prefills "
            "PrefillCadence.note_skipped PrefillCadence.note_admitted PrefillCadence.after_waiting_loop "
            "PrefillCadence.after_schedule PrefillCadence.check_invariants",
            "the reference Scheduler's prefill-cadence hooks (issue #22), called with its own state and a "
            "validated SchedulerConfig (its new fields are fuzzed through SchedulerConfig)"),
    **_each(f"{_REF}.scheduler_encoder", "EncoderCacheManager.allocate EncoderCacheManager.can_allocate "
            "EncoderCacheManager.check_and_update_cache EncoderCacheManager.free EncoderCacheManager.free_encoder_input "
            "EncoderCacheManager.get_cached_input_ids EncoderCacheManager.get_cached_num_encoder_embeds "
            "EncoderState.commit EncoderState.try_schedule "
            "EncoderState.unschedule EncoderState.end_step EncoderState.forget encoder_input_updates "
            "allocate_encoder_inputs features_in_window free_encoder_inputs "
            "num_encoder_embeds try_schedule_encoder_inputs",
            "a step of the reference Scheduler's encoder gate (issue #22), called at its hooks with its own "
            "checked requests (vLLM's EncoderCacheManager is driven only by its Scheduler too); the budget and "
            "the cache constructors are fuzzed"),
    **_each(f"{_REF}.scheduler_lora", "running_loras exceeds_max_loras",
            "the reference Scheduler's max_loras rule (issue #22), called in its waiting loop with its own "
            "checked requests; max_loras itself is fuzzed (check_max_loras, Scheduler)"),
    **_each(f"{_REF}.scheduler_sessions", "SessionSteps SessionSteps.check_invariants SessionSteps.is_session "
            "SessionSteps.waiting_for_input add_session add_update check_new_session enqueue_waiting forget "
            "handle_stopped",
            "the reference Scheduler's streaming-session hooks (issue #22), called with the Scheduler and its "
            "own SessionSteps; reached (and fuzzed) through Scheduler.add_request / update_from_output"),
    **_each(f"{_REF}.scheduler_connector_stats", "check_invariants connector_stats flag_connector_reset "
            "record_connector_prefix_cache_stats set_kv_fetch_stage",
            "the reference Scheduler's make_stats bookkeeping with a KV connector (issue #22), called with its "
            "own ConnectorState; reached through Scheduler.make_stats"),
    **_each(f"{_REF}.scheduler_aux_output", "AuxOutputControl AuxOutputControl.build_connector_meta "
            "AuxOutputControl.cap_external_hit AuxOutputControl.check_invariants AuxOutputControl.max_cache_hit "
            "AuxOutputControl.request_finished AuxOutputControl.request_loading full_attention_group_id",
            "the reference Scheduler's aux-output connector (vLLM's AuxOutputSchedulerConnector, issue #22), "
            "built and called by the Scheduler with its own manager and checked requests; reached (and fuzzed) "
            "through Scheduler(aux_output=True)"),
    **_each(f"{_REF}.scheduler_structured_output", "StructuredOutputState StructuredOutputState.accepts "
            "StructuredOutputState.add StructuredOutputState.check_invariants StructuredOutputState.filter_drafts "
            "StructuredOutputState.forget StructuredOutputState.ready_to_schedule StructuredOutputState.validate "
            "strip_padding GrammarOracle GrammarOracle.accept_tokens GrammarOracle.grammar_state "
            "GrammarOracle.validate_tokens",
            "the reference Scheduler's structured-output hooks (vLLM's grammar checks, issues #22/#28), built and "
            "called by the Scheduler with its own checked requests; the oracle is a Protocol (no behaviour); "
            "reached (and refused bad input) through Scheduler(grammar_oracle=...) / add_request"),
    **_each(f"{_REF}.scheduler_structured_output", "ScriptedGrammarOracle ScriptedGrammarOracle.accept_tokens "
            "ScriptedGrammarOracle.grammar_state ScriptedGrammarOracle.limit_drafts "
            "ScriptedGrammarOracle.reject_sampled ScriptedGrammarOracle.set_state "
            "ScriptedGrammarOracle.validate_tokens",
            "the state machines' scripted grammar answers (a test double both schedulers ask); its setters refuse "
            "bad input by field (tests/impl/reference/test_scheduler_structured_output.py)"),
    **_each(f"{_REF}.sink_full_attention_manager", "SinkFullAttentionManager", INTERNAL),
    # HiSparse (issue #23): the managers are HiSparsePool's building blocks; the pool is the conformance
    # harness's reference side, driven by kvref.models.machines.hisparse_pool with generated valid calls
    **_each(f"{_REF}.hisparse_hot_manager", "HiSparseHotManager HiSparseHotManager.add_local_computed_blocks "
            "HiSparseHotManager.allocate_external_computed_blocks HiSparseHotManager.allocate_new_blocks "
            "HiSparseHotManager.get_num_blocks_to_allocate HiSparseHotManager.get_num_required_blocks "
            "HiSparseHotManager.has_hot HiSparseHotManager.pop_blocks_for_free HiSparseHotManager.require_hot",
            INTERNAL),
    **_each(f"{_REF}.hisparse_resident_manager", "HiSparseResidentManager "
            "HiSparseResidentManager.add_local_computed_blocks HiSparseResidentManager.adopt_resident_page "
            "HiSparseResidentManager.allocate_external_computed_blocks HiSparseResidentManager.allocate_new_blocks "
            "HiSparseResidentManager.drop_resident_page HiSparseResidentManager.get_num_blocks_to_allocate "
            "HiSparseResidentManager.get_residency_row HiSparseResidentManager.get_resident_page "
            "HiSparseResidentManager.pop_blocks_for_free", INTERNAL),
    **_each(f"{_REF}.hisparse_gpu_group", "HiSparseGpuGroup HiSparseGpuGroup.cache_blocks "
            "HiSparseGpuGroup.find_longest_cache_hit", INTERNAL),
    **_each(f"{_REF}.hisparse_source_manager", "HiSparseSourceManager HiSparseSourceManager.bind_host_pool "
            "HiSparseSourceManager.cache_blocks HiSparseSourceManager.get_num_blocks_to_allocate "
            "HiSparseSourceManager.pop_blocks_for_free HiSparseSourceManager.allocate_external_computed_blocks "
            "HiSparseSourceManager.publish_blocks HiSparseSourceManager.take_new_block_ids", INTERNAL),
    **_each(f"{_REF}.hisparse_pool", "HiSparsePool.adopt HiSparsePool.drop HiSparsePool.free "
            "HiSparsePool.require_hot HiSparsePool.block_hashes HiSparsePool.cache_blocks",
            "conformance-harness side of kvref.models.machines.hisparse_pool, "
            "called only with the harness's generated, valid request ids and token counts"),
    # the HiSparse coordinator (#23) is built by HiSparsePool over its own managers and reached through
    # the pool's coordinator calls (HiSparseManagerCalls), which the harness drives with generated ids,
    # counts and worker reports of transfers it was sent
    **_each(f"{_REF}.hisparse_block_pool", "ReuseWatchingBlockPool ReuseWatchingBlockPool.get_new_blocks "
            "ReuseWatchingBlockPool.unpin_blocks ReuseWatchingBlockPool.free_blocks SharedEventQueueBlockPool",
            INTERNAL),
    **_each(f"{_REF}.hisparse_coordinator", "HiSparseCoordinator HiSparseCoordinator.advance_scheduled "
            "HiSparseCoordinator.commit_computed_blocks HiSparseCoordinator.complete_host_import "
            "HiSparseCoordinator.finish_host_import HiSparseCoordinator.free "
            "HiSparseCoordinator.plan_prefix_materialization HiSparseCoordinator.record_pending_host_import "
            "HiSparseCoordinator.update_residency HiSparseCoordinator.update_spills", INTERNAL),
    **_each(f"{_REF}.hisparse_publication", "HiSparsePublication.publish_when_ready "
            "HiSparsePublication.release_completed_host_copies", INTERNAL),
    **_each(f"{_REF}.hisparse_invariants", "check_hisparse_ref_counts", INTERNAL),
    **_each(f"{_REF}.hisparse_views", "HiSparseWorkerViews.all_context_pages_resident "
            "HiSparseWorkerViews.build_row_mirrors HiSparseWorkerViews.take_residency_updates", INTERNAL),
    **_each(f"{_REF}.hisparse_state", "HiSparseRequestState KVCacheBlockCopy PendingPublication PendingSpill SparseKVOffloadCommand "
            "SparseKVPageTransfer SparseKVResidencyUpdate SparseKVRowMirror",
            "the HiSparse coordinator's records (vLLM's names), built only by it"),
    **_each("kvref.impl.hisparse_calls", "HiSparseManagerCalls.allocate HiSparseManagerCalls.get_num_blocks_to_allocate "
            "HiSparseManagerCalls.is_running HiSparseManagerCalls.advance_scheduled "
            "HiSparseManagerCalls.all_context_pages_resident HiSparseManagerCalls.build_row_mirrors "
            "HiSparseManagerCalls.finish_host_import HiSparseManagerCalls.observe_pools "
            "HiSparseManagerCalls.take_residency_updates HiSparseManagerCalls.update_residency "
            "HiSparseManagerCalls.update_spills HiSparseManagerCalls.find_longest_cache_hit "
            "HiSparseManagerCalls.take_host_block_copies HiSparseManagerCalls.release_completed_host_copies "
            "HiSparseManagerCalls.complete_host_import HiSparseManagerCalls.plan_prefix_materialization",
            "the manager calls HiSparsePool and VllmHiSparsePool share (#26), "
            "called only through those pools by kvref.models.machines.hisparse_pool with generated valid calls"),
    **_each(f"{_REF}.circular_buffer_manager", "CircularBufferManager CircularBufferManager.add_local_computed_blocks "
            "CircularBufferManager.allocate_external_computed_blocks CircularBufferManager.allocate_new_blocks "
            "CircularBufferManager.cache_blocks CircularBufferManager.find_longest_cache_hit "
            "CircularBufferManager.get_num_blocks_to_allocate CircularBufferManager.get_num_skipped_tokens "
            "CircularBufferManager.remove_skipped_blocks", INTERNAL),
    **_each(f"{_REF}.kv_cache_coordinator", "HybridKVCacheCoordinator HybridKVCacheCoordinator.find_longest_cache_hit "
            "HybridKVCacheCoordinator.get_num_cacheable_tokens KVCacheCoordinator KVCacheCoordinator.allocate_new_blocks "
            "KVCacheCoordinator.allocate_new_computed_blocks KVCacheCoordinator.cache_blocks "
            "KVCacheCoordinator.emit_cached_block_events KVCacheCoordinator.find_longest_cache_hit "
            "KVCacheCoordinator.free KVCacheCoordinator.get_blocks KVCacheCoordinator.get_num_blocks_to_allocate "
            "KVCacheCoordinator.get_num_cacheable_tokens KVCacheCoordinator.is_running "
            "KVCacheCoordinator.pop_blocks_for_free KVCacheCoordinator.remove_skipped_blocks "
            "KVCacheCoordinatorNoPrefixCache KVCacheCoordinatorNoPrefixCache.find_longest_cache_hit SpecGroup "
            "UnitaryKVCacheCoordinator UnitaryKVCacheCoordinator.find_longest_cache_hit get_kv_cache_coordinator "
            "get_manager_for_kv_cache_spec manager_class_for_spec scheduler_spec "
            "HybridKVCacheCoordinator.find_longest_cache_hit_per_group eagle_proof_margin "
            "partial_hash_hits_enabled context_parallel_kwargs", INTERNAL),
    **_each(f"{_REF}.scheduler_queue", "WaitingQueue WaitingQueue.add_request WaitingQueue.prepend_request "
            "WaitingQueue.prepend_requests WaitingQueue.remove_requests WaitingQueue.remove_request priority_key", INTERNAL),
    **_each(f"{_REF}.block_hash", "BlockHashListWithBlockSize RequestBlockHasher RequestBlockHasher.block_hashes "
            "RequestBlockHasher.forget RequestBlockHasher.peek", INTERNAL),
    **_each(f"{_REF}.block_hash", "compute_none_hash get_block_hash get_group_id sha256 hash_block_tokens "
            "resolve_block_hashes make_block_hash_with_group_id block_extra_keys", HOT),
    **_each(f"{_REF}.block_hash", "sha256_cbor xxhash xxhash_cbor resolve_none_hash_seed has_extra_hash_inputs "
            "to_event_extra_keys", HOT),
    **_each(f"{_REF}.prefix_cache_stats", "PrefixCacheStats PrefixCacheStats.record", RECORD),
    **_each(f"{_REF}.kv_cache_metrics", "BlockMetricsState KVCacheMetricsCollector.on_block_accessed "
            "KVCacheMetricsCollector.on_block_allocated KVCacheMetricsCollector.on_block_evicted", INTERNAL),
    f"{_REF}.kv_cache_metrics.KVCacheEvictionEvent": RECORD,
    f"{_REF}.kv_cache_manager.KVCacheManager.pop_blocks_for_free": (
        "hands a request's blocks to the caller (a KV connector still reading them), who frees them later: "
        "reference counts exceed table slots until then, by design (vLLM's method of the same name)"),
    f"{_REF}.block_pool.group_suffix": HOT,
    # issue #26: the plain core under the checked BlockPool, and the checks themselves
    **_each(f"{_REF}.block_pool", "BlockPoolCore BlockPoolCore.cache_full_blocks BlockPoolCore.cache_partial_block "
            "BlockPoolCore.emit_cached_block_events BlockPoolCore.evict_blocks BlockPoolCore.free_blocks "
            "BlockPoolCore.get_cached_block BlockPoolCore.get_new_blocks BlockPoolCore.is_block_writable "
            "BlockPoolCore.move_block_hashes BlockPoolCore.touch",
            "the plain core of BlockPool, trusting its arguments as vLLM's BlockPool does: the KV cache managers "
            "call it with their own tables' blocks; everyone constructs BlockPool, whose same methods check "
            "first and are fuzzed"),
    **_each(f"{_REF}.block_pool_checks", "as_list check_block_ids check_cache_full_blocks check_cache_partial_block "
            "check_emit_cached_block_events check_get_cached_block check_group_id check_move_block_hashes check_own "
            "check_pool_args own_blocks",
            "an argument check of a BlockPool entry, called by that entry with its own pool; fuzzed through it"),
    **_each(f"{_REF}.kv_cache_manager_checks", "check_allocate_slots check_group_ids check_kv_cache_blocks "
            "check_request check_request_id",
            "an argument check of a KVCacheManager / reference adapter entry, called by that entry with its own "
            "manager; fuzzed through it"),
    **_each("kvref.spec.mathutil", "cdiv round_down round_up", HOT),
    **_each("kvref.spec.pool_sizing", "no_memory_error too_long_error",
            "vLLM's startup error texts, built (not raised) by the memory checks from the values they have "
            "already validated; the checks themselves are fuzzed"),
    **_each("kvref.spec.errors", "check_choice check_int check_sequence",
            "the validators themselves: field and value are checked; the bounds/choices are kvref's own constants"),
    f"{_REF}.kv_cache_manager.KVCacheManager.check_invariants": "invariant check (a test tool), not an input path",
    "kvref.spec.grouping.check_exact_partition": ("postcondition of get_kv_cache_groups (vLLM's "
                                                  "_check_exact_partition): its AssertionError means a kvref bug"),
    f"{_REF}.kv_cache_manager.KVCacheBlocks": RECORD,
    f"{_REF}.scheduler.request_state": RECORD,
    **_each(f"{_REF}.scheduler_spec_decode", "SpecDecodeState SpecDecodeState.after_schedule "
            "SpecDecodeState.check_invariants SpecDecodeState.check_sampled SpecDecodeState.forget "
            "SpecDecodeState.mark_padded SpecDecodeState.note_scheduled SpecDecodeState.num_spec "
            "SpecDecodeState.pad_new_decode SpecDecodeState.take_running_drafts SpecDecodeState.unschedule "
            "SpecDecodeState.update_draft_token_ids SpecDecodeState.verify SpecDecodeState.invalid_in_output "
            "SpecDecodeState.add SpecDecodeState.freed drafts_unused", SPEC_STEP),
    "kvref.impl.scheduler_types.SpecDecodingStats": RECORD,
    "kvref.impl.scheduler_types.RequestSpecDecodeMetrics": RECORD,
    **_each(f"{_REF}.scheduler_connector", "ScriptedConnector.build_connector_meta "
            "ScriptedConnector.get_num_new_matched_tokens ScriptedConnector.on_new_request "
            "ScriptedConnector.request_finished ScriptedConnector.update_connector_output "
            "ScriptedConnector.update_state_after_alloc ScriptedConnector.get_loaded_kv_cache_group_ids",
            CONNECTOR_API),
    **_each(f"{_REF}.scheduler_connector_multi", "MultiScriptedConnector.build_connector_meta "
            "MultiScriptedConnector.get_num_new_matched_tokens MultiScriptedConnector.on_new_request "
            "MultiScriptedConnector.request_finished MultiScriptedConnector.update_connector_output "
            "MultiScriptedConnector.update_state_after_alloc MultiScriptedConnector.get_loaded_kv_cache_group_ids",
            CONNECTOR_API),
    **_each(f"{_REF}.kv_events", "AllBlocksCleared BlockRemoved BlockStored event_to_plain "
            "kv_cache_spec_sliding_window", RECORD),
    **_each(f"{_REF}.offload.cache_policy", "CachePolicy CachePolicy.evict CachePolicy.get CachePolicy.insert "
            "CachePolicy.mark_evictable CachePolicy.mark_non_evictable CachePolicy.on_request_access "
            "CachePolicy.on_request_finished CachePolicy.on_store_miss CachePolicy.remove CachePolicy.touch", POLICY),
    **_each(f"{_REF}.offload.lru_policy", "LRUCachePolicy.evict LRUCachePolicy.get LRUCachePolicy.insert "
            "LRUCachePolicy.mark_evictable LRUCachePolicy.mark_non_evictable LRUCachePolicy.on_request_access "
            "LRUCachePolicy.on_request_finished LRUCachePolicy.remove LRUCachePolicy.touch", POLICY),
    **_each(f"{_REF}.offload.arc_policy", "ARCCachePolicy.evict ARCCachePolicy.get ARCCachePolicy.insert "
            "ARCCachePolicy.on_request_finished ARCCachePolicy.on_store_miss ARCCachePolicy.remove "
            "ARCCachePolicy.touch", POLICY),
    f"{_REF}.offload.cache_policy.ChunkStatus": RECORD,
    **_each(f"{_REF}.offload.cpu_offloading_manager", "OffloadingEvent PrepareStoreOutput", RECORD),
    **_each(f"{_REF}.offload.canonical_mapping", "ReferenceMapping", RECORD),
    **_each(f"{_REF}.offload.offloading_scheduler", "GroupOffloadConfig OffloadingMeta TransferJob", RECORD),
    **_each(f"{_REF}.offload.offload_event_tracker", "ChunkEventMetadata EventGroupSpec", RECORD),
    **_each(f"{_REF}.offload.simple_cpu_offload_scheduler", "LoadRequestState SimpleOffloadMeta StoreRequestState "
            "TransferMeta", RECORD),
    f"{_REF}.offload.keys.LookupResult": "an enum: its members are the values",
    "kvref.impl.request.RequestStatus": "an enum: its members are the values",
    f"{_REF}.scheduler_pause.PauseState": "an enum: its members are the values (checked by as_pause_state)",
    f"{_REF}.offload.offloading_scheduler.swa_store_mask": CONNECTOR_STEP,
    **_each("kvref.impl.scheduler_types", "RequestState ScheduledRequest SchedulerOutput SchedulerSnapshot", RECORD),
    **_each("kvref.impl.interface", "KVCacheManagerLike KVCacheManagerLike.allocate_slots KVCacheManagerLike.forget "
            "KVCacheManagerLike.free KVCacheManagerLike.get_block_ids KVCacheManagerLike.get_computed_blocks",
            ABSTRACT),
    "kvref.impl.interface.register_manager": "registration hook for a new implementation (code, not data)",
    **_each("kvref.spec.kv_cache_interface", "AttentionSpec KVCacheSpec KVCacheSpec.max_memory_usage_bytes "
            "KVCacheSpec.max_num_blocks_per_req", ABSTRACT + " (every concrete spec overrides this method)"),
    **_each("kvref.spec.planning", "GroupPlan KVCachePlan", RECORD),
    **_each("kvref.spec.planning_hisparse", "HiSparsePlan HiSparseTensor", RECORD),
    "kvref.spec.kv_cache_tensors.KVCacheTensor": RECORD,
    "kvref.spec.kv_cache_tensors.check_kv_cache_tensors": "an invariant checker (KVCachePlan.check_invariants): "
                                                          "asserts by design",
    **_each("kvref.spec.planning_parallel", "ParallelKVCachePlan WorkerPlan", RECORD),
    **_each("kvref.impl.run_trace.format", "block_table cached_block_ids encode_lengths int_column sched_record "
            "sched_rows update_sampled", CODEC),
    **_each("kvref.impl.torch.block_pool", "as_device group_key TorchBlockPool.cache_full_block "
            "TorchBlockPool.cache_partial_block TorchBlockPool.insert_hash TorchBlockPool.get_one_block "
            "TorchBlockPool.primary", TORCH),
    **_each("kvref.impl.torch.block_table", "BlockTables BlockTables.batch BlockTables.clear_front BlockTables.extend "
            "BlockTables.get BlockTables.null_head BlockTables.num_blocks BlockTables.pop BlockTables.slice "
            "BlockTables.touch_row slot_mapping", TORCH),
    **_each("kvref.impl.torch.group_kinds", "ChunkedLocalKind ChunkedLocalKind.admission_cap ChunkedLocalKind.find_hit "
            "ChunkedLocalKind.skipped_tokens FullAttentionKind FullAttentionKind.find_hit GroupKind "
            "GroupKind.admission_cap GroupKind.cache_mask GroupKind.find_hit GroupKind.skipped_tokens MambaKind "
            "MambaKind.find_hit MambaKind.skipped_tokens SlidingWindowKind SlidingWindowKind.admission_cap "
            "SlidingWindowKind.blocks_for_hit SlidingWindowKind.cache_mask SlidingWindowKind.find_hit "
            "SlidingWindowKind.skipped_tokens kind_for", TORCH),
    **_each("kvref.impl.torch.hashing", "RequestHashes RequestHashes.forget RequestHashes.get coarse_hashes "
            "hash_block_tokens none_hash none_hash_seed sha256_pickle", HOT),
    **_each("kvref.impl.torch.kv_cache_tensors", "KVCacheTensors.kv KVCacheTensors.state KVCacheTensors.write_kv "
            "page_elems", TORCH),
    **_each("kvref.impl.torch.mamba_state", "MambaStateRunner MambaStateRunner.reset MambaStateRunner.run_chunk scan",
            TORCH),
    "kvref.impl.torch.manager.TorchKVCacheManager.batch_block_tables": TORCH,
    **_each("kvref.impl.torch.model_runner", "Chunk DataPathRunner.dense_step DataPathRunner.max_error "
            "DataPathRunner.run_step DataPathRunner.write_only TokenModel TokenModel.qkv", TORCH),
    **_each("kvref.impl.torch.offload_copy", "CopyHandle CopyHandle.wait_stream OffloadCopier.load OffloadCopier.store "
            "merge_runs", TORCH),
    **_each("kvref.impl.torch.paged_attention", "AttentionMask AttentionMask.allowed AttentionMask.for_spec "
            "dense_attention paged_attention", TORCH),
    **_each("kvref.impl.vllm.kv_events", "DecodedBatch", RECORD),
    "kvref.impl.vllm.kv_events.vllm_event_to_plain": VLLM,
    **_each("kvref.impl.vllm.record", "RecordingAsyncScheduler RecordingScheduler build_header record_settings "
            "spec_record", VLLM),
    **_each("kvref.spec.hf_config", "ModelLayout ModelLayout.engine_config mamba_state", HF),
    **_each(f"{_P2P}.client", "ClientRequest ClientRole ClientRole.collect_results ClientRole.finish "
            "ClientRole.on_abort_ack ClientRole.on_transfer_done ClientRole.request_blocks Load ClientRole.expired_lookup "
            "ClientRole.flush_pending_lookups ClientRole.on_lookup_resp ClientRole.register_lookup", P2P),
    **_each(f"{_P2P}.control", "Conn Conn.send ControlPlane ControlPlane.connect ControlPlane.peer_went_away", P2P),
    **_each(f"{_P2P}.manager", "P2PRequest P2PTierManager P2PTierManager.get_finished_jobs P2PTierManager.lookup "
            "P2PTierManager.on_new_request P2PTierManager.on_request_finished P2PTierManager.shutdown "
            "P2PTierManager.submit_load P2PTierManager.submit_store P2PTierManager.on_schedule_end "
            "P2PTierManager.serve_external_requests P2PTierManager.drain_jobs", P2P),
    **_each(f"{_P2P}.parent", "ScriptedParent.create_store_job ScriptedParent.hold ScriptedParent.lookup "
            "ScriptedParent.on_new_request ScriptedParent.on_request_finished ctx_key", P2P),
    **_each(f"{_P2P}.messages", "abort_ack abort_fetch connect connect_ack fetch transfer_done validate lookup "
            "lookup_resp", P2P),
    **_each(f"{_P2P}.world", "P2PWorld.inject", "harness hook of the P2P reference world: delivers an out-of-protocol message the machine drew (kvref.models.machines.p2p); the message itself is checked by messages.validate on receipt"),
    **_each(f"{_P2P}.server", "Round ServerRequest ServerRole ServerRole.add_stored_blocks ServerRole.collect_results "
            "ServerRole.drain_pending_aborts ServerRole.finish ServerRole.on_abort_fetch ServerRole.on_fetch Xfer "
            "ActiveLookup ServerRole.on_lookup ServerRole.serve_external_requests",
            P2P),
    **_each(f"{_P2P}.session", "Session Session.add_stored_blocks Session.finish_request Session.poll "
            "Session.request_blocks Session.flush_pending_lookups Session.register_lookup "
            "Session.serve_external_requests", P2P),
    **_each(f"{_P2P}.transport", "DataPlane DataPlane.add_remote_peer DataPlane.cancel DataPlane.complete "
            "DataPlane.poll DataPlane.remove_remote_peer DataPlane.write_blocks Transfer DataPlane.set_peer_fault "
            "DataPlane.break_transfers DataPlane.fail_submissions peer_fault_status", P2P),
}


@functools.lru_cache(maxsize=1)
def discover() -> dict[str, str]:
    return _discover()


def _resolve(key: str):
    parts = key.split(".")
    for i in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:i]))
        except ImportError:
            continue
        for name in parts[i:]:
            obj = getattr(obj, name)
        return obj
    raise LookupError(key)


def _takes_no_argument(key: str, kind: str) -> bool:
    try:
        params = inspect.signature(_resolve(key)).parameters
    except (TypeError, ValueError):
        return False
    return not [p for p in params if p not in ("self", "cls")]


@functools.lru_cache(maxsize=1)
def covered() -> frozenset[str]:
    out = set()
    for name, (fn, _) in constructors().items():
        out.add(ALIASES.get(name) or qualified(fn))
    out.update(qualified(fn) for fn, _ in functions().values())
    out.update(qualified(build()[3]) for _, build in method_cases())
    return frozenset(out)


def test_every_public_entry_point_is_fuzzed_or_excluded():
    found = discover()
    cov = covered()
    missing = sorted(k for k, kind in found.items()
                     if k not in cov and k not in EXCLUDED and not _takes_no_argument(k, kind))
    assert not missing, ("public entry points neither in tests/hardening/api_targets.py nor in EXCLUDED "
                         "(add a valid argument set, or an exclusion with its reason):\n  " + "\n  ".join(missing))


def test_exclusions_are_current():
    found = discover()
    cov = covered()
    stale = sorted(k for k in EXCLUDED if k not in found)
    both = sorted(k for k in EXCLUDED if k in cov)
    assert not stale, f"EXCLUDED names entry points that no longer exist: {stale}"
    assert not both, f"EXCLUDED names entry points the catalogue covers (drop the exclusion): {both}"
    unknown = sorted(k for k in cov if k not in found)
    assert not unknown, f"the catalogue names entry points discovery does not see: {unknown}"


def test_discovery_sees_the_main_entry_points():
    """The walk itself must not go blind (a wrong package name would make the test above vacuous)."""
    found = discover()
    for key in ("kvref.impl.reference.block_pool.BlockPool.free_blocks",
                "kvref.impl.reference.kv_cache_manager.KVCacheManager.allocate_slots",
                "kvref.impl.reference.offload.simple_cpu_offload_scheduler.SimpleCPUOffloadScheduler",
                "kvref.spec.planning.plan_kv_cache", "kvref.models.conformance.trace.Trace.loads",
                "kvref.impl.run_trace.reader.TraceReader", "kvref.impl.vllm.kv_events.decode_batch"):
        assert key in found, key
    assert len(found) > 400
