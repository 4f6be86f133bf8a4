"""vLLM's own ``Scheduler._mamba_block_aligned_split`` on plain numbers, for conformance.

The method reads a handful of scheduler attributes and four request fields; it is called unbound
with exactly those (a namespace built from :class:`~kvref.impl.reference.scheduler_mamba_split.
MambaSplitConfig`), so vLLM's code runs as is, without building a whole ``Scheduler``.
"""

from __future__ import annotations

from types import SimpleNamespace

from kvref.impl.reference.scheduler_mamba_split import MambaSplitConfig
from kvref.spec.errors import InvalidFieldError


def vllm_mamba_block_aligned_split(config: MambaSplitConfig, num_computed_tokens: int, num_prompt_tokens: int,
                                   num_tokens: int, num_new_tokens: int, num_new_local_computed_tokens: int = 0,
                                   num_external_computed_tokens: int = 0, shared_prefix_boundary: int = 0) -> int:
    """What the installed vLLM's scheduler clips the chunk to (same arguments as the reference's
    :func:`~kvref.impl.reference.scheduler_mamba_split.mamba_block_aligned_split`)."""
    from kvref.impl.vllm.loader import load_vllm

    load_vllm()  # the environment vLLM needs on CPU
    from vllm.v1.core.sched.scheduler import Scheduler

    if not isinstance(config, MambaSplitConfig):
        raise InvalidFieldError("config", config, "a MambaSplitConfig")
    scheduler = SimpleNamespace(
        cache_config=SimpleNamespace(block_size=config.block_size),
        hash_block_size=config.hash_block_size,
        block_size=config.scheduler_block_size or config.block_size,
        mamba_partial_cache_hit=config.partial_cache_hit,
        use_eagle_block_drop=config.use_eagle_block_drop,
        num_hash_lookahead_tokens=config.num_hash_lookahead_tokens,
        mamba_has_prefill_checkpoint_blocks=config.has_prefill_checkpoint_blocks,
        mamba_prefill_checkpoint_alignment=config.checkpoint_alignment,
        max_num_scheduled_tokens=config.max_prefill_tokens,
        scheduler_config=SimpleNamespace(long_prefill_token_threshold=0),
        mamba_shared_prefix_checkpoint=config.shared_prefix_checkpoint,
    )
    request = SimpleNamespace(num_computed_tokens=num_computed_tokens, num_prompt_tokens=num_prompt_tokens,
                              num_tokens=num_tokens, shared_prefix_boundary=shared_prefix_boundary)
    return Scheduler._mamba_block_aligned_split(scheduler, request, num_new_tokens,
                                                num_new_local_computed_tokens, num_external_computed_tokens)
