"""Engine settings that the KV-cache formulas read (a flat stand-in for vLLM's ``VllmConfig``).

vLLM spreads these over ``ModelConfig``, ``CacheConfig``, ``SchedulerConfig`` and
``ParallelConfig``; kvref keeps the ones KV-cache sizing and admission depend on in one frozen
dataclass, with vLLM's names.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Literal, Union

from .errors import InvalidFieldError, check_choice, check_int

AUTO = "auto"
MambaCacheMode = Literal["none", "all", "align"]


def max_in_flight_tokens(max_num_batched_tokens: int, max_concurrent_batches: int) -> int:
    """Tokens scheduled but not yet settled: ``max_concurrent_batches * max_num_batched_tokens``
    (``VllmConfig.max_in_flight_tokens``; 2 batches with async scheduling).

    Sliding-window and chunked-local caps reserve for them because out-of-window blocks are freed on
    the processed-token basis. The one definition: startup sizing (:class:`EngineConfig`) and the
    scheduler (``kvref.impl.scheduler_types.SchedulerConfig``) both call it.
    """
    check_int("max_num_batched_tokens", max_num_batched_tokens, minimum=1)
    check_int("max_concurrent_batches", max_concurrent_batches, minimum=1)
    return max_concurrent_batches * max_num_batched_tokens


@dataclass(frozen=True)
class EngineConfig:
    """Settings for startup pool sizing and the runtime admission gate.

    Args:
        block_size: ``cache_config.block_size`` (tokens per block) used when there is one group.
        max_model_len: tokens per request, or ``"auto"`` (vLLM's ``-1``) to auto-fit it to the pool,
            starting from ``derived_max_model_len``.
        derived_max_model_len: the model's own maximum context (from its config); the starting point
            of auto-fit and the default when ``max_model_len`` is None.
        max_num_batched_tokens: token budget of one scheduler step.
        max_num_seqs: running requests at most.
        max_concurrent_batches: batches in flight at once (``VllmConfig.max_concurrent_batches``):
            1 normally, 2 with async scheduling, the PP size with pipeline parallelism.
        num_gpu_blocks_override: replace the profiled block count (``--num-gpu-blocks-override``).
        enable_prefix_caching: prefix caching on/off.
        mamba_cache_mode: ``"none"``, ``"all"`` or ``"align"``.
        max_num_encoder_input_tokens: encoder budget; sizes cross-attention caches.
        dcp_world_size: decode context parallel size (shards token positions of DCP-sharded specs).
        disable_hybrid_kv_cache_manager: promote SWA/chunked layers to full attention when mixed.
        prefix_match_unit: explicit ``hash_block_size`` for hybrid models (None: gcd rule).
        has_kv_connector: a KV connector is configured (affects block-size resolution).
    """

    block_size: int = 16
    max_model_len: Union[int, str, None] = None
    derived_max_model_len: int = 8192
    max_num_batched_tokens: int = 2048
    max_num_seqs: int = 128
    max_concurrent_batches: int = 1
    num_gpu_blocks_override: int | None = None
    enable_prefix_caching: bool = True
    mamba_cache_mode: str = "none"
    max_num_encoder_input_tokens: int = 2048
    dcp_world_size: int = 1
    disable_hybrid_kv_cache_manager: bool = False
    prefix_match_unit: int | None = None
    has_kv_connector: bool = False

    def __post_init__(self) -> None:
        check_int("block_size", self.block_size, minimum=1)
        mml = self.max_model_len
        if isinstance(mml, str):
            if mml != AUTO:
                raise InvalidFieldError("max_model_len", mml, "a positive int, 'auto', -1 or None")
        elif mml is not None and not (type(mml) is int and (mml == -1 or mml >= 1)):
            raise InvalidFieldError("max_model_len", mml, "a positive int, 'auto', -1 or None")
        check_int("derived_max_model_len", self.derived_max_model_len, minimum=1)
        check_int("max_num_batched_tokens", self.max_num_batched_tokens, minimum=1)
        check_int("max_num_seqs", self.max_num_seqs, minimum=1)
        check_int("max_concurrent_batches", self.max_concurrent_batches, minimum=1)
        check_int("num_gpu_blocks_override", self.num_gpu_blocks_override, minimum=1, allow_none=True)
        check_choice("mamba_cache_mode", self.mamba_cache_mode, ("none", "all", "align"))
        check_int("max_num_encoder_input_tokens", self.max_num_encoder_input_tokens, minimum=0)
        check_int("dcp_world_size", self.dcp_world_size, minimum=1)
        check_int("prefix_match_unit", self.prefix_match_unit, minimum=1, allow_none=True)
        for name in ("enable_prefix_caching", "disable_hybrid_kv_cache_manager", "has_kv_connector"):
            if not isinstance(getattr(self, name), bool):
                raise InvalidFieldError(name, getattr(self, name), "True or False")

    @property
    def auto_fit(self) -> bool:
        """True when the user asked vLLM to fit max_model_len to the pool (``-1``/``auto``)."""
        return self.max_model_len == AUTO or self.max_model_len == -1

    @property
    def resolved_max_model_len(self) -> int:
        """max_model_len before auto-fit: the user's value, else the model's own maximum."""
        if self.max_model_len is None or self.auto_fit:
            return self.derived_max_model_len
        return int(self.max_model_len)

    @property
    def max_in_flight_tokens(self) -> int:
        """Tokens scheduled but not yet settled (:func:`max_in_flight_tokens`)."""
        return max_in_flight_tokens(self.max_num_batched_tokens, self.max_concurrent_batches)

    def with_max_model_len(self, max_model_len: int) -> "EngineConfig":
        """A copy with a concrete max_model_len (what auto-fit does to the real config)."""
        return replace(self, max_model_len=max_model_len)
