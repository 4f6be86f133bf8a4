"""Reference sliding-window attention (vLLM ``RSWAManager``, a full-attention manager).

The prompt (text + image) stays visible to every token; of the generated tokens only the last
``rswa_window`` are. So, when the caller passes the prompt length, the blocks wholly inside the
*gap* ``[cdiv(P, bs) * bs, max(P, processed - rswa_window))`` are freed (null placeholders keep
positions) and a request holds O(prompt + window) blocks however long it decodes. Hits and caching
are full attention's: the gap lies after the prompt, and a prefix hit covers prompt tokens.
"""

from __future__ import annotations

from kvref.spec.kv_cache_interface import RSWASpec
from kvref.spec.mathutil import cdiv

from .full_attention_manager import FullAttentionManager


class RSWAManager(FullAttentionManager):
    def __init__(self, kv_cache_spec: RSWASpec, **kwargs) -> None:
        super().__init__(kv_cache_spec, **kwargs)
        self.rswa_window = kv_cache_spec.rswa_window

    def remove_skipped_blocks(self, request_id: str, processed_computed_tokens: int,
                              num_prompt_tokens: int | None = None) -> None:
        """Free the gap blocks (without the prompt length: full attention, nothing to free)."""
        if num_prompt_tokens is None:
            super().remove_skipped_blocks(request_id, processed_computed_tokens, num_prompt_tokens)
            return
        first_gap_block = cdiv(num_prompt_tokens, self.block_size)
        window_start = max(num_prompt_tokens, processed_computed_tokens - self.rswa_window)
        self._remove_blocks_in_range(request_id, first_gap_block, window_start // self.block_size)
