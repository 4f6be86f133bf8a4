"""Sparse prefix-cache retention (vLLM 0.33.0 ``prefix_cache_retention_interval``).

Sliding-window and Mamba groups can serve a prefix-cache hit only at a few positions: a window
needs the ``cdiv(window - 1, block_size)`` blocks ending at the hit, Mamba the one state block
ending there. Publishing every block of such a group keeps states nobody will reuse, so vLLM lets
the deployment thin them out (``CacheConfig.prefix_cache_retention_interval``, carried into
``KVCacheConfig``; full-attention and chunked-local groups always cache densely):

* ``None`` — dense: a reachable tail at every cache-hit alignment boundary (``KVCacheConfig``'s
  default, what kvref modelled before);
* ``0`` — only the *semantic* checkpoints: the replay boundaries of the request's prompt
  (:func:`replay_boundaries`) and the shared-prefix junction the scheduler observed
  (``Request.shared_prefix_boundary``, Marconi-style APC); ``CacheConfig``'s default;
* ``k > 0`` (a multiple of ``scheduler_block_size``) — the semantic checkpoints plus one tail per
  ``k``-token segment.

Under ``0`` Mamba reserves a prefill-checkpoint block only on the chunk that reaches the prefill
end (``prefill_end``); otherwise every chunk may export one (vLLM forces ``prefill_end`` to 0).
Source: ``vllm/v1/core/kv_cache_coordinator.py`` (``_validate_prefix_cache_retention_interval``,
``replay_boundaries``) and the managers' ``reachable_block_mask``.
"""

from __future__ import annotations

from collections.abc import Sequence

from .errors import InvalidFieldError, check_int, check_sequence
from .kv_cache_interface import KVCacheGroupSpec, MambaSpec, SlidingWindowSpec


def has_sparse_retention_group(groups: Sequence[KVCacheGroupSpec]) -> bool:
    """Whether some group is sliding-window or Mamba, the only kinds retention thins out. As in
    vLLM the group's own spec is tested (a UniformType group does not count)."""
    check_sequence("groups", groups, "a tuple of KVCacheGroupSpec")
    for i, g in enumerate(groups):
        if not isinstance(g, KVCacheGroupSpec):
            raise InvalidFieldError(f"groups[{i}]", g, "a KVCacheGroupSpec")
    return any(isinstance(g.kv_cache_spec, (SlidingWindowSpec, MambaSpec)) for g in groups)


def validate_prefix_cache_retention_interval(retention_interval: int | None, scheduler_block_size: int,
                                             groups: Sequence[KVCacheGroupSpec]) -> None:
    """Reject what vLLM's coordinator rejects (it raises ``ValueError`` at construction):

    * a non-zero interval on a pool without sliding-window or Mamba groups (it would do nothing);
    * a negative interval, or one that is not a multiple of ``scheduler_block_size`` (retained
      tails must end on real cache-hit boundaries).

    Raises:
        InvalidFieldError: naming ``prefix_cache_retention_interval``.
    """
    check_int("prefix_cache_retention_interval", retention_interval, allow_none=True)
    check_int("scheduler_block_size", scheduler_block_size, minimum=1)
    sparse = has_sparse_retention_group(groups)
    if retention_interval is None:
        return
    if not sparse:
        if retention_interval == 0:
            return
        raise InvalidFieldError("prefix_cache_retention_interval", retention_interval,
                                "0 or None: this pool has no sliding-window or Mamba group, so retention "
                                "has no effect")
    if retention_interval < 0 or retention_interval % scheduler_block_size:
        raise InvalidFieldError("prefix_cache_retention_interval", retention_interval,
                                f"None or a non-negative multiple of scheduler_block_size={scheduler_block_size}")


def replay_boundaries(num_prompt_tokens: int, scheduler_block_size: int, use_eagle: bool) -> tuple[int, ...]:
    """Token positions a later request replaying this prompt can resume at; sparse retention
    keeps the reachable tail ending at each of them (vLLM's function of the same name).

    Without EAGLE: ``num_prompt_tokens - 1`` (a resend's hit stops one short, its last token is
    recomputed for logits). With EAGLE the hit drops a scheduler block, and a resend
    (``(n - 1)`` floored) and a longer sibling (``n`` floored) differ on a block-aligned prompt:
    both are kept, each one block lower.
    """
    check_int("num_prompt_tokens", num_prompt_tokens, minimum=0)
    check_int("scheduler_block_size", scheduler_block_size, minimum=1)
    if not isinstance(use_eagle, bool):
        raise InvalidFieldError("use_eagle", use_eagle, "True or False")
    if not use_eagle:
        return (num_prompt_tokens - 1,)
    block = scheduler_block_size
    resend = (num_prompt_tokens - 1) // block * block
    extension = num_prompt_tokens // block * block
    return tuple(sorted({max(resend - block, 0), max(extension - block, 0)}))
