"""Which blocks a request still needs, per KV cache group, from the group's spec in the header.

vLLM frees a sliding-window or chunked-local request's blocks behind its attention window without
``schedule()`` saying so: ``KVCacheManager.allocate_slots`` calls ``remove_skipped_blocks`` with the
request's *processed* tokens (computed tokens of steps already settled: ``num_computed_tokens -
num_in_flight_tokens``), and the first ``get_num_skipped_tokens(processed) // block_size`` blocks
become null. A block inside the window is still needed: freeing or reusing it while its holder
runs is the early-free bug class. The run properties use these rules both ways: they free exactly
what vLLM frees at the holder's own allocation (block conservation stays exact) and report any
reuse of a block that lies inside its holder's window (no blanket allowance; issue #28).

The rules, as vLLM 0.33.0 has them (``single_type_kv_cache_manager.py``):

* full attention (and MLA): nothing is skipped;
* sliding window (and DeepSeek-V4.1's ``SlidingWindowMLASpec``, bounded replay or not):
  ``max(0, processed - sliding_window + 1 - extra_retained_tokens)`` tokens;
* chunked local: ``processed // attention_chunk_size * attention_chunk_size`` tokens;
* Mamba: outside ``none`` mode vLLM keeps only the last state block(s) (``1 +
  num_speculative_blocks``); in ``none`` mode a request holds one block for its whole life;
* R-SWA (``RSWASpec``, Unlimited-OCR): not a leading run but the *gap* between the prompt and the
  window of the last ``rswa_window`` generated tokens, table positions ``[cdiv(P, block_size),
  max(P, processed - rswa_window) // block_size)`` with ``P`` the request's prompt length
  (``RSWAManager.remove_skipped_blocks``, given ``num_prompt_tokens`` by ``allocate_slots``). Hits
  and caching are full attention's; a resumed request's hit blocks inside its gap are freed at its
  next allocation, not at admission (``remove_skipped_blocks`` runs before the hit is added);
* circular buffer (``CircularBufferSpec``, DeepSeek-V4.1 / GLM-5-next rings): one block per
  request for its whole life, never hashed, never hit, nothing skipped.

The startup bound a request's held blocks never exceed is the spec's ``admission_cap`` (vLLM
#40946's ``max_admission_blocks_per_request`` for windowed specs), else ``cdiv(max_model_len,
block_size)``.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvref.spec.errors import KVRefError


@dataclass(frozen=True)
class GroupRule:
    """One KV cache group's block rules, read from its recorded spec."""

    kind: str  # "full", "window", "chunk", "mamba", "rswa", "ring", "unknown"
    block_size: int
    window: int = 0  # sliding window (tokens) or attention chunk size
    extra: int = 0  # extra_retained_tokens
    keep_last: int = 0  # Mamba outside "none" mode: state blocks kept at the end
    bound: int | None = None  # the most blocks one request may hold (startup sizing)
    #: sliding window: the full blocks vLLM caches, one segment's tail per this many blocks
    #: (``reachable_block_mask`` under dense retention); 0: every full block
    per_segment: int = 0
    need: int = 0  # ... the last ``need`` blocks of each segment (a hit's contiguous run)
    shift: int = 0  # ... counted from this block (1 with the EAGLE block drop: the peeked block)
    #: False: vLLM never hashes this group's blocks (``prefix_cacheable`` False: a DeepSeek-V4.1
    #: bounded-replay window, per-request scratch), so each freed block goes to the queue's front
    cacheable: bool = True

    def caches(self, idx: int) -> bool:
        """Whether vLLM gives the full block at table position ``idx`` a prefix-cache hash
        (``cache_blocks``): every one but on a sliding-window group whose segments are longer than
        a hit's run, where only each segment's last ``need`` blocks can serve a hit (vLLM 0.33.0
        ``SlidingWindowManager.reachable_block_mask``, dense retention). A block without a hash
        goes to the free queue's front when freed, one with a hash to its back."""
        if not self.cacheable:
            return False
        if not self.per_segment:
            return True
        return idx >= self.shift and (idx - self.shift) % self.per_segment >= self.per_segment - self.need

    def skipped_blocks(self, processed: int) -> int:
        """Leading blocks vLLM frees once ``processed`` tokens are settled (table positions)."""
        if self.kind == "window":
            return max(0, processed - self.window + 1 - self.extra) // self.block_size
        if self.kind == "chunk":
            return (processed // self.window * self.window) // self.block_size
        return 0

    def skipped_range(self, processed: int, prompt_len: int) -> range:
        """The table positions vLLM frees at an allocation once ``processed`` tokens are settled:
        the leading :meth:`skipped_blocks`, or an R-SWA group's gap after a ``prompt_len``-token
        prompt (empty while the prompt is unknown: a trace that starts mid-run)."""
        if self.kind == "rswa":
            if prompt_len <= 0:
                return range(0)
            return range(-(-prompt_len // self.block_size), max(prompt_len, processed - self.window) // self.block_size)
        return range(self.skipped_blocks(processed))

    def needed_from(self, processed: int, table_len: int) -> int:
        """The first table position the holder still needs (positions before it may be freed)."""
        if self.kind == "mamba" and self.keep_last:
            return max(0, table_len - self.keep_last)
        return self.skipped_blocks(processed)

    def needs(self, idx: int, processed: int, table_len: int, prompt_len: int) -> bool:
        """Whether the holder still needs table position ``idx`` (:meth:`needed_from`; an R-SWA
        group needs every position outside its gap)."""
        if self.kind == "rswa":
            return idx not in self.skipped_range(processed, prompt_len)
        return idx >= self.needed_from(processed, table_len)

    @property
    def frees_exactly(self) -> bool:
        """Whether :meth:`skipped_range` is exactly what vLLM frees at an allocation."""
        return self.kind in ("full", "window", "chunk", "rswa", "ring") or (self.kind == "mamba" and not self.keep_last)

    @property
    def holds_tokens(self) -> bool:
        """Whether a block holds the KV of a fixed token range (prefix-cache content is checkable)."""
        return self.kind in ("full", "window", "chunk", "rswa")


def group_rules(header: dict) -> list[GroupRule]:
    """One :class:`GroupRule` per recorded group (``unknown`` where the spec is not modelled)."""
    from .setup import _spec

    pool = header["pool"]
    mift = pool.get("max_in_flight_tokens") or pool["max_model_len"]
    mml = pool["max_model_len"]
    rules = []
    for g in pool["groups"]:
        d = g["spec"]
        bs = d["block_size"]
        try:
            spec = _spec(d)
        except (KVRefError, KeyError, TypeError, ValueError):
            rules.append(GroupRule("unknown", bs))
            continue
        name = type(spec).__name__
        cap = spec.admission_cap(mift, mml) if name != "MambaSpec" else None
        bound = cap if cap is not None else -(-mml // spec.block_size)
        if name == "SlidingWindowMLASpec" and not spec.prefix_cacheable:
            # SWA bounded replay (#28, session 20): freed behind the window as a sliding window is
            # (vLLM runs it with the SlidingWindowManager), never cached
            rules.append(GroupRule("window", spec.block_size, spec.sliding_window, spec.extra_retained_tokens,
                                   bound=bound, cacheable=False))
        elif name in ("SlidingWindowSpec", "SlidingWindowMLASpec"):
            rules.append(GroupRule("window", spec.block_size, spec.sliding_window, spec.extra_retained_tokens,
                                   bound=bound, **_window_mask(pool, g, spec)))
        elif name == "ChunkedLocalAttentionSpec":
            rules.append(GroupRule("chunk", spec.block_size, spec.attention_chunk_size, bound=bound))
        elif name == "RSWASpec":  # full attention's hits, caching and sizing; the gap freed
            rules.append(GroupRule("rswa", spec.block_size, spec.rswa_window, bound=bound))
        elif name == "CircularBufferSpec":  # one ring block per request, never cached
            rules.append(GroupRule("ring", spec.block_size, bound=1, cacheable=False))
        elif name == "MambaSpec":
            keep = 0 if spec.mamba_cache_mode == "none" else 1 + spec.num_speculative_blocks
            rules.append(GroupRule("mamba", spec.block_size, keep_last=keep))
        elif getattr(spec, "sliding_window", None) or getattr(spec, "attention_chunk_size", None):
            rules.append(GroupRule("unknown", spec.block_size))  # a full spec with a window: not modelled here
        else:
            rules.append(GroupRule("full", spec.block_size, bound=bound))
    return rules


def _window_mask(pool: dict, group: dict, spec) -> dict:
    """A sliding-window group's caching segments (:meth:`GroupRule.caches`) as vLLM 0.33.0's
    ``reachable_block_mask`` draws them under dense retention (``prefix_cache_retention_interval``
    None): a segment per ``cache_hit_alignment_tokens``, of which a hit needs the last
    ``cdiv(window - 1, block_size)`` blocks (one more where the manager drops the EAGLE block,
    ``drops_eagle_block``, which also shifts the run one block right). Every block is cached when the run fills a segment or the alignment
    is not a whole number of blocks. {} (every block) where the trace does not say: the free-queue
    check then stays off for the group (``cache_hit_alignment_tokens`` missing: recorded since
    session 18, #28; sparse retention: its shared-prefix junction is not in the trace)."""
    align = group.get("cache_hit_alignment_tokens")
    if not align or pool.get("prefix_cache_retention_interval") is not None:
        return {}
    bs = spec.block_size
    eagle = bool(group.get("drops_eagle_block", False))
    need = -(-(spec.sliding_window - 1) // bs) + int(eagle)
    if align % bs or need >= align // bs:
        return {}
    return {"per_segment": align // bs, "need": need, "shift": int(eagle)}
