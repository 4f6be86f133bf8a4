"""A model's KV cache layout from its Hugging Face ``config.json``, as vLLM 0.33.0 derives it.

``kvref size`` needs one spec per layer. A vLLM user has a ``config.json`` and engine arguments;
vLLM builds the model, and each attention or Mamba layer reports its spec
(``Attention.get_kv_cache_spec``, ``MambaBase.get_kv_cache_spec``). This module reproduces that
derivation from the parsed dict, without weights or torch, for the families people serve:

* **full attention, GQA** — Llama, Mistral/Mixtral, Qwen2, Qwen3, Qwen2-MoE, Qwen3-MoE. A model
  whose ``layer_types`` is absent or all ``sliding_attention`` takes the model-level
  ``sliding_window`` for every layer (vLLM's ``CacheConfig.sliding_window``; Mistral-7B-v0.1); a
  ``layer_types`` list sets it per layer in ``llama.py``, while Mixtral's and the Qwen classes'
  attention has no per-layer window (all layers or none). Qwen's ``use_sliding_window: false``
  clears the window (transformers' config ``__post_init__``).
* **sliding window with a layer pattern** — Gemma-2 (every other layer), Gemma-3
  (``sliding_window_pattern``, default 6: five sliding, one full), both from ``layer_types`` when the
  file lists it.
* **gpt-oss** — even layers sliding (``gpt_oss.py`` tests ``layer_idx % 2 == 0``).
* **Llama-4** — layers with RoPE use chunked local attention (``attention_chunk_size``), the NoPE
  layers (``no_rope_layers[i] == 0``) full attention. vLLM 0.33.0 then *disables the hybrid KV cache
  manager by default* for any model with ``attention_chunk_size`` (a latency regression; opt back in
  with ``VLLM_ALLOW_CHUNKED_LOCAL_ATTN_WITH_HYBRID_KV_CACHE=1``), so the chunked layers are sized
  as full attention: :attr:`ModelLayout.disable_hybrid_kv_cache_manager` says so.
* **MLA** — DeepSeek-V2/V3: one latent vector per token, ``kv_lora_rank + qk_rope_head_dim``
  (576) elements, one "head"; ``fp8_ds_mla`` packs a token into 656 bytes.
* **Mamba hybrids** — Qwen3-Next (gated delta net, ``full_attention_interval``), Nemotron-H
  (Mamba2, ``hybrid_override_pattern``), Jamba (Mamba1, ``attn_layer_period``/``offset``),
  Granite-4.0-H (Mamba2, ``layer_types``), Falcon-H1 (attention beside Mamba2 in every layer); and
  the attention-free Mamba, FalconMamba and Mamba2 (no block alignment: vLLM aligns only when an
  attention backend exists); Zamba2 (Mamba2 in every layer, plus in each ``hybrid`` layer the shared
  transformer block's attention with its own KV cache, ``attention_head_dim`` over a doubled
  hidden size). Bamba (dropped by vLLM after 0.23.0) is refused. The
  state shapes are vLLM's ``MambaStateShapeCalculator`` formulas, the dtypes its
  ``MambaStateDtypeCalculator`` (Nemotron-H keeps the SSM state in float32 unless the config or
  ``--mamba-ssm-cache-dtype`` says otherwise). The attention block size is then raised so one
  attention page covers one Mamba state, and the Mamba page padded to it
  (``Platform._align_hybrid_block_size``): block = ``a * cdiv(mamba_page, a * attention_page_per_token)``
  with ``a = max(kernel_block_size, block_size)`` (``max(a, 128)`` for MLA hybrids) — Qwen3-Next-80B
  gets 544 tokens, as vLLM logs. With prefix caching (vLLM's default) Mamba layers run in ``align``
  cache mode with the attention block size; without it in ``none`` mode with a block of
  ``max_model_len`` tokens (``MambaModelConfig.verify_and_update_config``).

What depends on the GPU and its attention backend is a parameter with the CUDA default: the smallest
kernel block (``kernel_block_size``, 16 for FlashAttention/Triton) and the default block size (16;
64 for MLA, FlashMLA's only size on Hopper). The derived ``max_model_len`` is vLLM's
(``derive_max_model_len_and_key``): the smallest of the length keys, times the RoPE ``factor`` for
scaling types that do not pre-scale ``max_position_embeddings`` (not for YaRN, llama3, longrope;
never for Gemma-3; read off the top-level config, so a nested ``text_config``'s RoPE scaling
does not count). A tokenizer's ``model_max_length`` is not read (kvref sees only ``config.json``).

Everything here is a pure function of the dict and the arguments (stdlib only; the file is read by
the CLI). Bad input raises :class:`~kvref.spec.errors.InvalidFieldError` naming the ``config.json``
key; an unsupported architecture names itself and the supported ones.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from math import lcm, prod
from typing import Any

from .config import EngineConfig
from .dtypes import DTYPE_SIZES, canonical_dtype, get_dtype_size
from .errors import InvalidFieldError, check_choice, check_int, check_sequence
from .kv_cache_interface import (
    ChunkedLocalAttentionSpec,
    FullAttentionSpec,
    KVCacheSpec,
    MambaSpec,
    MLAAttentionSpec,
    SlidingWindowSpec,
)
from .mathutil import cdiv

#: architecture (``config.json`` ``architectures[0]``) -> family handled below
SUPPORTED_ARCHITECTURES: dict[str, str] = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "llama",
    "MixtralForCausalLM": "llama",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen2",
    "Qwen3MoeForCausalLM": "qwen2",
    "Gemma2ForCausalLM": "gemma2",
    "Gemma3ForCausalLM": "gemma3",
    "Gemma3ForConditionalGeneration": "gemma3",
    "GptOssForCausalLM": "gpt_oss",
    "Llama4ForCausalLM": "llama4",
    "Llama4ForConditionalGeneration": "llama4",
    "DeepseekV2ForCausalLM": "deepseek_mla",
    "DeepseekV3ForCausalLM": "deepseek_mla",
    "Qwen3NextForCausalLM": "qwen3_next",
    "NemotronHForCausalLM": "nemotron_h",
    "JambaForCausalLM": "jamba",
    "Qwen2MoeForCausalLM": "qwen2",
    "GraniteMoeHybridForCausalLM": "granite_hybrid",
    "FalconH1ForCausalLM": "falcon_h1",
    "MambaForCausalLM": "mamba1",
    "FalconMambaForCausalLM": "mamba1",
    "Mamba2ForCausalLM": "mamba2",
    "Zamba2ForCausalLM": "zamba2",
}

#: architectures of the named classes kvref does not derive, and why (the error says so)
UNSUPPORTED_REASONS: dict[str, str] = {
    "BambaForCausalLM": "vLLM 0.33.0 no longer serves it (removed after 0.23.0, registry._PREVIOUSLY_SUPPORTED_MODELS)",
}

#: RoPE types whose ``max_position_embeddings`` is already the scaled length (vLLM
#: ``_get_and_verify_max_len`` applies ``factor`` to every other type)
_PRESCALED_ROPE = ("su", "longrope", "llama3", "yarn", "deepseek_yarn", "deepseek_llama_scaling")
#: vLLM's length keys (``derive_max_model_len_and_key``), the smallest wins
_MAX_LEN_KEYS = ("max_position_embeddings", "n_positions", "max_seq_len", "seq_length", "model_max_length",
                 "max_target_positions", "max_sequence_length", "max_seq_length", "seq_len")
_MODEL_DTYPES = {"bfloat16": "bfloat16", "float16": "float16", "half": "float16", "float32": "float32",
                 "float": "float32"}
#: KV cache dtypes ``--kv-cache-dtype`` accepts here (``auto`` = the model's dtype)
KV_CACHE_DTYPES = ("auto", "bfloat16", "float16", "float32", "fp8", "fp8_e4m3", "fp8_e5m2", "fp8_ds_mla")
MAMBA_DTYPES = ("auto", "bfloat16", "float16", "float32")
#: most decoder layers a config may declare (the largest served models have a few hundred)
MAX_LAYERS = 100_000
#: bytes of one token of DeepSeek's ``fp8_ds_mla`` cache: 512 fp8 latent values, 4 float32 scales,
#: 64 bf16 RoPE values
FP8_DS_MLA_TOKEN_BYTES = 656


@dataclass(frozen=True)
class ModelLayout:
    """What vLLM would build from one ``config.json`` and the engine arguments.

    Attributes:
        architecture: ``architectures[0]``; ``family``: which derivation ran.
        layers: layer name -> spec, in model order (only layers that hold KV cache or state).
        derived_max_model_len: the model's own maximum context (vLLM's derived ``max_model_len``).
        block_size: ``cache_config.block_size`` after vLLM's adjustments (hybrid alignment).
        mamba_cache_mode: ``none``/``align``/``all`` (``none`` without Mamba layers).
        disable_hybrid_kv_cache_manager: what vLLM decides by default (True for chunked local
            attention, see the module docstring).
        enable_prefix_caching: as given (vLLM's default: on).
        notes: one line per decision a user may not expect (why a block size was raised, ...).
    """

    architecture: str
    family: str
    model_dtype: str
    kv_cache_dtype: str
    layers: dict[str, KVCacheSpec]
    derived_max_model_len: int
    block_size: int
    mamba_cache_mode: str = "none"
    disable_hybrid_kv_cache_manager: bool = False
    enable_prefix_caching: bool = True
    notes: tuple[str, ...] = field(default=())

    def engine_config(self, **changes: Any) -> EngineConfig:
        """An :class:`EngineConfig` carrying this layout's derived settings, then ``changes``."""
        base = EngineConfig(block_size=self.block_size, derived_max_model_len=self.derived_max_model_len,
                            mamba_cache_mode=self.mamba_cache_mode,
                            enable_prefix_caching=self.enable_prefix_caching,
                            disable_hybrid_kv_cache_manager=self.disable_hybrid_kv_cache_manager)
        return replace(base, **changes) if changes else base

    def counts(self) -> dict[str, int]:
        """Layers per kind (``full``, ``sliding_window``, ``chunked_local``, ``mla``, ``mamba``)."""
        out: dict[str, int] = {}
        for spec in self.layers.values():
            out[_kind(spec)] = out.get(_kind(spec), 0) + 1
        return out


def _kind(spec: KVCacheSpec) -> str:
    if isinstance(spec, MLAAttentionSpec):
        return "mla"
    if isinstance(spec, FullAttentionSpec):
        return "full"
    if isinstance(spec, SlidingWindowSpec):
        return "sliding_window"
    if isinstance(spec, ChunkedLocalAttentionSpec):
        return "chunked_local"
    return "mamba"


# -- reading the dict -------------------------------------------------------------------------

#: defaults of transformers' config classes (by text ``model_type``) for the keys read here: a
#: ``config.json`` omits what equals the default, and vLLM sees the config object, default included.
#: An explicit ``null`` in the file is kept (Mistral-7B-v0.3's ``"sliding_window": null``).
CLASS_DEFAULTS: dict[str, dict[str, Any]] = {
    "llama": {"max_position_embeddings": 2048},
    "mistral": {"max_position_embeddings": 131072, "sliding_window": 4096, "num_key_value_heads": 8},
    "mixtral": {"max_position_embeddings": 131072, "num_key_value_heads": 8},
    "qwen2": {"max_position_embeddings": 32768, "sliding_window": 4096, "num_key_value_heads": 32},
    "qwen3": {"max_position_embeddings": 32768, "sliding_window": 4096, "num_key_value_heads": 32, "head_dim": 128},
    "qwen3_moe": {"max_position_embeddings": 32768, "sliding_window": 4096, "num_key_value_heads": 4},
    "gemma2": {"max_position_embeddings": 8192, "sliding_window": 4096, "num_key_value_heads": 4, "head_dim": 256},
    "gemma3_text": {"max_position_embeddings": 131072, "sliding_window": 4096, "num_key_value_heads": 4,
                    "head_dim": 256},
    "gpt_oss": {"max_position_embeddings": 131072, "sliding_window": 128, "num_key_value_heads": 8, "head_dim": 64},
    "llama4_text": {"max_position_embeddings": 131072, "num_key_value_heads": 8, "head_dim": 128,
                    "attention_chunk_size": 8192},
    "deepseek_v2": {"max_position_embeddings": 2048, "kv_lora_rank": 512, "qk_rope_head_dim": 64},
    "deepseek_v3": {"max_position_embeddings": 4096, "kv_lora_rank": 512, "qk_rope_head_dim": 64},
    "qwen3_next": {"max_position_embeddings": 32768, "num_key_value_heads": 2, "head_dim": 256},
    "nemotron_h": {"max_position_embeddings": 4096, "num_key_value_heads": 8, "head_dim": 128},
    "jamba": {"max_position_embeddings": 262144, "num_key_value_heads": 8},
    "qwen2_moe": {"max_position_embeddings": 32768, "sliding_window": 4096, "num_key_value_heads": 16},
    "granitemoehybrid": {"max_position_embeddings": 2048, "mamba_n_heads": 128, "mamba_n_groups": 1,
                         "mamba_d_state": 256, "mamba_d_conv": 4, "mamba_expand": 2},
    "falcon_h1": {"max_position_embeddings": 8192, "num_key_value_heads": 8, "mamba_d_ssm": 1024,
                  "mamba_n_heads": 128, "mamba_n_groups": 1, "mamba_d_state": 256, "mamba_d_conv": 4,
                  "mamba_expand": 2},
    "mamba": {"state_size": 16, "conv_kernel": 4, "expand": 2},
    "falcon_mamba": {"state_size": 16, "conv_kernel": 4, "expand": 2},
    "mamba2": {"num_heads": 128, "head_dim": 64, "state_size": 128, "conv_kernel": 4, "expand": 2, "n_groups": 8},
    "zamba2": {"max_position_embeddings": 4096, "hidden_size": 2560, "num_attention_heads": 32, "mamba_d_state": 64,
               "mamba_d_conv": 4, "mamba_expand": 2, "mamba_ngroups": 1, "n_mamba_heads": 8},
}
#: the text ``model_type`` of each architecture, for a file that does not say
_ARCH_MODEL_TYPE = {
    "LlamaForCausalLM": "llama", "MistralForCausalLM": "mistral", "MixtralForCausalLM": "mixtral",
    "Qwen2ForCausalLM": "qwen2", "Qwen3ForCausalLM": "qwen3", "Qwen3MoeForCausalLM": "qwen3_moe",
    "Gemma2ForCausalLM": "gemma2", "Gemma3ForCausalLM": "gemma3_text", "Gemma3ForConditionalGeneration": "gemma3_text",
    "GptOssForCausalLM": "gpt_oss", "Llama4ForCausalLM": "llama4_text", "Llama4ForConditionalGeneration": "llama4_text",
    "DeepseekV2ForCausalLM": "deepseek_v2", "DeepseekV3ForCausalLM": "deepseek_v3",
    "Qwen3NextForCausalLM": "qwen3_next", "NemotronHForCausalLM": "nemotron_h", "JambaForCausalLM": "jamba",
    "Qwen2MoeForCausalLM": "qwen2_moe", "GraniteMoeHybridForCausalLM": "granitemoehybrid",
    "FalconH1ForCausalLM": "falcon_h1", "MambaForCausalLM": "mamba", "FalconMambaForCausalLM": "falcon_mamba",
    "Mamba2ForCausalLM": "mamba2",
    "Zamba2ForCausalLM": "zamba2",
}


class _Cfg:
    """``config.json`` values (the class default when the key is absent) and errors naming the key."""

    def __init__(self, data: Mapping[str, Any], prefix: str = "", defaults: Mapping[str, Any] | None = None) -> None:
        self.data, self.prefix, self.defaults = data, prefix, defaults or {}

    def raw(self, key: str) -> Any:
        return self.data[key] if key in self.data else self.defaults.get(key)

    def has(self, key: str) -> bool:
        return self.raw(key) is not None

    def get(self, key: str, default: Any = None) -> Any:
        value = self.raw(key)
        return default if value is None else value

    def int(self, key: str, default: int | None = None, minimum: int = 1) -> int:
        value = self.get(key, default)
        if value is None:
            raise InvalidFieldError(self.prefix + key, None, f"an int >= {minimum} in config.json (the key is missing)")
        check_int(self.prefix + key, value, minimum=minimum)
        return value

    def list(self, key: str, length: int | None = None) -> list | None:
        value = self.raw(key)
        if value is None:
            return None
        if not isinstance(value, list) or (length is not None and len(value) != length):
            want = "a list" + (f" of {length} entries (one per layer)" if length is not None else "")
            raise InvalidFieldError(self.prefix + key, value, want)
        return value


#: keys kvref reads that transformers' config class types as ``int`` (not ``int | None``): an
#: explicit ``null`` fails its strict validation (transformers 5 ``@strict`` configs), so vLLM
#: cannot load the file
_NOT_NULL_COMMON = ("hidden_size", "num_hidden_layers", "num_attention_heads", "max_position_embeddings")
NOT_NULL_KEYS: dict[str, tuple[str, ...]] = {
    "llama": _NOT_NULL_COMMON,
    "mistral": (*_NOT_NULL_COMMON, "num_key_value_heads"),
    "mixtral": (*_NOT_NULL_COMMON, "num_key_value_heads"),
    "qwen2": (*_NOT_NULL_COMMON, "max_window_layers"),
    "qwen3": (*_NOT_NULL_COMMON, "head_dim", "max_window_layers"),
    "qwen3_moe": (*_NOT_NULL_COMMON, "num_key_value_heads"),
    # Qwen2MoeConfig allows a null num_key_value_heads but, unlike Qwen2's, does not fill it in:
    # vLLM's ModelArchitectureConfig then refuses total_num_kv_heads=None
    "qwen2_moe": (*_NOT_NULL_COMMON, "max_window_layers", "num_key_value_heads"),
    "gemma2": (*_NOT_NULL_COMMON, "num_key_value_heads", "head_dim"),
    "gemma3_text": (*_NOT_NULL_COMMON, "num_key_value_heads", "head_dim"),
    "gpt_oss": (*_NOT_NULL_COMMON, "num_key_value_heads", "head_dim"),
    "llama4_text": (*_NOT_NULL_COMMON, "num_key_value_heads", "head_dim"),
    "deepseek_v2": (*_NOT_NULL_COMMON, "kv_lora_rank", "qk_rope_head_dim"),
    "deepseek_v3": (*_NOT_NULL_COMMON, "kv_lora_rank", "qk_rope_head_dim"),
    "qwen3_next": (*_NOT_NULL_COMMON, "num_key_value_heads", "head_dim"),
    "nemotron_h": ("hidden_size", "num_attention_heads", "max_position_embeddings", "num_key_value_heads", "head_dim"),
    "jamba": (*_NOT_NULL_COMMON, "num_key_value_heads", "attn_layer_period", "attn_layer_offset"),
    "granitemoehybrid": _NOT_NULL_COMMON,
    "falcon_h1": _NOT_NULL_COMMON,
    "mamba": ("hidden_size", "num_hidden_layers"),
    "falcon_mamba": ("hidden_size", "num_hidden_layers"),
    "mamba2": ("hidden_size", "num_hidden_layers", "head_dim"),
    "zamba2": ("hidden_size", "num_attention_heads", "max_position_embeddings"),
}


def _check_not_null(cfg: _Cfg, model_type: str) -> None:
    for key in NOT_NULL_KEYS.get(model_type, ()):
        if key in cfg.data and cfg.data[key] is None:
            raise InvalidFieldError(cfg.prefix + key, None, f"an int ({model_type}'s config class does not allow null)")


#: layer types transformers' ``validate_layer_type`` accepts (``ALLOWED_ATTN_LAYER_TYPES``), plus the
#: legacy names it remaps first (``mamba``, ``attention``)
ALLOWED_LAYER_TYPES = ("full_attention", "sliding_attention", "chunked_attention", "window_attention",
                       "indexed_attention", "compressed_sparse_attention", "heavily_compressed_attention",
                       "minimax_m3_sparse", "conv", "moe", "hybrid", "hybrid_sliding", "reference_sliding_attention",
                       "linear_attention", "mamba", "attention")


def _check_layer_types(cfg: _Cfg, n: int, key: str = "layer_types") -> None:
    """transformers validates any ``layer_types`` a file gives, whatever the family reads: one known
    entry per layer (``PreTrainedConfig.validate_layer_type``); vLLM's loader refuses the file otherwise."""
    types = cfg.list(key, n) if key in cfg.data else None
    if types is not None and any(t not in ALLOWED_LAYER_TYPES for t in types):
        raise InvalidFieldError(cfg.prefix + key, types, "entries among " + ", ".join(ALLOWED_LAYER_TYPES))


def _architecture(data: Mapping[str, Any]) -> str:
    archs = data.get("architectures")
    supported = ", ".join(sorted(SUPPORTED_ARCHITECTURES))
    if not isinstance(archs, list) or not archs or not isinstance(archs[0], str):
        raise InvalidFieldError("architectures", archs, f"a list naming the model class, one of: {supported}")
    if archs[0] not in SUPPORTED_ARCHITECTURES:
        why = f" ({archs[0]}: {UNSUPPORTED_REASONS[archs[0]]})" if archs[0] in UNSUPPORTED_REASONS else ""
        raise InvalidFieldError("architectures", archs[0],
                                f"an architecture kvref derives layouts for{why}: {supported}")
    return archs[0]


def _text_config(data: Mapping[str, Any]) -> _Cfg:
    """vLLM reads layer fields from ``hf_text_config``: the nested ``text_config`` of a multimodal
    checkpoint (Gemma-3 27B-it, Llama-4), else the top level; absent keys take the class default."""
    archs = data.get("architectures") or [None]
    text = data.get("text_config")
    if text is None:
        text, prefix = data, ""
    elif not isinstance(text, dict):
        raise InvalidFieldError("text_config", text, "an object of the language model's fields")
    else:
        prefix = "text_config."
    model_type = text.get("model_type") or _ARCH_MODEL_TYPE.get(archs[0] if isinstance(archs[0], str) else "")
    return _Cfg(text, prefix, CLASS_DEFAULTS.get(str(model_type), {}))


def _check_config(data: Any) -> None:
    if not isinstance(data, Mapping):
        raise InvalidFieldError("config.json", type(data).__name__, "a JSON object")


def model_dtype(data: Mapping[str, Any]) -> str:
    """The checkpoint dtype vLLM's ``dtype="auto"`` serves in.

    ``dtype`` (transformers 5) or ``torch_dtype``, at the top or in ``text_config``. A float32
    checkpoint is served in bfloat16 on CUDA GPUs (vLLM downcasts float32 under ``auto``); no
    dtype at all is float32, hence bfloat16 as well.
    """
    _check_config(data)
    text = data.get("text_config") if isinstance(data.get("text_config"), dict) else {}
    for where in (data, text):
        for key in ("dtype", "torch_dtype"):
            value = where.get(key)
            if value is not None:
                if not isinstance(value, str) or value not in _MODEL_DTYPES:
                    raise InvalidFieldError(key, value, "one of " + ", ".join(sorted(_MODEL_DTYPES)))
                dt = _MODEL_DTYPES[value]
                return "bfloat16" if dt == "float32" else dt
    return "bfloat16"


def _rope_parameter_sets(cfg: _Cfg) -> list[dict]:
    """RoPE parameter dicts (``rope_parameters``, or the older ``rope_scaling``), one per layer type
    when they are nested by layer type (transformers 5, Gemma-3)."""
    rp = cfg.get("rope_parameters") or cfg.get("rope_scaling")
    if rp is None:
        return []
    if not isinstance(rp, dict):
        raise InvalidFieldError(cfg.prefix + "rope_scaling", rp, "an object such as {'rope_type': 'yarn', 'factor': 4}")
    if rp and all(isinstance(v, dict) for v in rp.values()):
        return list(rp.values())
    return [rp]


def derived_max_model_len(data: Mapping[str, Any]) -> int:
    """vLLM 0.33.0's derived ``max_model_len`` of a ``config.json`` (``_get_and_verify_max_len``)."""
    _check_config(data)
    cfg = _text_config(data)
    lengths = [(key, cfg.get(key)) for key in _MAX_LEN_KEYS if cfg.get(key) is not None]
    for key, value in lengths:
        check_int(cfg.prefix + key, value, minimum=1)
    if cfg.defaults is CLASS_DEFAULTS["zamba2"] and cfg.get("use_long_context"):  # Zamba2Config.__post_init__
        lengths = [(k, 16384 if k == "max_position_embeddings" else v) for k, v in lengths]
    if cfg.get("model_max_length"):
        derived = cfg.get("model_max_length")
    elif lengths:
        derived = min(v for _, v in lengths)
    else:
        derived = 2048  # vLLM assumes 2048 (with a warning) when no key is present
    model_type = str(data.get("model_type", ""))
    # vLLM reads the RoPE parameters off the top-level config (``iter_rope_parameters(hf_config)``),
    # not ``hf_text_config``: a multimodal file's ``text_config.rope_scaling`` does not scale the length
    rope = _rope_parameter_sets(_Cfg(data))
    if rope and "gemma3" not in model_type:
        factor = 1.0
        for rp in rope:
            rope_type = rp.get("rope_type", rp.get("type", "default"))
            if rope_type not in _PRESCALED_ROPE:
                factor = rp.get("factor", factor)
                if factor is not None and (isinstance(factor, bool) or not isinstance(factor, (int, float))
                                           or not 0 < factor < 1e6):
                    raise InvalidFieldError(cfg.prefix + "rope_scaling.factor", factor, "a positive number")
        derived = derived * (1.0 if factor is None else factor)
    return int(derived)


# -- per-family layer kinds -------------------------------------------------------------------

def _layer_types_window(cfg: _Cfg, n: int, window: int | None) -> list[str]:
    """llama.py's rule: ``layer_types[i] == 'sliding_attention'`` takes the window; without
    ``layer_types`` (or when every layer slides) the model-level window applies to every layer
    through ``CacheConfig.sliding_window``."""
    types = cfg.list("layer_types", n)
    if window is None:
        return ["full"] * n
    if types is None or all(t == "sliding_attention" for t in types):
        return ["sliding_window"] * n
    return ["sliding_window" if t == "sliding_attention" else "full" for t in types]


def _qwen_window(arch: str, cfg: _Cfg) -> int | None:
    """transformers: ``sliding_window`` only with ``use_sliding_window`` (Qwen2-MoE stores 0, read as none)."""
    window = cfg.get("sliding_window") if cfg.get("use_sliding_window", False) else None
    return window or None


def _qwen_kinds(arch: str, cfg: _Cfg, n: int) -> list[str]:
    """Qwen2/Qwen3/Qwen2-MoE/Qwen3-MoE. Their vLLM attention takes ``CacheConfig.sliding_window``
    only, which vLLM sets when ``layer_types`` is absent or all sliding (``engine/arg_utils.py``):
    every layer slides or none does. transformers derives ``layer_types``: Qwen2/Qwen3 slide from
    ``max_window_layers`` (default 28) on, Qwen2-MoE on even layers below it, Qwen3-MoE lists none.
    ``qwen2.py`` (Qwen2Model, Qwen3Model) rejects mixed layer types unless ``max_window_layers ==
    num_hidden_layers``."""
    window = _qwen_window(arch, cfg)
    use = bool(cfg.get("use_sliding_window", False))
    types = cfg.list("layer_types", n)
    if arch == "Qwen2MoeForCausalLM" and not use and types and all(t == "sliding_attention" for t in types):
        # Qwen2MoeConfig stores sliding_window 0 without use_sliding_window, and vLLM would build a
        # 0-token window for every layer: refused here (a deliberate difference, docs/size.md)
        raise InvalidFieldError(cfg.prefix + "use_sliding_window", cfg.get("use_sliding_window"),
                                "true when every layer_types entry slides (Qwen2-MoE's window is 0 otherwise)")
    if types is None and arch != "Qwen3MoeForCausalLM":
        mwl = cfg.get("max_window_layers", 28)
        check_int(cfg.prefix + "max_window_layers", mwl, minimum=0)
        if arch == "Qwen2MoeForCausalLM":
            types = ["sliding_attention" if i % 2 == 0 and i < mwl and use else "full_attention" for i in range(n)]
        else:
            types = ["sliding_attention" if window is not None and i >= mwl else "full_attention" for i in range(n)]
    if arch in ("Qwen2ForCausalLM", "Qwen3ForCausalLM") and types is not None and len(set(types)) > 1:
        mwl = cfg.get("max_window_layers", 28)
        if mwl != n:
            raise InvalidFieldError(cfg.prefix + "max_window_layers", mwl,
                                    f"0 or >= num_hidden_layers ({n}) with use_sliding_window: vLLM 0.33.0 does not "
                                    "support sliding window on some layers only (qwen2.py)")
    if window is not None and (types is None or all(t == "sliding_attention" for t in types)):
        return ["sliding_window"] * n
    return ["full"] * n


def _zamba2_types(cfg: _Cfg) -> list[str]:
    """``layers_block_type`` (transformers' 54-layer default when absent); vLLM builds one layer per
    entry, and transformers requires one entry per ``num_hidden_layers``."""
    types = cfg.list("layers_block_type")
    if types is None:
        types = ["linear_attention"] + (["linear_attention"] * 5 + ["hybrid"]) * 7 + ["linear_attention"] * 4 + \
            ["hybrid"] + ["linear_attention"] * 3 + ["hybrid"] + ["linear_attention"] * 2
    return types


def _kinds(family: str, cfg: _Cfg, n: int, arch: str = "") -> tuple[list[str], dict[str, Any]]:
    """Kind of each decoder layer (``full``/``sliding_window``/``chunked_local``/``mla``/``mamba``/
    ``none``) and the family's extra fields (window, chunk size)."""
    extra: dict[str, Any] = {}
    if family == "llama":
        window = cfg.get("sliding_window")
        extra["sliding_window"] = window
        kinds = _layer_types_window(cfg, n, window)
        if arch == "MixtralForCausalLM" and "full" in kinds:  # mixtral.py: no per-layer window
            kinds = ["full"] * n
        return kinds, extra
    if family == "qwen2":
        return _qwen_kinds(arch, cfg, n), {"sliding_window": _qwen_window(arch, cfg)}
    if family in ("gemma2", "gemma3"):
        window = cfg.raw("sliding_window")  # an explicit null: no layer slides (gemma2.py, gemma3.py)
        if window is None:
            return ["full"] * n, extra
        check_int(cfg.prefix + "sliding_window", window, minimum=1)
        if family == "gemma3" and cfg.get("use_bidirectional_attention", False):
            window = window // 2 + 1  # transformers' Gemma3TextConfig (exclusive bounds)
        extra["sliding_window"] = window
        types = cfg.list("layer_types", n)
        if types is None:
            period = 2 if family == "gemma2" else cfg.int("sliding_window_pattern", 6)
            types = ["sliding_attention" if (i + 1) % period else "full_attention" for i in range(n)]
        return ["sliding_window" if t == "sliding_attention" else "full" for t in types], extra
    if family == "gpt_oss":
        window = cfg.raw("sliding_window")  # an explicit null: no layer slides (gpt_oss.py)
        if window is None:
            return ["full"] * n, extra
        check_int(cfg.prefix + "sliding_window", window, minimum=1)
        extra["sliding_window"] = window
        return ["sliding_window" if i % 2 == 0 else "full" for i in range(n)], extra
    if family == "llama4":
        chunk = cfg.raw("attention_chunk_size")  # an explicit null: every layer full (llama4.py)
        if chunk is None:
            return ["full"] * n, extra
        check_int(cfg.prefix + "attention_chunk_size", chunk, minimum=1)
        extra["attention_chunk_size"] = chunk
        no_rope = cfg.list("no_rope_layers")
        if not no_rope:
            interval = cfg.int("no_rope_layer_interval", 4)
            no_rope = [int((i + 1) % interval != 0) for i in range(n)]
        if len(no_rope) != n:
            raise InvalidFieldError(cfg.prefix + "no_rope_layers", no_rope, f"a list of {n} entries (1 = RoPE layer)")
        return ["chunked_local" if r else "full" for r in no_rope], extra
    if family == "deepseek_mla":
        return ["mla"] * n, extra
    if family == "qwen3_next":
        types = cfg.list("layer_types", n)
        if types is None:
            interval = cfg.int("full_attention_interval", 4)
            types = ["linear_attention" if (i + 1) % interval else "full_attention" for i in range(n)]
        return ["mamba" if t == "linear_attention" else "full" for t in types], extra
    if family == "nemotron_h":
        pattern = cfg.get("hybrid_override_pattern")
        types = cfg.list("layers_block_type") or cfg.list("layer_types")
        if pattern is not None:
            if not isinstance(pattern, str) or set(pattern) - set("M*-E"):
                raise InvalidFieldError(cfg.prefix + "hybrid_override_pattern", pattern,
                                        "a string of M (Mamba2), * (attention), - (MLP), E (MoE)")
            kinds = ["mamba" if c == "M" else "full" if c == "*" else "none" for c in pattern]
        elif types is not None:
            names = {"mamba": "mamba", "linear_attention": "mamba", "attention": "full", "full_attention": "full"}
            kinds = [names.get(t, "none") for t in types]
        else:
            raise InvalidFieldError(cfg.prefix + "hybrid_override_pattern", None,
                                    "a pattern such as 'M-M*-' or a layers_block_type list")
        return kinds, extra
    if family == "jamba":
        period, offset = cfg.int("attn_layer_period", 8), cfg.int("attn_layer_offset", 4, minimum=0)
        if offset >= period:
            raise InvalidFieldError(cfg.prefix + "attn_layer_offset", offset, f"an int < attn_layer_period ({period})")
        return ["full" if i % period == offset else "mamba" for i in range(n)], extra
    if family == "granite_hybrid":  # granitemoehybrid.py: ALL_DECODER_LAYER_TYPES[layer_types[i]]
        types = cfg.list("layer_types", n) or cfg.list("layers_block_type", n) or ["linear_attention"] * n
        names = {"mamba": "mamba", "linear_attention": "mamba", "attention": "full", "full_attention": "full"}
        if any(t not in names for t in types):
            raise InvalidFieldError(cfg.prefix + "layer_types", types, "entries 'mamba' or 'attention'")
        return [names[t] for t in types], extra
    if family == "falcon_h1":  # falcon_h1.py: every layer is a parallel hybrid (attention beside Mamba2)
        return ["full+mamba"] * n, extra
    if family in ("mamba1", "mamba2"):
        return ["mamba"] * n, extra
    if family == "zamba2":  # zamba2.py: "hybrid" layers add the shared block's attention (own KV cache)
        return ["full+mamba" if t == "hybrid" else "mamba" for t in _zamba2_types(cfg)], extra
    raise AssertionError(family)  # pragma: no cover - SUPPORTED_ARCHITECTURES lists only the above


# -- Mamba states -----------------------------------------------------------------------------

def _tp_divide(field_: str, value: int, tp: int) -> int:
    if value % tp:
        raise InvalidFieldError("tensor_parallel_size", tp, f"a divisor of {field_} ({value})")
    return value // tp


def mamba_state(family: str, cfg: _Cfg, *, model_dtype_: str, mamba_cache_dtype: str = "auto",
                mamba_ssm_cache_dtype: str = "auto", tensor_parallel_size: int = 1,
                num_speculative_tokens: int = 0) -> tuple[tuple[tuple[int, ...], ...], tuple[str, ...]]:
    """``(shapes, dtypes)`` of one Mamba layer's state, vLLM's ``MambaStateShapeCalculator`` /
    ``MambaStateDtypeCalculator`` for the family's mixer (conv state as ``(kernel - 1, dim)``)."""
    tp = tensor_parallel_size
    conv_dtype = model_dtype_ if mamba_cache_dtype == "auto" else mamba_cache_dtype
    ssm_dtype = conv_dtype if mamba_ssm_cache_dtype == "auto" else mamba_ssm_cache_dtype
    if family == "qwen3_next":  # gated delta net
        nk, nv = cfg.int("linear_num_key_heads", 16), cfg.int("linear_num_value_heads", 32)
        dk, dv = cfg.int("linear_key_head_dim", 128), cfg.int("linear_value_head_dim", 128)
        kernel = cfg.int("linear_conv_kernel_dim", 4)
        conv_dim = dk * nk * 2 + dv * nv
        shapes = ((kernel - 1 + num_speculative_tokens, _tp_divide("the conv dim", conv_dim, tp)),
                  (_tp_divide("text_config.linear_num_value_heads", nv, tp), dv, dk))
    elif family == "nemotron_h":  # Mamba2
        heads, head_dim = cfg.int("mamba_num_heads"), cfg.int("mamba_head_dim")
        shapes = _mamba2_shapes(cfg, heads * head_dim, "n_groups", "mamba_num_heads", heads, head_dim,
                                cfg.int("ssm_state_size"), cfg.int("conv_kernel"), tp, num_speculative_tokens)
        if mamba_ssm_cache_dtype == "auto":  # NemotronHForCausalLMConfig.update_mamba_ssm_cache_dtype
            ssm_dtype = cfg.get("mamba_ssm_cache_dtype", "float32")
    elif family in ("granite_hybrid", "falcon_h1"):  # Mamba2 with transformers' mamba_* names
        inter = cfg.int("mamba_expand") * cfg.int("hidden_size")
        what = "mamba_expand * hidden_size"
        if family == "falcon_h1" and cfg.get("mamba_d_ssm") is not None:  # falcon_h1.py: d_ssm wins
            inter, what = cfg.int("mamba_d_ssm"), "mamba_d_ssm"
        heads = cfg.int("mamba_n_heads")
        head_dim = cfg.get("mamba_d_head", "auto")
        if head_dim == "auto":  # transformers' __post_init__
            head_dim = inter // heads
        check_int(cfg.prefix + "mamba_d_head", head_dim, minimum=1)
        if heads * head_dim != inter:  # transformers' validate_architecture (strict config)
            raise InvalidFieldError(cfg.prefix + "mamba_d_head", head_dim,
                                    f"{what} ({inter}) / mamba_n_heads ({heads})")
        shapes = _mamba2_shapes(cfg, inter, "mamba_n_groups", "mamba_n_heads", heads, head_dim,
                                cfg.int("mamba_d_state"), cfg.int("mamba_d_conv"), tp, num_speculative_tokens)
    elif family == "zamba2":  # Zamba2ForCausalLM.get_mamba_state_shape_from_config
        inter = cfg.int("mamba_expand") * cfg.int("hidden_size")
        heads = cfg.int("n_mamba_heads")
        head_dim = cfg.int("mamba_headdim", inter // heads)  # transformers' __post_init__ unless the file says
        shapes = _mamba2_shapes(cfg, inter, "mamba_ngroups", "n_mamba_heads", heads, head_dim,
                                cfg.int("mamba_d_state"), cfg.int("mamba_d_conv"), tp, num_speculative_tokens)
    elif family == "mamba2":
        inter, heads, head_dim = cfg.int("expand") * cfg.int("hidden_size"), cfg.int("num_heads"), cfg.int("head_dim")
        if heads * head_dim != inter:  # Mamba2Config.validate_architecture
            raise InvalidFieldError(cfg.prefix + "head_dim", head_dim,
                                    f"hidden_size * expand ({inter}) / num_heads ({heads})")
        shapes = _mamba2_shapes(cfg, inter, "n_groups", "num_heads", heads, head_dim, cfg.int("state_size"),
                                cfg.int("conv_kernel"), tp, num_speculative_tokens)
    elif family in ("jamba", "mamba1"):  # Mamba1
        if family == "jamba":
            inner, what = cfg.int("mamba_expand", 2) * cfg.int("hidden_size"), "mamba_expand * hidden_size"
            state, kernel = cfg.int("mamba_d_state", 16), cfg.int("mamba_d_conv", 4)
        elif cfg.has("intermediate_size"):  # a file's value survives MambaConfig.__post_init__
            inner, what = cfg.int("intermediate_size"), "intermediate_size"
        else:  # MambaConfig.__post_init__: intermediate_size = int(expand * hidden_size)
            expand = cfg.get("expand", 2)
            if isinstance(expand, bool) or not isinstance(expand, (int, float)) or expand <= 0:
                raise InvalidFieldError(cfg.prefix + "expand", expand, "a positive number")
            inner, what = int(expand * cfg.int("hidden_size")), "expand * hidden_size"
            check_int(cfg.prefix + "expand", inner, minimum=1)
        if family == "mamba1":
            state, kernel = cfg.int("state_size"), cfg.int("conv_kernel")
        dim = _tp_divide(what, inner, tp)
        shapes = ((kernel - 1, dim), (dim, state))
    else:  # pragma: no cover - only the three hybrid families call this
        raise AssertionError(family)
    return shapes, (canonical_dtype(conv_dtype, "mamba_cache_dtype"), canonical_dtype(ssm_dtype, "mamba_ssm_cache_dtype"))


def _mamba2_shapes(cfg: _Cfg, inter: int, groups_key: str, heads_key: str, heads: int, head_dim: int, state: int,
                   kernel: int, tp: int, spec: int) -> tuple[tuple[int, ...], ...]:
    """``MambaStateShapeCalculator.mamba2_state_shape``: groups padded for head shards
    (``extra_groups_for_head_shards``), the conv state over ``inter + 2 * groups * state``."""
    groups = cfg.int(groups_key)
    if groups % tp:
        groups += tp - groups  # extra_groups_for_head_shards
    conv_dim = inter + 2 * groups * state
    return ((kernel - 1 + spec, _tp_divide("the Mamba2 conv dim", conv_dim, tp)),
            (_tp_divide(cfg.prefix + heads_key, heads, tp), head_dim, state))


def mamba_state_bytes(shapes, dtypes) -> int:
    """Bytes of one Mamba state: each tensor's element count times its dtype's size."""
    check_sequence("shapes", shapes, "a tuple of state shapes (tuples of ints)")
    check_sequence("dtypes", dtypes, "a tuple of dtype names, one per shape")
    if len(shapes) != len(dtypes):
        raise InvalidFieldError("dtypes", dtypes, f"{len(shapes)} dtypes, one per shape")
    for i, shape in enumerate(shapes):
        check_sequence(f"shapes[{i}]", shape, "a tuple of ints")
        for j, n in enumerate(shape):
            check_int(f"shapes[{i}][{j}]", n, minimum=1)
    return sum(prod(s) * get_dtype_size(d) for s, d in zip(shapes, dtypes))


def _zamba2_head_size(cfg: _Cfg) -> int:
    """Zamba2's attention head size, after the check ``Zamba2Attention.__init__`` makes:
    ``attention_head_dim * num_attention_heads == attention_hidden_size``."""
    heads = cfg.int("num_attention_heads")
    hidden = cfg.int("attention_hidden_size", 2 * cfg.int("hidden_size"))
    head_size = cfg.int("attention_head_dim", 2 * cfg.int("hidden_size") // heads)
    if head_size * heads != hidden:
        raise InvalidFieldError(cfg.prefix + "attention_head_dim", head_size,
                                f"attention_hidden_size ({hidden}) / num_attention_heads ({heads}) (zamba2.py)")
    return head_size


def _attention_geometry(family: str, cfg: _Cfg, use_mla: bool, tp: int) -> tuple[int, int]:
    """``(KV heads per rank, head size)`` as vLLM's ``get_num_kv_heads`` / ``get_head_size`` give
    them, after the checks vLLM makes for tensor parallelism: attention heads divisible by TP
    (``ModelConfig.verify_with_parallel_config``), and KV heads divisible by TP or TP a multiple of
    them (``QKVParallelLinear`` replicates KV heads only whole)."""
    heads = cfg.int("num_attention_heads")
    if heads % tp:
        raise InvalidFieldError("tensor_parallel_size", tp, f"a divisor of {cfg.prefix}num_attention_heads ({heads})")
    if use_mla:
        return 1, cfg.int("kv_lora_rank") + cfg.int("qk_rope_head_dim")
    total_kv = cfg.int("num_key_value_heads", heads)
    if (tp % total_kv if tp >= total_kv else total_kv % tp):
        raise InvalidFieldError("tensor_parallel_size", tp, f"a divisor or multiple of {cfg.prefix}num_key_value_heads "
                                f"({total_kv})")
    if family == "zamba2":  # zamba2.py: Attention(heads / TP, attention_head_dim), KV heads = heads
        return heads // tp, _zamba2_head_size(cfg)
    if family == "granite_hybrid":  # granitemoehybrid.py: hidden_size // heads, head_dim unread
        head_size = cfg.int("hidden_size") // heads
    else:
        head_size = cfg.get("head_dim") or cfg.int("hidden_size") // heads
    check_int(cfg.prefix + "head_dim", head_size, minimum=1)
    return max(1, total_kv // tp), head_size


def hybrid_attention_block_size(attention_page_per_token: int, mamba_page: int, *, block_size: int,
                                kernel_block_size: int = 16, use_mla: bool = False,
                                checkpoint_alignment: int | None = None, align_mode: bool = False) -> int:
    """The attention block size vLLM picks so one attention page holds one Mamba state
    (``Platform._align_hybrid_block_size``): the smallest multiple of
    ``a = max(kernel_block_size, block_size)`` (at least 128 for MLA; lcm'd with the prefill
    checkpoint alignment in ``align`` mode) whose page is >= the state, never below ``block_size``."""
    for name, value in (("attention_page_per_token", attention_page_per_token), ("mamba_page", mamba_page),
                        ("block_size", block_size), ("kernel_block_size", kernel_block_size)):
        check_int(name, value, minimum=1)
    check_int("checkpoint_alignment", checkpoint_alignment, minimum=1, allow_none=True)
    align = max(kernel_block_size, block_size)
    if use_mla:
        align = max(align, 128)
    if align_mode and checkpoint_alignment:
        align = lcm(align, checkpoint_alignment)
    attn = align * cdiv(mamba_page, align * attention_page_per_token)
    attn = kernel_block_size * cdiv(attn, kernel_block_size)
    return max(block_size, attn)


# -- the layout -------------------------------------------------------------------------------

def layout_from_hf_config(data: Mapping[str, Any], *, block_size: int | None = None, kv_cache_dtype: str = "auto",
                          max_model_len: int | None = None, enable_prefix_caching: bool = True,
                          mamba_cache_mode: str | None = None, mamba_cache_dtype: str = "auto",
                          mamba_ssm_cache_dtype: str = "auto", tensor_parallel_size: int = 1,
                          kernel_block_size: int = 16, mamba_checkpoint_alignment: int | None = None,
                          allow_chunked_local_with_hybrid: bool = False) -> ModelLayout:
    """Derive the per-layer KV cache specs of a ``config.json`` as vLLM 0.33.0 would build them.

    Args:
        data: the parsed ``config.json``.
        block_size: ``--block-size``; None = vLLM's default (16; 64 for MLA, FlashMLA).
        kv_cache_dtype: ``--kv-cache-dtype`` (``auto`` = the model's dtype).
        max_model_len: ``--max-model-len`` (only the Mamba block size of ``none`` mode reads it;
            None = the derived length).
        enable_prefix_caching: vLLM's default True puts Mamba layers in ``align`` mode.
        mamba_cache_mode: None = vLLM's choice (``align`` with prefix caching, else ``none``).
        mamba_cache_dtype, mamba_ssm_cache_dtype: ``--mamba-cache-dtype`` / ``--mamba-ssm-cache-dtype``.
        tensor_parallel_size: KV heads and Mamba states are split across TP ranks; one rank is sized.
        kernel_block_size: the attention backend's smallest kernel block (16: FlashAttention/Triton).
        mamba_checkpoint_alignment: token alignment of mid-prefill Mamba checkpoints (64 with the
            FlashInfer gated-delta-net prefill in ``align`` mode; None = not exported).
        allow_chunked_local_with_hybrid: ``VLLM_ALLOW_CHUNKED_LOCAL_ATTN_WITH_HYBRID_KV_CACHE=1``.
    """
    if not isinstance(data, Mapping):
        raise InvalidFieldError("config.json", type(data).__name__, "a JSON object")
    arch = _architecture(data)
    family = SUPPORTED_ARCHITECTURES[arch]
    check_choice("kv_cache_dtype", kv_cache_dtype, KV_CACHE_DTYPES)
    check_choice("mamba_cache_dtype", mamba_cache_dtype, MAMBA_DTYPES)
    check_choice("mamba_ssm_cache_dtype", mamba_ssm_cache_dtype, MAMBA_DTYPES)
    check_int("block_size", block_size, minimum=1, allow_none=True)
    check_int("max_model_len", max_model_len, minimum=1, allow_none=True)
    check_int("tensor_parallel_size", tensor_parallel_size, minimum=1)
    check_int("kernel_block_size", kernel_block_size, minimum=1)
    check_int("mamba_checkpoint_alignment", mamba_checkpoint_alignment, minimum=1, allow_none=True)
    if mamba_cache_mode is not None:
        check_choice("mamba_cache_mode", mamba_cache_mode, ("none", "all", "align"))
    use_mla = family == "deepseek_mla"
    if kv_cache_dtype == "fp8_ds_mla" and not use_mla:
        raise InvalidFieldError("kv_cache_dtype", kv_cache_dtype, "fp8_ds_mla only for MLA models (DeepSeek)")
    cfg = _text_config(data)
    _check_not_null(cfg, str(cfg.data.get("model_type") or _ARCH_MODEL_TYPE[arch]))
    notes: list[str] = []
    m_dtype = model_dtype(data)
    kv_dtype = m_dtype if kv_cache_dtype == "auto" else kv_cache_dtype
    derived = derived_max_model_len(data)

    if family == "zamba2":  # layer_types is layers_block_type here: validate_layer_type checks it
        n = cfg.int("num_hidden_layers", 54)
        _check_layer_types(_Cfg({"layers_block_type": _zamba2_types(cfg)}, cfg.prefix), n, "layers_block_type")
    elif family != "nemotron_h" or not cfg.has("hybrid_override_pattern"):
        n = cfg.int("num_hidden_layers")
    else:
        n = len(str(cfg.get("hybrid_override_pattern")))
    if n > MAX_LAYERS:  # real models have a few hundred; a typo must not build a billion specs
        raise InvalidFieldError(cfg.prefix + "num_hidden_layers", n, f"at most {MAX_LAYERS:,} layers")
    if family not in ("nemotron_h", "zamba2"):
        _check_layer_types(cfg, n)
    kinds, extra = _kinds(family, cfg, n, arch)
    if len(kinds) != n:
        raise InvalidFieldError(cfg.prefix + "num_hidden_layers", n,
                                f"the length of the layer pattern ({len(kinds)})")

    # attention geometry (vLLM: get_num_kv_heads / get_head_size)
    has_attention = any(k not in ("mamba", "none") for k in kinds)
    num_kv_heads = head_size = 0
    if has_attention:
        num_kv_heads, head_size = _attention_geometry(family, cfg, use_mla, tensor_parallel_size)
    elif family == "zamba2" and cfg.int("num_mem_blocks", 1, minimum=0) > 0:
        # Zamba2Model builds its num_mem_blocks shared attention blocks eagerly, hybrid layers or
        # not, so their head-size check rejects a config without any "hybrid" layer too
        _zamba2_head_size(cfg)
    default_block = 64 if use_mla else 16
    bs = block_size if block_size is not None else default_block
    if block_size is None and use_mla:
        notes.append("MLA: block size 64 by default (FlashMLA's kernel block on Hopper); pass --block-size to change")

    # Mamba state and the hybrid block size
    has_mamba = any("mamba" in k for k in kinds)
    mode = "none"
    mamba_shapes = mamba_dtypes = None
    page_padded = None
    mamba_block = None
    if has_mamba:
        if enable_prefix_caching:
            mode = "align" if mamba_cache_mode in (None, "none") else mamba_cache_mode
        else:
            mode = "none"
        mamba_shapes, mamba_dtypes = mamba_state(family, cfg, model_dtype_=m_dtype, mamba_cache_dtype=mamba_cache_dtype,
                                                 mamba_ssm_cache_dtype=mamba_ssm_cache_dtype,
                                                 tensor_parallel_size=tensor_parallel_size)
        state_bytes = mamba_state_bytes(mamba_shapes, mamba_dtypes)
        if has_attention:  # update_block_size_for_backend aligns only models with an attention backend
            per_token = (FP8_DS_MLA_TOKEN_BYTES if kv_dtype == "fp8_ds_mla" else
                         num_kv_heads * head_size * (1 if use_mla else 2) * DTYPE_SIZES[kv_dtype])
            attn_block = hybrid_attention_block_size(per_token, state_bytes, block_size=bs,
                                                     kernel_block_size=kernel_block_size, use_mla=use_mla,
                                                     checkpoint_alignment=mamba_checkpoint_alignment,
                                                     align_mode=mode == "align")
            if attn_block != bs:
                notes.append(f"attention block size raised from {bs} to {attn_block} tokens so one attention page "
                             f"({attn_block} x {per_token:,} B) covers one Mamba state ({state_bytes:,} B), as "
                             "vLLM's _align_hybrid_block_size does")
            bs = attn_block
            if bs * per_token != state_bytes:
                page_padded = bs * per_token
                notes.append(f"Mamba page padded from {state_bytes:,} B to {page_padded:,} B "
                             f"(+{100 * (page_padded - state_bytes) / state_bytes:.2f}%) to equal the attention page")
        mamba_block = bs if mode == "align" else (max_model_len or derived)
        notes.append(f"Mamba cache mode {mode!r} ("
                     + ("prefix caching on: states checkpointed every block)" if mode != "none"
                        else f"prefix caching off: one state per request, block = max_model_len {mamba_block:,})"))

    disable_hma = False
    if family == "llama4" and "chunked_local" in kinds and not allow_chunked_local_with_hybrid:
        disable_hma = True
        notes.append("vLLM 0.33.0 disables the hybrid KV cache manager for chunked local attention by default "
                     "(latency regression): chunked layers are sized as full attention; "
                     "VLLM_ALLOW_CHUNKED_LOCAL_ATTN_WITH_HYBRID_KV_CACHE=1 keeps them local")

    layers: dict[str, KVCacheSpec] = {}
    attn_common = {"block_size": bs, "num_kv_heads": num_kv_heads, "head_size": head_size, "dtype": kv_dtype}
    for i, kind in enumerate(kinds):
        if kind == "none":
            continue
        if "mamba" in kind:
            assert mamba_shapes is not None and mamba_dtypes is not None and mamba_block is not None
            layers[f"model.layers.{i}.mamba"] = MambaSpec(block_size=mamba_block, shapes=mamba_shapes,
                                                          dtypes=mamba_dtypes, page_size_padded=page_padded,
                                                          mamba_cache_mode=mode)
            if kind == "mamba":
                continue
            kind = kind.removesuffix("+mamba")
        name = f"model.layers.{i}.self_attn.attn"
        if kind == "mla":
            layers[name] = MLAAttentionSpec(
                **attn_common, cache_dtype_str=kv_cache_dtype,
                state_content_bytes=FP8_DS_MLA_TOKEN_BYTES if kv_dtype == "fp8_ds_mla" else None)
        elif kind == "full":
            layers[name] = FullAttentionSpec(**attn_common)
        elif kind == "sliding_window":
            layers[name] = SlidingWindowSpec(**attn_common, sliding_window=extra["sliding_window"])
        else:
            layers[name] = ChunkedLocalAttentionSpec(**attn_common, attention_chunk_size=extra["attention_chunk_size"])
    if not layers:
        raise InvalidFieldError(cfg.prefix + "num_hidden_layers", n, "at least one layer with a KV cache")
    return ModelLayout(architecture=arch, family=family, model_dtype=m_dtype, kv_cache_dtype=kv_dtype, layers=layers,
                       derived_max_model_len=derived, block_size=bs, mamba_cache_mode=mode,
                       disable_hybrid_kv_cache_manager=disable_hma, enable_prefix_caching=enable_prefix_caching,
                       notes=tuple(notes))
