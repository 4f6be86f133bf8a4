"""The one door from kvref's request data to vLLM's ``Request`` and ``SamplingParams`` (#26).

Every adapter that hands vLLM a request (the scheduler, the waiting queues, streaming sessions,
the KV cache manager's mirror, HiSparse, the offload engines, the connector role probe, the
offload recorder) builds it here, so a rule about how a kvref request becomes a vLLM one is
written once: an EOS token goes in the way vLLM's input processor puts it
(``SamplingParams.update_from_generation_config``, which adds it to ``all_stop_token_ids``), a
remote prefill and the ``"full"`` KV-cache report mode travel in ``extra_args`` (where vLLM's
scheduler and ``KVCacheManager`` read them), multimodal items become vLLM ``MultiModalFeatureSpec``
with a ``PlaceholderRange``, a LoRA adapter a vLLM ``LoRARequest``, prompt embeddings the tensor
whose raw bytes vLLM hashes (``tensor_data``).

The door does not guess what a caller wants: the callers differ (the waiting queues mirror only
the fields vLLM's queue order reads; the KV cache manager's mirror carries the hash and event
inputs but no stop rules; the scheduler carries the stop rules but not the session id), and each
says so explicitly, with keyword arguments (:func:`vllm_sampling_params`, :func:`vllm_request`)
or with the set of kvref ``Request`` fields it carries (:func:`vllm_request_from` and the
``*_CARRY`` sets below). A field not carried keeps vLLM's default.

vLLM is imported inside the functions: importing this module costs nothing and works without vLLM.
"""

from __future__ import annotations

import math
from typing import Any

from kvref.impl.request import LoRARequest, MultiModalFeatureSpec, RepetitionDetectionParams, Request
from kvref.spec.errors import InvalidFieldError, check_int

#: the kvref ``Request`` fields :func:`vllm_request_from` can carry into vLLM's request;
#: ``stop_rules`` is ``stop_token_ids``, ``eos_token_id`` (``ignore_eos`` without one), ``min_tokens``
#: and ``repetition_detection`` together, as vLLM's ``check_stop`` reads them
CARRIABLE = frozenset({
    "stop_rules", "skip_reading_prefix_cache", "do_remote_prefill", "kv_cache_report_mode", "arrival_time",
    "priority", "cache_salt", "mm_features", "lora_request", "prompt_embeds", "session_id", "resumable",
    "use_structured_output"})

#: :class:`kvref.impl.vllm.scheduler.VllmScheduler`: everything vLLM's ``Scheduler`` reads, as
#: the engine's input processor builds it; kvref's scheduler machines set no session id and keep
#: the incremental KV-cache report, so neither is carried (vLLM's defaults: None, incremental)
SCHEDULER_CARRY = CARRIABLE - {"session_id", "kv_cache_report_mode"}
#: :class:`kvref.impl.vllm.kv_cache_manager.VllmKVCacheManager`'s mirror: what vLLM's
#: ``KVCacheManager`` reads (hash inputs, event fields, the cache-read and report switches); no
#: stop rules (a manager never stops a request), no remote prefill, never resumable, no grammar
KV_MANAGER_CARRY = CARRIABLE - {"stop_rules", "do_remote_prefill", "resumable", "use_structured_output"}
#: :class:`kvref.impl.vllm.scheduler_queue.VllmWaitingQueue`: what vLLM's queue order reads
#: (``Request.__lt__``: priority, then arrival time)
QUEUE_CARRY = frozenset({"arrival_time", "priority"})


def vllm_sampling_params(*, max_tokens: int, stop_token_ids: tuple[int, ...] | list[int] = (),
                         eos_token_id: int | None = None, ignore_eos: bool = False, min_tokens: int = 0,
                         repetition_detection: RepetitionDetectionParams | None = None,
                         skip_reading_prefix_cache: bool | None = None, do_remote_prefill: bool = False,
                         kv_cache_report_mode: str = "incremental", prompt_logprobs: bool = False,
                         structured_output: bool = False) -> Any:
    """vLLM ``SamplingParams`` with these stop rules and KV switches (vLLM's defaults elsewhere).

    ``eos_token_id`` is set as vLLM's input processor sets a model's EOS
    (``update_from_generation_config({}, eos)``), so ``check_stop`` finishes on it with reason
    stop; ``ignore_eos=True`` with an EOS token is refused (kvref has no meaning for it: vLLM would
    keep the token and ignore it). ``do_remote_prefill`` becomes ``extra_args["kv_transfer_params"]
    = {"do_remote_prefill": True}`` (what a KV connector reads), ``kv_cache_report_mode="full"``
    ``extra_args["kv_cache_report_mode"] = "full"`` (what ``KVCacheManager.get_computed_blocks``
    reads to announce a hit's blocks); ``prompt_logprobs=True`` asks for prompt logprobs (0: the
    sampled token's). ``skip_reading_prefix_cache=None`` leaves it to vLLM's own rule (skip exactly
    when prompt logprobs are asked for: their computation needs the whole prompt run).
    ``structured_output=True`` asks for JSON mode (``structured_outputs=StructuredOutputsParams(
    json_object=True)``): vLLM's ``Request`` then derives ``use_structured_output`` and starts in
    ``WAITING_FOR_STRUCTURED_OUTPUT_GRAMMAR``.
    """
    check_int("max_tokens", max_tokens, minimum=1)  # vLLM's SamplingParams refuses < 1 too
    stop = _token_ids("stop_token_ids", stop_token_ids)
    if eos_token_id is not None:
        check_int("eos_token_id", eos_token_id, minimum=0)
    for name, flag in (("ignore_eos", ignore_eos), ("do_remote_prefill", do_remote_prefill),
                       ("prompt_logprobs", prompt_logprobs), ("structured_output", structured_output)):
        if not isinstance(flag, bool):
            raise InvalidFieldError(name, flag, "True or False")
    if skip_reading_prefix_cache is not None and not isinstance(skip_reading_prefix_cache, bool):
        raise InvalidFieldError("skip_reading_prefix_cache", skip_reading_prefix_cache, "None, True or False")
    if ignore_eos and eos_token_id is not None:
        raise InvalidFieldError("ignore_eos", ignore_eos, f"False with eos_token_id={eos_token_id}")
    check_int("min_tokens", min_tokens, minimum=0)
    if min_tokens > max_tokens:  # vLLM's SamplingParams refuses it too
        raise InvalidFieldError("min_tokens", min_tokens, f"at most max_tokens={max_tokens}")
    if repetition_detection is not None and not isinstance(repetition_detection, RepetitionDetectionParams):
        raise InvalidFieldError("repetition_detection", repetition_detection,
                                "None or a kvref RepetitionDetectionParams")
    if kv_cache_report_mode not in ("incremental", "full"):
        raise InvalidFieldError("kv_cache_report_mode", kv_cache_report_mode, "'incremental' or 'full'")
    from vllm.sampling_params import RepetitionDetectionParams as VRepetitionDetectionParams, SamplingParams
    from vllm.sampling_params import StructuredOutputsParams

    extra: dict[str, Any] = {}
    if do_remote_prefill:
        extra["kv_transfer_params"] = {"do_remote_prefill": True}
    if kv_cache_report_mode == "full":
        extra["kv_cache_report_mode"] = "full"
    rd = repetition_detection
    sp = SamplingParams(
        max_tokens=max_tokens, stop_token_ids=stop, ignore_eos=ignore_eos, min_tokens=min_tokens,
        repetition_detection=None if rd is None else VRepetitionDetectionParams(
            max_pattern_size=rd.max_pattern_size, min_pattern_size=rd.min_pattern_size, min_count=rd.min_count),
        skip_reading_prefix_cache=skip_reading_prefix_cache, extra_args=extra or None,
        prompt_logprobs=0 if prompt_logprobs else None,
        structured_outputs=StructuredOutputsParams(json_object=True) if structured_output else None)
    if eos_token_id is not None:
        sp.update_from_generation_config({}, eos_token_id)
    return sp


def vllm_request(request_id: str, prompt_token_ids: list[int] | tuple[int, ...], sampling_params: Any, *,
                 arrival_time: float | None = None, priority: int = 0, cache_salt: str | None = None,
                 block_hasher: Any = None, mm_features: tuple[MultiModalFeatureSpec, ...] = (),
                 mm_data: Any = None, lora_request: LoRARequest | None = None,
                 prompt_embeds: tuple[bytes, ...] | None = None, session_id: str | None = None,
                 resumable: bool = False) -> Any:
    """vLLM's ``Request`` (``pooling_params=None``) from kvref's values.

    ``sampling_params`` is vLLM's (:func:`vllm_sampling_params` builds it). ``arrival_time=None``
    is vLLM's default (the wall clock at construction). ``block_hasher`` is vLLM's
    ``get_request_block_hasher`` callable, or None (no block hashes: a pool without prefix
    caching). ``mm_features`` are kvref :class:`~kvref.impl.request.MultiModalFeatureSpec` items
    (each a vLLM ``MultiModalFeatureSpec`` whose ``data`` is ``mm_data``: None on the V1 model
    runner, a placeholder whose presence V2 reads), ``lora_request`` a kvref
    :class:`~kvref.impl.request.LoRARequest`, ``prompt_embeds`` one bytes row per prompt token
    (the tensor vLLM hashes those bytes of, float32 where the row length allows, else uint8).
    """
    if not isinstance(request_id, str) or not request_id:
        raise InvalidFieldError("request_id", request_id, "a non-empty str")
    prompt = _token_ids("prompt_token_ids", prompt_token_ids)
    if not prompt:
        raise InvalidFieldError("prompt_token_ids", prompt_token_ids, "a non-empty list of ints >= 0")
    from vllm.sampling_params import SamplingParams

    if not isinstance(sampling_params, SamplingParams):
        raise InvalidFieldError("sampling_params", sampling_params, "vLLM SamplingParams (vllm_sampling_params)")
    if arrival_time is not None and (isinstance(arrival_time, bool) or not isinstance(arrival_time, (int, float))
                                     or not math.isfinite(arrival_time)):
        raise InvalidFieldError("arrival_time", arrival_time, "None or a finite number")
    check_int("priority", priority)
    if cache_salt is not None and not isinstance(cache_salt, str):
        raise InvalidFieldError("cache_salt", cache_salt, "None or a str")
    if block_hasher is not None and not callable(block_hasher):
        raise InvalidFieldError("block_hasher", block_hasher, "None or vLLM's request block hasher (a callable)")
    if not isinstance(mm_features, (list, tuple)) or not all(isinstance(f, MultiModalFeatureSpec)
                                                                for f in mm_features):
        raise InvalidFieldError("mm_features", mm_features, "a tuple of kvref MultiModalFeatureSpec")
    if lora_request is not None and not isinstance(lora_request, LoRARequest):
        raise InvalidFieldError("lora_request", lora_request, "None or a kvref LoRARequest")
    if prompt_embeds is not None and (
            not isinstance(prompt_embeds, (list, tuple)) or len(prompt_embeds) != len(prompt)
            or not all(isinstance(r, bytes) and r and len(r) == len(prompt_embeds[0]) for r in prompt_embeds)):
        raise InvalidFieldError("prompt_embeds", prompt_embeds, f"None or {len(prompt)} non-empty bytes rows of "
                                "one length (one per prompt token)")
    if session_id is not None and not isinstance(session_id, str):
        raise InvalidFieldError("session_id", session_id, "None or a str")
    if not isinstance(resumable, bool):
        raise InvalidFieldError("resumable", resumable, "True or False")
    from vllm.v1.request import Request as VRequest

    mm = None
    if mm_features:
        from vllm.multimodal.inputs import MultiModalFeatureSpec as VFeature, PlaceholderRange as VRange

        mm = [VFeature(data=mm_data, modality=f.modality, identifier=f.identifier,
                       mm_position=VRange(offset=f.mm_position.offset, length=f.mm_position.length))
              for f in mm_features]
    lora = None
    if lora_request is not None:
        from vllm.lora.request import LoRARequest as VLoRARequest

        lora = VLoRARequest(lora_name=lora_request.lora_name, lora_int_id=lora_request.lora_int_id,
                            lora_path=lora_request.lora_path)
    return VRequest(request_id=request_id, prompt_token_ids=prompt, sampling_params=sampling_params,
                    pooling_params=None, arrival_time=arrival_time, cache_salt=cache_salt, priority=priority,
                    block_hasher=block_hasher, mm_features=mm, resumable=resumable,
                    prompt_embeds=embeds_tensor(prompt_embeds), lora_request=lora, session_id=session_id)


def vllm_request_from(request: Request, *, carry: frozenset[str], block_hasher: Any = None, mm_data: Any = None,
                      max_tokens: int | None = None) -> Any:
    """vLLM's ``Request`` for the kvref ``request``: its id, prompt and ``max_tokens`` (or the
    ``max_tokens`` given), and of its other fields exactly those named in ``carry`` (a subset of
    :data:`CARRIABLE`; :data:`SCHEDULER_CARRY`, :data:`KV_MANAGER_CARRY`, :data:`QUEUE_CARRY` are
    the adapters' sets). ``block_hasher`` and ``mm_data`` as for :func:`vllm_request`."""
    if not isinstance(request, Request):
        raise InvalidFieldError("request", request, "a kvref.impl.request.Request")
    if not isinstance(carry, (set, frozenset)) or not carry <= CARRIABLE:
        raise InvalidFieldError("carry", carry, f"a set of field names from {sorted(CARRIABLE)}")
    stop = "stop_rules" in carry

    def field(name: str, default: Any = None) -> Any:
        return getattr(request, name) if name in carry else default

    sp = vllm_sampling_params(
        max_tokens=request.max_tokens if max_tokens is None else max_tokens,
        stop_token_ids=request.stop_token_ids if stop else (),
        eos_token_id=request.eos_token_id if stop else None,
        ignore_eos=stop and request.eos_token_id is None,
        min_tokens=request.min_tokens if stop else 0,
        repetition_detection=request.repetition_detection if stop else None,
        skip_reading_prefix_cache=field("skip_reading_prefix_cache"),
        do_remote_prefill=field("do_remote_prefill", False),
        kv_cache_report_mode=field("kv_cache_report_mode", "incremental"),
        structured_output=field("use_structured_output", False))
    return vllm_request(request.request_id, request.prompt_token_ids, sp, arrival_time=field("arrival_time"),
                        priority=field("priority", 0), cache_salt=field("cache_salt"), block_hasher=block_hasher,
                        mm_features=field("mm_features", ()), mm_data=mm_data, lora_request=field("lora_request"),
                        prompt_embeds=field("prompt_embeds"), session_id=field("session_id"),
                        resumable=field("resumable", False))


def embeds_tensor(rows: tuple[bytes, ...] | None) -> Any:
    """The prompt embeddings as a tensor whose raw bytes are the rows (float32 where the row
    length allows, else uint8): vLLM hashes exactly those bytes per block (``tensor_data``)."""
    if rows is None:
        return None
    from kvref.impl.vllm.loader import load_vllm

    torch = load_vllm()["torch"]
    data = torch.frombuffer(bytearray(b"".join(rows)), dtype=torch.uint8).reshape(len(rows), len(rows[0]))
    return data.view(torch.float32) if len(rows[0]) % 4 == 0 else data


def _token_ids(name: str, tokens: Any) -> list[int]:
    if not isinstance(tokens, (list, tuple)):
        raise InvalidFieldError(name, tokens, "a list of ints >= 0")
    # fast path (C-level passes) for the common all-int case; the loop names a bad element
    if tokens and (set(map(type, tokens)) != {int} or min(tokens) < 0):
        for t in tokens:
            check_int(f"{name}[i]", t, minimum=0)
    return list(tokens)
