"""Recording schedulers: vLLM's own ``Scheduler`` / ``AsyncScheduler``, writing a run trace.

A user switches recording on without patching vLLM, through vLLM's ``--scheduler-cls`` hook
(``SchedulerConfig.scheduler_cls``; the engine core resolves the string with
``resolve_obj_by_qualname`` in ``SchedulerConfig.get_scheduler_cls`` and constructs the class
with the same arguments as its default scheduler)::

    KVREF_RECORD=/data/run.kvtrace.gz vllm serve MODEL \\
        --scheduler-cls kvref.record.RecordingAsyncScheduler
    kvref check-run /data/run.kvtrace.gz

Pick the class that matches the engine's mode: ``RecordingAsyncScheduler`` under async
scheduling (vLLM's default where supported), ``RecordingScheduler`` with
``--no-async-scheduling``. A custom ``scheduler_cls`` does not change whether the engine
*runs* asynchronously (``SchedulerConfig.async_scheduling`` does), so a mismatch is recorded in
the header and ``kvref check-run`` falls back to the run properties for it.

Settings (environment, or ``--additional-config '{"kvref_record": {...}}'``):

* ``KVREF_RECORD`` / ``path``: the trace file (``*.gz``: gzip; ``{pid}`` and ``{rank}``, the
  data-parallel rank, are substituted so several engine cores do not share a file);
* ``KVREF_RECORD_ANONYMIZE=1`` / ``anonymize``: token ids, request ids and cache salts replaced
  by a consistent anonymous mapping (:class:`~kvref.impl.run_trace.format.TokenAnonymizer`), so
  production prompts never leave the machine.

What is recorded is what the reference needs to replay the run and nothing it would have to
guess (see :mod:`kvref.impl.run_trace.format`): the KV cache config and scheduler settings, every
arrival and outside abort, every ``schedule()`` as the KV cache sees it, every
``update_from_output``. Features kvref's scheduler subset does not model (speculative decoding,
KV connectors, structured output, multimodal inputs, ...) are named in the header or on the
request's record, so the checker can say why it cannot follow instead of reporting a false
divergence.

The recording cost on the engine thread is a handful of C calls per wrapped call (ids joined
between quotes, int columns as ``array("I")`` + base64, the JSON encoder only for the few block
tables a step allocates, format version 2); compression runs in a writer thread
(``benchmarks/bench_record.py`` measures both against ``schedule()`` + ``update_from_output()``).
"""

from __future__ import annotations

import atexit
import dataclasses
import json
import os
import sys
import time
import weakref
from array import array
from binascii import b2a_base64
from itertools import chain, compress
from math import isfinite
from typing import TYPE_CHECKING, Any

from kvref.impl.run_trace.format import (
    FINISH_REASONS,
    FORMAT,
    VERSION,
    TokenAnonymizer,
    encode_lengths,
    encode_tokens,
    update_sampled,
)
from kvref.impl.run_trace.writer import TraceWriter, _dumps
from kvref.impl.vllm.record_connector import ConnectorTap, connector_header
from kvref.impl.vllm.record_grammar import WAITING_FOR_GRAMMAR, GrammarTap
from kvref.spec.errors import InvalidFieldError

if TYPE_CHECKING:  # vLLM is imported when a recording class is first asked for (see __getattr__)
    from vllm.v1.core.sched.scheduler import Scheduler

ENV_PATH = "KVREF_RECORD"
ENV_ANONYMIZE = "KVREF_RECORD_ANONYMIZE"
_TRUE = ("1", "true", "yes", "on")


def record_settings(vllm_config) -> tuple[str, bool]:
    """``(path, anonymize)`` from the environment, else ``additional_config["kvref_record"]``."""
    extra = getattr(vllm_config, "additional_config", None)
    extra = extra.get("kvref_record", {}) if isinstance(extra, dict) else {}
    if not isinstance(extra, dict):
        raise InvalidFieldError("additional_config.kvref_record", extra, 'an object like {"path": "run.kvtrace.gz"}')
    path = os.environ.get(ENV_PATH) or extra.get("path")
    if not path or not isinstance(path, str):
        raise InvalidFieldError(ENV_PATH, path, "the trace's output path (set KVREF_RECORD=/path/run.kvtrace.gz or "
                                "additional_config kvref_record.path) when a kvref recording scheduler is used")
    anon_env = os.environ.get(ENV_ANONYMIZE)
    anonymize = anon_env.lower() in _TRUE if anon_env is not None else bool(extra.get("anonymize", False))
    rank = getattr(getattr(vllm_config, "parallel_config", None), "data_parallel_rank", 0)
    return path.replace("{pid}", str(os.getpid())).replace("{rank}", str(rank)), anonymize


def _plain(value: Any) -> Any:
    """A spec field as JSON: dtypes by name, tuples as lists, anything else as its repr."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, (tuple, list)):
        return [_plain(v) for v in value]
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    text = str(value)
    return text.removeprefix("torch.")


def spec_record(spec) -> dict:
    """A vLLM ``KVCacheSpec`` as ``{"type": class name, field: value, ...}``."""
    out: dict[str, Any] = {"type": type(spec).__name__}
    if dataclasses.is_dataclass(spec):
        for f in dataclasses.fields(spec):
            out[f.name] = _plain(getattr(spec, f.name))
    if type(spec).__name__ == "UniformTypeKVCacheSpecs":
        out["kv_cache_specs"] = {k: spec_record(v) for k, v in spec.kv_cache_specs.items()}
    return out


#: (R-SWA and the circular buffer since session 20, #28; not SinkFullAttentionSpec, which vLLM 0.33.0
#: cannot build behind its coordinator, nor HiddenStateCacheSpec, which comes only with
#: extract_hidden_states and its connector: docs/differences.md)
_MODELLED_SPECS = ("FullAttentionSpec", "MLAAttentionSpec", "SlidingWindowSpec", "ChunkedLocalAttentionSpec",
                   "MambaSpec", "SlidingWindowMLASpec", "RSWASpec", "CircularBufferSpec")


def _setup_unmodelled(s: Scheduler, is_async_class: bool) -> list[str]:
    """What this engine uses that kvref's scheduler subset does not model (docs/differences.md)."""
    vc, sc = s.vllm_config, s.scheduler_config
    found = []

    def flag(cond: Any, name: str) -> None:
        if cond:
            found.append(name)

    # a KV connector is replayed from its recorded answers (format 4, record_connector.py); what
    # the reference does not model beside it is named
    # a connector that supports divergent local hybrid hits is replayed (the header's
    # divergent_local_hybrid_hits makes the reference ask get_computed_blocks_for_connector): on a
    # Mamba pool with prefix caching too, where the Mamba group's hit may lag the full-attention
    # one and a hit with no external tokens behind it is reconciled (#28: generated align
    # connector runs agree step by step)
    conn = getattr(s, "connector", None)
    # HiSparse's deferred async loads are replayed (#28, session 20): the header's connector says
    # whether the pool has a HiSparse host pool (vLLM's defer_async_loads follows from it and the
    # deferred frees); a scheduler that defers without one is named
    flag(getattr(s, "defer_async_loads", False)
         and getattr(s.kv_cache_config, "hisparse_host_num_blocks", None) is None, "deferred_async_loads")
    # vLLM's aux-output (routed-experts) connector is replayed without a KV connector (#28, session
    # 20: the header's scheduler.aux_output, impl/reference/scheduler_aux_output.py); beside one the
    # reference's connector path does not model the V2 runner's output shape it requires
    flag(getattr(s, "aux_output_connector", None) is not None and conn is not None,
         "aux_output_connector (with a KV connector)")
    flag(getattr(s, "ec_connector", None) is not None, "ec_connector")
    spec = getattr(vc, "speculative_config", None)
    method = _MODELLED_SPEC_METHODS.get(str(getattr(spec, "method", ""))) if spec is not None else None
    k = int(getattr(spec, "num_speculative_tokens", 0) or 0) if spec is not None else 0
    flag(spec is not None and method is None, f"spec_decode (method {getattr(spec, 'method', None)})")
    # an EAGLE-like drafter's lookahead slots are modelled (num_speculative_tokens of them)
    lookahead = getattr(s, "num_lookahead_tokens", 0)
    flag(lookahead and not (method == "eagle" and lookahead == k), "lookahead_tokens")
    # the drafter's prefill lookahead is replayed (the header's spec carries it): 1 for an
    # EAGLE-family drafter changes nothing; multi-module MTP's longer runway is the reference's
    # scheduler_prefill_lookahead and the manager's re-prefillable tail (#28)
    # lookahead block hashes (an EAGLE-family drafter's hashes cover the tokens its KV at a block's
    # last position reads ahead) are replayed: the header's pool carries num_hash_lookahead_tokens,
    # the reference's manager hashes the same way (#28)
    # SWA bounded replay (DeepSeek-V4.1: a SlidingWindowMLASpec with bounded_replay) is replayed
    # (#28, session 20): the header's group carries the spec, each new request's replay_start is
    # recorded (the sched record's "replay"), and beside a KV connector whether each load carries
    # the window (the connector log's "w" entries, _load_restores_replay_window below)
    # the adaptive long-prefill threshold, max_num_active_seqs and the local prefill cadence are
    # replayed (the header's scheduler section carries them; impl/reference/scheduler_cadence.py):
    # only the cadence beside a KV connector, which the reference scheduler refuses, is named (#28)
    flag(getattr(s, "defer_block_free", False) and conn is None, "deferred_block_free")
    # an explicit max_num_scheduled_tokens (the step's token budget beside the input budget) is
    # replayed: the header's scheduler section carries it (#28)
    flag(_local_prefill_interval(s) != 1 and conn is not None, "prefill_schedule_interval (with a KV connector)")
    flag(getattr(s, "num_sampled_tokens_per_step", 1) != 1, "pooling_or_diffusion_model")
    flag(getattr(s, "is_encoder_decoder", False), "encoder_decoder")
    flag(getattr(s, "dcp_world_size", 1) != 1, "decode_context_parallel")
    flag(getattr(getattr(vc, "parallel_config", None), "pipeline_parallel_size", 1) != 1, "pipeline_parallel")
    # Mamba "align" mode (vLLM's _mamba_block_aligned_split, align-mode state blocks and hits) is
    # replayed, with a KV connector too (#28): the reference's connector path splits like vLLM's
    # waiting loop and returns copy-on-write endpoints at the end of schedule() as vLLM's
    # _free_cow_retained_blocks does (it kept them: a free-block divergence after a delayed free)
    # the Mamba shared-prefix checkpoint is replayed (the header's pool carries it; the reference's
    # managers narrow and split at the junction as vLLM does, #28)
    # encoder inputs (multimodal) are replayed with vLLM's own EncoderCacheManager sizes (the
    # header's scheduler.encoder); another encoder cache manager (an EC connector's) is not modelled
    ecm = getattr(s, "encoder_cache_manager", None)
    flag(ecm is not None and type(ecm).__name__ != "EncoderCacheManager",
         f"encoder_cache_manager:{type(ecm).__name__}")
    flag(bool(sc.async_scheduling) != is_async_class,
         "async_scheduling_mismatch (async_scheduling=%s with a %s scheduler class)"
         % (sc.async_scheduling, "async" if is_async_class else "synchronous"))
    for i, g in enumerate(s.kv_cache_config.kv_cache_groups):
        name = type(g.kv_cache_spec).__name__
        flag(name not in _MODELLED_SPECS, f"kv_cache_spec:{name} (group {i})")
    return found


def _local_prefill_interval(s: Scheduler) -> int:
    """The prefill cadence this scheduler applies itself: vLLM's ``local_prefill_interval`` (the
    configured ``prefill_schedule_interval`` without data parallelism, 1 where a DP coordinator
    drives it); older vLLMs without the attribute fall back to the config field."""
    return int(getattr(s, "local_prefill_interval", getattr(s.scheduler_config, "prefill_schedule_interval", 1)))


def build_header(s: Scheduler, anonymize: bool, is_async_class: bool) -> dict:
    """The trace header for a constructed scheduler."""
    import vllm

    from kvref.spec.version import KVREF_VERSION as kvref_version

    vc, sc, cc = s.vllm_config, s.scheduler_config, s.cache_config
    kvc = s.kv_cache_config
    return {
        "format": FORMAT, "version": VERSION,
        "producer": {"vllm": getattr(vllm, "__version__", "unknown"), "kvref": kvref_version,
                     "scheduler_cls": f"{type(s).__module__}.{type(s).__qualname__}", "pid": os.getpid(),
                     "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())},
        "anonymized": anonymize,
        "log_stats": bool(getattr(s, "log_stats", False)),
        "pool": {
            "num_blocks": kvc.num_blocks, "max_model_len": s.max_model_len,
            "scheduler_block_size": s.block_size, "hash_block_size": s.hash_block_size,
            "max_in_flight_tokens": vc.max_in_flight_tokens, "enable_caching": bool(cc.enable_prefix_caching),
            "watermark": float(getattr(sc, "watermark", 0.0)), "use_eagle": bool(getattr(s, "use_eagle_block_drop", False)),
            # replayed (#28): lookahead block hashes, and the Mamba shared-prefix checkpoint as configured
            "num_hash_lookahead_tokens": int(getattr(s, "num_hash_lookahead_tokens", 0) or 0),
            "mamba_shared_prefix_checkpoint": bool(getattr(cc, "enable_mamba_shared_prefix_checkpoint", False)),
            # sparse prefix-cache retention (None: dense): which sliding-window / Mamba blocks vLLM
            # caches, so which of their freed blocks go to the free queue's back (run properties'
            # free_order, #28 session 18); replayed too
            "prefix_cache_retention_interval": getattr(kvc, "prefix_cache_retention_interval", None),
            # the coordinator rounds what it caches down to this many tokens (a hybrid pool's
            # scheduler block unless fine-grained hits; 1: no rounding): which blocks of a group
            # smaller than the scheduler block get a hash (free_order, #28 session 18)
            **_cache_round(s),
            # is_eagle_group: the groups an EAGLE-like drafter's block drop applies to (replayed, #28);
            # cache_hit_alignment_tokens / drops_eagle_block: each manager's hit alignment and EAGLE
            # block drop, which its reachable-block mask (the blocks it caches) follows
            "groups": [{"layers": list(g.layer_names), "spec": spec_record(g.kv_cache_spec),
                        **({"is_eagle_group": True} if getattr(g, "is_eagle_group", False) else {}),
                        **_alignment(s, i)}
                       for i, g in enumerate(kvc.kv_cache_groups)],
        },
        "scheduler": {
            "max_num_batched_tokens": sc.max_num_batched_tokens,
            "max_num_scheduled_tokens": getattr(s, "max_num_scheduled_tokens", sc.max_num_batched_tokens),
            "max_num_seqs": sc.max_num_seqs,
            "long_prefill_token_threshold": sc.long_prefill_token_threshold,
            "enable_chunked_prefill": bool(sc.enable_chunked_prefill),
            "policy": str(sc.policy),
            "scheduler_reserve_full_isl": bool(getattr(sc, "scheduler_reserve_full_isl", True)),
            "async_scheduling": bool(sc.async_scheduling),
            "async_class": is_async_class,
            "prefill_schedule_interval": _local_prefill_interval(s),
            "long_prefill_token_threshold_adaptive": bool(getattr(s, "adaptive_long_prefill_threshold", False)),
            "max_num_active_seqs": getattr(s, "max_num_active_reqs", sc.max_num_seqs),
            # what multimodal and LoRA requests need replayed (#28): the encoder limits vLLM derived
            # from the model's MultiModalBudget, LoRAConfig.max_loras, and the V2 model runner
            # (resumed requests sent as new ones, the encoder-input updates)
            "use_v2_model_runner": bool(getattr(s, "use_v2_model_runner", False)),
            "max_loras": _max_loras(s),
            # vLLM's aux-output (routed-experts, R3) connector: caps prefix hits at the blocks whose
            # routing it can serve (replayed, session 20)
            "aux_output": getattr(s, "aux_output_connector", None) is not None,
            "encoder": _encoder_header(s),
        },
        "unmodelled": _setup_unmodelled(s, is_async_class),
        **({"spec": _spec_header(s)} if getattr(vc, "speculative_config", None) is not None else {}),
        **({"connector": connector_header(s)} if getattr(s, "connector", None) is not None else {}),
    }


def _cache_round(s) -> dict:
    """``{"cache_round_tokens": n}``: vLLM 0.33.0's ``HybridKVCacheCoordinator._align_cacheable``
    rounds the tokens ``cache_blocks`` may cache down to the scheduler block size unless
    fine-grained partial hash hits are on (1); the unitary coordinator does not round (1). {} where
    the coordinator is neither (another vLLM): the trace then does not say."""
    coord = getattr(getattr(s, "kv_cache_manager", None), "coordinator", None)
    if coord is None:
        return {}
    if hasattr(type(coord), "_align_cacheable"):
        return {"cache_round_tokens": 1 if coord.enable_partial_hash_hits else int(coord.scheduler_block_size)}
    if type(coord).__name__ in ("UnitaryKVCacheCoordinator", "KVCacheCoordinatorNoPrefixCache"):
        return {"cache_round_tokens": 1}
    return {}


def _alignment(s, group: int) -> dict:
    """What a group's manager caches by (#28, session 18): ``cache_hit_alignment_tokens`` (vLLM 0.33.0:
    every manager has one; the coordinator sets it to the hash block size under fine-grained hybrid
    hits) and ``drops_eagle_block`` (the manager's ``use_eagle``, which the coordinator sets per
    group); {} where the manager has no alignment."""
    try:
        m = s.kv_cache_manager.coordinator.single_type_managers[group]
        n = m.cache_hit_alignment_tokens
    except (AttributeError, IndexError):
        return {}
    if n is None:
        return {}
    return {"cache_hit_alignment_tokens": int(n), "drops_eagle_block": bool(getattr(m, "use_eagle", False))}


def _max_loras(s) -> int | None:
    """vLLM's ``LoRAConfig.max_loras`` the scheduler admits under, or None (LoRA off)."""
    lc = getattr(s, "lora_config", None)
    return int(lc.max_loras) if lc else None


def _encoder_header(s) -> dict:
    """The encoder limits vLLM's ``Scheduler.__init__`` took from the model's ``MultiModalBudget``
    (zero for a text model): the compute budget per step, the encoder cache's size (both in
    embeddings) and ``disable_chunked_mm_input``."""
    ecm = getattr(s, "encoder_cache_manager", None)
    return {"compute_budget": int(getattr(s, "max_num_encoder_input_tokens", 0) or 0),
            "cache_size": int(getattr(ecm, "cache_size", 0) or 0),
            "disable_chunked_mm_input": bool(getattr(s.scheduler_config, "disable_chunked_mm_input", False))}


#: drafting methods kvref's scheduler models (n-gram; EAGLE-like drafters with lookahead slots)
_MODELLED_SPEC_METHODS = {"ngram": "ngram", "eagle": "eagle", "eagle3": "eagle", "mtp": "eagle"}


def _spec_header(s) -> dict:
    """Speculative decoding as the scheduler sees it: what the replay needs to follow it (issue #28)."""
    sc = s.vllm_config.speculative_config
    return {"num_speculative_tokens": int(getattr(sc, "num_speculative_tokens", 0) or 0),
            "method": str(getattr(sc, "method", "")),
            "num_lookahead_tokens": int(getattr(s, "num_lookahead_tokens", 0) or 0),
            "num_prefill_lookahead": int(getattr(s, "num_prefill_lookahead", 0) or 0),
            "can_skip_drafts": bool(getattr(s, "can_skip_drafts", False))}


def _ids_json(ids) -> str:
    """Request ids as a JSON list; joined by hand when no id needs escaping (the common case,
    twice as fast as the encoder), else by the encoder."""
    joined = '","'.join(ids)
    if joined.isprintable() and "\\" not in joined and joined.count('"') == 2 * (len(ids) - 1):
        return '["' + joined + '"]' if ids else "[]"
    return _dumps(list(ids))


def _plain_id(request_id: Any) -> bool:
    """Whether a request id can be written between two quotes as it is (no JSON escaping)."""
    return type(request_id) is str and request_id.isprintable() and '"' not in request_id and "\\" not in request_id


if sys.byteorder == "little":
    def _u32(ints) -> str:
        """:func:`~kvref.impl.run_trace.format.encode_tokens` without its checks and copies (hot path)."""
        return b2a_base64(array("I", ints), newline=False).decode("ascii")
else:  # pragma: no cover - the format is little-endian everywhere
    _u32 = encode_tokens


def _ids(ids) -> str:
    """Plain request ids (:func:`_plain_id`) as a JSON list, joined by hand."""
    return '["' + '","'.join(ids) + '"]' if ids else "[]"


def _groups(groups) -> str:
    """Block ids per KV cache group as a JSON list of base64 uint32 strings (format version 2)."""
    return '["' + '","'.join(map(_u32, groups)) + '"]' if groups else "[]"


def _ints(values) -> str:
    """Ints as a JSON list (``%d`` refuses anything that is not a number)."""
    return "[" + ",".join(["%d" % v for v in values]) + "]"


_REASONS: dict = {}  # RequestStatus -> finish reason (an enum's .name is a Python-level property)


def _reason(status) -> str:
    why = _REASONS.get(status)
    if why is None:
        why = _REASONS[status] = FINISH_REASONS.get(status.name, status.name.lower())
    return why


def _streaming_unmodelled(s, request) -> str | None:
    """Why a streaming-input session (a ``resumable`` arrival, or an update: ``add_request`` with a
    live session's id) cannot be replayed, or None. The reference models vLLM's sessions
    (impl/reference/scheduler_sessions.py) under FCFS without a KV connector, speculative decoding
    or multimodal items, and refuses a session outside that; the recorder names those (#28)."""
    if getattr(s, "connector", None) is not None:
        return "streaming_input (with a KV connector)"
    if getattr(s.vllm_config, "speculative_config", None) is not None:
        return "streaming_input (with speculative decoding)"
    if getattr(request, "mm_features", None):
        return "streaming_input (multimodal)"
    if getattr(request, "prompt_embeds", None) is not None:
        return "streaming_input (prompt embeds)"
    if str(s.scheduler_config.policy).lower() != "fcfs":
        return "streaming_input (priority policy)"
    return None


def _request_unmodelled(request, existing: bool, s=None) -> list[str]:
    found = []
    sp = request.sampling_params
    # streaming-input sessions are recorded (add.resumable; an update is an add with the session's
    # id) and replayed where the reference models them (#28, format 6)
    if existing or getattr(request, "resumable", False):
        why = _streaming_unmodelled(s, request) if s is not None else "streaming_input"
        if why:
            found.append(why)
    if request.pooling_params is not None:
        found.append("pooling")
    # a routed-experts prompt start other than 0 (the aux-output connector's routing rows start
    # there): the reference keeps vLLM's default (docs/differences.md)
    if s is not None and getattr(s, "aux_output_connector", None) is not None and sp is not None \
            and getattr(sp, "routed_experts_prompt_start", 0):
        found.append("routed_experts_prompt_start")
    # structured output is recorded (add.so, the grammar's answers in each record's "gr" list,
    # record_grammar.py, format 7) and replayed (#28); the reference models it without a KV connector
    # and without streaming sessions
    if getattr(request, "use_structured_output", False):
        if s is not None and getattr(s, "connector", None) is not None:
            found.append("structured_output (with a KV connector)")
        elif getattr(request, "resumable", False) or existing:
            found.append("structured_output (streaming session)")
    # multimodal items and LoRA adapters are recorded (add.mm, add.lora) and replayed (#28); an item
    # whose placeholder tokens are not all embeddings (an is_embed mask) is not modelled
    if any(getattr(f.mm_position, "is_embed", None) is not None for f in getattr(request, "mm_features", None) or ()):
        found.append("multimodal (is_embed mask)")
    # prompt embeddings are recorded (add.embeds: a digest per row, format 6) and replayed (#28)
    if getattr(request, "prompt_embeds", None) is None and request.prompt_token_ids is None:
        found.append("prompt_embeds")  # no token ids and no embeddings: nothing to replay
    # kv_transfer_params (a P/D split's do_remote_prefill / do_remote_decode, the remote engine's
    # address) are read by the KV connector, whose answers the trace holds (format 4); vLLM's
    # scheduler itself reads only do_remote_prefill (a fetch stage from arrival, recorded as
    # add.remote): replayed (#28)
    # repetition detection, min_tokens and the EOS id are recorded (add.rep/min/eos, format 5) and
    # replayed through the reference's check_stop (#28)
    return found


def _embeds_json(request, anon) -> str:
    """``,"embeds":"<base64>"``: an 8-byte digest of each prompt position's embedding row (keyed
    when anonymized), what vLLM's block hashes take of a prompt-embeds request
    (``_gen_prompt_embeds_extra_hash_keys``: the bytes of the block's rows), or "" (format 6, #28).
    One pass over the tensor's bytes at arrival, as vLLM's hasher makes per block."""
    pe = getattr(request, "prompt_embeds", None)
    if pe is None:
        return ""
    from vllm.v1.utils import tensor_data

    from kvref.impl.run_trace.format import embeds_digests

    data = tensor_data(pe)
    rows = int(pe.shape[0]) if len(pe.shape) else 0
    if not rows:
        return ',"embeds":""'
    row_bytes = len(data) // rows
    digests = anon.embeds_digests(data, row_bytes) if anon is not None else embeds_digests(data, row_bytes)
    return ',"embeds":"%s"' % b2a_base64(digests, newline=False).decode("ascii")


def _stop_json(sp, anon) -> str:
    """``,"eos":id`` (or null with ``ignore_eos``), ``,"min":n`` (when not 0) and ``,"rep":[max
    pattern, min pattern, min count]`` (when set): what vLLM's ``check_stop`` reads besides
    ``max_tokens`` and the stop ids, so the replay can tell whether each request stopped at the
    right token (format 5, #28). Anonymized: the EOS id goes through the token mapping, as ``stop``."""
    if sp is None:
        return ""
    eos = sp.eos_token_id
    if eos is not None and anon is not None:
        eos = anon.tokens([eos])[0]
    out = ',"eos":' + ("null" if eos is None else str(int(eos)))
    if sp.min_tokens:
        out += ',"min":%d' % sp.min_tokens
    rd = getattr(sp, "repetition_detection", None)
    if rd is not None:
        out += ',"rep":[%d,%d,%d]' % (rd.max_pattern_size, rd.min_pattern_size, rd.min_count)
    return out


def _features_json(request, anon) -> str:
    """``,"mm":[[identifier, offset, length, modality], ...]`` and ``,"lora":[name, id, path]``: a
    request's multimodal items (their identifiers enter the block hashes and key the encoder cache)
    and LoRA adapter (its name and path enter the hashes, its id counts against max_loras), or ""
    (#28). Anonymized: identifiers, names and paths become keyed hashes (equal stays equal)."""
    out = ""
    mm = getattr(request, "mm_features", None)
    if mm:
        key = anon.salt if anon is not None else str
        out += ',"mm":' + _dumps([[key(f.identifier), int(f.mm_position.offset), int(f.mm_position.length),
                                    str(f.modality)] for f in mm])
    lora = getattr(request, "lora_request", None)
    if lora is not None:
        key = anon.salt if anon is not None else str
        out += ',"lora":' + _dumps([key(lora.lora_name), int(lora.lora_int_id), key(lora.lora_path)])
    return out


def _encoder_json(so, anon) -> str:
    """A step's encoder inputs (``,"enc":{id: [input ids]}``), the encoder-cache entries it evicted
    (``,"efree":[identifier, ...]``) and, for the V2 model runner, the items the workers install or
    release (``,"eupd":{id: {input id: "install"|"release"}}``): compared by the replay (#28)."""
    out = ""
    rid = anon.request_id if anon is not None else str
    key = anon.salt if anon is not None else str
    if so.scheduled_encoder_inputs:
        out += ',"enc":' + _dumps({rid(r): [int(i) for i in ids] for r, ids in so.scheduled_encoder_inputs.items()})
    if so.free_encoder_mm_hashes:
        out += ',"efree":' + _dumps([key(h) for h in so.free_encoder_mm_hashes])
    upd = getattr(so, "encoder_input_updates", None)
    if upd:
        out += ',"eupd":' + _dumps({rid(r): {str(i): "release" if d is None else "install" for i, d in u.items()}
                                    for r, u in upd.items()})
    return out


SKIP_DRAFTS = ',"skip_drafts":true'


def _anon_drafts(anon, drafts) -> list[int]:
    """Draft token ids through the anonymizer, the -1 of an empty or placeholder slot kept: the
    ``drafts`` records and the ``sched`` records' ``spec`` must rename a draft alike (the replay
    compares the drafts it schedules with ``spec``; an anonymized trace with drafts diverged there)."""
    return [-1 if int(t) < 0 else anon.tokens([int(t)])[0] for t in drafts]


def _stats_json(outputs) -> str:
    """``,"stats":{...}`` from the ``SchedulerStats`` ``update_from_output`` returned (what the
    metrics endpoint shows: KV cache usage, prefix-cache queries and hits), or "" when vLLM made
    none (``log_stats`` off). Read from the return value, never by calling ``make_stats()``, which
    resets the counters the endpoint would have read."""
    if not outputs:
        return ""
    for eco in outputs.values():
        st = getattr(eco, "scheduler_stats", None)
        if st is None:
            continue
        p = st.prefix_cache_stats
        # skip: vLLM's num_skipped_waiting_reqs (deferred_waiting: requests its waiting loop skipped,
        # left out of num_waiting_reqs), so the properties can count the waiting queue (#28)
        if p is None:
            return ',"stats":{"usage":%r,"run":%d,"wait":%d,"skip":%d}' % (
                float(st.kv_cache_usage), st.num_running_reqs, st.num_waiting_reqs, st.num_skipped_waiting_reqs)
        c = st.connector_prefix_cache_stats
        return (',"stats":{"usage":%r,"req":%d,"q":%d,"h":%d,"preq":%d,"pq":%d,"ph":%d,"run":%d,"wait":%d,"skip":%d%s}'
                % (
            float(st.kv_cache_usage), p.requests, p.queries, p.hits, p.preempted_requests, p.preempted_queries,
            p.preempted_hits, st.num_running_reqs, st.num_waiting_reqs, st.num_skipped_waiting_reqs,
            "" if c is None else ',"creq":%d,"cq":%d,"ch":%d,"cpreq":%d,"cpq":%d,"cph":%d,"creset":%d' % (
                c.requests, c.queries, c.hits, c.preempted_requests, c.preempted_queries, c.preempted_hits,
                bool(c.reset))))
    return ""


class _Recorder:
    """The recording half, shared by both classes (a mixin before vLLM's class in the MRO).

    Each wrapped call runs vLLM's own method, then one ``_kvref_on_*`` hook formats the record.
    The hooks have a fast path (no anonymizer, every request id writable between quotes as it is:
    checked once per request in :meth:`add_request`) that formats a line from vLLM's own lists
    with C calls only — ``str.join`` for id columns, ``array("I")`` + base64 for int columns, the
    JSON encoder only for block tables and non-empty sets — and the general path otherwise.
    """

    _kvref_writer: TraceWriter | None = None
    _kvref_stats = False  # vLLM makes SchedulerStats (log_stats): set by _kvref_start
    _kvref_connector = False  # a KV connector is configured: set by _kvref_start
    _kvref_fin: list | None = None  # finishes seen by _free_request during update_from_output
    _kvref_fast = False  # the fast path's conditions hold (see the class docstring)
    _kvref_tap: ConnectorTap | None = None  # the connector's answers (KV-connector runs)
    _kvref_grammar: GrammarTap | None = None  # the structured-output grammars' answers (format 7)

    def _handle_blocked_waiting_request(self, request) -> bool:
        """vLLM's check of a blocked waiting request; for one waiting for its grammar the answer it
        saw is logged (``["g", id, state]``, :mod:`.record_grammar`)."""
        waited = request.status.name == WAITING_FOR_GRAMMAR
        went_on = super()._handle_blocked_waiting_request(request)  # type: ignore[misc]
        if waited and self._kvref_grammar is not None:
            self._kvref_grammar.checked(self, request, went_on)
        return went_on

    def update_draft_token_ids_in_output(self, draft_token_ids, scheduler_output):
        """Not recorded (an async step's drafts): its grammar checks are not logged either."""
        tap = self._kvref_grammar
        if tap is None:
            return super().update_draft_token_ids_in_output(draft_token_ids, scheduler_output)  # type: ignore[misc]
        tap.in_output = True
        try:
            return super().update_draft_token_ids_in_output(draft_token_ids, scheduler_output)  # type: ignore[misc]
        finally:
            tap.in_output = False

    def _kvref_so(self) -> str:
        """``,"gr":[...]``: the grammar answers since the last record, or ""."""
        tap = self._kvref_grammar
        if tap is None or not tap.log:
            return ""
        return ',"gr":' + _dumps(tap.take())

    def _load_restores_replay_window(self, request) -> bool:
        """vLLM 0.33.0's SWA bounded replay beside a KV connector asks the connector which groups
        its load for ``request`` restores (``get_loaded_kv_cache_group_ids``) to decide whether the
        load carries the replay window. Inside this call the tap logs the connector's answer as
        ``["w", id, group ids]``, in call order, so the replay hands the reference the same groups
        and the reference decides for itself (#28, session 20); vLLM's other call of that method
        (the groups an async load need not zero) decides nothing the trace compares."""
        tap = self._kvref_tap
        if tap is None:
            return super()._load_restores_replay_window(request)  # type: ignore[misc]
        tap.window_query = True
        try:
            return super()._load_restores_replay_window(request)  # type: ignore[misc]
        finally:
            tap.window_query = False

    def _kvref_start(self, is_async_class: bool) -> None:
        path, anonymize = record_settings(self.vllm_config)
        self._kvref_anon = TokenAnonymizer() if anonymize else None
        self._kvref_fast = not anonymize
        self._kvref_step = 0
        self._kvref_steps: dict[int, int] = {}  # id(SchedulerOutput) -> step
        self._kvref_depth = 0  # > 0 inside our own calls: internal finish_requests are not aborts
        self._kvref_errors = 0  # calls that raised (the end record counts them)
        self._kvref_pre_why: dict[str, str] = {}  # reset preemptions since the last schedule -> reason
        # bound once: read on every step (the recording cost, issue #14's budget)
        self._kvref_free = self.kv_cache_manager.block_pool.get_num_free_blocks
        self._kvref_connector = getattr(self, "connector", None) is not None
        self._kvref_transfer_ids = []
        if self._kvref_connector:  # its answers go to the records (format 4: the replay needs them)
            anon = self._kvref_anon
            self._kvref_tap = ConnectorTap(self.connector, anon.request_id if anon is not None else None)
        if getattr(self, "structured_output_manager", None) is not None:  # structured output (format 7)
            anon = self._kvref_anon
            self._kvref_grammar = GrammarTap(self, anon.request_id if anon is not None else None)
        self._kvref_stats = bool(getattr(self, "log_stats", False))
        self._kvref_refused: list[str] = []  # running requests allocate_slots refused this step
        if _has_windowed_group(self):
            _tap_refusals(self)
        self._kvref_writer = TraceWriter(path, build_header(self, anonymize, is_async_class))
        self.kvref_trace_path = path
        ref = weakref.ref(self)
        atexit.register(lambda: (lambda s: s is not None and s._kvref_close("atexit"))(ref()))

    def _kvref_close(self, how: str) -> None:
        w = self._kvref_writer
        if w is not None and not w.closed:
            end = {"t": "end", "steps": self._kvref_step, "records": w.num_records + 1, "how": how}
            if self._kvref_errors:  # shutdown() after a crash: the trace says so (issue #28)
                end["errors"] = self._kvref_errors
            w.close(end)

    def _kvref_error(self, call: str, step: int, exc: BaseException, inputs: dict) -> None:
        """Record a call that raised inside vLLM, then let the exception go on (issue #28).

        Without this record a crashed run's trace ended in a clean ``end`` record written by the
        engine's ``shutdown()`` and checked as "agrees". The record holds what the replay needs to
        make the same call on the reference: the step, and the call's inputs. Flushed at once: a
        process that dies of the exception still leaves it readable. Never raises itself.
        """
        self._kvref_errors += 1
        w = self._kvref_writer
        if w is None or w.closed:
            return
        rec = {"t": "error", "call": call, "step": step, "type": type(exc).__name__,
               "message": str(exc)[:4000]}
        rec.update(inputs)
        if self._kvref_tap is not None:
            rec["kv"] = self._kvref_tap.take()
        if self._kvref_grammar is not None and self._kvref_grammar.log:
            rec["gr"] = self._kvref_grammar.take()
        try:
            w.write(rec)
            w.flush()
        except Exception:  # noqa: BLE001 - the engine's own exception matters more than the trace
            pass

    # ---- recorded calls ---------------------------------------------------------------------
    def add_request(self, request) -> None:
        existing = request.request_id in self.requests
        self._kvref_depth += 1
        try:
            super().add_request(request)
        except Exception as exc:
            self._kvref_error("add_request", self._kvref_step, exc, {"add": self._kvref_add_record(request, existing)})
            raise
        finally:
            self._kvref_depth -= 1
        self._kvref_on_add(request, existing)

    def _kvref_add_record(self, request, existing: bool) -> dict | None:
        try:
            return json.loads(self._kvref_add_line(request, existing))
        except Exception:  # noqa: BLE001 - a request vLLM refused may not be recordable either
            return None

    def finish_requests(self, request_ids, finished_status):
        if self._kvref_depth:
            return super().finish_requests(request_ids, finished_status)
        self._kvref_depth += 1
        status = getattr(finished_status, "name", str(finished_status))
        try:
            done = super().finish_requests(request_ids, finished_status)
        except Exception as exc:
            ids = [request_ids] if isinstance(request_ids, str) else list(request_ids or ())
            if self._kvref_anon is not None:
                ids = [self._kvref_anon.request_id(i) for i in ids if isinstance(i, str)]
            self._kvref_error("finish_requests", self._kvref_step, exc,
                              {"ids": [i for i in ids if isinstance(i, str)], "status": status})
            raise
        finally:
            self._kvref_depth -= 1
        if done:
            ids = [r.request_id for r in done]
            anon = self._kvref_anon
            if anon is not None:
                ids = [anon.request_id(i) for i in ids]
            rec = {"t": "abort", "ids": ids, "status": status, "free": self._kvref_free()}
            if self._kvref_tap is not None:
                rec["kv"] = self._kvref_tap.take()
            self._kvref_writer.write(rec)
        return done

    def schedule(self, *args, **kwargs):
        self._kvref_depth += 1
        throttle = args[0] if args else kwargs.get("throttle_prefills", False)
        try:
            so = super().schedule(*args, **kwargs)
        except Exception as exc:
            # the step index this call would have had: the replay schedules once more there
            self._kvref_error("schedule", self._kvref_step, exc, {"throttle": True} if throttle else {})
            self._kvref_pre_why.clear()
            self._kvref_refused.clear()
            raise
        finally:
            self._kvref_depth -= 1
        self._kvref_on_schedule(so, throttle)
        return so

    def update_from_output(self, scheduler_output, model_runner_output):
        # Encoded before vLLM sees them: update_from_output trims a token list in place at a stop.
        step = self._kvref_steps.pop(id(scheduler_output), -1)
        head = self._kvref_update_head(step, model_runner_output)
        if self._kvref_tap is not None:  # the worker's report, in the order vLLM iterates it
            self._kvref_kvo = self._kvref_kvo_json(model_runner_output)
        self._kvref_fin = finished = []
        self._kvref_depth += 1
        try:
            out = super().update_from_output(scheduler_output, model_runner_output)
        except Exception as exc:
            try:
                update = json.loads(head + "[]" + (self._kvref_kvo if self._kvref_tap is not None else "") + "}")
                del update["fin"]
            except ValueError:
                update = None
            self._kvref_error("update_from_output", step, exc, {"update": update} if update else {})
            raise
        finally:
            self._kvref_depth -= 1
            self._kvref_fin = None
        if self._kvref_stats:
            self._kvref_out = out  # the SchedulerStats inside go to the record (the hook's signature is kept)
            self._kvref_on_update(head, finished)
            self._kvref_out = None
        else:
            self._kvref_on_update(head, finished)
        return out

    def update_draft_token_ids(self, draft_token_ids):
        """The drafts a synchronous runner proposed after a step: recorded for the replay."""
        out = super().update_draft_token_ids(draft_token_ids)
        ids = list(draft_token_ids.req_ids)
        anon = self._kvref_anon
        toks = [[int(t) for t in d] for d in draft_token_ids.draft_token_ids]
        if anon is not None:
            ids = [anon.request_id(i) for i in ids]
            toks = [_anon_drafts(anon, d) for d in toks]
        rec = {"t": "drafts", "ids": ids, "tokens": toks}
        if self._kvref_grammar is not None and self._kvref_grammar.log:
            rec["gr"] = self._kvref_grammar.take()  # the drafts each grammar kept (format 7)
        self._kvref_writer.write(rec)
        return out

    def set_pause_state(self, pause_state) -> None:
        # the engine's pause_generation / resume (weight updates, RL rollouts): what later steps may
        # schedule changes, so the replay must pause its reference at the same point (#28)
        super().set_pause_state(pause_state)
        w = self._kvref_writer
        if w is not None and not w.closed:
            w.write({"t": "pause", "state": int(pause_state)})

    def reset_prefix_cache(self, *args, **kwargs):
        running = bool(args[0] if args else kwargs.get("reset_running_requests", False))
        if running:  # every running request is preempted for the reset: the next step's pre_why
            self._kvref_pre_why.update(dict.fromkeys([r.request_id for r in self.running], "reset_prefix_cache"))
        raised = None
        ok = False
        try:
            ok = super().reset_prefix_cache(*args, **kwargs)
        except RuntimeError as exc:
            # vLLM refuses a reset it cannot complete after preempting the running requests (an
            # async load holds blocks); the preemptions stand, the engine goes on: recorded
            raised = f"{type(exc).__name__}: {exc}"[:1000]
            raise
        finally:
            rec = {"t": "reset", "running": running, "ok": bool(ok), "free": self._kvref_free()}
            if raised is not None:
                rec["raised"] = raised
            if self._kvref_tap is not None:
                rec["connector"] = bool(args[1] if len(args) > 1 else kwargs.get("reset_connector", False))
                rec["kv"] = self._kvref_tap.take()
            self._kvref_writer.write(rec)
        return ok

    # ---- formatting hooks (engine thread: the recording cost) --------------------------------
    def _kvref_on_add(self, request, existing: bool) -> None:
        self._kvref_writer.write_line(self._kvref_add_line(request, existing))

    def _kvref_add_line(self, request, existing: bool) -> str:
        sp = request.sampling_params
        stop = list(sp.stop_token_ids or ()) if sp is not None else []
        eos = sp.eos_token_id if sp is not None else None
        if eos is not None and eos not in stop:
            stop.append(eos)
        prompt = request.prompt_token_ids or ()
        if getattr(request, "prompt_embeds", None) is not None:
            # the token ids vLLM hashes for the prompt: 0 where an embedding stands in (vLLM's
            # Request zeroes those positions of _all_token_ids), beside the embeds digests
            prompt = list(request.all_token_ids)[:request.num_prompt_tokens]
        rid, salt = request.request_id, request.cache_salt
        anon = self._kvref_anon
        if anon is not None:
            prompt, stop = anon.tokens(prompt), anon.tokens(stop)
            rid, salt = anon.request_id(rid), anon.salt(salt)
            rid_json = _dumps(rid)
        elif _plain_id(rid):
            rid_json = '"' + rid + '"'
        else:
            self._kvref_fast = False  # from now on, ids go through the encoder
            rid_json = _dumps(rid)
        # One line by hand: the base64 prompt needs no JSON escaping (the encoder's scan of a
        # 4,000-token prompt costs as much as encoding it).
        extra = _request_unmodelled(request, existing, self)
        arrival = float(request.arrival_time)
        return (
            '{"t":"add","id":%s,"prompt":"%s","max_tokens":%d,"stop":%s%s,"salt":%s,"priority":%d,"arrival":%s%s%s%s%s%s%s%s}' % (
                rid_json, _u32(prompt), request.max_tokens, _ints(stop), _stop_json(sp, anon),
                "null" if salt is None else _dumps(salt),
                request.priority, repr(arrival) if isfinite(arrival) else _dumps(arrival),
                # the request never reads the prefix cache (prompt logprobs): replayed (issue #28)
                ',"skip_read":true' if getattr(request, "skip_reading_prefix_cache", False) else "",
                # a streaming-input session's turn (format 6, #28): vLLM's Request.resumable; an add
                # with a live session's id is its next input, or (not resumable) its end
                ',"resumable":true' if getattr(request, "resumable", False) else "",
                # the decode side of a P/D split (kv_transfer_params.do_remote_prefill, #28)
                ',"remote":true' if (getattr(request, "kv_transfer_params", None) or {}).get("do_remote_prefill")
                else "",
                _features_json(request, anon), _embeds_json(request, anon),
                # structured output (format 7, #28): the grammar's answers are in the records' "gr"
                ',"so":true' if getattr(request, "use_structured_output", False) else "",
                ',"x":' + _dumps(extra) if extra else ""))

    def _kvref_on_schedule(self, so, throttle: bool) -> None:
        step = self._kvref_step
        self._kvref_step = step + 1
        self._kvref_steps[id(so)] = step
        extra = ',"throttle":true' if throttle else ""  # DP prefill cadence: not modelled, the checker stops following
        if so.scheduled_encoder_inputs or so.free_encoder_mm_hashes or getattr(so, "encoder_input_updates", None):
            extra += _encoder_json(so, self._kvref_anon)  # replayed and compared (#28)
        spec = so.scheduled_spec_decode_tokens
        if spec:  # the drafts scheduled for verification (-1: placeholders), what the replay compares
            anon = self._kvref_anon
            extra += ',"spec":' + _dumps({(anon.request_id(k) if anon is not None else k):
                                          [int(t) for t in v] if anon is None else _anon_drafts(anon, v)
                                          for k, v in spec.items()})
        if getattr(so, "skip_drafts", False):
            extra += SKIP_DRAFTS
        # what the conservation and metrics checks read (format version 3, issue #28)
        extra += ',"free":%d' % self._kvref_free()
        extra += self._kvref_so()  # the grammars' answers in this step's waiting loop (format 7)
        if getattr(self, "prefix_replay_tokens", 0):
            # SWA bounded replay (#28): where each new request's replay starts (vLLM's
            # NewRequestData.replay_start, which bounds the window's attention in the workers); 0s
            # left out
            replay = {nr.req_id: nr.replay_start for nr in so.scheduled_new_reqs if nr.replay_start}
            if replay:
                anon = self._kvref_anon
                extra += ',"replay":' + _dumps({(anon.request_id(k) if anon is not None else k): int(v)
                                                for k, v in replay.items()})
        pre = so.preempted_req_ids
        if pre:
            # why each request lost its blocks (issue #28): a prefix-cache reset preempted it, else the
            # KV cache could not hold it (no override of vLLM's _preempt_request: it cost a point of
            # the recording budget, BENCHMARKS.md)
            why = self._kvref_pre_why
            anon = self._kvref_anon
            extra += ',"pre_why":' + _dumps({(anon.request_id(k) if anon is not None else k): why.get(k, "kv")
                                             for k in pre})
            why.clear()
        if self._kvref_refused:
            # allocate_slots frees a windowed group's skipped blocks before it refuses (vLLM's
            # remove_skipped_blocks runs first): a request left unscheduled still let some go
            anon = self._kvref_anon
            extra += ',"refused":' + _dumps([anon.request_id(k) if anon is not None else k
                                             for k in self._kvref_refused])
            self._kvref_refused.clear()
        if self._kvref_connector:
            loading = sum(1 for q in (self.waiting, getattr(self, "kv_holding_waiting", ())) for r in q
                          if r.status.name == "WAITING_FOR_REMOTE_KVS")
            extra += ',"loading":%d,"kv":%s' % (loading, _dumps(self._kvref_tap.take()))
        # Columnar, straight from vLLM's own output: no Python row per request (format.py).
        nst = so.num_scheduled_tokens
        cached = so.scheduled_cached_reqs
        new_reqs = so.scheduled_new_reqs
        cids = cached.req_ids
        resumed, pre, fin = cached.resumed_req_ids, so.preempted_req_ids or (), so.finished_req_ids
        if self._kvref_fast:
            # Every id was checked when its request was added: joined between quotes as it is; no
            # JSON encoder on this path. Block tables as base64 per group; of the cached requests
            # only the non-null entries, with their indexes (format version 2: in a decode step
            # about one request in sixteen gets a block).
            cb = cached.new_block_ids
            at = list(compress(range(len(cb)), cb))  # None -> skipped; a tuple of groups is truthy
            self._kvref_writer.write_line(
                '{"t":"sched","step":%d,"ids":%s,"n":"%s","new":[%s],"cached":[%s,"%s",{"at":"%s","blocks":[%s]}],'
                '"resumed":%s,"pre":%s,"fin":%s%s}' % (
                    step, _ids(nst), _u32(list(nst.values())),
                    ",".join(['["%s",%d,%s]' % (nr.req_id, nr.num_computed_tokens, _groups(nr.block_ids))
                              for nr in new_reqs]),
                    _ids(cids), _u32(cached.num_computed_tokens), _u32(at), ",".join(map(_groups, compress(cb, cb))),
                    _ids(resumed), _ids(pre), _ids(fin), extra))
            if not step & 7:  # the flush timer: every 8th step is often enough
                self._kvref_writer.tick()
            return
        ids, counts = list(nst), list(nst.values())
        new = [[nr.req_id, nr.num_computed_tokens, nr.block_ids] for nr in new_reqs]
        resumed, pre, fin = list(resumed), list(pre), list(fin)
        anon = self._kvref_anon
        if anon is not None:
            a = anon.request_id
            ids, cids, resumed, pre, fin = ([a(i) for i in x] for x in (ids, cids, resumed, pre, fin))
            for e in new:
                e[0] = a(e[0])
            # the last time vLLM's schedule names a finished request (its _free_request added it to
            # finished_req_ids): its anonymous id is not needed again — unless a KV connector still
            # holds its blocks (vLLM keeps it in requests until the worker reports the transfer), or a
            # step still in flight names it: under async scheduling the update of the step scheduled
            # before it finished comes after this schedule, so it is forgotten one schedule later
            # (two steps in flight at most; forgetting at once renamed it in that update)
            held = self.requests
            for i in self._kvref_forget_next:
                if i not in held:
                    anon.forget(i)
            self._kvref_forget_next = [i for i in so.finished_req_ids if i not in held]
        w = self._kvref_writer
        w.write_line('{"t":"sched","step":%d,"ids":%s,"n":"%s","new":%s,"cached":[%s,"%s",%s],"resumed":%s,'
                     '"pre":%s,"fin":%s%s}' % (step, _ids_json(ids), encode_tokens(counts), _dumps(new),
                                               _ids_json(cids), encode_tokens(cached.num_computed_tokens),
                                               _dumps(cached.new_block_ids), _dumps(resumed), _dumps(pre),
                                               _dumps(fin), extra))
        w.tick()

    def _kvref_update_head(self, step: int, model_runner_output) -> str:
        """The update record up to its ``fin`` (taken before vLLM's update_from_output runs)."""
        sampled = model_runner_output.sampled_token_ids
        ids = model_runner_output.req_ids
        try:
            if self._kvref_fast:
                return '{"t":"update","step":%d,"ids":%s,"tok":"%s","len":"%s","fin":' % (
                    step, _ids(ids), _u32(list(chain.from_iterable(sampled))),
                    b2a_base64(bytes(map(len, sampled)), newline=False).decode("ascii"))
            head = '{"t":"update","step":%d,"ids":%s,"tok":"%s","len":"%s","fin":' % (
                step, _ids_json(ids), encode_tokens(chain.from_iterable(sampled)), encode_lengths(sampled))
        except (TypeError, ValueError, OverflowError):  # > 255 tokens for one id, odd types: plain JSON
            head = '{"t":"update","step":%d,"ids":%s,"sampled":%s,"fin":' % (
                step, _dumps(list(ids)), _dumps([[int(t) for t in toks] for toks in sampled]))
        if self._kvref_anon is not None:
            head = self._kvref_anonymize_update(head)
        return head

    _kvref_out = None  # what the update_from_output being recorded returned

    _kvref_kvo = ""  # the update being recorded: its KVConnectorOutput as JSON (connector runs)
    _kvref_forget_next: list = []  # anonymized: finished ids to forget at the next schedule
    _kvref_transfer_ids: list = []  # set per scheduler in _kvref_start: ids a worker report named

    def _kvref_kvo_json(self, model_runner_output) -> str:
        """``,"kvo":{...}``: the worker's ``KVConnectorOutput`` lists in the order vLLM iterates
        them (sets of str: their order is the process's, and the frees follow it), or ""."""
        kvo = getattr(model_runner_output, "kv_connector_output", None)
        if kvo is None:
            return ""
        anon = self._kvref_anon
        out = {}
        for key, name in (("s", "finished_sending"), ("r", "finished_recving"), ("f", "failed_recving")):
            ids = list(getattr(kvo, name, None) or ())
            if ids:
                out[key] = [anon.request_id(i) for i in ids] if anon is not None else ids
                if anon is not None:  # forgotten once vLLM let go of them (_kvref_on_update)
                    self._kvref_transfer_ids.extend(ids)
        bad = [int(b) for b in getattr(kvo, "invalid_block_ids", None) or ()]
        if bad:
            out["i"] = bad
        return ',"kvo":' + _dumps(out) if out else ""

    def _kvref_on_update(self, head: str, finished: list) -> None:
        out = self._kvref_out
        tail = ',"free":%d%s%s}' % (self._kvref_free(), _stats_json(out) if out else "", self._kvref_so())
        tap = self._kvref_tap
        if tap is not None:
            tail = self._kvref_kvo + ',"kv":' + _dumps(tap.take()) + tail
        if not finished:
            self._kvref_writer.write_line(head + "[]" + tail)
        elif self._kvref_fast:
            self._kvref_writer.write_line(
                head + "[" + ",".join(['["%s","%s"]' % (rid, _reason(status)) for rid, status in finished]) + "]"
                + tail)
        else:
            anon = self._kvref_anon
            fin = [[rid if anon is None else anon.request_id(rid), _reason(status)] for rid, status in finished]
            self._kvref_writer.write_line(head + _dumps(fin) + tail)
        done = self._kvref_transfer_ids
        if done:  # requests whose transfer a worker report named: once vLLM let go, their ids are done
            held, anon, named = self.requests, self._kvref_anon, self.finished_req_ids  # named at the next step
            for i in done:
                if i not in held and i not in named:
                    anon.forget(i)
            done.clear()

    def _kvref_anonymize_update(self, head: str) -> str:
        """Re-encode an update's ids and tokens through the anonymizer (opt-in path: not the fast one)."""
        rec = json.loads(head + "[]}")
        anon = self._kvref_anon
        rec["ids"] = [anon.request_id(i) for i in rec["ids"]]
        rec["sampled"] = [anon.tokens(t) for t in update_sampled(rec)]
        return '{"t":"update","step":%d,"ids":%s,"sampled":%s,"fin":' % (
            rec["step"], _dumps(rec["ids"]), _dumps(rec["sampled"]))

    def _free_request(self, request, *args, **kwargs):
        # Every finish inside update_from_output (a stop, the length cap, an error) passes here,
        # once per finished request: cheaper than scanning the batch's statuses afterwards.
        finished = self._kvref_fin
        if finished is not None:
            finished.append((request.request_id, request.status))
        return super()._free_request(request, *args, **kwargs)

    def shutdown(self) -> None:
        try:
            super().shutdown()
        finally:
            self._kvref_close("shutdown")

    def kvref_flush(self) -> None:
        """Make everything recorded so far readable from the file (tests, tools)."""
        self._kvref_writer.flush()


#: constructor arguments :func:`recorded_vllm_scheduler` overrides while it builds a scheduler (the
#: engine core's ``log_stats``; kvref's test adapter passes False, a server True by default)
_ENGINE_ARGS: dict[str, Any] = {}
#: what a multimodal / LoRA model's engine sets while vLLM's ``Scheduler.__init__`` runs (the encoder
#: budget, ``lora_config``, the V2 runner), applied by :func:`recorded_vllm_scheduler` before the
#: recorder writes its header (kvref's adapter drives a text model and sets them afterwards)
_ENGINE_SETUP: list = []


def _engine_setup(s) -> None:
    for apply in _ENGINE_SETUP:
        apply(s)


def _has_windowed_group(s) -> bool:
    """A KV-cache group frees blocks behind a window (sliding window, chunked local attention)."""
    groups = getattr(getattr(s, "kv_cache_config", None), "kv_cache_groups", None) or ()
    return any(getattr(g.kv_cache_spec, "sliding_window", None) or getattr(g.kv_cache_spec, "attention_chunk_size", None)
               for g in groups)


def _tap_refusals(s) -> None:
    """Note each request ``allocate_slots`` refuses (returns None) during a ``schedule()``.

    vLLM's ``KVCacheManager.allocate_slots`` calls ``remove_skipped_blocks`` before it checks the
    free blocks, so a running request it refuses keeps its place but has given up the windowed
    blocks behind its processed tokens; the trace's ``sched.refused`` says which requests, and the
    block checks free them as vLLM did (found by generated connector runs, #28: conservation
    counted a block held that vLLM had freed). Installed on the instance only when the pool has a
    windowed group: elsewhere a refusal frees nothing and the recorder adds no call.
    """
    manager = s.kv_cache_manager
    allocate = manager.allocate_slots
    refused = s._kvref_refused

    def allocate_slots(request, *args, **kwargs):
        out = allocate(request, *args, **kwargs)
        if out is None:
            refused.append(request.request_id)
        return out

    manager.allocate_slots = allocate_slots


def _recording_classes() -> dict[str, type]:
    """Build the recording schedulers on vLLM's ``Scheduler`` / ``AsyncScheduler`` (once).

    They subclass vLLM's classes, so they are made when first asked for (module ``__getattr__``,
    which is how vLLM's ``resolve_obj_by_qualname`` and ``kvref.record`` reach them), not when this
    module loads: every :mod:`kvref.impl.vllm` module imports without vLLM (#26).
    """
    if _CLASSES:
        return _CLASSES
    from vllm.v1.core.sched.async_scheduler import AsyncScheduler
    from vllm.v1.core.sched.scheduler import Scheduler

    class RecordingScheduler(_Recorder, Scheduler):
        """vLLM's synchronous ``Scheduler``, recording a run trace (``--no-async-scheduling``)."""

        def __init__(self, *args, **kwargs) -> None:
            kwargs.update(_ENGINE_ARGS)
            super().__init__(*args, **kwargs)
            _engine_setup(self)
            self._kvref_start(is_async_class=False)

        def check_invariants(self) -> None:
            assert self._kvref_writer is not None
            self._kvref_writer.check_invariants()
            assert len(self._kvref_steps) <= 2, "more steps in flight than vLLM's batch queue holds"
            if self._kvref_tap is not None:
                self._kvref_tap.check_invariants()

    class RecordingAsyncScheduler(_Recorder, AsyncScheduler):
        """vLLM's ``AsyncScheduler``, recording a run trace (async scheduling, vLLM's default)."""

        def __init__(self, *args, **kwargs) -> None:
            kwargs.update(_ENGINE_ARGS)
            super().__init__(*args, **kwargs)
            _engine_setup(self)
            self._kvref_start(is_async_class=True)

        check_invariants = RecordingScheduler.check_invariants

    for cls in (RecordingScheduler, RecordingAsyncScheduler):
        cls.__qualname__ = cls.__name__  # importable by this name (pickle, --scheduler-cls)
        _CLASSES[cls.__name__] = cls
        globals()[cls.__name__] = cls
    return _CLASSES


_CLASSES: dict[str, type] = {}


def __getattr__(name: str) -> type:
    if name in ("RecordingScheduler", "RecordingAsyncScheduler"):
        return _recording_classes()[name]
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = ["ENV_ANONYMIZE", "ENV_PATH", "RecordingAsyncScheduler", "RecordingScheduler", "build_header",
           "record_settings", "spec_record"]


def recorded_vllm_scheduler(pool, config, env=None, scheduler_cls: str | None = None, log_stats: bool = True,
                            connector=None, encoder_budget=None, max_loras: int | None = None,
                            use_v2_model_runner: bool = False, grammar_oracle=None):
    """A :class:`~kvref.impl.vllm.scheduler.VllmScheduler` whose vLLM scheduler is built from a
    ``scheduler_cls`` string exactly as vLLM's engine core builds it (``SchedulerConfig.
    get_scheduler_cls()``, then the engine core's constructor arguments); default: the recording
    class that matches ``config.async_scheduling``. Drives a recorded run on CPU with a fake model
    (tests, benchmarks); the trace goes where :func:`record_settings` says. ``log_stats``: the
    engine core's argument (True unless a server runs with ``--disable-log-stats``): the recorder
    then records the ``SchedulerStats`` the metrics endpoint would have shown. ``connector``: a
    :class:`~kvref.impl.reference.scheduler_connector.ScriptedConnector` (or its MultiConnector
    composition) that vLLM builds through its own ``KVConnectorFactory`` (:mod:`.connector`); the
    recorder then records its answers (format 4). ``encoder_budget``, ``max_loras``,
    ``use_v2_model_runner``: a multimodal model's encoder limits, LoRA, the V2 model runner, set on
    vLLM's scheduler as a server's engine has them when the recorder writes its header;
    ``pool.enable_mamba_shared_prefix_checkpoint`` goes to vLLM's ``CacheConfig`` (#28).
    ``grammar_oracle``: a scripted :class:`~kvref.impl.reference.scheduler_structured_output.GrammarOracle`
    that vLLM's structured-output manager and grammars answer from (:mod:`.structured_output`); the
    recorder then records their answers (format 7).
    """
    if type(log_stats) is not bool:
        raise InvalidFieldError("log_stats", log_stats, "True or False")
    from .scheduler import VllmScheduler

    if scheduler_cls is None:
        scheduler_cls = ("kvref.record.RecordingAsyncScheduler" if config.async_scheduling
                         else "kvref.record.RecordingScheduler")

    class _Driven(VllmScheduler):
        def close(self) -> None:
            self.scheduler.shutdown()

    if type(use_v2_model_runner) is not bool:
        raise InvalidFieldError("use_v2_model_runner", use_v2_model_runner, "True or False")
    if max_loras is not None:
        from kvref.impl.reference.scheduler_lora import check_max_loras

        check_max_loras(max_loras)
    if encoder_budget is not None:
        from kvref.impl.reference.scheduler_encoder import EncoderBudget

        if not isinstance(encoder_budget, EncoderBudget):
            raise InvalidFieldError("encoder_budget", encoder_budget, "an EncoderBudget")

    def setup(s) -> None:  # before the header: what a multimodal / LoRA engine's __init__ set
        if encoder_budget is not None:
            from vllm.v1.core.encoder_cache_manager import EncoderCacheManager

            s.max_num_encoder_input_tokens = encoder_budget.encoder_compute_budget
            s.encoder_cache_manager = EncoderCacheManager(cache_size=encoder_budget.encoder_cache_size)
            s.scheduler_config.disable_chunked_mm_input = encoder_budget.disable_chunked_mm_input
        if max_loras is not None:
            from vllm.config import LoRAConfig

            s.lora_config = LoRAConfig(max_loras=max_loras)
        s.use_v2_model_runner = use_v2_model_runner
        if config.num_speculative_tokens:  # the V2 runner's draft skipping (the header's spec reads it)
            s.can_skip_drafts = config.can_skip_drafts

    from .scheduler import VllmEnv

    env = env or VllmEnv()
    cache = env.vllm_config.cache_config
    saved_checkpoint = cache.enable_mamba_shared_prefix_checkpoint
    cache.enable_mamba_shared_prefix_checkpoint = bool(getattr(pool, "enable_mamba_shared_prefix_checkpoint", False))
    _ENGINE_ARGS["log_stats"] = log_stats
    _ENGINE_SETUP.append(setup)
    try:
        return _Driven(pool, config, env, scheduler_cls=scheduler_cls, connector=connector,
                       encoder_budget=encoder_budget, max_loras=max_loras, use_v2_model_runner=use_v2_model_runner,
                       grammar_oracle=grammar_oracle)
    finally:
        _ENGINE_ARGS.clear()
        _ENGINE_SETUP.clear()
        cache.enable_mamba_shared_prefix_checkpoint = saved_checkpoint
