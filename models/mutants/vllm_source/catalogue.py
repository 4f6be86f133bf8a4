"""The catalogue of source faults in vLLM 0.33.0's KV-cache code (and refactors that must pass).

Each entry is an exact ``old -> new`` edit of one file of the installed ``vllm`` package
(:class:`~kvref.models.mutants.vllm_source.overlay.SourceFault`). Three classes:

* ``historic`` — the pre-fix logic of a merged vLLM fix (or the fix as first merged, where a later
  PR corrected it), re-applied to 0.33.0's code: the bug the PR/issue number names comes back;
* ``classic`` — textbook faults (off-by-one, wrong comparison, dropped call, swapped order, wrong
  queue end) in code the checks can reach;
* ``neutral`` — behaviour-preserving refactors (a local renamed, independent statements reordered,
  equivalent arithmetic, a helper extracted): the checks must *not* flag them.

Every edit must match exactly once in the installed file; :func:`check_catalogue` says which do
not (a test asserts that none fails on the installed vLLM 0.33.0). The vLLM text quoted in ``old``
is the minimum needed to locate one place; the ``new`` text is the fault, written here.
"""

from __future__ import annotations

import os

from .overlay import CLASSIC, HISTORIC, NEUTRAL, FaultDoesNotApplyError, SourceFault, fault, installed_vllm_dir

_POOL = "v1/core/block_pool.py"
_UTILS = "v1/core/kv_cache_utils.py"
_STM = "v1/core/single_type_kv_cache_manager.py"
_COORD = "v1/core/kv_cache_coordinator.py"
_KVM = "v1/core/kv_cache_manager.py"
_SCHED = "v1/core/sched/scheduler.py"
_QUEUE = "v1/core/sched/request_queue.py"
_ASYNC = "v1/core/sched/async_scheduler.py"
_PLAN = "v1/core/kv_cache_planning.py"
_HSL = "v1/hisparse/layout.py"
_IFACE = "v1/kv_cache_interface.py"
_SIMPLE = "v1/simple_kv_offload/manager.py"
_OFFL = "distributed/kv_transfer/kv_connector/v1/offloading/scheduler.py"

FAULTS: list[SourceFault] = []


def _add(*faults: SourceFault) -> None:
    FAULTS.extend(faults)


# --------------------------------------------------------------------------------------------
# block pool and free queue (v1/core/block_pool.py, kv_cache_utils.py)

_add(
    fault("pool.free_uncached_appended", _POOL,
          "        self.free_block_queue.prepend_n(blocks_to_evict_first)",
          "        self.free_block_queue.append_n(blocks_to_evict_first)",
          CLASSIC, "freed blocks without a hash go to the back of the free queue instead of the front "
                   "(LIFO reuse lost; free-queue order and later evictions change)", behaviour="free-order"),
    fault("pool.free_hash_test_inverted", _POOL,
          "                if block.block_hash is None or not self.enable_caching:",
          "                if block.block_hash is not None or not self.enable_caching:",
          CLASSIC, "wrong comparison: cached blocks are reused first and uncached ones kept (the LRU of "
                   "prefix-cached blocks is inverted)", behaviour="free-order"),
    fault("pool.touch_no_queue_remove", _POOL,
          "            if block.ref_cnt == 0:\n                self.free_block_queue.remove(block)\n",
          "",
          CLASSIC, "dropped call: a prefix hit on a free cached block leaves it in the free queue, so it can "
                   "be handed out while in use", behaviour="prefix-cache"),
    fault("pool.alloc_keeps_stale_hash", _POOL,
          "                self._maybe_evict_cached_block(block)\n",
          "",
          CLASSIC, "dropped call: a reused block keeps its old hash entry, so a later request hits a block "
                   "whose content was overwritten", behaviour="prefix-cache"),
    fault("pool.free_count_off_by_one", _POOL,
          "        return self.free_block_queue.num_free_blocks\n",
          "        return self.free_block_queue.num_free_blocks - 1\n",
          CLASSIC, "off-by-one: one free block fewer is reported (admission refuses what fits)",
          behaviour="admission"),
    fault("pool.cache_hash_shifted", _POOL,
          "        new_block_hashes = block_hashes[num_cached_blocks:]",
          "        new_block_hashes = block_hashes[num_cached_blocks + 1:] + block_hashes[-1:]",
          CLASSIC, "off-by-one: a newly full block is cached under the next block's hash", behaviour="prefix-cache"),
    fault("pool.pop_drops_duplicates", _POOL,
          "            block = blocks.pop(block_id, None)\n            if len(blocks) > 0:\n"
          "                self._cache[key] = blocks\n",
          "            block = blocks.pop(block_id, None)\n",
          CLASSIC, "evicting one of several blocks with the same hash forgets all of them (later hits lost)",
          behaviour="prefix-cache"),
    fault("pool.reset_ignores_used_blocks", _POOL,
          "        if num_used_blocks != 1:  # The null block is always marked as used",
          "        if num_used_blocks < 1:  # The null block is always marked as used",
          CLASSIC, "wrong comparison: reset_prefix_cache succeeds while requests still hold blocks",
          behaviour="prefix-cache"),
    fault("queue.prepend_reversed", _UTILS,
          "        prev_block = self.fake_free_list_head\n        for block in blocks:\n",
          "        prev_block = self.fake_free_list_head\n        for block in reversed(blocks):\n",
          CLASSIC, "swapped order: a freed request's blocks are prepended in reverse (its head block is "
                   "reused first instead of its tail)", behaviour="free-order"),
    fault("hash.not_chained", _UTILS,
          "        hash_function((parent_block_hash, curr_block_token_ids_tuple, extra_keys))",
          "        hash_function((NONE_HASH, curr_block_token_ids_tuple, extra_keys))",
          CLASSIC, "block hashes not chained to the parent: equal blocks after different prefixes collide",
          behaviour="prefix-cache"),
    fault("hash.hasher_skips_first_block", _UTILS,
          "        start_token_idx = len(request.block_hashes) * hash_block_size\n",
          "        start_token_idx = len(request.block_hashes) * hash_block_size\n"
          "        start_token_idx += hash_block_size if not request.block_hashes else 0\n",
          CLASSIC, "off-by-one: a request's first block is never hashed (hashes shifted by one block)",
          behaviour="prefix-cache"),
)

# --------------------------------------------------------------------------------------------
# single-type managers (v1/core/single_type_kv_cache_manager.py)

_add(
    fault("stm.pre40946_gate_uncapped", _STM,
          "        if apply_admission_cap and self.max_admission_blocks_per_request is not None:",
          "        if False and self.max_admission_blocks_per_request is not None:",
          HISTORIC, "pre-#40946 admission gate: the full-sequence gate charges a sliding-window / chunked-local "
                    "group cdiv(L, block) blocks while startup sized it with the recycling-aware bound; a "
                    "max_model_len request startup accepted is never admitted (scheduler waits forever)",
          bug="#39734, PR 40946", behaviour="admission"),
    fault("stm.pr40027_cap_every_step", _STM,
          "        if apply_admission_cap and self.max_admission_blocks_per_request is not None:",
          "        if self.max_admission_blocks_per_request is not None:",
          HISTORIC, "PR 40946 as first merged: the admission cap also clamps the per-step predictor, so "
                    "allocate_new_blocks takes more blocks than were checked ('Cannot get N free blocks')",
          bug="PR 40027, #45856, PR 40946", behaviour="admission"),
    fault("stm.evictable_hits_uncounted", _STM,
          "        return num_new_blocks + num_evictable_blocks\n",
          "        return num_new_blocks\n",
          CLASSIC, "dropped term: prefix-hit blocks sitting in the free queue are not counted against free "
                   "capacity, so admission over-commits the pool", behaviour="admission"),
    fault("stm.required_blocks_floor", _STM,
          "        num_required_blocks = cdiv(num_tokens, self.block_size)\n"
          "        if apply_admission_cap",
          "        num_required_blocks = num_tokens // self.block_size\n"
          "        if apply_admission_cap",
          CLASSIC, "off-by-one: the predictor rounds the blocks a request needs down instead of up",
          behaviour="admission"),
    fault("stm.free_head_first", _STM,
          "        self.block_pool.free_blocks(reversed(self.pop_blocks_for_free(request_id)))",
          "        self.block_pool.free_blocks(self.pop_blocks_for_free(request_id))",
          CLASSIC, "swapped order: a finished request's blocks are freed head first, so its prefix is "
                   "evicted before its tail", behaviour="free-order"),
    fault("stm.free_keeps_cached_count", _STM,
          "        self.num_cached_block.pop(request_id, None)\n        self._partial_hit_reqs",
          "        self._partial_hit_reqs",
          CLASSIC, "dropped bookkeeping: a freed request's cached-block count survives; when the id comes "
                   "back (preemption/resume) its new blocks are taken as already cached", behaviour="prefix-cache"),
    fault("stm.swa_skip_one_too_many", _STM,
          "            num_computed_tokens - self.sliding_window + 1 - self.extra_retained_tokens,",
          "            num_computed_tokens - self.sliding_window + 2 - self.extra_retained_tokens,",
          CLASSIC, "off-by-one: the sliding window skips one token too many, freeing a block the next token "
                   "still attends to", behaviour="sliding-window"),
    fault("stm.swa_never_frees", _STM,
          "            num_computed_tokens - self.sliding_window + 1 - self.extra_retained_tokens,",
          "            0 * num_computed_tokens,",
          CLASSIC, "sliding-window blocks are never freed (the recycling the admission cap assumes is gone)",
          behaviour="sliding-window"),
    fault("stm.chunked_local_skip_next_chunk", _STM,
          "            num_computed_tokens // self.attention_chunk_size\n        ) * self.attention_chunk_size",
          "            num_computed_tokens // self.attention_chunk_size + 1\n        ) * self.attention_chunk_size",
          CLASSIC, "off-by-one: chunked-local attention skips the current chunk too", behaviour="sliding-window"),
    fault("stm.remove_skipped_stops_early", _STM,
          "        for i in range(last_block - 1, first_block - 1, -1):\n            if blocks[i] == self._null_block:",
          "        for i in range(last_block - 1, first_block, -1):\n            if blocks[i] == self._null_block:",
          CLASSIC, "off-by-one: the first block of a skipped range is never freed (a sliding-window request "
                   "leaks its first block until it finishes)", behaviour="sliding-window"),
    fault("stm.skipped_hits_not_dropped", _STM,
          "            new_computed_blocks = new_computed_blocks[num_skipped_blocks:]\n",
          "            new_computed_blocks = new_computed_blocks[num_skipped_blocks - 1:]\n",
          CLASSIC, "off-by-one: one prefix-hit block outside the window is kept besides the null padding "
                   "(the block table is one block too long)", behaviour="sliding-window"),
    fault("stm.swa_hit_window_minus_one", _STM,
          "        blocks = cdiv(window_size - 1, block_size)\n",
          "        blocks = cdiv(window_size - 1, block_size) - 1\n",
          CLASSIC, "off-by-one: a sliding-window prefix hit needs one contiguous cached block fewer than the "
                   "window spans (hits on blocks whose window is not all cached)", behaviour="prefix-cache"),
    fault("stm.full_hit_covers_partial", _STM,
          "        for block_hash in itertools.islice(full_block_hashes, max_length // block_size):",
          "        for block_hash in itertools.islice(full_block_hashes, cdiv(max_length, block_size)):",
          CLASSIC, "off-by-one: a full-attention hit may cover the block holding the last prompt token "
                   "(the hit exceeds max_cache_hit_length)", behaviour="prefix-cache"),
    fault("stm.external_blocks_not_allocated", _STM,
          "        allocated_blocks = self.block_pool.get_new_blocks(num_new_blocks)\n"
          "        req_blocks.extend(allocated_blocks)\n        if self._record_new_block_ids and record_for_zeroing:",
          "        allocated_blocks = self.block_pool.get_new_blocks(max(0, num_new_blocks - 1))\n"
          "        req_blocks.extend(allocated_blocks)\n        if self._record_new_block_ids and record_for_zeroing:",
          CLASSIC, "off-by-one: external (connector) computed tokens get one block fewer than they span",
          behaviour="external-tokens"),
    fault("stm.swa_mask_ignores_dcp", _STM,
          "        block_size = kv_cache_spec.block_size * dcp_world_size\n",
          "        block_size = kv_cache_spec.block_size\n",
          CLASSIC, "dropped factor: the sliding-window publication mask counts rank-local blocks under decode "
                   "context parallelism, so it keeps the wrong blocks (#22: reachable_block_mask)",
          behaviour="prefix-cache"),
    fault("stm.sink_len_rank_block", _STM,
          "        assert sink_len is not None and sink_len > 0 and sink_len % self.block_size == 0\n",
          "        assert sink_len is not None and sink_len > 0 and sink_len % kv_cache_spec.block_size == 0\n",
          CLASSIC, "wrong operand: the sink-attention manager checks its sink against the rank-local block, so "
                   "under DCP it accepts a sink that does not fill whole (DCP-wide) blocks (#22)",
          behaviour="admission"),
    fault("stm.swa_final_tail_one_short", _STM,
          "                        final_segment_start, final_segment_end_block - need\n",
          "                        final_segment_start, final_segment_end_block - need + 1\n",
          CLASSIC, "off-by-one: the offloading connector's final partial segment keeps one block fewer than a "
                   "hit at its end needs (#22: reachable_block_mask)", behaviour="prefix-cache"),
)

# --------------------------------------------------------------------------------------------
# coordinator and KV cache manager

_add(
    fault("coord.pre33775_external_before_touch", _COORD,
          "        for i, manager in enumerate(self.single_type_managers):\n"
          "            manager.add_local_computed_blocks(\n"
          "                request_id,\n"
          "                new_computed_blocks[i],\n"
          "                num_local_computed_tokens,\n"
          "                num_external_computed_tokens,\n"
          "            )\n"
          "        if num_external_computed_tokens > 0:\n"
          "            for i, manager in enumerate(self.single_type_managers):\n"
          "                manager.allocate_external_computed_blocks(",
          "        for i, manager in enumerate(self.single_type_managers):\n"
          "            manager.add_local_computed_blocks(\n"
          "                request_id,\n"
          "                new_computed_blocks[i],\n"
          "                num_local_computed_tokens,\n"
          "                num_external_computed_tokens,\n"
          "            )\n"
          "            if num_external_computed_tokens > 0:\n"
          "                manager.allocate_external_computed_blocks(",
          HISTORIC, "before the two-phase allocation of #33775: each group allocates its external-token blocks "
                    "right after touching its own hits, so an earlier group's get_new_blocks can evict a later "
                    "group's not-yet-touched cache-hit blocks (hybrid pools with a KV connector)",
          bug="#33775", behaviour="external-tokens",
          more=(("                    record_for_zeroing=i not in skip_zeroing_group_ids,\n                )\n",
                 "                    record_for_zeroing=i not in skip_zeroing_group_ids,\n            )\n"),)),
    fault("kvm.processed_basis_dropped", _KVM,
          "            max(0, total_computed_tokens - request.num_in_flight_tokens),",
          "            total_computed_tokens,",
          HISTORIC, "PR 40946 as merged freed sliding-window blocks on the optimistic computed-token basis: "
                    "with async scheduling a step still in flight reads blocks already freed (and reused)",
          bug="PR 40946 (max_in_flight_tokens follow-up)", behaviour="sliding-window"),
    fault("kvm.no_full_sequence_gate", _KVM,
          "            required_blocks = num_blocks_to_allocate + watermark_blocks\n"
          "            if required_blocks > self.block_pool.get_num_free_blocks():\n                return None\n",
          "            required_blocks = num_blocks_to_allocate + watermark_blocks\n",
          CLASSIC, "dropped check: the full-sequence admission gate never refuses (chunked prefill "
                   "over-admits, requests preempt each other mid-prefill)", behaviour="admission"),
    fault("kvm.gate_ignores_max_model_len", _KVM,
          "            full_num_tokens = min(request.num_tokens, self.max_model_len)\n",
          "            full_num_tokens = request.num_tokens + 1\n",
          CLASSIC, "off-by-one: the full-sequence gate charges one token more than the request holds",
          behaviour="admission"),
    fault("kvm.reserved_blocks_ignored", _KVM,
          "        available_blocks = self.block_pool.get_num_free_blocks() - reserved_blocks\n",
          "        available_blocks = self.block_pool.get_num_free_blocks()\n",
          HISTORIC, "before PR 44560: an async KV load is admitted without keeping the blocks in-flight "
                    "prefills still need (a parked load starves them: Running 0, Waiting N)",
          bug="#45388, PR 44560", behaviour="external-tokens"),
    fault("kvm.hit_covers_last_token", _KVM,
          "        # could slightly improve performance in the future.\n        if max_cache_hit_length is None:\n"
          "            max_cache_hit_length = request.num_tokens - 1\n",
          "        # could slightly improve performance in the future.\n        if max_cache_hit_length is None:\n"
          "            max_cache_hit_length = request.num_tokens\n",
          CLASSIC, "off-by-one: a fully cached prompt is taken as a full hit, leaving no token to compute "
                   "the logits from", behaviour="prefix-cache"),
    fault("kvm.cache_lags_one_token", _KVM,
          "        self.coordinator.cache_blocks(request, num_tokens_to_cache)\n",
          "        self.coordinator.cache_blocks(request, num_tokens_to_cache - 1)\n",
          CLASSIC, "off-by-one: a block filled by the step's last token is cached one step late (a request "
                   "arriving meanwhile misses it)", behaviour="prefix-cache"),
    fault("kvm.watermark_for_running", _KVM,
          "        if has_scheduled_reqs and request.status in (\n            RequestStatus.WAITING,\n"
          "            RequestStatus.PREEMPTED,\n        ):",
          "        if has_scheduled_reqs:",
          CLASSIC, "wrong condition: the watermark also holds back running requests' decode steps",
          behaviour="admission"),
)

_add(
    fault("pool.pre51482_fifo_without_caching", _POOL,
          "                if block.block_hash is None or not self.enable_caching:",
          "                if block.block_hash is None and self.enable_caching:",
          HISTORIC, "PR 48017 as merged: with prefix caching off every freed block is appended (FIFO reuse of "
                    "the whole id space) instead of prepended; restored to LIFO by PR 51482",
          bug="PR 48017, PR 51482", behaviour="free-order"),
)

# DCP at runtime (issue #23): conform-kv-manager's DCP/PCP pools (models/machines/context_parallel.py)
_add(
    fault("stm.dcp_lookup_unscaled", _STM,
          "            # the sharded block size.\n            block_size *= dcp_world_size\n",
          "            # the sharded block size.\n            pass\n",
          CLASSIC, "dropped scaling: full-attention lookups under DCP read the hashes at the unscaled block "
                   "(hits of the wrong length, blocks of another prefix)", behaviour="prefix-cache"),
    fault("utils.dcp_partial_hits_strict", _UTILS,
          "            or (dcp_world_size > 1 and spec.block_size >= hash_block_size)",
          "            or (dcp_world_size > 1 and spec.block_size > hash_block_size)",
          CLASSIC, "wrong comparison: DCP no longer turns fine-grained hits on for a Mamba block equal to the "
                   "hash block (hits land on scheduler blocks only)", behaviour="prefix-cache"),
)

# Mamba shared-prefix checkpoint (issue #23): conform-kv-manager's sweep asks for
# enable_mamba_shared_prefix_checkpoint on fine-grained Mamba pools (models/machines/mamba_junctions.py)
_add(
    fault("stm.shared_prefix_junction_ignored", _STM,
          "        if num_tokens != latest_prompt_hash_boundary and not (\n            self.shared_prefix_checkpoint\n",
          "        if num_tokens != latest_prompt_hash_boundary and not (\n            False\n",
          CLASSIC, "dropped branch: with the shared-prefix checkpoint on, the Mamba state at the junction is not "
                   "keyed (the scheduler still ends the chunk there; siblings recompute the prefix)",
          behaviour="prefix-cache"),
    fault("stm.shared_prefix_past_junction", _STM,
          "            and num_tokens == request.shared_prefix_boundary\n",
          "            and num_tokens >= request.shared_prefix_boundary\n",
          CLASSIC, "wrong comparison: every hash boundary of the prompt past the junction is keyed as a partial "
                   "tail, not the junction alone", behaviour="prefix-cache"),
    fault("kvm.shared_prefix_checkpoint_under_mtp", _KVM,
          "            and self.coordinator.num_reprefillable_tokens == 0\n",
          "",
          CLASSIC, "dropped condition: the shared-prefix checkpoint stays on under multi-module MTP, whose "
                   "cache_blocks is handed the computed count less the re-prefillable tail",
          behaviour="prefix-cache"),
)

# --------------------------------------------------------------------------------------------
# scheduler (v1/core/sched/)

_add(
    fault("sched.preempt_oldest_running", _SCHED,
          "                        preempted_req = self.running.pop()\n",
          "                        preempted_req = self.running.pop(0)\n",
          CLASSIC, "wrong victim: FCFS preemption takes the oldest running request instead of the newest",
          behaviour="preemption"),
    fault("sched.preempted_to_back", _SCHED,
          "        # Put the request back to the waiting queue.\n        self.waiting.prepend_request(request)",
          "        # Put the request back to the waiting queue.\n        self.waiting.add_request(request)",
          CLASSIC, "wrong queue end: a preempted request goes behind the waiting queue instead of in front",
          behaviour="preemption"),
    fault("sched.preempt_keeps_computed_tokens", _SCHED,
          "        request.status = RequestStatus.PREEMPTED\n        request.num_computed_tokens = 0\n",
          "        request.status = RequestStatus.PREEMPTED\n",
          CLASSIC, "dropped reset: a preempted request keeps its computed-token count though its blocks were "
                   "freed (it resumes past KV it no longer has)", behaviour="preemption"),
    fault("sched.running_tokens_not_charged", _SCHED,
          "            token_budget -= num_new_tokens\n            input_budget -= num_new_tokens + draft_slots\n"
          "            req_index += 1\n",
          "            req_index += 1\n",
          CLASSIC, "dropped updates: running requests' tokens are charged to neither the token nor the input "
                   "budget, so waiting requests are admitted past max_num_batched_tokens (dropping only the "
                   "token-budget update is equivalent: the input budget mirrors it and every loop checks both)",
          behaviour="scheduler"),
    fault("sched.chunks_without_chunked_prefill", _SCHED,
          "                        not self.scheduler_config.enable_chunked_prefill\n"
          "                        and num_new_tokens > request_token_budget",
          "                        False\n"
          "                        and num_new_tokens > request_token_budget",
          CLASSIC, "dropped check: with chunked prefill disabled a prompt larger than the budget is still "
                   "split into chunks", behaviour="scheduler"),
    fault("sched.running_ignores_placeholders", _SCHED,
          "                request.num_tokens_with_spec\n                + request.num_output_placeholders\n"
          "                - request.num_computed_tokens\n",
          "                request.num_tokens_with_spec\n"
          "                - request.num_computed_tokens\n",
          CLASSIC, "async scheduling: the running loop forgets the output placeholders of the step in flight, "
                   "so a decoding request is not scheduled again until its output arrives",
          behaviour="async-scheduling"),
    fault("sched.async_placeholders_overwritten", _ASYNC,
          "            request.num_output_placeholders += (",
          "            request.num_output_placeholders = (",
          CLASSIC, "async scheduling: the placeholder count is overwritten instead of accumulated (two steps in "
                   "flight look like one)", behaviour="async-scheduling"),
    fault("sched.async_placeholders_for_prefill", _ASYNC,
          "            if request.is_prefill_chunk:\n                continue\n",
          "",
          CLASSIC, "async scheduling: prefill chunks that sample nothing also get output placeholders",
          behaviour="async-scheduling"),
)

# the waiting queues alone and the encoder-cache embed-count check (conform-scheduler's queue and
# encoder runs, #22)
_add(
    fault("sched.queue_priority_remove_no_heapify", _QUEUE,
          "        self._heap.remove(request)\n        heapq.heapify(self._heap)\n",
          "        self._heap.remove(request)\n",
          CLASSIC, "dropped call: removing one request from the priority queue leaves the heap unordered, so a "
                   "later pop or iteration yields a lower-priority request first", behaviour="queue"),
    fault("sched.queue_fcfs_prepend_to_back", _QUEUE,
          "        self.extendleft(requests)\n",
          "        self.extend(requests)\n",
          CLASSIC, "wrong queue end: requests skipped in a pass are put back behind the waiting queue instead "
                   "of in front (later arrivals overtake them)", behaviour="queue"),
    fault("sched.encoder_embed_mismatch_served", _SCHED,
          "        if cached_num_encoder_embeds == requested_num_encoder_embeds:\n            return False\n",
          "        return False\n",
          CLASSIC, "dropped check: a multimodal identifier reused with another embedding count is served from "
                   "the encoder cache (or encoded once for both sizes) instead of failing the request",
          behaviour="encoder"),
    fault("sched.encoder_mismatch_never_failed", _SCHED,
          "        error_req_ids.update(self.encoder_cache_mismatch_reqs)\n",
          "",
          CLASSIC, "dropped update: a request the embed-count check rejected is never finished as an error; it "
                   "is rejected again every step and never frees its slot", behaviour="encoder"),
    fault("sched.preempted_encoder_inputs_kept", _SCHED,
          "                            preempted_encoder_inputs = scheduled_encoder_inputs.pop(\n",
          "                            preempted_encoder_inputs = scheduled_encoder_inputs.get(\n",
          CLASSIC, "PRIORITY: a request preempted after this step scheduled it keeps its encoder inputs in the "
                   "step's scheduled_encoder_inputs (the workers encode images of a request not in the batch)",
          behaviour="encoder"),
)

# --------------------------------------------------------------------------------------------
# SimpleCPU offload scheduler (v1/simple_kv_offload/manager.py)

_add(
    fault("simple.pre41289_in_flight_not_deduped", _SIMPLE,
          "        if gpu_block.block_id in self._in_flight_store_gpu_blocks:\n"
          "            return _StoreAdmission.IN_FLIGHT\n",
          "",
          HISTORIC, "before PR 41289: a GPU block whose store is scheduled but not complete is offered again "
                    "(a second request hitting the same prefix re-stores it: duplicate in-flight store)",
          bug="#41289, PR 41289", behaviour="offload"),
    fault("simple.in_flight_never_drained", _SIMPLE,
          "            self._in_flight_store_gpu_blocks.difference_update(transfer.gpu_block_ids)\n",
          "            pass\n",
          CLASSIC, "dropped call: completed stores stay 'in flight', so those GPU blocks are never stored again",
          behaviour="offload"),
    fault("simple.stores_unconfirmed_tokens", _SIMPLE,
          "        confirmed_tokens = request.num_computed_tokens - request.num_output_placeholders\n",
          "        confirmed_tokens = request.num_computed_tokens\n",
          CLASSIC, "async scheduling: eager stores count tokens of the step still in flight as computed",
          behaviour="offload"),
    fault("simple.hit_covers_last_token", _SIMPLE,
          "        max_hit_len = request.num_tokens - 1 - num_computed_tokens\n",
          "        max_hit_len = request.num_tokens - num_computed_tokens\n",
          CLASSIC, "off-by-one: a CPU hit may cover the last prompt token", behaviour="offload"),
    fault("simple.store_source_not_pinned", _SIMPLE,
          "                gpu_block_pool.touch(\n"
          "                    [gpu_block_pool.blocks[bid] for bid in gpu_block_ids]\n                )\n",
          "",
          CLASSIC, "dropped call: GPU blocks being copied to CPU are not pinned, so they can be reused "
                   "mid-store", behaviour="offload"),
    fault("simple.preempt_keeps_store_cursor", _SIMPLE,
          "                state.num_stored_blocks = [0] * num_groups\n",
          "",
          CLASSIC, "dropped reset: a preempted request's store cursor survives its new block table",
          behaviour="offload"),
)

# --------------------------------------------------------------------------------------------
# OffloadingConnector scheduler (distributed/kv_transfer/kv_connector/v1/offloading/)

_OFFL_CFG = "distributed/kv_transfer/kv_connector/v1/offloading/config.py"
_add(
    fault("offl.pre29087_duplicate_loads", _OFFL,
          "                if any(key in self._chunks_being_loaded for key in offload_keys):",
          "                if False and any(key in self._chunks_being_loaded for key in offload_keys):",
          HISTORIC, "before PR 29087: a request whose hit chunks another request is still loading is not "
                    "delayed, so the same chunks are loaded twice", bug="PR 29087", behaviour="offload"),
    fault("offl.transfers_not_awaited", _OFFL,
          "        if req_status.transfer_jobs:\n            logger.debug(\n"
          "                \"Delaying request %s since it still has in-flight transfers\",",
          "        if False:\n            logger.debug(\n"
          "                \"Delaying request %s since it still has in-flight transfers\",",
          CLASSIC, "dropped check: a request with transfers in flight is looked up again at once",
          behaviour="offload"),
    fault("offl.prompt_only_ignored", _OFFL,
          "        if self.config.offload_prompt_only:\n            num = min(num, req_status.req.num_prompt_tokens)\n",
          "",
          CLASSIC, "dropped check: offload_prompt_only is ignored (generated tokens are offloaded too)",
          behaviour="offload"),
    fault("offl.prefix_lookup_skips_miss", _OFFL,
          "                case LookupResult.MISS:\n                    break\n        return hit_count",
          "                case LookupResult.MISS:\n                    pass\n        return hit_count",
          CLASSIC, "dropped break: the prefix lookup counts hits after a miss (non-contiguous hits)",
          behaviour="offload"),
    fault("offl.window_lookup_miss_keeps_streak", _OFFL,
          "                case LookupResult.MISS:\n                    consecutive_hits = 0\n",
          "                case LookupResult.MISS:\n",
          CLASSIC, "dropped reset: the sliding-window lookup keeps its streak across a miss", behaviour="offload"),
    fault("offl.pr41228_window_ignores_extra_retained", _OFFL_CFG,
          "                kv_cache_spec.sliding_window - 1 + kv_cache_spec.extra_retained_tokens,\n",
          "                kv_cache_spec.sliding_window,\n",
          HISTORIC, "PR 41228 as merged: the offload window in chunks is cdiv(sliding_window, chunk), ignoring "
                    "the extra retained tokens of multi-module MTP (too few chunks restored)",
          bug="PR 41228", behaviour="offload"),
    fault("offl.pre51161_chunked_local_asserts", _OFFL_CFG,
          "    if isinstance(kv_cache_spec, ChunkedLocalAttentionSpec):\n",
          "    if False:\n",
          HISTORIC, "before PR 51161: chunked-local specs fall through to the FullAttention assert (the "
                    "offloading connector crashes at startup on Llama 4)", bug="#51150, PR 51161",
          behaviour="offload"),
    # partial tails: FA + Mamba "align" pools with hashes finer than the blocks (#22)
    fault("offl.partial_tail_pending_taken", _OFFL,
          "        if pending:\n            return False, True\n", "",
          CLASSIC, "dropped check: a partial tail whose keys are still being stored is taken as a hit (the load "
                   "reads CPU chunks not written yet)", behaviour="offload"),
    fault("offl.partial_tail_load_keeps_last_chunk", _OFFL,
          "end_chunk_idx = num_chunks - (partial_tail_boundary is not None)", "end_chunk_idx = num_chunks",
          CLASSIC, "off-by-one: a partial-tail load also reads the complete chunk of the tail's block",
          behaviour="offload"),
    fault("offl.partial_tail_covers_last_prompt_token", _OFFL,
          "min(req_status.req.num_prompt_tokens - 1, block_end - 1)",
          "min(req_status.req.num_prompt_tokens, block_end - 1)",
          CLASSIC, "off-by-one: a partial-tail hit may cover the last prompt token (nothing left to compute)",
          behaviour="offload"),
    fault("offl.partial_tail_store_unfenced", _OFFL,
          "            for block_id in source_blocks:\n"
          "                self._block_id_to_pending_jobs.setdefault(block_id, set()).add(job_id)\n",
          "            for block_id in source_blocks:\n                pass\n",
          CLASSIC, "dropped fence: a re-allocated COW source of a partial-tail store is not waited for (the CPU "
                   "copy keeps another request's state)", behaviour="offload"),
)

# OffloadingConnector worker setup: canonical page mappings, the parallelism gate, the layout the
# connector asks for (conform-offload-worker's generated layers and layer sets, #22)
_CMAP = "distributed/kv_transfer/kv_connector/v1/offloading/canonical_mapping.py"
_OFFL_CONN = "distributed/kv_transfer/kv_connector/v1/offloading_connector.py"
_add(
    fault("offl.cmap_cp_rank_dropped", _CMAP,
          "    return (chunk * ctx.cp_size + ctx.total_cp_rank) * ctx.interleave + pos_in_chunk",
          "    return (chunk * ctx.cp_size) * ctx.interleave + pos_in_chunk",
          CLASSIC, "dropped term: every context-parallel rank places its tokens at CP rank 0's canonical positions",
          behaviour="offload-worker"),
    fault("offl.cmap_dcp_writers", _CMAP,
          "        num_writers=replication // ctx.dcp_size,",
          "        num_writers=replication,",
          CLASSIC, "wrong count: DCP ranks that split a block's tokens are counted as rotating writers of it",
          behaviour="offload-worker"),
    fault("offl.cmap_partial_chunk_certified", _CMAP,
          "    if ctx.cp_size > 1 and (ctx.interleave > bs or bs % ctx.interleave):",
          "    if ctx.cp_size > 1 and ctx.interleave > bs:",
          CLASSIC, "dropped check: a block that is not whole interleave chunks is certified under CP",
          behaviour="offload-worker"),
    fault("offl.cmap_hnd_token_stride_unchecked", _CMAP,
          "    if head_stride == bs * head_size and token_stride == head_size:  # HND",
          "    if head_stride == bs * head_size:  # HND",
          CLASSIC, "dropped check: a split page is read as HND from its head stride alone",
          behaviour="offload-worker"),
    fault("offl.cmap_mamba_padded_page", _CMAP,
          "        return replace(spec, page_size_padded=None).page_size_bytes",
          "        return spec.page_size_bytes",
          CLASSIC, "wrong size: a Mamba layer's fallback spans its padded page", behaviour="offload-worker"),
    fault("offl.cfg_per_token_head_certified", _OFFL_CFG,
          "            if spec.kv_quant_mode.is_per_token_head:\n                return False\n",
          "",
          CLASSIC, "dropped check: the canonical gate certifies per-token-head quantized layers",
          behaviour="offload-worker"),
    fault("offl.cfg_uniform_bytes_per_layer", _OFFL_CFG,
          "    if isinstance(spec, UniformTypeKVCacheSpecs):\n        return spec.page_size_bytes\n",
          "",
          CLASSIC, "dropped branch: a UniformTypeKVCacheSpecs group's bytes per block are its whole page "
                   "times its layers", behaviour="offload-worker"),
    fault("offl.cfg_canonical_world_unchecked", _OFFL_CFG,
          "            and parallel_config.world_size == tp_size\n",
          "",
          CLASSIC, "dropped check: the canonical gate calls a world that is not the TP group agnostic",
          behaviour="offload-worker"),
    fault("offl.conn_hisparse_layout", _OFFL_CONN,
          "            return \"BLHNC\"",
          "            return \"LBHNC\"",
          CLASSIC, "wrong value: the connector asks for the layer-outermost layout under HiSparse too",
          behaviour="offload-worker"),
)

# --------------------------------------------------------------------------------------------
# startup planning and spec formulas (v1/core/kv_cache_planning.py, v1/kv_cache_interface.py)

_add(
    fault("plan.pre41069_override_ignored", _PLAN,
          "    override = vllm_config.cache_config.num_gpu_blocks_override\n    if override is not None:\n",
          "    override = vllm_config.cache_config.num_gpu_blocks_override\n    if False:\n",
          HISTORIC, "before PR 41069: num_gpu_blocks_override is ignored by auto-fit and the enough-memory check, "
                    "so a max_model_len the overridden pool cannot hold is accepted and the scheduler hangs",
          bug="#35541, PR 41069", behaviour="planning"),
    fault("plan.pre47272_null_block_usable", _PLAN,
          "            avail_mem - _pool_bytes_per_block_from_builder(builder, vllm_config, groups)\n",
          "            avail_mem\n",
          HISTORIC, "before PR 47272 / 48724: the check and auto-fit count the null block as usable, so a pool "
                    "of exactly the needed blocks has one too few", bug="PR 47272, PR 48724", behaviour="planning"),
    fault("iface.pr39866_cap_without_plus_one", _IFACE,
          "        return cdiv(num_tokens, self.block_size) + 1\n\n"
          "    def max_memory_usage_bytes(self, vllm_config: VllmConfig) -> int:\n        assert (\n"
          "            not self.dcp_sharded\n"
          "            or vllm_config.parallel_config.decode_context_parallel_size == 1\n"
          "        ), \"DCP not support sliding window.\"",
          "        return cdiv(num_tokens, self.block_size)\n\n"
          "    def max_memory_usage_bytes(self, vllm_config: VllmConfig) -> int:\n        assert (\n"
          "            not self.dcp_sharded\n"
          "            or vllm_config.parallel_config.decode_context_parallel_size == 1\n"
          "        ), \"DCP not support sliding window.\"",
          HISTORIC, "PR 39866's cap cdiv(min(sw-1+F, M), bs) misses the block a window starting mid-block spans: "
                    "a sliding-window request can hold one block more than it was admitted and sized for",
          bug="PR 39866, #39734", behaviour="admission"),
    fault("iface.pr28176_mamba_ignores_spec_blocks", _IFACE,
          "            return self.page_size_bytes * (1 + self.num_speculative_blocks)\n",
          "            return self.page_size_bytes * 1\n",
          HISTORIC, "before PR 28176: Mamba sizing reserves one block per request while allocation takes "
                    "1 + num_speculative_blocks (startup accepts a pool the gate cannot admit into)",
          bug="PR 28176", behaviour="planning"),
    fault("iface.swa_cap_ignores_extra_retained", _IFACE,
          "            self.sliding_window - 1 + self.extra_retained_tokens + max_in_flight_tokens,\n",
          "            self.sliding_window - 1 + max_in_flight_tokens,\n",
          CLASSIC, "dropped term: the sliding-window admission cap forgets extra_retained_tokens",
          behaviour="admission"),
    # HiSparse's startup sizing and the DCP spec view (conform-planning, #22/#23)
    fault("plan.hisparse_steady_tail_off_by_one", _HSL,
          "            required = min(required, ACTIVE_TAIL_PAGES)\n",
          "            required = min(required, ACTIVE_TAIL_PAGES + 1)\n",
          CLASSIC, "off-by-one: the steady-state concurrency charges a running request one resident page more "
                   "than its active tail", behaviour="planning"),
    fault("utils.concurrency_ignores_host_pool", _UTILS,
          "    if host_blocks_per_request:\n",
          "    if False:\n",
          CLASSIC, "dropped limit: max concurrency ignores the HiSparse host pool (reports what the GPU pool "
                   "holds although the host pool backs fewer requests)", behaviour="planning"),
    fault("plan.hisparse_host_offset_unscaled", _HSL,
          "                * max(layer_stride, spec.page_size_bytes)\n",
          "                * spec.page_size_bytes\n",
          CLASSIC, "wrong stride: a layer-outermost host tensor's offset counts pages, not whole layers of the "
                   "host pool (the second spec's layers overlap the first's)", behaviour="planning"),
    fault("plan.hisparse_fits_ignores_failed_config", _PLAN,
          "            except ValueError:\n                return False\n",
          "            except ValueError:\n                pass\n",
          CLASSIC, "swallowed error: HiSparse auto-fit counts a length whose host pool (or layout) cannot be "
                   "built as fitting, so startup fails after auto-fit instead of shortening max_model_len",
          behaviour="planning"),
    fault("plan.hisparse_hot_page_unaligned", _PLAN,
          "        if isinstance(group.kv_cache_spec, HiSparseHotSpec)\n",
          "        if False\n",
          CLASSIC, "dropped alignment: a block-outermost HiSparse pool's block is not rounded up to the hot page "
                   "(a hot page straddles two blocks)", behaviour="planning"),
    fault("utils.dcp_spec_layers_unscaled", _UTILS,
          "                name: resolve_dcp_kv_cache_spec(layer_spec, dcp_world_size)\n",
          "                name: layer_spec\n",
          CLASSIC, "missed recursion: a uniform-type group's layer specs keep the unscaled block size under DCP",
          behaviour="planning"),
)

# pipeline/tensor-parallel startup planning (get_kv_cache_configs over several workers, #22)

_add(
    fault("plan.pp_merge_mismatch_unchecked", _PLAN,
          "                assert merged_kv_cache_specs[layer_name] == layer_spec, (\n",
          "                assert True, (\n",
          CLASSIC, "dropped check: a layer two workers report with different specs is planned with the first "
                   "worker's spec", behaviour="planning"),
    fault("plan.pp_projection_keeps_whole_uniform_spec", _PLAN,
          "        if worker_layer_names and isinstance(group_spec, UniformTypeKVCacheSpecs):\n",
          "        if False and isinstance(group_spec, UniformTypeKVCacheSpecs):\n",
          CLASSIC, "missed projection: a worker holding part of a uniform-type group keeps every stage's layer "
                   "specs in its group spec", behaviour="planning"),
    fault("plan.pp_autofit_last_worker", _PLAN,
          "        if worker_max < auto_fit_max:\n",
          "        if worker_max < original_max:\n",
          CLASSIC, "wrong variable: auto-fit keeps the last worker below the model's length, not the tightest "
                   "one (another stage cannot hold a max_model_len request)", behaviour="planning"),
    fault("plan.pp_check_first_worker_only", _PLAN,
          "    for groups, avail_mem in zip(projected_groups_per_worker, check_memory):\n        if not groups:\n",
          "    for groups, avail_mem in zip(projected_groups_per_worker[:1], check_memory):\n        if not groups:\n",
          CLASSIC, "truncated loop: only the first worker's memory is checked (a later pipeline stage too small "
                   "for one request starts)", behaviour="planning"),
    fault("plan.pp_common_blocks_largest", _PLAN,
          "    min_num_blocks = min(\n        kv_cache_config.num_blocks for kv_cache_config in kv_cache_configs\n",
          "    min_num_blocks = max(\n        kv_cache_config.num_blocks for kv_cache_config in kv_cache_configs\n",
          CLASSIC, "wrong extreme: every worker gets the largest worker's block count (the smaller ones' pools "
                   "overrun their memory)", behaviour="planning"),
    fault("plan.pp_shrink_without_replan", _PLAN,
          "        if kv_cache_config.num_blocks == min_num_blocks:\n            continue\n",
          "        if True:\n            kv_cache_config.num_blocks = min_num_blocks\n            continue\n",
          CLASSIC, "dropped re-plan: a worker's block count is lowered to the common one but its tensors keep "
                   "their own size (unused memory stays allocated, strides do not match the block count)",
          behaviour="planning"),
    fault("plan.tp_replicas_ignore_dcp", _PLAN,
          "    if spec.dcp_sharded and dcp_size > 1:\n        return 1\n",
          "    if False:\n        return 1\n",
          CLASSIC, "dropped condition: a DCP-sharded cache counts as replicated over TP ranks (offloading "
                   "would store one rank's shard for all)", behaviour="planning"),
    fault("plan.tp_replicas_unclamped", _PLAN,
          "    return max(1, tp_size // spec.max_tp_shards)\n",
          "    return tp_size // spec.max_tp_shards\n",
          CLASSIC, "missing clamp: more shards than TP ranks gives 0 replicas, which the gcd turns into "
                   "'every rank holds the same KV'", behaviour="planning"),
    fault("plan.eagle_group_needs_every_draft_layer", _PLAN,
          "            group.is_eagle_group = not draft_layer_names.isdisjoint(group.layer_names)\n",
          "            group.is_eagle_group = draft_layer_names <= set(group.layer_names)\n",
          CLASSIC, "wrong set test: a group is the EAGLE draft's only when it holds every draft layer (a drafter "
                   "spread over two groups keeps its volatile blocks cached in both)", behaviour="planning"),
)

# --------------------------------------------------------------------------------------------
# neutral refactors: behaviour-preserving, must NOT be flagged

_add(
    fault("neutral.pool_negated_free_check", _POOL,
          "        if num_blocks > self.get_num_free_blocks():\n",
          "        if not num_blocks <= self.get_num_free_blocks():\n",
          NEUTRAL, "equivalent comparison written as a negation", behaviour="refactor"),
    fault("neutral.pool_touch_truthiness", _POOL,
          "            if block.ref_cnt == 0:\n                self.free_block_queue.remove(block)\n",
          "            if not block.ref_cnt:\n                self.free_block_queue.remove(block)\n",
          NEUTRAL, "`== 0` as truthiness on an int ref count", behaviour="refactor"),
    fault("neutral.hash_reordered_statements", _UTILS,
          "    if not parent_block_hash:\n        parent_block_hash = NONE_HASH\n\n"
          "    curr_block_token_ids_tuple = tuple(curr_block_token_ids)\n",
          "    curr_block_token_ids_tuple = tuple(curr_block_token_ids)\n"
          "    if not parent_block_hash:\n        parent_block_hash = NONE_HASH\n\n",
          NEUTRAL, "two independent statements swapped", behaviour="refactor"),
    fault("neutral.stm_divmod", _STM,
          "        num_skipped_blocks = num_skipped_tokens // self.block_size\n        # We need blocks",
          "        num_skipped_blocks, _ = divmod(num_skipped_tokens, self.block_size)\n        # We need blocks",
          NEUTRAL, "floor division written with divmod", behaviour="refactor"),
    fault("neutral.swa_skip_regrouped", _STM,
          "            num_computed_tokens - self.sliding_window + 1 - self.extra_retained_tokens,",
          "            num_computed_tokens + 1 - (self.sliding_window + self.extra_retained_tokens),",
          NEUTRAL, "equivalent integer arithmetic, regrouped", behaviour="refactor"),
    fault("neutral.kvm_helper_extracted", _KVM,
          "        available_blocks = self.block_pool.get_num_free_blocks() - reserved_blocks\n",
          "        available_blocks = _blocks_left_after(self.block_pool, reserved_blocks)\n",
          NEUTRAL, "a one-line computation extracted into a module-level helper", behaviour="refactor",
          more=(("class KVCacheManager:\n",
                 "def _blocks_left_after(block_pool, reserved_blocks: int) -> int:\n"
                 "    return block_pool.get_num_free_blocks() - reserved_blocks\n\n\n"
                 "class KVCacheManager:\n"),)),
    fault("neutral.coord_loop_var_renamed", _COORD,
          "        for manager in self.single_type_managers:\n            manager.free(request_id)\n",
          "        for single_type_manager in self.single_type_managers:\n"
          "            single_type_manager.free(request_id)\n",
          NEUTRAL, "a loop variable renamed", behaviour="refactor"),
    fault("neutral.sched_reordered_updates", _SCHED,
          "            token_budget -= num_new_tokens\n            input_budget -= num_new_tokens + draft_slots\n"
          "            req_index += 1\n",
          "            req_index += 1\n            input_budget -= num_new_tokens + draft_slots\n"
          "            token_budget -= num_new_tokens\n",
          NEUTRAL, "three independent counter updates reordered", behaviour="refactor"),
    fault("neutral.simple_hit_len_regrouped", _SIMPLE,
          "        max_hit_len = request.num_tokens - 1 - num_computed_tokens\n        if max_hit_len <= 0:\n",
          "        max_hit_len = request.num_tokens - (num_computed_tokens + 1)\n        if max_hit_len < 1:\n",
          NEUTRAL, "equivalent arithmetic and comparison on ints", behaviour="refactor"),
    fault("neutral.offl_local_renamed", _OFFL,
          "        num = min(num_computed_tokens, req_status.req.num_tokens)\n"
          "        max_offload_tokens = req_status.max_offload_tokens\n"
          "        if max_offload_tokens is not None:\n            num = min(num, max_offload_tokens)\n"
          "        if self.config.offload_prompt_only:\n            num = min(num, req_status.req.num_prompt_tokens)\n"
          "        return num\n",
          "        offloadable = min(num_computed_tokens, req_status.req.num_tokens)\n"
          "        max_offload_tokens = req_status.max_offload_tokens\n"
          "        if max_offload_tokens is not None:\n            offloadable = min(offloadable, max_offload_tokens)\n"
          "        if self.config.offload_prompt_only:\n"
          "            offloadable = min(offloadable, req_status.req.num_prompt_tokens)\n"
          "        return offloadable\n",
          NEUTRAL, "a local variable renamed throughout a function", behaviour="refactor"),
)

# --------------------------------------------------------------------------------------------
# the scheduler's stop rules (v1/core/sched/utils.py check_stop; conform-scheduler's stop-rule
# traces, models/machines/scheduler_stop.py, #22): a finish frees the request's KV blocks

_SCHED_UTILS = "v1/core/sched/utils.py"

_add(
    fault("sched.stop_eos_held_by_min_tokens", _SCHED_UTILS,
          "    if last_token_id == sampling_params.eos_token_id:\n",
          "    if last_token_id == sampling_params.eos_token_id and (\n"
          "        request.num_output_tokens >= sampling_params.min_tokens\n    ):\n",
          CLASSIC, "wrong order: an EOS token sampled before min_tokens no longer finishes the request "
                   "(check_stop leaves min_tokens to the logits processors; only repetition waits for it)",
          behaviour="stop"),
    fault("sched.stop_min_tokens_off_by_one", _SCHED_UTILS,
          "    if request.num_output_tokens < sampling_params.min_tokens:\n",
          "    if request.num_output_tokens <= sampling_params.min_tokens:\n",
          CLASSIC, "off by one: repetition detection waits one output past min_tokens", behaviour="stop"),
    fault("sched.repetition_pattern_filling_output_missed", _SCHED_UTILS,
          "        if pattern_len * min_count > len(token_ids):\n",
          "        if pattern_len * min_count >= len(token_ids):\n",
          CLASSIC, "off by one: an n-gram whose repetitions make up the whole output is not detected",
          behaviour="stop"),
    fault("sched.repetition_one_copy_short", _SCHED_UTILS,
          "        for m in range(1, repetition_min_count):\n",
          "        for m in range(1, repetition_min_count - 1):\n",
          CLASSIC, "off by one: min_count - 1 copies of an n-gram count as a repetition", behaviour="stop"),
    fault("sched.repetition_reported_as_stop", _SCHED_UTILS,
          "        request.status = RequestStatus.FINISHED_REPETITION\n",
          "        request.status = RequestStatus.FINISHED_STOPPED\n",
          CLASSIC, "wrong status: a detected repetition finishes as a stop (finish reason 'stop', not "
                   "'repetition')", behaviour="stop"),
)

# --------------------------------------------------------------------------------------------
# the HiSparse coordinator's layout checks, host-only layouts, adoption and row mirrors
# (conform-kv-manager's HiSparse programs and layouts, models/machines/hisparse_*.py, #22)

_HSC = "v1/hisparse/coordinator.py"

_add(
    fault("hisparse.two_host_groups_accepted", _HSC,
          "                if self.host_manager is not None:\n"
          "                    raise ValueError(\"Only one HiSparse host group is supported.\")\n",
          "                if False:\n"
          "                    raise ValueError(\"Only one HiSparse host group is supported.\")\n",
          CLASSIC, "dropped check: a layout with two host groups is accepted (the second rebinds the host pool)",
          behaviour="hisparse"),
    fault("hisparse.host_group_order_max", _HSC,
          "            if self.host_group_id > min(resident_group_ids):\n",
          "            if self.host_group_id > max(resident_group_ids):\n",
          CLASSIC, "wrong bound: a host group between two resident groups is accepted", behaviour="hisparse"),
    fault("hisparse.mirror_gap_ends_window", _HSC,
          "                if len(source_starts) != len(self.resident_managers):\n"
          "                    token_position += num_rows\n                    continue\n",
          "                if len(source_starts) != len(self.resident_managers):\n"
          "                    break\n",
          CLASSIC, "wrong exit: a page with no GPU copy ends the request's row mirrors, so the mirrorable pages "
                   "after it are never mirrored (their host rows stay stale)", behaviour="hisparse"),
    fault("hisparse.host_only_offload_command", _HSC,
          "        if not self.resident_managers:\n            return None\n"
          "        command = SparseKVOffloadCommand(",
          "        if False:\n            return None\n"
          "        command = SparseKVOffloadCommand(",
          CLASSIC, "dropped guard: a layout without resident groups sends the worker an (empty) offload command",
          behaviour="hisparse"),
    fault("stm.hisparse_adopt_past_table", _STM,
          "        if blocks is None or block_idx >= len(blocks):\n            return False\n"
          "        if self.get_resident_page(request_id, block_idx) is not None:\n            return False\n",
          "        if blocks is None or block_idx > len(blocks):\n            return False\n"
          "        if self.get_resident_page(request_id, block_idx) is not None:\n            return False\n",
          CLASSIC, "off by one: a resident group adopts a GPU copy for the page one past the request's table",
          behaviour="hisparse"),
    fault("hisparse.import_last_page_not_valid", _HSC,
          "        state.valid_pages = set(range(num_pages))\n",
          "        state.valid_pages = set(range(num_pages - 1))\n",
          CLASSIC, "off by one: a landed KV-connector import leaves its last full page invalid (written back "
                   "again, never published)", behaviour="hisparse"),
    fault("hisparse.reused_copy_kept", _HSC,
          "        if host_hash is not None:\n            self._drop_copy(host_hash)\n",
          "        if False:\n            self._drop_copy(host_hash)\n",
          CLASSIC, "dropped call: a GPU copy of a published host page stays indexed after the pool hands its "
                   "block to another request (a later hit would adopt another request's KV)",
          behaviour="hisparse"),
    fault("hisparse.lost_page_other_group_owner_kept", _HSC,
          "            if owners is not None:\n                owners.discard((request_id, page_idx))\n"
          "        state.unpinned_pages.discard(page_idx)\n",
          "            if owners is not None:\n                pass\n"
          "        state.unpinned_pages.discard(page_idx)\n",
          CLASSIC, "dropped call: a page lost in one resident group stays an owner of its block in the other "
                   "group (that block's later reuse loses the page again)", behaviour="hisparse"),
    fault("kvm.hisparse_longer_hit_untrimmed", _KVM,
          "            if self.retained_hit_group_ids:\n",
          "            if False:\n",
          CLASSIC, "dropped trim: allocate_slots hands the HiSparse host source its whole longer hit instead of "
                   "the prefix the request reuses (#22: retained_hit_group_ids)", behaviour="hisparse"),
    fault("hisparse.host_only_materializes", _HSC,
          "        if not self.resident_managers:\n            return\n        assert self.host_manager is not None\n"
          "        host_block_size = self.host_manager.block_size\n",
          "        assert self.host_manager is not None\n"
          "        host_block_size = self.host_manager.block_size\n",
          CLASSIC, "dropped guard: write-back planning on a layout without resident groups plans transfers with "
                   "no GPU page (#22: the coordinator's entry points probed directly)", behaviour="hisparse"),
)

# --------------------------------------------------------------------------------------------
# streaming-input sessions inside whole steps (v1/core/sched/scheduler.py; conform-scheduler's
# session traces, models/machines/scheduler_sessions.py, #22): a stopped turn keeps its KV blocks

_add(
    fault("sched.session_waiting_for_input_scheduled", _SCHED,
          "            assert not request.streaming_queue\n            return False\n",
          "            assert not request.streaming_queue\n            return True\n",
          CLASSIC, "wrong return: a session waiting for input is scheduled again (on its last turn's "
                   "tokens) instead of being skipped until its next chunk arrives", behaviour="sessions"),
    fault("sched.session_kv_holding_to_waiting", _SCHED,
          "        if self._holds_kv_blocks(request):\n            self.kv_holding_waiting.add_request(request)\n",
          "        if False:\n            self.kv_holding_waiting.add_request(request)\n",
          CLASSIC, "wrong queue: a stopped session that keeps its KV blocks goes to the plain waiting queue "
                   "(behind new arrivals, not drained first, not admitted under PAUSED_NEW)", behaviour="sessions"),
    fault("sched.session_slot_not_counted", _SCHED,
          "                num_running = len(self.running) + self.num_waiting_for_streaming_input\n",
          "                num_running = len(self.running)\n",
          CLASSIC, "dropped term: sessions waiting for input no longer count against max_num_seqs, so more "
                   "requests are admitted than the model runner has slots", behaviour="sessions"),
    fault("sched.session_counted_unfinished", _SCHED,
          "        num_waiting -= self.num_waiting_for_streaming_input\n",
          "",
          CLASSIC, "dropped update: sessions waiting for input count as unfinished work (the engine loop "
                   "never idles on them)", behaviour="sessions"),
    fault("sched.session_stale_block_hash_kept", _SCHED,
          "        del session.block_hashes[keep_end // self.hash_block_size :]\n",
          "        del session.block_hashes[keep_end // self.hash_block_size + 1 :]\n",
          CLASSIC, "off by one: the hash of the block the dropped sampled token fell in survives an update "
                   "(the new tokens are cached under the old hash)", behaviour="sessions"),
    fault("sched.session_keeps_in_flight_tokens", _SCHED,
          "        request.num_computed_tokens = safe_frontier\n",
          "",
          CLASSIC, "dropped reset: a stopped session keeps the computed tokens of its in-flight output "
                   "placeholders (async scheduling), past the KV it materialized", behaviour="sessions"),
    fault("sched.finished_set_not_cleared", _SCHED,
          "            finished_req_ids.clear()\n",
          "",
          CLASSIC, "dropped reset: with include_finished_set, every update reports again the requests freed "
                   "before the previous one", behaviour="sessions"),
    fault("sched.abort_all_aborts_none", _SCHED,
          "            request_ids = self.requests.keys()\n",
          "            request_ids = ()\n",
          CLASSIC, "wrong default: finish_requests(None) aborts nothing instead of every request (their KV "
                   "blocks stay held)", behaviour="sessions"),
)


# the CPU tier's cache policies (LRU, ARC, the factory, the base class's compatibility hooks) and the
# connector's stats merged over an interval (conform-offload-worker's policy sequences and stats
# intervals, #22)
_POL = "v1/kv_offload/cpu/policies/"
_OFFL_METRICS = "distributed/kv_transfer/kv_connector/v1/offloading/metrics.py"
_add(
    fault("offl.arc_touch_promotes_pending", _POL + "arc.py",
          "                if not chunk.is_ready:\n",
          "                if chunk.ref_cnt > 0:\n",
          CLASSIC, "wrong condition: a touch promotes a chunk still being stored to ARC's frequency list T2 "
                   "(and keeps a pinned ready one in T1)", behaviour="offload"),
    fault("offl.arc_remove_t2_kept", _POL + "arc.py",
          "        if self.t1.pop(key, None) is None:\n            self.t2.pop(key, None)\n",
          "        if self.t1.pop(key, None) is None:\n            pass\n",
          CLASSIC, "dropped removal: ARC's remove forgets a chunk only in T1; one in T2 stays resident",
          behaviour="offload"),
    fault("offl.lru_heap_rebuild_unheapified", _POL + "lru.py",
          "            self._heap = [(self._ranks[key], key) for key in self._evictable]\n"
          "            heapq.heapify(self._heap)\n        else:",
          "            self._heap = [(self._ranks[key], key) for key in self._evictable]\n        else:",
          CLASSIC, "dropped call: the LRU heap rebuilt after a long recency update is not heapified (evictions "
                   "leave the least recent order)", behaviour="offload"),
    fault("offl.lru_ready_insert_pinned", _POL + "lru.py",
          "        if chunk.ref_cnt == 0:\n            self._evictable.add(key)\n",
          "        if chunk.ref_cnt > 0:\n            self._evictable.add(key)\n",
          CLASSIC, "wrong comparison: a chunk inserted ready is never evictable under LRU", behaviour="offload"),
    fault("offl.policy_factory_rebinds_name", _POL + "factory.py",
          "        if name in cls._registry:\n            raise ValueError",
          "        if name in ():\n            raise ValueError",
          CLASSIC, "dropped check: registering a taken cache-policy name silently replaces the policy",
          behaviour="offload"),
    fault("offl.policy_base_first_group_only", _POL + "base.py",
          "        for keys in key_groups:\n            self.touch(keys, req_context)\n",
          "        for keys in key_groups[:1]:\n            self.touch(keys, req_context)\n",
          CLASSIC, "dropped groups: the base on_request_finished (out-of-tree policies) touches only the first "
                   "KV cache group's keys", behaviour="offload"),
    fault("offl.stats_gauge_summed", _OFFL_METRICS,
          "                    current_label_values[labelvalues] = value\n",
          "                    current_label_values[labelvalues] = current_label_values.get(labelvalues, 0) + value\n",
          CLASSIC, "wrong merge: gauges (CPU cache usage) are summed over an interval instead of keeping the "
                   "latest", behaviour="offload-worker"),
    fault("offl.stats_counter_last", _OFFL_METRICS,
          "                        current_label_values.get(labelvalues, 0) + value\n",
          "                        value\n",
          CLASSIC, "wrong merge: counters keep the last increment instead of their sum", behaviour="offload-worker"),
    fault("offl.stats_hist_sum_counts", _OFFL_METRICS,
          "                    return_dict[f\"{key_with_labels}_sum\"] = sum(value)\n",
          "                    return_dict[f\"{key_with_labels}_sum\"] = len(value)\n",
          CLASSIC, "copy-paste: a histogram's reduced _sum is its count", behaviour="offload-worker"),
    fault("offl.worker_sync_load_not_waited", "distributed/kv_transfer/kv_connector/v1/offloading/worker.py",
          "        if sync_job_ids:\n            self.worker.wait(sync_job_ids)\n",
          "",
          CLASSIC, "dropped wait: a synchronous load is only submitted before the forward pass (the request "
                   "computes over blocks whose KV has not arrived)", behaviour="offload-worker"),
    fault("offl.worker_sync_load_reported", "distributed/kv_transfer/kv_connector/v1/offloading/worker.py",
          "                sync_job_ids.add(job_id)\n                self._load_jobs[job_id] = None\n",
          "                sync_job_ids.add(job_id)\n                self._load_jobs[job_id] = entry.req_id\n",
          CLASSIC, "wrong bookkeeping: a synchronous load names its (already running) request in "
                   "finished_recving", behaviour="offload-worker"),
)

def check_catalogue(vllm_dir: str | None = None) -> list[FaultDoesNotApplyError]:
    """Every fault's edits applied to the installed files; the errors of those that do not apply."""
    vllm_dir = vllm_dir or installed_vllm_dir()
    texts: dict[str, str] = {}
    errors = []
    for f in FAULTS:
        if f.path not in texts:
            with open(os.path.join(vllm_dir, f.path), encoding="utf-8") as fh:
                texts[f.path] = fh.read()
        try:
            f.apply_to(texts[f.path])
        except FaultDoesNotApplyError as exc:
            errors.append(exc)
    return errors


def by_id() -> dict[str, SourceFault]:
    return {f.id: f for f in FAULTS}


#: the CI subset (tests/models/test_vllm_mutants_campaign.py): faults each killed within seconds at
#: the fast profile by a different check, and two neutrals that must pass every check
# --------------------------------------------------------------------------------------------
# structured output (v1/core/sched/scheduler.py _handle_blocked_waiting_request; conform-scheduler's
# structured-output traces, models/machines/scheduler_structured_output.py, #22/#28)

_add(
    fault("sched.grammar_pending_scheduled", _SCHED,
          "            if not struct_output_req or struct_output_req.grammar is None:\n                return False\n",
          "            if not struct_output_req or struct_output_req.grammar is None:\n                return True\n",
          CLASSIC, "wrong return: a request whose grammar still compiles is scheduled (it takes KV blocks "
                   "and runs unconstrained) instead of being skipped", behaviour="structured-output"),
    fault("sched.grammar_error_not_recorded", _SCHED,
          "                self.grammar_compile_error_reqs[request.request_id] = RequestError(\n",
          "                _unrecorded = RequestError(\n",
          CLASSIC, "dropped update: a grammar that failed to compile is not recorded, so the request is "
                   "never finished and stays skipped in the waiting queue forever", behaviour="structured-output"),
    fault("sched.grammar_rejection_ignored", _SCHED,
          "                request.status = RequestStatus.FINISHED_ERROR\n                request.resumable = False\n"
          "                stopped = True\n",
          "                pass\n",
          CLASSIC, "dropped update: sampled tokens the grammar rejects are kept and the request runs on "
                   "(holding its KV blocks) instead of finishing as an error", behaviour="structured-output"),
)


# deferred async loads under HiSparse (v1/core/sched/scheduler.py defer_async_loads,
# _drain_deferred_loads; conform-connector's lifecycle traces with a HiSparse host pool, #22). The
# drain's stop at a later fence is not planted: with two batches in flight at most one fence is
# outstanding when it runs (it needs pipeline parallelism, which kvref does not drive)

_add(
    fault("sched.deferred_load_never_deferred", _SCHED,
          "                        and self.sched_step_seq > self.processed_step_seq\n",
          "                        and self.sched_step_seq < self.processed_step_seq\n",
          CLASSIC, "wrong comparison: with a HiSparse host pool an async load admitted while a step is in "
                   "flight is handed to the connector at once (it may write pages that step still reads)",
          behaviour="kv-connector"),
    fault("sched.deferred_load_abort_keeps_blocks", _SCHED,
          "                    self.deferred_loads.pop(request.request_id, None) is None\n",
          "                    self.deferred_loads.pop(request.request_id, None) is None or True\n",
          CLASSIC, "wrong condition: an aborted load that was still deferred (never started) waits for a "
                   "finished_recving that never comes, so its blocks leak", behaviour="kv-connector"),
    fault("sched.deferred_load_stats_dropped", _SCHED,
          "            if self.connector_prefix_cache_stats is not None and queries != 0:\n",
          "            if self.connector_prefix_cache_stats is not None and queries == 0:\n",
          CLASSIC, "wrong comparison: a deferred load's external hit is never recorded in the connector's "
                   "prefix-cache stats when it starts", behaviour="kv-connector"),
    fault("sched.deferred_load_unfenced_free", _SCHED,
          "                        request.last_sched_seq = self.sched_step_seq\n",
          "",
          CLASSIC, "dropped update: a deferred load's request keeps an old fence, so aborting it returns its "
                   "blocks to the pool while the step in flight may still use them", behaviour="kv-connector"),
)


# --------------------------------------------------------------------------------------------
# DeepSeek-V4.1 SWA bounded replay (v1/core/sched/scheduler.py _mark_prefix_replay and the dropped
# short hits; the coordinator's and manager's opt-out of a non-prefix-cacheable group;
# conform-scheduler's bounded-replay traces, models/machines/scheduler_prefix_replay.py, #22)

_add(
    fault("sched.replay_short_hit_kept", _SCHED,
          "                        and 0 < num_computed_tokens <= self.prefix_replay_tokens\n",
          "                        and 0 < num_computed_tokens < self.prefix_replay_tokens\n",
          CLASSIC, "off by one: a prefix hit exactly as long as the replay window is kept (and then "
                   "recomputed in full) instead of dropped", behaviour="prefix-replay"),
    fault("sched.replay_window_short", _SCHED,
          "        num_replay_tokens = min(self.prefix_replay_tokens, num_hit_tokens)\n",
          "        num_replay_tokens = min(self.prefix_replay_tokens - 1, num_hit_tokens)\n",
          CLASSIC, "off by one: a prefix hit is rewound by one token less than the window, so the window's "
                   "first token keeps no sliding-window KV", behaviour="prefix-replay"),
    fault("sched.replay_slots_for_replayed_tokens", _SCHED,
          "                num_tokens_past_hit = max(num_new_tokens - num_replay_tokens, 0)\n",
          "                num_tokens_past_hit = num_new_tokens\n",
          CLASSIC, "wrong count: a replayed admission asks allocate_slots for the replayed tokens again, "
                   "on top of the hit that already holds their slots", behaviour="prefix-replay"),
    fault("coord.replay_group_in_hit_search", _COORD,
          "            if not g.kv_cache_spec.prefix_cacheable:\n                continue\n",
          "",
          CLASSIC, "dropped guard: a group that opts out of prefix caching (a bounded-replay window) takes "
                   "part in the hit search, where it never has a cached block", behaviour="prefix-replay"),
)

# SWA bounded replay beside a KV connector (v1/core/sched/scheduler.py: the waiting loop's cut of
# an external hit to whole blocks, _mark_prefix_replay's window_loaded, _update_waiting_for_remote_kv's
# rewind; conform-connector's bounded-replay traces, models/machines/scheduler_replay_connector.py, #22)

_add(
    fault("sched.replay_external_partial_block_kept", _SCHED,
          "                            ext_tokens -= ext_tokens % self.block_size\n",
          "                            ext_tokens -= 0\n",
          CLASSIC, "dropped update: an external hit whose load does not carry the replay window keeps its "
                   "partial last block (the sliding-window group may retire the block the replay starts in)",
          behaviour="prefix-replay"),
    fault("sched.replay_window_loaded_ignored", _SCHED,
          "        if window_loaded:\n            request.replay_start = 0\n            return 0\n",
          "",
          CLASSIC, "dropped guard: a hit whose KV load carried the window (a P/D transfer of every group) is "
                   "rewound and recomputed all the same", behaviour="prefix-replay"),
    fault("sched.replay_async_load_not_rewound", _SCHED,
          "            request.num_computed_tokens -= num_replay_tokens\n",
          "            request.num_computed_tokens -= 0\n",
          CLASSIC, "dropped update: a landed async load without the window records its replay but is not "
                   "rewound, so the window's tokens never get their sliding-window KV", behaviour="prefix-replay"),
    fault("sched.replay_window_check_inverted", _SCHED,
          "        ).issubset(self.connector.get_loaded_kv_cache_group_ids(request))\n",
          "        ).isdisjoint(self.connector.get_loaded_kv_cache_group_ids(request))\n",
          CLASSIC, "wrong set test: a load counts as carrying the window when it restores none of the replay "
                   "groups (a hash-addressed store's hit is taken whole, a P/D transfer's replayed)",
          behaviour="prefix-replay"),
    fault("sched.replay_window_loaded_without_external", _SCHED,
          "                    ) and self._load_restores_replay_window(request)\n",
          "                    ) or self._load_restores_replay_window(request)\n",
          CLASSIC, "wrong operator: a hit with no external tokens counts as carrying the window whenever the "
                   "connector would restore it, so a local hit is neither dropped nor replayed",
          behaviour="prefix-replay"),
)

CI_SUBSET = (
    "pool.free_uncached_appended",
    "stm.pre40946_gate_uncapped",
    "simple.pre41289_in_flight_not_deduped",
    "neutral.stm_divmod",
    "neutral.coord_loop_var_renamed",
)
