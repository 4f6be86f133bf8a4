"""What vLLM 0.33.0 itself derives from a ``config.json``: the cross-check of :mod:`kvref.spec.hf_config`.

vLLM builds the model to learn each layer's KV cache spec; that needs weights' shapes on a device
and, for some families, packages the CPU closure lacks (Qwen3-Next's module imports
``compressed_tensors``). What can run on CPU without them is vLLM's own code for every input of
the derivation, and this module calls exactly that:

* the config object: ``vllm.transformers_utils.config.get_config`` (transformers' config classes
  with their defaults, ``layer_types`` included);
* KV heads, head size, MLA: the model-architecture convertor ``ModelConfig`` uses
  (``MODEL_ARCH_CONFIG_CONVERTORS``), and the derived length: ``_get_and_verify_max_len``;
* which layer is sliding / chunked / Mamba: read from that config object the way each model class
  reads it (``layer_types``, ``no_rope_layers``, ``layers_block_type``, ``hybrid_override_pattern``;
  the one-line selections of ``llama.py``, ``gemma2.py``, ``gemma3.py``, ``gpt_oss.py``,
  ``llama4.py``), so the check covers transformers' defaults and vLLM's own fields;
* Mamba state shapes and dtypes: the model classes' ``get_mamba_state_shape_from_config`` /
  ``get_mamba_state_dtype_from_config`` (Jamba, Nemotron-H, Granite-4.0-H, Falcon-H1, Zamba2,
  Mamba, Mamba2), or the calculator Qwen3-Next's classmethod calls when its module cannot be imported;
* what vLLM rejects for tensor parallelism: ``ModelConfig.verify_with_parallel_config`` (attention
  heads) and the KV-head split ``QKVParallelLinear`` makes with ``vllm.distributed.divide``;
* the hybrid attention block size and Mamba page padding: ``Platform._align_hybrid_block_size``
  itself, with the Triton backend (kernel blocks ``MultipleOf(16)``, as FlashAttention on CUDA).

A lightweight stand-in config object carries the engine settings into those functions: building a
real ``ModelConfig`` inspects the architecture in a subprocess (~30 s per model on 2 cores) and the
CPU platform rewrites the SSM dtype to float32, which a GPU does not.
"""

from __future__ import annotations

import logging
import os
from types import SimpleNamespace
from typing import Any


def _torch_dtype_name(dtype: Any) -> str:
    return str(dtype).removeprefix("torch.")


def vllm_hf_facts(config_dir: str, *, tensor_parallel_size: int = 1, block_size: int = 16,
                  kv_cache_dtype: str = "auto", mamba_cache_dtype: str = "auto",
                  mamba_ssm_cache_dtype: str = "auto", enable_prefix_caching: bool = True) -> dict[str, Any]:
    """vLLM's view of the checkpoint in ``config_dir`` (a folder with ``config.json``).

    Returns a dict: ``architecture``, ``total_num_kv_heads``, ``num_kv_heads`` (per TP rank),
    ``head_size``, ``use_mla``, ``derived_max_model_len``, ``layer_kinds`` (one of ``full``,
    ``sliding_window``, ``chunked_local``, ``mla``, ``mamba``, ``none`` per decoder layer),
    ``sliding_window``, ``attention_chunk_size``, and for hybrids ``mamba_shapes``,
    ``mamba_dtypes``, ``block_size`` (after alignment), ``mamba_page_size_padded``,
    ``mamba_cache_mode``, ``mamba_block_size``; ``model_dtype`` always. A layer kind ``full+mamba``
    is a layer holding both (Falcon-H1's parallel hybrid). Raises whatever vLLM raises for a config
    it rejects.
    """
    os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
    import torch
    from vllm.config.model import _get_and_verify_max_len
    from vllm.transformers_utils.config import get_config
    from vllm.transformers_utils.model_arch_config_convertor import (
        MODEL_ARCH_CONFIG_CONVERTORS,
        ModelArchConfigConvertorBase,
    )

    logging.getLogger("vllm").setLevel(logging.CRITICAL)
    hf = _get_config_once(get_config, config_dir)
    text = hf.get_text_config()
    convertor = MODEL_ARCH_CONFIG_CONVERTORS.get(hf.model_type, ModelArchConfigConvertorBase)(hf, text, revision=None)
    arch_config = convertor.convert()
    architecture = hf.architectures[0]
    use_mla = bool(arch_config.is_deepseek_mla)
    window = getattr(text, "sliding_window", None)
    derived = _get_and_verify_max_len(hf, arch_config, None, None, False, window)
    total_kv = arch_config.total_num_kv_heads
    num_kv_heads = 1 if use_mla else max(1, total_kv // tensor_parallel_size)
    n = text.num_hidden_layers
    kinds = _layer_kinds(architecture, text, n, use_mla)
    head_size = arch_config.head_size
    if architecture == "GraniteMoeHybridForCausalLM":  # its attention takes hidden_size // heads, head_dim unread
        head_size = text.hidden_size // text.num_attention_heads
    has_attention = any(k not in ("mamba", "none") for k in kinds)
    if has_attention:
        _check_tensor_parallel(arch_config, total_kv, use_mla, tensor_parallel_size)
    model_dtype = convertor.get_torch_dtype(hf, config_dir, None, "auto")
    if model_dtype == torch.float32:  # vLLM's "auto" on CUDA downcasts float32 checkpoints
        model_dtype = torch.bfloat16
    facts: dict[str, Any] = {
        "architecture": architecture, "total_num_kv_heads": total_kv, "num_kv_heads": num_kv_heads,
        "head_size": head_size, "use_mla": use_mla, "derived_max_model_len": derived, "layer_kinds": kinds,
        "model_dtype": _torch_dtype_name(model_dtype),
        "sliding_window": window if "sliding_window" in kinds else None,
        "attention_chunk_size": getattr(text, "attention_chunk_size", None) if "chunked_local" in kinds else None}
    if not any("mamba" in k for k in kinds):
        return facts

    from vllm.config import CacheConfig, ParallelConfig
    from vllm.platforms.interface import Platform
    from vllm.v1.attention.backends.triton_attn import TritonAttentionBackend

    cache = CacheConfig(block_size=block_size, enable_prefix_caching=enable_prefix_caching,
                        cache_dtype=kv_cache_dtype, mamba_cache_dtype=mamba_cache_dtype,
                        mamba_ssm_cache_dtype=mamba_ssm_cache_dtype)
    model = SimpleNamespace(
        hf_config=hf, hf_text_config=text, dtype=model_dtype, use_mla=use_mla, architecture=architecture,
        max_model_len=derived, is_hybrid=has_attention,
        get_num_kv_heads=lambda parallel_config: num_kv_heads, get_head_size=lambda: arch_config.head_size)
    vc = SimpleNamespace(model_config=model, cache_config=cache,
                         parallel_config=ParallelConfig(tensor_parallel_size=tensor_parallel_size),
                         scheduler_config=SimpleNamespace(enable_chunked_prefill=True), speculative_config=None,
                         num_speculative_tokens=0, compilation_config=SimpleNamespace(static_forward_context={}))
    if architecture == "NemotronHForCausalLM":
        from vllm.model_executor.models.config import NemotronHForCausalLMConfig

        NemotronHForCausalLMConfig.update_mamba_ssm_cache_dtype(cache_config=cache, hf_config=hf)
    # MambaModelConfig.verify_and_update_config, the part that does not need a real VllmConfig
    if cache.enable_prefix_caching:
        if cache.mamba_cache_mode == "none":
            cache.mamba_cache_mode = "align"
        if cache.mamba_block_size is None:
            cache.mamba_block_size = cache.block_size
    else:
        cache.mamba_cache_mode = "none"
        if cache.mamba_block_size is None:
            cache.mamba_block_size = derived
    model_cls = _mamba_model_class(architecture)
    shapes = tuple(tuple(s) for s in model_cls.get_mamba_state_shape_from_config(vc))
    dtypes = tuple(model_cls.get_mamba_state_dtype_from_config(vc))

    from vllm.model_executor.models import ModelRegistry

    saved = ModelRegistry.resolve_model_cls
    ModelRegistry.resolve_model_cls = lambda *a, **k: (model_cls, architecture)  # type: ignore[method-assign]
    try:
        if has_attention:  # update_block_size_for_backend aligns only models with attention backends
            Platform._align_hybrid_block_size(vc, TritonAttentionBackend)
    finally:
        ModelRegistry.resolve_model_cls = saved  # type: ignore[method-assign]
    facts.update(mamba_shapes=shapes, mamba_dtypes=tuple(_torch_dtype_name(d) for d in dtypes),
                 block_size=cache.block_size, mamba_page_size_padded=cache.mamba_page_size_padded,
                 mamba_cache_mode=cache.mamba_cache_mode, mamba_block_size=cache.mamba_block_size)
    return facts


def _get_config_once(get_config: Any, config_dir: str) -> Any:
    """``get_config`` without its retry: it retries a failed parse after 2 s (a concurrent HF cache
    refresh may hide ``config.json``), which for a config the class rejects only costs time."""
    import vllm.transformers_utils.config as config_module
    from vllm.transformers_utils.repo_utils import with_retry

    def once(func, log_msg, max_retries=2, **kwargs):
        return with_retry(func, log_msg, max_retries=1, **kwargs)

    config_module.with_retry = once
    try:
        return get_config(config_dir, trust_remote_code=False)
    finally:
        config_module.with_retry = with_retry


def _check_tensor_parallel(arch_config: Any, total_kv: int, use_mla: bool, tp: int) -> None:
    """What vLLM rejects before sizing: attention heads not divisible by TP
    (``ModelConfig.verify_with_parallel_config``), and the KV-head split of ``QKVParallelLinear``
    (KV heads divided by TP, or replicated when TP is a multiple of them)."""
    from vllm.config import ParallelConfig
    from vllm.config.model import ModelConfig
    from vllm.distributed import divide

    stand_in = SimpleNamespace(model_arch_config=arch_config, use_mla=use_mla, multimodal_config=None,
                               get_total_num_kv_heads=lambda: total_kv)
    ModelConfig.verify_with_parallel_config(stand_in, ParallelConfig(tensor_parallel_size=tp))  # type: ignore[arg-type]
    if not use_mla:
        divide(tp, total_kv) if tp >= total_kv else divide(total_kv, tp)


def _layer_kinds(architecture: str, text: Any, n: int, use_mla: bool) -> list[str]:
    """Each decoder layer's cache kind, read off vLLM's config object as the model class does."""
    if use_mla:
        return ["mla"] * n
    if architecture in ("MambaForCausalLM", "FalconMambaForCausalLM", "Mamba2ForCausalLM"):
        return ["mamba"] * n
    if architecture == "FalconH1ForCausalLM":  # falcon_h1.py: every layer is FalconH1ParallelHybrid
        return ["full+mamba"] * n
    if architecture == "Zamba2ForCausalLM":  # zamba2.py: a layer per layers_block_type entry; "hybrid" ones
        # add the shared transformer block, with an Attention (own KV cache) per hybrid layer
        # Zamba2Model builds its num_mem_blocks shared attention blocks eagerly, each checking this
        if text.num_mem_blocks > 0 and text.attention_head_dim * text.num_attention_heads != text.attention_hidden_size:
            raise ValueError("zamba2.py: attention_hidden_size must be attention_head_dim * num_attention_heads")
        return ["full+mamba" if t == "hybrid" else "mamba" for t in text.layers_block_type]
    if architecture == "GraniteMoeHybridForCausalLM":  # granitemoehybrid.py: ALL_DECODER_LAYER_TYPES
        return [{"full_attention": "full", "linear_attention": "mamba"}[t] for t in text.layer_types]
    if architecture in ("Qwen3NextForCausalLM",):
        return ["mamba" if t == "linear_attention" else "full" for t in text.layer_types]
    if architecture == "JambaForCausalLM":
        return ["full" if t == "attention" else "mamba" for t in text.layers_block_type]
    if architecture == "NemotronHForCausalLM":  # nemotron_h.py indexes hybrid_override_pattern
        return [{"M": "mamba", "*": "full"}.get(c, "none") for c in text.hybrid_override_pattern]
    if architecture in ("Llama4ForCausalLM", "Llama4ForConditionalGeneration"):
        # llama4.py: use_chunked_local_attn = not nope and config.attention_chunk_size
        return ["chunked_local" if r and text.attention_chunk_size else "full" for r in text.no_rope_layers]
    if architecture == "GptOssForCausalLM":  # gpt_oss.py; a null window leaves every layer full
        window = getattr(text, "sliding_window", None)
        return ["sliding_window" if i % 2 == 0 and window is not None else "full" for i in range(n)]
    window = getattr(text, "sliding_window", None)
    types = getattr(text, "layer_types", None)
    if architecture in _QWEN2_MODEL and types is not None and len(set(types)) > 1:
        # qwen2.py Qwen2Model.__init__ (Qwen3Model subclasses it): mixed layer types need
        # max_window_layers == num_hidden_layers
        assert text.max_window_layers == text.num_hidden_layers, "qwen2.py: sliding window on some layers only"
    if window is None:
        return ["full"] * n
    if types is None or all(t == "sliding_attention" for t in types):
        return ["sliding_window"] * n  # CacheConfig.sliding_window (engine arg_utils)
    if architecture in _WINDOW_FROM_CACHE_CONFIG:  # no per-layer window: every layer takes CacheConfig's (None)
        return ["full"] * n
    return ["sliding_window" if t == "sliding_attention" else "full" for t in types]  # llama.py and the like


#: model classes whose attention takes ``CacheConfig.sliding_window`` only (no per-layer window;
#: ``mixtral.py``, ``qwen2.py``, ``qwen3.py``, ``qwen3_moe.py``, ``qwen2_moe.py``)
_WINDOW_FROM_CACHE_CONFIG = ("MixtralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM", "Qwen3MoeForCausalLM",
                             "Qwen2MoeForCausalLM")
_QWEN2_MODEL = ("Qwen2ForCausalLM", "Qwen3ForCausalLM")


def _mamba_model_class(architecture: str) -> Any:
    """The model class whose state classmethods vLLM calls; Qwen3-Next's module needs
    ``compressed_tensors`` here, so a stand-in calls the calculator its classmethods call."""
    if architecture == "JambaForCausalLM":
        from vllm.model_executor.models.jamba import JambaForCausalLM

        return JambaForCausalLM
    if architecture == "NemotronHForCausalLM":
        from vllm.model_executor.models.nemotron_h import NemotronHForCausalLM

        return NemotronHForCausalLM
    if architecture == "GraniteMoeHybridForCausalLM":
        from vllm.model_executor.models.granitemoehybrid import (
            GraniteMoeHybridForCausalLM,
        )

        return GraniteMoeHybridForCausalLM
    if architecture == "FalconH1ForCausalLM":
        from vllm.model_executor.models.falcon_h1 import FalconH1ForCausalLM

        return FalconH1ForCausalLM
    if architecture == "Zamba2ForCausalLM":
        from vllm.model_executor.models.zamba2 import Zamba2ForCausalLM

        return Zamba2ForCausalLM
    if architecture in ("MambaForCausalLM", "FalconMambaForCausalLM"):  # registry: both mamba.py's class
        from vllm.model_executor.models.mamba import MambaForCausalLM

        return MambaForCausalLM
    if architecture == "Mamba2ForCausalLM":
        from vllm.model_executor.models.mamba2 import Mamba2ForCausalLM

        return Mamba2ForCausalLM
    from vllm.model_executor.layers.mamba.mamba_utils import (
        MambaStateDtypeCalculator,
        MambaStateShapeCalculator,
    )

    class Qwen3NextStateStandIn:
        """``Qwen3NextForCausalLM``'s two classmethods, verbatim in effect (gated delta net)."""

        @classmethod
        def get_mamba_state_shape_from_config(cls, vllm_config: Any):
            hf = vllm_config.model_config.hf_text_config
            return MambaStateShapeCalculator.gated_delta_net_state_shape(
                vllm_config.parallel_config.tensor_parallel_size, hf.linear_num_key_heads, hf.linear_num_value_heads,
                hf.linear_key_head_dim, hf.linear_value_head_dim, hf.linear_conv_kernel_dim, 0)

        @classmethod
        def get_mamba_state_dtype_from_config(cls, vllm_config: Any):
            return MambaStateDtypeCalculator.gated_delta_net_state_dtype(
                vllm_config.model_config.dtype, vllm_config.cache_config.mamba_cache_dtype,
                vllm_config.cache_config.mamba_ssm_cache_dtype)

    return Qwen3NextStateStandIn
