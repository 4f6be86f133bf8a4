"""How many offloaded tokens a request can load: the OffloadingConnector's lookup.

vLLM: ``OffloadingConnectorScheduler._maximal_prefix_lookup``, ``_sliding_window_lookup`` and
``_lookup_complete_chunks`` (PR #41228, later renamed blocks -> chunks).

* A full-attention group needs every chunk from the local prefix on: count hits left to right
  until the first MISS.
* A sliding-window (or chunked-local, or Mamba) group only needs the last ``window`` chunks before
  the hit boundary: scan from the *right* for the rightmost run of ``window`` consecutive hits; a
  MISS (or RETRY) breaks the run. With no full window anywhere, fall back to the run that touches
  the start (a short prefix still loads everything it needs).
* HIT_PENDING counts as a hit but makes the answer "not yet" (None, ask again next step);
  RETRY likewise. The scan does not stop there, so an asynchronous tier sees every key.
* Groups are looked up FA first, then SW by window size descending. A group can only shrink the
  boundary; when it does, sliding-window groups already checked must be re-checked against the
  new boundary (a window that ended at the old boundary may not end at the new one), so the loop
  runs to a fixed point.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

from kvref.spec.errors import InvalidFieldError, check_int
from kvref.spec.mathutil import cdiv

from .keys import LookupResult, OffloadKey

Lookup = Callable[[OffloadKey], LookupResult]


def _check_lookup(keys: object, lookup: object) -> None:
    """O(1): a list of keys and a callable (the keys themselves go to ``lookup`` as they are)."""
    if not isinstance(keys, (list, tuple)):
        raise InvalidFieldError("keys", keys, "a list of offload keys")
    if not callable(lookup):
        raise InvalidFieldError("lookup", lookup, "a callable key -> LookupResult")


def _check_groups(groups: object) -> None:
    if not isinstance(groups, (list, tuple)) or not all(isinstance(g, LookupGroup) for g in groups):
        raise InvalidFieldError("groups", groups, "a list of LookupGroup")


def maximal_prefix_lookup(keys: Sequence[OffloadKey], lookup: Lookup) -> int | None:
    """Consecutive hits from the start (until the first MISS), or None if any looked-up key
    was pending or RETRY."""
    _check_lookup(keys, lookup)
    hits, defer = 0, False
    for key in keys:
        r = lookup(key)
        if r is LookupResult.MISS:
            break
        if r is LookupResult.RETRY:
            defer = True
        else:
            hits += 1
            defer |= r is LookupResult.HIT_PENDING
    return None if defer else hits


def sliding_window_lookup(keys: Sequence[OffloadKey], window: int, lookup: Lookup,
                          initial_window: int | None = None) -> int | None:
    """End index (exclusive, in ``keys``) of the rightmost run of ``window`` hits.

    The first run counted (touching the right edge) may need ``initial_window`` hits (a right
    edge that is not chunk aligned widens what the window covers); any gap resets to ``window``.
    Returns the length of the run touching index 0 when no run is long enough, and None when a
    RETRY was seen anywhere or the deciding run holds a pending chunk.
    """
    _check_lookup(keys, lookup)
    check_int("window", window, minimum=1)
    check_int("initial_window", initial_window, minimum=1, allow_none=True)
    defer = pending = False
    run = 0
    need = initial_window or window
    for idx in range(len(keys) - 1, -1, -1):
        r = lookup(keys[idx])
        if r is LookupResult.HIT or r is LookupResult.HIT_PENDING:
            run += 1
            pending |= r is LookupResult.HIT_PENDING
        else:
            defer |= r is LookupResult.RETRY
            run, pending, need = 0, False, window
        if run == need:
            return None if defer or pending else idx + need
    return None if defer or pending else run


@dataclass(frozen=True)
class LookupGroup:
    """What the lookup needs to know about one offloaded KV cache group.

    ``window`` is ``get_sliding_window_size_in_chunks`` (None = full attention).
    ``sliding_window`` / ``extra_retained_tokens`` are set for SlidingWindowSpec groups only: they
    widen the window when the hit's right edge is not chunk aligned
    (``GroupOffloadConfig.load_window_size_in_chunks``).
    ``eagle``: the group holds EAGLE/MTP drafter layers (vLLM ``is_eagle_group``): its trailing hit
    chunk is volatile, so it is looked up one chunk further and that chunk popped (issue #52735).
    """

    tokens_per_chunk: int
    window: int | None = None
    sliding_window: int | None = None
    extra_retained_tokens: int = 0
    eagle: bool = False

    def __post_init__(self) -> None:
        check_int("tokens_per_chunk", self.tokens_per_chunk, minimum=1)
        check_int("window", self.window, minimum=1, allow_none=True)
        check_int("sliding_window", self.sliding_window, minimum=1, allow_none=True)
        check_int("extra_retained_tokens", self.extra_retained_tokens, minimum=0)
        if not isinstance(self.eagle, bool):
            raise InvalidFieldError("eagle", self.eagle, "True or False")

    def load_window(self, num_tokens: int) -> int | None:
        check_int("num_tokens", num_tokens, minimum=0)
        w = self.window
        if self.sliding_window is not None:
            pad = -num_tokens % self.tokens_per_chunk
            w = max(w, cdiv(self.sliding_window - 1 + self.extra_retained_tokens + pad, self.tokens_per_chunk))
        return w


def lookup_order(groups: Sequence[LookupGroup]) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(full-attention group indices, windowed group indices by window size descending)."""
    _check_groups(groups)
    fa = tuple(i for i, g in enumerate(groups) if g.window is None)
    sw = sorted((i for i, g in enumerate(groups) if g.window is not None), key=lambda i: groups[i].window,
                reverse=True)
    return fa, tuple(sw)


def lookup_complete_chunks(groups: Sequence[LookupGroup], group_keys: Sequence[Sequence[OffloadKey]],
                           num_tokens: int, num_computed_tokens: int, lookup: Lookup,
                           chunks_being_loaded: set[OffloadKey] | None = None,
                           max_num_new_tokens: int | None = None, max_load_tokens: int | None = None,
                           mamba_align_size: int | None = None, hit_ends: list[int] | None = None) -> int | None:
    """Tokens beyond ``num_computed_tokens`` loadable from offloaded chunks, 0 for none, None
    to ask again later (pending writes, or a chunk another request is loading right now — see
    vLLM PR 29087). ``max_load_tokens`` (the request's ``kv_transfer_params`` cap) limits the hit
    and makes every group's boundary chunk aligned. ``mamba_align_size`` (a Mamba "align" group's
    chunk, vLLM ``resolve_mamba_align_size``): the hit ends on a multiple of it, where a state was
    stored. ``hit_ends`` (one int per group, filled in): where each full-attention group's last
    prefix lookup confirmed hits to (a chunk index; vLLM ``lookup_hit_end_chunk_idx``, which the
    partial-tail lookup reads), 0 for the others.

    An EAGLE group (``LookupGroup.eagle``) not yet verified in this round is queried one chunk
    past the boundary (a window one chunk longer), and its last hit chunk is popped: the drafter's
    KV of the last position may be rewritten, so a hit never ends on it, and the widened query
    keeps the pop from pushing the boundary under a coarser group's chunk (vLLM #52735). It stays
    verified until a non-EAGLE group tightens the boundary."""
    _check_groups(groups)
    if not isinstance(group_keys, (list, tuple)) or len(group_keys) != len(groups):
        raise InvalidFieldError("group_keys", group_keys, f"{len(groups)} lists of offload keys, one per group")
    for keys in group_keys:
        _check_lookup(keys, lookup)
    check_int("num_tokens", num_tokens, minimum=0)
    check_int("num_computed_tokens", num_computed_tokens, minimum=0)
    check_int("max_num_new_tokens", max_num_new_tokens, minimum=0, allow_none=True)
    check_int("max_load_tokens", max_load_tokens, minimum=0, allow_none=True)
    check_int("mamba_align_size", mamba_align_size, minimum=1, allow_none=True)
    if hit_ends is not None and (not isinstance(hit_ends, list) or len(hit_ends) != len(groups)):
        raise InvalidFieldError("hit_ends", hit_ends, f"None or a list of {len(groups)} ints (filled in)")
    if hit_ends is not None:
        hit_ends[:] = [0] * len(groups)
    if chunks_being_loaded is not None and not isinstance(chunks_being_loaded, (set, frozenset)):
        raise InvalidFieldError("chunks_being_loaded", chunks_being_loaded, "a set of offload keys or None")
    fa, sw = lookup_order(groups)
    all_groups = fa + sw
    max_hit = num_tokens
    if max_num_new_tokens is not None:
        max_hit = min(max_hit, num_computed_tokens + max_num_new_tokens)
    if max_load_tokens is not None:
        max_hit = min(max_hit, num_computed_tokens + max_load_tokens)
    if sw:
        max_hit -= 1  # the last prompt token is recomputed (logprobs) and SW must still hit after that
        if mamba_align_size is not None:
            max_hit -= max_hit % mamba_align_size  # only chunk-end states exist
    num_hit = 0
    defer = False
    todo = all_groups
    verified: set[int] = set()  # EAGLE groups whose volatile chunk this round already popped
    while todo:
        saw_sw = False
        current, todo = todo, ()
        for gi in current:
            g, keys = groups[gi], group_keys[gi]
            tpc = g.tokens_per_chunk
            unverified = g.eagle and gi not in verified
            max_hit = min(max_hit, len(keys) * tpc)
            if max_load_tokens is not None:
                max_hit -= max_hit % tpc  # a capped hit ends on this group's chunk boundary
            if max_hit - num_computed_tokens < tpc:
                return 0
            query_max = min(max_hit + tpc, len(keys) * tpc) if unverified else max_hit
            n_chunks = min(cdiv(query_max, tpc), len(keys))
            start = num_computed_tokens // tpc
            window_keys = keys[start:n_chunks]
            if g.window is None:
                hits = maximal_prefix_lookup(window_keys, lookup)
                if hit_ends is not None:
                    hit_ends[gi] = start + (hits or 0)
            else:
                hits = sliding_window_lookup(window_keys, g.window + unverified, lookup,
                                             g.load_window(min(max_hit, (n_chunks - unverified) * tpc)) + unverified)
            if hits == 0:
                return 0
            if hits is None:
                defer = True
            else:
                if unverified:
                    hits -= 1  # the volatile trailing chunk
                    verified.add(gi)
                max_hit = min(max_hit, tpc * (start + hits))
            new_hit = max_hit - num_computed_tokens
            if new_hit < tpc:
                return 0
            if new_hit < num_hit:
                if not g.eagle:
                    verified.clear()  # a tighter boundary: the EAGLE groups pop again
                if defer:
                    # Re-check everything: the deferral may not matter at the smaller boundary.
                    defer = False
                    todo = all_groups
                elif saw_sw and not todo:
                    todo = sw
            saw_sw |= g.window is not None
            num_hit = new_hit
    if defer:
        return None
    if chunks_being_loaded:
        end = num_computed_tokens + num_hit
        for g, keys in zip(groups, group_keys):
            tpc = g.tokens_per_chunk
            ks = keys[num_computed_tokens // tpc:cdiv(end, tpc)]
            w = g.load_window(end)
            if w is not None:
                ks = ks[-w:]
            if any(k in chunks_being_loaded for k in ks):
                return None
    return num_hit
