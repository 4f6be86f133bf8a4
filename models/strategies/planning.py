"""Hypothesis strategies for layer sets and engine settings (shared by the planning unit tests and
the vLLM conformance suite).

Families follow real model shapes (uniform Llama, Gemma-style sliding/full patterns, Llama-4-style
chunked-local, DeepSeek-style MLA, Jamba/Nemotron-H-style Mamba hybrids, Whisper-style
cross-attention) plus a "random" family with tiny parameters that drives the grouping corner cases
(page sizes that divide, that need padding, that cannot be unified). Memory and overrides are
drawn near the boundary of the enough-memory check, computed with kvref's own grouping.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from hypothesis import strategies as st

from kvref.spec import (
    AUTO,
    ChunkedLocalAttentionSpec,
    CrossAttentionSpec,
    EngineConfig,
    FullAttentionSpec,
    HiddenStateCacheSpec,
    KVCacheSpec,
    KVRefError,
    MambaSpec,
    MLAAttentionSpec,
    SlidingWindowSpec,
)
from kvref.spec.planning_packed import get_kv_cache_groups_for_layout
from kvref.spec.pool_sizing import group_blocks_per_request, pool_bytes_per_block

#: dtypes whose vLLM storage types are distinct (all fp8 spellings are uint8 in vLLM)
DTYPES = ("float16", "bfloat16", "float32", "fp8", "int8")
FAMILIES = ("uniform", "uniform_type", "fa_swa", "fa_chunked", "mla", "mamba", "cross", "packed", "random", "hidden")
#: the models a hidden-state extractor (vLLM's extract_hidden_states) is drawn beside
_HIDDEN_BASES = ("uniform", "fa_swa", "fa_chunked", "mla", "mamba", "packed")
#: vLLM's layouts (``VLLM_KV_CACHE_LAYOUT``); LBNHC is the default, block-outermost ones pack pages
LAYOUTS = ("LBNHC",) * 4 + ("BLHNC",) * 3 + ("BLNHC", "BHLNC", "LBHNC", "LHBNC")


@dataclass(frozen=True)
class PlanCase:
    family: str
    layers: dict[str, KVCacheSpec]
    config: EngineConfig
    available_memory: int
    extra_retained_tokens: int
    kv_cache_layout: str = "LBNHC"


def _name(i: int) -> str:
    return f"model.layers.{i}.attn"


@st.composite
def attn_kw(draw, dtype=None, block_size=None, dcp_sharded=None):
    return dict(
        block_size=block_size if block_size is not None else draw(st.sampled_from((16, 16, 32, 64, 8))),
        num_kv_heads=draw(st.sampled_from((1, 2, 4, 8))),
        head_size=draw(st.sampled_from((64, 128, 80, 256))),
        dtype=dtype if dtype is not None else draw(st.sampled_from(DTYPES)),
        dcp_sharded=dcp_sharded if dcp_sharded is not None else draw(st.sampled_from((True, True, True, False))),
    )


@st.composite
def mamba_spec(draw, block_size: int, mode: str) -> MambaSpec:
    shapes = draw(st.sampled_from((((3, 64), (4, 16, 16)), ((2, 128),), ((4, 32), (8, 16, 8)), ((1, 8),))))
    dtypes = tuple(draw(st.sampled_from(("float16", "bfloat16", "float32"))) for _ in shapes)
    spec = MambaSpec(block_size=block_size, shapes=shapes, dtypes=dtypes, mamba_cache_mode=mode,
                     num_speculative_blocks=draw(st.integers(0, 2)),
                     num_prefill_checkpoint_blocks=draw(st.integers(0, 2)))
    if draw(st.integers(0, 3)) == 0:
        spec = replace(spec, page_size_padded=spec.page_size_bytes + draw(st.integers(0, 4096)))
    return spec


@st.composite
def hidden_state_layers(draw, block_size: int, dtype: str, first: int) -> dict[str, KVCacheSpec]:
    """1-2 hidden-state cache layers of an extractor (one head per captured layer, head size = the
    hidden size), at the model's block size: per-token bytes from below to far above the model's
    page, so the common page is sometimes scaled up to hold one token (``_ensure_min_page_size``)."""
    return {_name(first + i): HiddenStateCacheSpec(
        block_size=block_size, num_kv_heads=draw(st.sampled_from((1, 2, 3, 4))),
        head_size=draw(st.sampled_from((64, 256, 1024, 2880, 4096, 8192))), dtype=dtype)
        for i in range(draw(st.integers(1, 2)))}


@st.composite
def layer_sets(draw, family: str | None = None, mamba_mode: str = "none") -> tuple[str, dict[str, KVCacheSpec]]:
    family = family or draw(st.sampled_from(FAMILIES))
    if family == "hidden":  # a model plus the layers its hidden states are stored in
        _, layers = draw(layer_sets(draw(st.sampled_from(_HIDDEN_BASES)), mamba_mode))
        block_size = min(s.block_size for s in layers.values())  # the cache config's (attention's)
        dtype = next((s.dtype for s in layers.values() if hasattr(s, "dtype")), "float16")
        return family, {**layers, **draw(hidden_state_layers(block_size, dtype, len(layers)))}
    dtype = draw(st.sampled_from(DTYPES))
    specs: list[KVCacheSpec] = []
    if family == "uniform":
        spec = FullAttentionSpec(**draw(attn_kw(dtype=dtype)))
        specs = [spec] * draw(st.integers(1, 40))
    elif family == "uniform_type":
        bs = draw(st.sampled_from((16, 32)))
        n = draw(st.integers(2, 10))
        for _ in range(n):
            if draw(st.integers(0, 4)) == 0:
                specs.append(MLAAttentionSpec(block_size=bs, num_kv_heads=1, head_size=576, dtype=dtype))
            else:
                specs.append(FullAttentionSpec(**draw(attn_kw(dtype=dtype, block_size=bs, dcp_sharded=True))))
    elif family in ("fa_swa", "fa_chunked"):
        full = FullAttentionSpec(**draw(attn_kw(dtype=dtype)))
        same_shape = draw(st.booleans())
        local_kw = (dict(block_size=full.block_size, num_kv_heads=full.num_kv_heads, head_size=full.head_size,
                         dtype=dtype, dcp_sharded=full.dcp_sharded)
                    if same_shape else draw(attn_kw(dtype=dtype, dcp_sharded=full.dcp_sharded)))
        windows = draw(st.lists(st.sampled_from((1, 16, 32, 128, 512, 1000, 1024, 4096)), min_size=1, max_size=2))
        if family == "fa_swa":
            locals_ = [SlidingWindowSpec(**local_kw, sliding_window=w) for w in windows]
        else:
            locals_ = [ChunkedLocalAttentionSpec(**local_kw, attention_chunk_size=w) for w in windows]
        ratio = draw(st.integers(1, 5))
        for _ in range(draw(st.integers(1, 6))):
            specs += [draw(st.sampled_from(locals_)) for _ in range(ratio)] + [full]
        specs += [full] * draw(st.integers(0, 2)) + [locals_[0]] * draw(st.integers(0, 2))
    elif family == "mla":
        cache_dtype = draw(st.sampled_from((None, "fp8_ds_mla")))
        mla_kw = dict(block_size=draw(st.sampled_from((16, 32, 64))), num_kv_heads=1, head_size=576,
                      dtype="fp8" if cache_dtype else dtype, cache_dtype_str=cache_dtype,
                      state_content_bytes=656 if cache_dtype else None)
        with_swa = draw(st.booleans())
        if not with_swa and draw(st.booleans()):
            mla_kw["alignment"] = draw(st.sampled_from((64, 576, 1024)))
        mla = MLAAttentionSpec(**mla_kw)
        specs = [mla] * draw(st.integers(1, 12))
        if with_swa:
            swa = SlidingWindowSpec(**draw(attn_kw(dtype=dtype, dcp_sharded=True)),
                                    sliding_window=draw(st.sampled_from((128, 512, 4096))))
            specs += [swa] * draw(st.integers(1, 6))
    elif family == "mamba":
        full = FullAttentionSpec(**draw(attn_kw(dtype=dtype)))
        # align mode checkpoints every Mamba block; a Mamba block larger than the attention block
        # enables sub-block prefix hits (partial hash hits)
        mamba = draw(mamba_spec(full.block_size * draw(st.sampled_from((1, 1, 2, 4))), mamba_mode))
        for _ in range(draw(st.integers(1, 4))):
            specs += [mamba] * draw(st.integers(1, 7)) + [full]
        if draw(st.integers(0, 3)) == 0:
            specs.append(SlidingWindowSpec(block_size=full.block_size, num_kv_heads=full.num_kv_heads,
                                           head_size=full.head_size, dtype=dtype, sliding_window=256))
    elif family == "cross":
        full = FullAttentionSpec(**draw(attn_kw(dtype=dtype)))
        cross = CrossAttentionSpec(block_size=full.block_size, num_kv_heads=full.num_kv_heads,
                                   head_size=full.head_size, dtype=dtype, dcp_sharded=full.dcp_sharded)
        n = draw(st.integers(1, 8))
        specs = [full] * n + [cross] * draw(st.integers(max(1, n - 2), n + 2))
    elif family == "packed":
        # a repeating pattern of layers with different page sizes (DeepSeek-V4-like indexer next to
        # attention, Gemma-like head sizes per layer kind): what block-outermost layouts pack
        bs = draw(st.sampled_from((16, 32, 64)))
        kinds = draw(st.lists(st.sampled_from(("full", "swa", "mla", "mamba")), min_size=2, max_size=3))
        pattern = []
        for kind in kinds:
            # two layers of a kind usually differ in heads: one bucket holding two page sizes
            for heads in draw(st.sampled_from(((None,), (1, 4), (2, 8), (None, None)))):
                kw = draw(attn_kw(dtype=dtype, block_size=bs))
                if heads is not None:
                    kw["num_kv_heads"] = heads
                if kind == "full":
                    pattern.append(FullAttentionSpec(**kw))
                elif kind == "swa":
                    pattern.append(SlidingWindowSpec(**kw, sliding_window=draw(st.sampled_from((128, 1024)))))
                elif kind == "mla":
                    pattern.append(MLAAttentionSpec(block_size=bs, num_kv_heads=1,
                                                    head_size=draw(st.sampled_from((576, 128))), dtype=dtype))
                else:
                    pattern.append(draw(mamba_spec(bs, mamba_mode)))
        for _ in range(draw(st.integers(1, 6))):
            specs += pattern if draw(st.integers(0, 4)) else [draw(st.sampled_from(pattern))]
    else:  # random: tiny parameters, every kind
        for _ in range(draw(st.integers(1, 10))):
            kw = dict(block_size=draw(st.sampled_from((1, 2, 4, 8, 16))), num_kv_heads=draw(st.integers(1, 3)),
                      head_size=draw(st.integers(1, 8)), dtype=draw(st.sampled_from(DTYPES)),
                      dcp_sharded=draw(st.booleans()))
            kind = draw(st.sampled_from(("full", "swa", "chunked", "mla", "mamba", "cross")))
            if kind == "full":
                specs.append(FullAttentionSpec(**kw))
            elif kind == "swa":
                specs.append(SlidingWindowSpec(**kw, sliding_window=draw(st.integers(1, 40))))
            elif kind == "chunked":
                specs.append(ChunkedLocalAttentionSpec(**kw, attention_chunk_size=draw(st.integers(1, 40))))
            elif kind == "mla":
                kw.update(num_kv_heads=1)
                specs.append(MLAAttentionSpec(**kw))
            elif kind == "cross":
                specs.append(CrossAttentionSpec(**kw))
            else:
                specs.append(MambaSpec(block_size=kw["block_size"], shapes=((draw(st.integers(1, 6)), 4),),
                                       dtypes=(kw["dtype"],), mamba_cache_mode=mamba_mode,
                                       num_speculative_blocks=draw(st.integers(0, 1))))
    return family, {_name(i): s for i, s in enumerate(specs)}


def with_extra_retained(layers: dict[str, KVCacheSpec], extra: int) -> dict[str, KVCacheSpec]:
    """Every sliding-window layer retains ``extra`` tokens (vLLM tags all of them alike)."""
    return {n: (replace(s, extra_retained_tokens=extra) if isinstance(s, SlidingWindowSpec) else s)
            for n, s in layers.items()}


def _blocks_needed(layers, config, layout: str = "LBNHC") -> tuple[int, int] | None:
    """(bytes per block, blocks one request needs) by kvref, or None when that cannot be computed."""
    try:
        groups = get_kv_cache_groups_for_layout(layers, config.disable_hybrid_kv_cache_manager, layout)
        m = config.resolved_max_model_len
        return pool_bytes_per_block(groups), sum(group_blocks_per_request(g.kv_cache_spec, config, m)
                                                 for g in groups)
    except (KVRefError, AssertionError):
        return None


@st.composite
def engine_configs(draw, mamba_mode: str = "none") -> EngineConfig:
    auto = draw(st.integers(0, 3)) == 0
    mml = draw(st.one_of(st.sampled_from((1, 2, 15, 16, 17, 100, 1024, 4096, 8192, 32768)),
                         st.integers(1, 1 << 16)))
    return EngineConfig(
        max_model_len=AUTO if auto else mml,
        derived_max_model_len=draw(st.sampled_from((1, 4096, 8192, 32768, 131072))) if auto else max(mml, 8192),
        max_num_batched_tokens=draw(st.one_of(st.sampled_from((1, 16, 512, 2048, 8192)), st.integers(1, 16384))),
        max_concurrent_batches=draw(st.sampled_from((1, 1, 2))),
        enable_prefix_caching=draw(st.booleans()),
        mamba_cache_mode=mamba_mode,
        prefix_match_unit=draw(st.one_of(st.none(), st.none(), st.none(), st.sampled_from((1, 2, 4, 8, 16, 32, 64)))),
        disable_hybrid_kv_cache_manager=draw(st.integers(0, 9)) == 0,
        dcp_world_size=draw(st.sampled_from((1,) * 8 + (2, 4))),
        has_kv_connector=draw(st.integers(0, 9)) == 0,
        max_num_encoder_input_tokens=draw(st.sampled_from((1, 1500, 2048, 4096))),
    )


@st.composite
def plan_cases(draw, family: str | None = None) -> PlanCase:
    mamba_mode = draw(st.sampled_from(("none", "align", "all")))
    family, layers = draw(layer_sets(family, mamba_mode))
    extra = draw(st.sampled_from((0,) * 6 + (1, 3, 7)))
    layers = with_extra_retained(layers, extra)
    # vLLM reads the cache mode from the config for memory but from the spec for block sizes;
    # they normally agree, sometimes let them differ
    config_mode = mamba_mode if draw(st.integers(0, 6)) else draw(st.sampled_from(("none", "align", "all")))
    config = draw(engine_configs(config_mode))
    # packed layer sets mostly under the block-outermost layouts that pack them
    layout = draw(st.sampled_from(("BLHNC", "BLNHC") if family == "packed" and draw(st.integers(0, 3)) else LAYOUTS))
    need = _blocks_needed(layers, config, layout)
    if need is None or draw(st.integers(0, 4)) == 0:
        memory = draw(st.integers(0, 1 << 34))
    else:
        bpb, blocks = need
        memory = bpb * (blocks + 1 + draw(st.integers(-3, 3))) + draw(st.sampled_from((0, 0, 1, bpb - 1)))
        memory = max(memory, 0)
        if draw(st.integers(0, 3)) == 0:
            config = replace(config, num_gpu_blocks_override=max(1, blocks + 1 + draw(st.integers(-2, 2))))
    return PlanCase(family, layers, config, memory, extra, layout)


@st.composite
def fallback_cases(draw) -> PlanCase:
    """MLA next to sliding-window layers whose pages cannot be unified (vLLM's full-allocation
    fallback), with the variations that decline it or pad it: padded sliding-window pages (their
    promoted padding), a sliding-window layer DCP-replicated unlike the MLA layers (promotion fails),
    a hidden-state extractor layer (no fallback with hidden states), a chunked-local layer."""
    bs = draw(st.sampled_from((16, 32, 64)))
    dtype = draw(st.sampled_from(("float16", "bfloat16")))
    mla = MLAAttentionSpec(block_size=bs, num_kv_heads=1, head_size=576, dtype=dtype)
    swa = SlidingWindowSpec(block_size=bs, num_kv_heads=draw(st.sampled_from((2, 4))), head_size=64, dtype=dtype,
                            sliding_window=draw(st.sampled_from((128, 512))))
    variation = draw(st.sampled_from(("plain", "padded", "replicated", "hidden", "chunked")))
    if variation == "padded":
        padded = swa.page_size_bytes + draw(st.sampled_from((64, 1024, 4096)))
        while mla.page_size_bytes % padded == 0:  # else vLLM unifies by scaling a padded page (differences.md)
            padded += 64
        swa = replace(swa, page_size_padded=padded)
    elif variation == "replicated":
        swa = replace(swa, dcp_sharded=False)
    specs: list[KVCacheSpec] = [mla] * draw(st.integers(1, 6)) + [swa] * draw(st.integers(1, 6))
    if variation == "hidden":
        specs.append(HiddenStateCacheSpec(block_size=bs, num_kv_heads=1, head_size=draw(st.sampled_from((64, 4096))),
                                          dtype=dtype))
    elif variation == "chunked":
        specs.append(ChunkedLocalAttentionSpec(block_size=bs, num_kv_heads=2, head_size=64, dtype=dtype,
                                               attention_chunk_size=256))
    layers = {_name(i): s for i, s in enumerate(draw(st.permutations(specs)))}
    config = replace(draw(engine_configs()), dcp_world_size=1)
    need = _blocks_needed(layers, config)
    memory = draw(st.integers(0, 1 << 32)) if need is None else need[0] * (need[1] + 1 + draw(st.integers(-1, 3)))
    return PlanCase("fallback", layers, config, max(memory, 0), 0)
