"""From a trace header to the reference's ``PoolConfig`` + ``SchedulerConfig`` (or why it cannot).

The header holds vLLM's own KV cache config and scheduler settings as the recorded engine had
them. The reference models a subset (docs/differences.md, "Scheduler subset"); everything outside
it is a *reason the reference cannot follow*, collected here and in per-request/per-step ``x``
lists, so ``kvref check-run`` says why it falls back to the run properties instead of reporting a
false divergence.

The scheduler side of the KV cache never reads a spec's head count, head size or dtype (they size
pages, which startup planning already did), so specs are rebuilt with their block size and the
fields that change block management (window, chunk, Mamba mode); where the recorded dtype or
shape is not one kvref knows, a neutral one stands in.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from kvref.impl.interface import PoolConfig
from kvref.impl.reference.scheduler_connector import ConnectorConfig
from kvref.impl.reference.scheduler_encoder import EncoderBudget
from kvref.impl.reference.scheduler_lora import check_max_loras
from kvref.impl.scheduler_types import SchedulerConfig
from kvref.spec import kv_cache_interface as ks
from kvref.spec.errors import KVRefError

_ATTN = dict(num_kv_heads=1, head_size=8, dtype="float16")


@dataclass
class RunSetup:
    """What the checker rebuilds from a header."""

    pool: PoolConfig | None
    config: SchedulerConfig | None
    #: reasons the reference cannot follow this run from its first step (empty: it can)
    unmodelled: list[str] = field(default_factory=list)
    vllm_version: str = "unknown"
    #: the scheduler settings as recorded (for the summary)
    scheduler: dict = field(default_factory=dict)
    #: the recorded KV connector's knobs (format 4: its answers are in the trace), or None
    connector: ConnectorConfig | None = None
    #: a multimodal model's encoder limits (None: a text model's), LoRA's max_loras (None: off) and
    #: the V2 model runner, as the header recorded them (#28)
    encoder_budget: EncoderBudget | None = None
    max_loras: int | None = None
    use_v2_model_runner: bool = False
    #: vLLM's aux-output (routed-experts) connector was on (header ``scheduler.aux_output``, session 20)
    aux_output: bool = False

    def scheduler_kwargs(self) -> dict:
        """The reference ``Scheduler``'s arguments beside the pool and config."""
        out: dict = {}
        if self.encoder_budget is not None:
            out["encoder_budget"] = self.encoder_budget
        if self.max_loras is not None:
            out["max_loras"] = self.max_loras
        if self.use_v2_model_runner:
            out["use_v2_model_runner"] = True
        if self.aux_output:
            out["aux_output"] = True
        return out

    @property
    def followable(self) -> bool:
        return not self.unmodelled and self.pool is not None and self.config is not None


def _spec(d: dict) -> ks.KVCacheSpec:
    kind = d["type"]
    if kind == "UniformTypeKVCacheSpecs":
        inner = list((d.get("kv_cache_specs") or {}).values())
        if not inner:
            raise KVRefError("UniformTypeKVCacheSpecs without kv_cache_specs")
        return _spec(inner[0])
    bs = d["block_size"]
    if kind in ("FullAttentionSpec", "MLAAttentionSpec"):
        return ks.FullAttentionSpec(block_size=bs, sliding_window=d.get("sliding_window"),
                                    attention_chunk_size=d.get("attention_chunk_size"), **_ATTN)
    if kind == "SlidingWindowSpec":
        return ks.SlidingWindowSpec(block_size=bs, sliding_window=d["sliding_window"],
                                    extra_retained_tokens=d.get("extra_retained_tokens", 0) or 0, **_ATTN)
    if kind == "SlidingWindowMLASpec":  # DeepSeek-V4.1's window, with or without bounded replay (#28)
        return ks.SlidingWindowMLASpec(block_size=bs, sliding_window=d["sliding_window"],
                                       extra_retained_tokens=d.get("extra_retained_tokens", 0) or 0,
                                       bounded_replay=bool(d.get("bounded_replay", False)), **_ATTN)
    if kind == "RSWASpec":  # Unlimited-OCR's R-SWA (#28): full attention whose decode gap is freed
        return ks.RSWASpec(block_size=bs, rswa_window=d["rswa_window"], sliding_window=d.get("sliding_window"),
                           attention_chunk_size=d.get("attention_chunk_size"), **_ATTN)
    if kind == "CircularBufferSpec":  # a compressor's ring (#28): one block per request, never cached
        return ks.CircularBufferSpec(block_size=bs, **_ATTN)
    if kind == "ChunkedLocalAttentionSpec":
        return ks.ChunkedLocalAttentionSpec(block_size=bs, attention_chunk_size=d["attention_chunk_size"], **_ATTN)
    if kind == "MambaSpec":
        return ks.MambaSpec(block_size=bs, shapes=((1,),), dtypes=("float16",),
                            mamba_cache_mode=d.get("mamba_cache_mode", "none") or "none",
                            num_speculative_blocks=d.get("num_speculative_blocks", 0) or 0)
    raise KVRefError(f"KV cache spec {kind} is not modelled by kvref's scheduler subset")


#: the header's drafting methods the reference replays (vLLM's ``SpeculativeConfig.use_eagle()``
#: methods are EAGLE-like: lookahead slots and the trailing hit block dropped)
_REPLAYED_METHODS = {"ngram": "ngram", "eagle": "eagle", "eagle3": "eagle", "mtp": "eagle"}


def _spec_decode(spec: dict | None, unmodelled: list[str]) -> dict:
    """Speculative decoding from the header's ``spec`` (format 3): drafts come from the trace's
    ``drafts`` records (synchronous runs) or the scheduled placeholders (async), acceptances from
    the sampled tokens. An EAGLE-like drafter is replayed too (issue #28): the reference reserves its
    ``num_lookahead_tokens`` slots and drops the trailing block of a hit as vLLM's
    ``use_eagle_block_drop`` does; a lookahead count other than ``num_speculative_tokens`` is not
    modelled and stays in ``unmodelled``."""
    if not isinstance(spec, dict) or not spec.get("num_speculative_tokens"):
        return {}
    k = int(spec["num_speculative_tokens"])
    method = _REPLAYED_METHODS.get(str(spec.get("method")))
    if method is None:
        unmodelled.append(f"spec_decode (method {spec.get('method')}: n-gram and EAGLE-like drafting are replayed)")
        return {}
    lookahead = int(spec.get("num_lookahead_tokens", k if method == "eagle" else 0) or 0)
    if lookahead != (k if method == "eagle" else 0):
        unmodelled.append(f"lookahead_tokens ({lookahead} with {method} drafting of {k} tokens)")
        return {}
    return {"num_speculative_tokens": k, "speculative_method": method,
            "skip_unused_drafts": bool(spec.get("can_skip_drafts", False))}


def _cadence(s: dict) -> dict:
    """The header's prefill cadence, adaptive long-prefill threshold and ``max_num_active_seqs``
    (replayed since session 11, #28; a trace without them ran with vLLM's defaults), and an
    explicit ``max_num_scheduled_tokens`` (replayed since session 19: the reference schedules at
    most the smaller of the two step budgets, as vLLM does)."""
    out: dict = {}
    scheduled = s.get("max_num_scheduled_tokens")
    if scheduled is not None and scheduled != s["max_num_batched_tokens"]:
        out["max_num_scheduled_tokens"] = int(scheduled)
    if int(s.get("prefill_schedule_interval", 1) or 1) != 1:
        out["prefill_schedule_interval"] = int(s["prefill_schedule_interval"])
    if s.get("long_prefill_token_threshold_adaptive"):
        out["long_prefill_token_threshold_adaptive"] = True
    active = s.get("max_num_active_seqs")
    if active is not None and active != s["max_num_seqs"]:
        out["max_num_active_seqs"] = int(active)
    return out


def setup_from_header(header: dict) -> RunSetup:
    """Rebuild the reference setup; never raises for a well-formed header (reasons go to ``unmodelled``)."""
    unmodelled = list(header.get("unmodelled", []))
    p, s = header["pool"], header["scheduler"]
    version = str((header.get("producer") or {}).get("vllm", "unknown"))
    pool = config = None
    try:
        groups = tuple(ks.KVCacheGroupSpec(tuple(g.get("layers") or (f"layer{i}",)), _spec(g["spec"]),
                                           is_eagle_group=bool(g.get("is_eagle_group", False)))
                       for i, g in enumerate(p["groups"]))
        config = SchedulerConfig(
            max_num_batched_tokens=s["max_num_batched_tokens"], max_num_seqs=s["max_num_seqs"],
            long_prefill_token_threshold=s.get("long_prefill_token_threshold", 0),
            enable_chunked_prefill=bool(s.get("enable_chunked_prefill", True)), policy=s.get("policy", "fcfs"),
            scheduler_reserve_full_isl=bool(s.get("scheduler_reserve_full_isl", True)),
            async_scheduling=bool(s.get("async_class", s.get("async_scheduling", False))),
            **_cadence(s), **_spec_decode(header.get("spec"), unmodelled))
        pool = PoolConfig.off_plan("a recorded run's pool, as the engine's own startup built it",
                                   num_blocks=p["num_blocks"], groups=groups, max_model_len=p["max_model_len"],
                          scheduler_block_size=p["scheduler_block_size"], hash_block_size=p["hash_block_size"],
                          max_in_flight_tokens=p.get("max_in_flight_tokens") or config.max_in_flight_tokens,
                          enable_caching=bool(p.get("enable_caching", True)), watermark=float(p.get("watermark", 0.0)),
                          use_eagle=bool(p.get("use_eagle", False)),
                          # multi-module MTP's runway (#28): the scheduler's chunk rule and the
                          # manager's unpublished tail; a trace without it had none past 1
                          num_prefill_lookahead=int((header.get("spec") or {}).get("num_prefill_lookahead", 0) or 0),
                          # lookahead block hashes and the Mamba shared-prefix checkpoint (#28)
                          num_hash_lookahead_tokens=int(p.get("num_hash_lookahead_tokens", 0) or 0),
                          enable_mamba_shared_prefix_checkpoint=bool(p.get("mamba_shared_prefix_checkpoint", False)),
                          # sparse prefix-cache retention, recorded since session 18 (#28); an older
                          # trace's pool was dense unless the engine was configured otherwise
                          prefix_cache_retention_interval=p.get("prefix_cache_retention_interval"),
                          log_stats=True)  # the reference's prefix-cache stats, compared with the recorded ones
        if pool.max_in_flight_tokens != config.max_in_flight_tokens:
            unmodelled.append(f"max_in_flight_tokens={pool.max_in_flight_tokens} (the reference's scheduler keeps "
                              f"{config.max_in_flight_tokens} in flight)")
        # vLLM's use_eagle_block_drop follows the drafter, unless lookahead hashes prove the boundary
        if pool.use_eagle != (config.use_eagle and not pool.num_hash_lookahead_tokens):
            unmodelled.append(f"eagle_block_drop={pool.use_eagle} with {config.speculative_method} drafting")
    except (KVRefError, KeyError, TypeError) as exc:
        unmodelled.append(f"setup: {exc}")
        pool = config = None
    connector = None
    if header.get("connector") is not None:  # format 4: replayed from the recorded answers
        from .connector import connector_config

        connector = connector_config(header["connector"])  # with speculative decoding too (session 19)
    budget, max_loras, v2 = _multimodal_and_lora(s, connector is not None, unmodelled)
    return RunSetup(pool=pool, config=config, unmodelled=unmodelled, vllm_version=version, scheduler=dict(s),
                    connector=connector, encoder_budget=budget, max_loras=max_loras, use_v2_model_runner=v2,
                    aux_output=bool(s.get("aux_output", False)))


def _multimodal_and_lora(s: dict, has_connector: bool, unmodelled: list[str]):
    """The header's encoder limits, ``max_loras`` and V2 runner (#28; a trace without them ran a text
    model without LoRA on the V1 runner). kvref models encoder inputs and LoRA without a KV connector
    only: beside one they are named."""
    budget = max_loras = None
    e = s.get("encoder") or {}
    try:
        if e.get("compute_budget") or e.get("cache_size") or e.get("disable_chunked_mm_input"):
            budget = EncoderBudget(int(e.get("compute_budget", 0)), int(e.get("cache_size", 0)),
                                   bool(e.get("disable_chunked_mm_input", False)))
        if s.get("max_loras") is not None:
            max_loras = check_max_loras(s["max_loras"])
    except (ValueError, TypeError) as exc:
        unmodelled.append(f"setup: {exc}")
        return None, None, False
    if has_connector and budget is not None:
        unmodelled.append("encoder_inputs (with a KV connector)")
        budget = None
    if has_connector and max_loras is not None:
        unmodelled.append("lora (with a KV connector)")
        max_loras = None
    v2 = bool(s.get("use_v2_model_runner", False))
    if has_connector and v2:
        # the reference's connector path sends a resumed request as a resumed one (the V1 runner's
        # output shape); vLLM's V2 runner gets it as a new one (docs/differences.md, session 20)
        unmodelled.append("use_v2_model_runner (with a KV connector)")
    return budget, max_loras, v2
