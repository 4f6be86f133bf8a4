"""Faults planted in vLLM's own code, in-process, in the paths check-run replays since #28 for
multimodal requests, LoRA, lookahead block hashes, the Mamba shared-prefix checkpoint, the stop
conditions (``check_stop``: EOS, stop ids, ``min_tokens``, repetition detection), streaming-input
sessions, ``reset_prefix_cache`` through the scheduler, SWA bounded replay, R-SWA and the circular
buffer.

Each is a plausible regression of that path, planted before a run is recorded (the scheduler then
binds the faulty code as if vLLM shipped it) and undone afterwards; the planted-fault tests and the
detection campaign (``benchmarks/bench_check_run_connector.py --generator <feature>``) measure
whether ``kvref check-run`` and ``--properties-only`` flag the recorded runs. A measurement tool,
never a check.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from kvref.spec.errors import InvalidFieldError

#: fault name -> (the feature whose path it is in, what it does)
FEATURE_FAULTS = {
    "lora-unhashed": ("lora", "the LoRA adapter left out of the block hashes (_gen_lora_extra_hash_keys "
                              "returns nothing): prefix hits across adapters"),
    "encoder-never-hits": ("multimodal", "the encoder cache never reports a cached item "
                                         "(EncoderCacheManager.check_and_update_cache): items encoded again"),
    "hasher-no-lookahead": ("hash-lookahead", "the engine's block hasher built without the lookahead tokens "
                                              "(get_request_block_hasher(..., 0)) while the pool hashes with them"),
    "checkpoint-ignored": ("mamba-checkpoint", "vLLM's scheduler ignores the shared-prefix checkpoint "
                                               "(mamba_shared_prefix_checkpoint off: chunks stop at the junction's "
                                               "block floor)"),
    # the order of check_stop's rules is a history of bugs (vLLM PRs #47489, #49521, #51299)
    "min-tokens-first": ("stop-conditions", "check_stop tests min_tokens before EOS and the stop ids: an EOS "
                                            "or stop id sampled before min_tokens no longer stops the request"),
    "repetition-ignores-min": ("stop-conditions", "check_stop's repetition rule ignores min_tokens: a repeated "
                                                  "n-gram stops the request before its min_tokens outputs"),
    # session 16 (#28, format 6): streaming-input sessions and prefix-cache resets
    "session-keeps-final-token": ("streaming-input", "_update_request_as_session keeps the stopped turn's final "
                                                     "sampled token (never computed) in the session's prompt: an "
                                                     "off-by-one in the kept output"),
    "embeds-unhashed": ("prompt-embeds", "the prompt embeddings left out of the block hashes "
                                         "(_gen_prompt_embeds_extra_hash_keys returns nothing): prompts of equal "
                                         "token ids hit each other whatever their embeddings"),
    "reset-preempts-in-order": ("prefix-cache-reset", "reset_prefix_cache(reset_running_requests=True) preempts the "
                                                      "running requests first to last, so they come back in reverse "
                                                      "order (vLLM preempts last to first to keep FIFO)"),
    # session 20 (#28): SWA bounded replay (DeepSeek-V4.1), which check-run now replays
    "replay-start-at-hit": ("prefix-replay", "_mark_prefix_replay rewinds the computed tokens by the window but "
                                             "records replay_start at the hit's end: the workers rebuild no "
                                             "window KV (the scheduled tokens are unchanged)"),
    "replay-window-short": ("prefix-replay", "_mark_prefix_replay replays one token less than the window: the "
                                             "window's first token is never rebuilt"),
    # session 20 (#28): R-SWA and the circular buffer, which check-run now replays
    "rswa-gap-kept": ("rswa", "RSWAManager.remove_skipped_blocks ignores the prompt length (frees as full "
                              "attention: nothing), so a decoding request's gap blocks are never freed"),
    "rswa-window-short": ("rswa", "RSWAManager keeps a window one token short: the block holding the window's "
                                  "first token is freed while the next token still attends to it"),
    "ring-grows": ("circular-buffer", "CircularBufferManager claims another ring block at every allocation "
                                      "instead of one for the request's life"),
    # session 20 (#28): the aux-output (routed-experts) connector, which check-run now replays
    "aux-cap-retained-only": ("aux-output", "the aux-output connector's max_cache_hit counts only the blocks it "
                                           "retained, not those still cached on the GPU: prefix hits cut short"),
}


@contextmanager
def plant_feature_fault(name: str) -> Iterator[None]:
    """Plant the fault ``name`` (a key of :data:`FEATURE_FAULTS`) while the block runs."""
    if name not in FEATURE_FAULTS:
        raise InvalidFieldError("fault", name, "one of " + ", ".join(FEATURE_FAULTS))
    undo = []
    try:
        if name == "lora-unhashed":
            from vllm.v1.core import kv_cache_utils

            real = kv_cache_utils._gen_lora_extra_hash_keys
            kv_cache_utils._gen_lora_extra_hash_keys = lambda request: []
            undo.append(lambda: setattr(kv_cache_utils, "_gen_lora_extra_hash_keys", real))
        elif name == "encoder-never-hits":
            from vllm.v1.core.encoder_cache_manager import EncoderCacheManager

            real = EncoderCacheManager.check_and_update_cache
            EncoderCacheManager.check_and_update_cache = lambda self, request, input_id: False
            undo.append(lambda: setattr(EncoderCacheManager, "check_and_update_cache", real))
        elif name == "hasher-no-lookahead":
            from .loader import load_vllm

            v = load_vllm()
            real = v["get_request_block_hasher"]
            v["get_request_block_hasher"] = lambda block_size, hash_fn, lookahead=0: real(block_size, hash_fn, 0)
            undo.append(lambda: v.__setitem__("get_request_block_hasher", real))
        elif name in ("min-tokens-first", "repetition-ignores-min"):
            from vllm.v1.core.sched import scheduler as sched_module

            real = sched_module.check_stop  # the name update_from_output calls
            if name == "min-tokens-first":
                def check_stop(request, max_model_len):
                    if request.num_output_tokens < request.sampling_params.min_tokens and not (
                            request.num_tokens >= max_model_len or request.num_output_tokens >= request.max_tokens):
                        return False
                    return real(request, max_model_len)
            else:
                def check_stop(request, max_model_len):
                    sp = request.sampling_params
                    if not sp.min_tokens or sp.repetition_detection is None:
                        return real(request, max_model_len)
                    saved = sp.min_tokens
                    sp.min_tokens = 0  # vLLM's own rules, min_tokens forgotten
                    try:
                        return real(request, max_model_len)
                    finally:
                        sp.min_tokens = saved
            sched_module.check_stop = check_stop
            undo.append(lambda: setattr(sched_module, "check_stop", real))
        elif name == "embeds-unhashed":
            from vllm.v1.core import kv_cache_utils

            real = kv_cache_utils._gen_prompt_embeds_extra_hash_keys
            kv_cache_utils._gen_prompt_embeds_extra_hash_keys = lambda request, start, end: []
            undo.append(lambda: setattr(kv_cache_utils, "_gen_prompt_embeds_extra_hash_keys", real))
        elif name == "session-keeps-final-token":
            from vllm.v1.core.sched.scheduler import Scheduler

            real = Scheduler._update_request_as_session

            def update_as_session(self, session, update):
                # a copy of the final token at the end: vLLM's own code drops the copy and keeps the
                # final sampled token among the outputs that become prompt
                session._all_token_ids.append(session._all_token_ids[-1])
                return real(self, session, update)

            Scheduler._update_request_as_session = update_as_session
            undo.append(lambda: setattr(Scheduler, "_update_request_as_session", real))
        elif name == "reset-preempts-in-order":
            from vllm.v1.core.sched.scheduler import Scheduler

            real = Scheduler.reset_prefix_cache

            def reset_prefix_cache(self, reset_running_requests=False, reset_connector=False):
                if reset_running_requests:
                    self.running.reverse()  # vLLM pops from the end: now the first running goes first
                return real(self, reset_running_requests, reset_connector)

            Scheduler.reset_prefix_cache = reset_prefix_cache
            undo.append(lambda: setattr(Scheduler, "reset_prefix_cache", real))
        elif name == "aux-cap-retained-only":
            from vllm.distributed.aux_output_connector.connector import AuxOutputSchedulerConnector

            real = AuxOutputSchedulerConnector.max_cache_hit

            def max_cache_hit(self, request):
                num_blocks = 0
                for block, _keys in self._kv_blocks(request.block_hashes):
                    if block not in self._kv_cached:
                        break
                    num_blocks += 1
                return min(num_blocks * self._block_size, request.num_tokens - 1)

            AuxOutputSchedulerConnector.max_cache_hit = max_cache_hit
            undo.append(lambda: setattr(AuxOutputSchedulerConnector, "max_cache_hit", real))
        elif name in ("replay-start-at-hit", "replay-window-short"):
            from vllm.v1.core.sched.scheduler import Scheduler

            real = Scheduler._mark_prefix_replay
            at_hit = name == "replay-start-at-hit"

            def mark_prefix_replay(self, request, num_hit_tokens, window_loaded):
                n = real(self, request, num_hit_tokens, window_loaded)
                if n and at_hit:
                    request.replay_start = num_hit_tokens
                elif n:
                    n -= 1
                    request.replay_start += 1
                return n

            Scheduler._mark_prefix_replay = mark_prefix_replay
            undo.append(lambda: setattr(Scheduler, "_mark_prefix_replay", real))
        elif name in ("rswa-gap-kept", "rswa-window-short"):
            from vllm.v1.core.single_type_kv_cache_manager import RSWAManager

            real = RSWAManager.remove_skipped_blocks
            kept = name == "rswa-gap-kept"

            def remove_skipped_blocks(self, request_id, processed_computed_tokens, num_prompt_tokens=None):
                if kept:
                    return real(self, request_id, processed_computed_tokens, None)
                return real(self, request_id, processed_computed_tokens + 1, num_prompt_tokens)

            RSWAManager.remove_skipped_blocks = remove_skipped_blocks
            undo.append(lambda: setattr(RSWAManager, "remove_skipped_blocks", real))
        elif name == "ring-grows":
            from vllm.v1.core.single_type_kv_cache_manager import CircularBufferManager

            real_count = CircularBufferManager.get_num_blocks_to_allocate
            real_new = CircularBufferManager.allocate_new_blocks

            def get_num_blocks_to_allocate(self, request_id, *args, **kwargs):
                return 1

            def allocate_new_blocks(self, request_id, num_tokens, num_tokens_main_model):
                blocks = self.block_pool.get_new_blocks(1)
                self.req_to_blocks[request_id].extend(blocks)
                return blocks

            CircularBufferManager.get_num_blocks_to_allocate = get_num_blocks_to_allocate
            CircularBufferManager.allocate_new_blocks = allocate_new_blocks
            undo.append(lambda: setattr(CircularBufferManager, "get_num_blocks_to_allocate", real_count))
            undo.append(lambda: setattr(CircularBufferManager, "allocate_new_blocks", real_new))
        else:
            from vllm.v1.core.sched.scheduler import Scheduler

            real = Scheduler.__init__

            def init(self, *args, **kwargs):
                real(self, *args, **kwargs)
                self.mamba_shared_prefix_checkpoint = False

            Scheduler.__init__ = init
            undo.append(lambda: setattr(Scheduler, "__init__", real))
        yield
    finally:
        for u in reversed(undo):
            u()


__all__ = ["FEATURE_FAULTS", "plant_feature_fault"]
