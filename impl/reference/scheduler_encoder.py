"""Encoder inputs in the scheduler: the encoder budget and cache that gate how many tokens a
multimodal request schedules (vLLM 0.33.0 ``Scheduler._try_schedule_encoder_inputs`` and
``EncoderCacheManager``).

A request's multimodal items (``Request.mm_features``: a placeholder range of prompt tokens and
an identifier, the item's hash) are encoded whole: a step whose token range overlaps an item must
encode it in the same step unless its output is already in the encoder cache. Two limits decide
whether it can:

- the step's **encoder compute budget** (``max_num_encoder_input_tokens``, embeddings the encoder
  may compute per step, shared by every request of the step), and
- the **encoder cache** (``encoder_cache_size`` embeddings): an entry stays while a request
  references it; unreferenced entries are *freeable* and are evicted oldest-first only when an
  allocation needs their room.

When an item does not fit, the request schedules only the tokens before it (or nothing, when a
prefix-cache hit already passed its start), so the encoder limits change how many KV slots a step
allocates, which requests are admitted (a waiting request whose first chunk is cut to zero is
skipped, not head-of-line blocking) and when. With ``disable_chunked_mm_input`` a chunk that would
end inside an item is cut back to before it.

Modelled for decoder-only models without an EC connector, items whose placeholder tokens are all
embeddings (no ``is_embed`` mask) and a drafter without prefill lookahead (no EAGLE shift);
an identifier reused with another embedding count (a client-provided multimodal UUID reused for
different content) rejects the request: it schedules nothing, and the next ``update_from_output``
finishes it as an error (vLLM ``_reject_on_encoder_cache_embed_mismatch``).

With the V2 model runner the scheduler also tells the workers which items' data to install and
release (vLLM ``_get_encoder_input_updates``): a request sent as new (admitted, or resumed: the V2
runner gets resumed requests as new ones) installs every item its prefix hit does not cover
(``strip_covered_mm_data``); an item encoded again
after a release is installed again; an item not encoded in this step is released once the
request's confirmed progress (computed tokens less in-flight prefill or placeholders) passes it.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

from kvref.impl.request import Request
from kvref.spec.errors import InvalidFieldError, check_int


@dataclass(frozen=True)
class EncoderBudget:
    """The encoder limits vLLM derives at startup (``MultiModalBudget``) for a multimodal model.

    Args:
        encoder_compute_budget: embeddings the encoder may compute per step (vLLM
            ``Scheduler.max_num_encoder_input_tokens``).
        encoder_cache_size: embeddings the encoder cache holds (``EncoderCacheManager.cache_size``).
        disable_chunked_mm_input: ``SchedulerConfig.disable_chunked_mm_input``: never end a chunk
            inside a multimodal item.

    The default (0, 0) is a text-only model's: vLLM builds no budget, so a request carrying
    multimodal items schedules only the tokens before its first item.
    """

    encoder_compute_budget: int = 0
    encoder_cache_size: int = 0
    disable_chunked_mm_input: bool = False

    def __post_init__(self) -> None:
        check_int("encoder_compute_budget", self.encoder_compute_budget, minimum=0)
        check_int("encoder_cache_size", self.encoder_cache_size, minimum=0)
        if not isinstance(self.disable_chunked_mm_input, bool):
            raise InvalidFieldError("disable_chunked_mm_input", self.disable_chunked_mm_input, "True or False")


def num_encoder_embeds(request: Request, input_id: int) -> int:
    """vLLM ``Request.get_num_encoder_embeds``: every placeholder token is an embedding here."""
    return request.mm_features[input_id].mm_position.length


class EncoderCacheManager:
    """vLLM's ``EncoderCacheManager`` bookkeeping, in embeddings (see the module docstring).

    ``cached`` maps an identifier to the requests referencing it (empty: freeable);
    ``freeable`` keeps unreferenced entries oldest first; ``freed`` the identifiers evicted since
    the last :meth:`get_freed_mm_hashes` (what the scheduler output tells the workers to drop).
    """

    def __init__(self, cache_size: int) -> None:
        check_int("cache_size", cache_size, minimum=0)
        self.cache_size = cache_size
        self.num_free_slots = cache_size
        self.num_freeable_slots = cache_size
        self.cached: dict[str, set[str]] = {}
        self.num_embeds_by_hash: dict[str, int] = {}
        self.request_cached_ids: dict[str, set[int]] = {}
        # request id -> identifier -> how many of that request's cached inputs carry it
        self.request_hash_refs: dict[str, dict[str, int]] = {}
        self.freeable: OrderedDict[str, int] = OrderedDict()
        self.freed: list[str] = []

    def check_and_update_cache(self, request: Request, input_id: int) -> bool:
        """Already encoded: reference it (taking it off the freeable list) and say True."""
        mm_hash = request.mm_features[input_id].identifier
        if mm_hash not in self.cached:
            return False
        if not self.cached[mm_hash]:
            self.num_freeable_slots -= self.freeable.pop(mm_hash)
        self.cached[mm_hash].add(request.request_id)
        self._add_cached_input_id(request.request_id, input_id, mm_hash)
        return True

    def can_allocate(self, request: Request, input_id: int, encoder_compute_budget: int,
                     num_embeds_to_schedule: int) -> bool:
        """Room for this item beside the ones this call already picked, evicting the oldest
        freeable entries when the free slots alone are short (the eviction happens here)."""
        num_embeds = num_encoder_embeds(request, input_id)
        if num_embeds > encoder_compute_budget:
            return False
        num_embeds += num_embeds_to_schedule
        if num_embeds <= self.num_free_slots:
            return True
        if num_embeds > self.num_freeable_slots:
            return False
        while num_embeds > self.num_free_slots:
            mm_hash, n = self.freeable.popitem(last=False)
            del self.cached[mm_hash]
            del self.num_embeds_by_hash[mm_hash]
            self.freed.append(mm_hash)
            self.num_free_slots += n
        return True

    def allocate(self, request: Request, input_id: int) -> None:
        mm_hash = request.mm_features[input_id].identifier
        n = num_encoder_embeds(request, input_id)
        self.cached.setdefault(mm_hash, set())
        assert self.num_embeds_by_hash.setdefault(mm_hash, n) == n, f"E1: {mm_hash} cached with another size"
        assert self.num_free_slots >= n and self.num_freeable_slots >= n, "E2: allocation without room"
        self.cached[mm_hash].add(request.request_id)
        self._add_cached_input_id(request.request_id, input_id, mm_hash)
        self.num_free_slots -= n
        self.num_freeable_slots -= n

    def _add_cached_input_id(self, request_id: str, input_id: int, mm_hash: str) -> None:
        ids = self.request_cached_ids.setdefault(request_id, set())
        if input_id in ids:
            return
        ids.add(input_id)
        refs = self.request_hash_refs.setdefault(request_id, {})
        refs[mm_hash] = refs.get(mm_hash, 0) + 1

    def get_cached_num_encoder_embeds(self, request: Request, input_id: int) -> int | None:
        """The embedding count the cache holds for this input's identifier (None: not cached)."""
        return self.num_embeds_by_hash.get(request.mm_features[input_id].identifier)

    def get_cached_input_ids(self, request: Request) -> set[int]:
        return self.request_cached_ids.get(request.request_id, set())

    def free_encoder_input(self, request: Request, input_id: int) -> None:
        """Drop the request's reference to one input. A request repeating an item holds its one
        reference until its last occurrence is freed (else the entry turns evictable while the
        request still needs it)."""
        rid = request.request_id
        mm_hash = request.mm_features[input_id].identifier
        ids = self.request_cached_ids.get(rid)
        if ids is not None and input_id in ids:
            ids.remove(input_id)
            refs = self.request_hash_refs[rid]
            refs[mm_hash] -= 1
            if not refs[mm_hash]:
                del refs[mm_hash]
            if not ids:
                del self.request_cached_ids[rid]
                del self.request_hash_refs[rid]
        if not self.cached.get(mm_hash):
            return  # evicted already, or referenced by nobody
        if mm_hash in self.request_hash_refs.get(rid, ()):
            return
        self.cached[mm_hash].discard(rid)
        if not self.cached[mm_hash]:
            n = self.num_embeds_by_hash[mm_hash]
            self.freeable[mm_hash] = n
            self.num_freeable_slots += n

    def free(self, request: Request) -> None:
        """Every reference the request holds (finish, abort, preemption, failed admission)."""
        for input_id in list(self.get_cached_input_ids(request)):
            self.free_encoder_input(request, input_id)

    def get_freed_mm_hashes(self) -> list[str]:
        """Evicted since the last call, less those allocated again in the same pass."""
        freed = [h for h in self.freed if h not in self.cached]
        self.freed = []
        return freed

    def view(self) -> dict:
        """What the conformance harness compares with vLLM's manager after every operation."""
        return {"num_free_slots": self.num_free_slots, "num_freeable_slots": self.num_freeable_slots,
                "cached": {h: frozenset(r) for h, r in self.cached.items()},
                "freeable": tuple(self.freeable.items()),
                "request_cached_ids": {r: frozenset(i) for r, i in self.request_cached_ids.items()}}

    def check_invariants(self) -> None:
        used = sum(self.num_embeds_by_hash.values())
        assert self.num_free_slots == self.cache_size - used, \
            f"E3: {self.num_free_slots} free slots, {used} of {self.cache_size} embeddings cached"
        unreferenced = {h for h, r in self.cached.items() if not r}
        assert unreferenced == set(self.freeable), "E4: freeable entries are exactly the unreferenced ones"
        assert self.num_freeable_slots == self.num_free_slots + sum(self.freeable.values()), \
            "E4: freeable slots = free slots + unreferenced entries"
        assert set(self.cached) == set(self.num_embeds_by_hash), "E1: sizes for exactly the cached entries"
        for rid, refs in self.request_hash_refs.items():
            for h in refs:
                assert h not in self.cached or rid in self.cached[h], f"E5: {rid} counts {h} without referencing it"


class EncoderState:
    """The scheduler's encoder side: the cache manager plus what the last ``schedule()`` encoded
    (vLLM ``SchedulerOutput.scheduled_encoder_inputs`` / ``free_encoder_mm_hashes``)."""

    def __init__(self, budget: EncoderBudget, use_v2_model_runner: bool = False) -> None:
        if not isinstance(budget, EncoderBudget):
            raise InvalidFieldError("encoder_budget", budget, "an EncoderBudget")
        if not isinstance(use_v2_model_runner, bool):
            raise InvalidFieldError("use_v2_model_runner", use_v2_model_runner, "True or False")
        self.budget = budget
        self.use_v2_model_runner = use_v2_model_runner
        #: V2 runner: request id -> items whose data the workers hold (vLLM _pending_encoder_input_ids)
        self.pending_input_ids: dict[str, set[int]] = {}
        #: V2 runner: the last step's ``encoder_input_updates`` ("install" / "release" per item)
        self.encoder_input_updates: dict[str, dict[int, str]] = {}
        self.manager = EncoderCacheManager(budget.encoder_cache_size)
        self.scheduled_encoder_inputs: dict[str, tuple[int, ...]] = {}
        self.free_encoder_mm_hashes: tuple[str, ...] = ()
        #: requests an identifier's embedding count mismatch rejected since the last update_from_output
        #: (vLLM ``Scheduler.encoder_cache_mismatch_reqs``), finished there as errors
        self.encoder_cache_mismatch_reqs: set[str] = set()

        self.step_budget = budget.encoder_compute_budget  # encoder_compute_budget left in this step
        self.step_inputs: dict[str, list[int]] = {}  # scheduled_encoder_inputs being built

    def start_step(self) -> None:
        self.step_budget = self.budget.encoder_compute_budget
        self.step_inputs = {}

    def try_schedule(self, request: Request, num_computed_tokens: int, num_new_tokens: int
                     ) -> tuple[int, tuple[list[int], list[int], int]]:
        """``num_new_tokens`` cut by the encoder limits, and what :meth:`commit` needs if the
        request is then scheduled (a request without items passes through untouched)."""
        if not request.mm_features or num_new_tokens <= 0:
            return num_new_tokens, ([], [], self.step_budget)
        inputs, num_new_tokens, left, duplicates = try_schedule_encoder_inputs(
            self, request, num_computed_tokens, num_new_tokens, self.step_budget)
        return num_new_tokens, (inputs, duplicates, left)

    def commit(self, request: Request, pending: tuple[list[int], list[int], int]) -> None:
        """The request got its KV slots: its inputs are encoded in this step."""
        inputs, duplicates, left = pending
        if inputs:
            self.step_inputs[request.request_id] = inputs
            self.step_budget = left
            allocate_encoder_inputs(self, request, inputs, duplicates)

    def unschedule(self, request: Request) -> None:
        """PRIORITY: a request scheduled earlier in this step is preempted; its inputs give their
        compute budget back (its cache references go with the preemption)."""
        inputs = self.step_inputs.pop(request.request_id, None)
        if inputs:
            self.step_budget += sum(num_encoder_embeds(request, i) for i in inputs)

    def end_step(self, scheduled: list[Request] = (), new_requests: list[Request] = ()) -> None:
        """Close the step: its encoder inputs, evictions and (V2 runner) the workers' updates for
        the ``scheduled`` requests, ``new_requests`` among them sent as new ones; called before the
        step advances their computed tokens, as vLLM builds its output first."""
        self.scheduled_encoder_inputs = {r: tuple(i) for r, i in self.step_inputs.items()}
        self.free_encoder_mm_hashes = tuple(self.manager.get_freed_mm_hashes())
        self.encoder_input_updates = (encoder_input_updates(self, scheduled, new_requests)
                                      if self.use_v2_model_runner else {})

    def forget(self, request: Request) -> None:
        """Preempted or finished: its cache references go, and the workers drop its items."""
        self.manager.free(request)
        self.pending_input_ids.pop(request.request_id, None)

    def view(self) -> dict:
        return {"cache": self.manager.view(), "scheduled_encoder_inputs": dict(self.scheduled_encoder_inputs),
                "free_encoder_mm_hashes": self.free_encoder_mm_hashes,
                "encoder_input_updates": {r: dict(u) for r, u in self.encoder_input_updates.items()}}


def features_in_window(request: Request, start: int, end: int) -> range:
    """vLLM ``get_mm_features_in_window``: the items overlapping tokens ``[start, end)``."""
    feats = request.mm_features
    lo = next((i for i, f in enumerate(feats) if f.mm_position.offset + f.mm_position.length > start), len(feats))
    hi = next((i for i, f in enumerate(feats) if f.mm_position.offset >= end), len(feats))
    return range(lo, hi)


def try_schedule_encoder_inputs(state: EncoderState, request: Request, num_computed_tokens: int,
                                num_new_tokens: int, encoder_compute_budget: int
                                ) -> tuple[list[int], int, int, list[int]]:
    """vLLM ``_try_schedule_encoder_inputs``: ``(inputs to encode, num_new_tokens cut to what the
    encoder limits allow, the budget left, inputs repeated within this call)``.

    Items are taken in order; the first one that can neither be found in the cache nor be
    allocated stops the walk and cuts the range to end before it (nothing, if the computed
    tokens are already past its start: a prefix hit into an item not encoded).
    """
    if num_new_tokens == 0 or not request.mm_features:
        return [], num_new_tokens, encoder_compute_budget, []
    manager = state.manager
    to_schedule: list[int] = []
    duplicates: list[int] = []
    scheduled_hashes: dict[str, int] = {}  # identifier -> embeddings, picked by this call
    num_embeds_to_schedule = 0
    end = num_computed_tokens + num_new_tokens
    for i in features_in_window(request, num_computed_tokens, end):
        feature = request.mm_features[i]
        start_pos, length = feature.mm_position.offset, feature.mm_position.length
        if (state.budget.disable_chunked_mm_input and num_computed_tokens <= start_pos
                and end < start_pos + length):
            # the chunk would split the item: stop before it (`<=`: starting at it splits it too)
            num_new_tokens = max(0, start_pos - num_computed_tokens)
            break
        n = num_encoder_embeds(request, i)
        if feature.identifier in scheduled_hashes:
            if scheduled_hashes[feature.identifier] != n:
                return _reject_mismatch(state, request, encoder_compute_budget)
            duplicates.append(i)  # the same item earlier in this request, encoded once
            continue
        cached = manager.get_cached_num_encoder_embeds(request, i)
        if cached is not None and cached != n:
            return _reject_mismatch(state, request, encoder_compute_budget)
        if manager.check_and_update_cache(request, i):
            continue  # encoded by an earlier step (of this request or another)
        if not manager.can_allocate(request, i, encoder_compute_budget, num_embeds_to_schedule):
            num_new_tokens = min(num_new_tokens, start_pos - num_computed_tokens) \
                if num_computed_tokens < start_pos else 0
            break
        num_embeds_to_schedule += n
        encoder_compute_budget -= n
        scheduled_hashes[feature.identifier] = n
        to_schedule.append(i)
    return to_schedule, num_new_tokens, encoder_compute_budget, duplicates


def _reject_mismatch(state: EncoderState, request: Request, encoder_compute_budget: int
                     ) -> tuple[list[int], int, int, list[int]]:
    """vLLM ``_reject_on_encoder_cache_embed_mismatch``: an identifier this step already encodes,
    or the cache holds, with another embedding count than this input's (a client-provided UUID
    reused for different content). Serving it would hand the model the wrong embeddings, so the
    request schedules nothing now and is finished as an error by the next ``update_from_output``.
    Cache references taken for earlier inputs of the call stay until then (as in vLLM)."""
    state.encoder_cache_mismatch_reqs.add(request.request_id)
    return [], 0, encoder_compute_budget, []


def allocate_encoder_inputs(state: EncoderState, request: Request, input_ids: list[int],
                            duplicate_ids: list[int]) -> None:
    """vLLM ``_allocate_encoder_inputs``, for a request the step scheduled."""
    for i in input_ids:
        state.manager.allocate(request, i)
    for i in duplicate_ids:
        state.manager.check_and_update_cache(request, i)


def free_encoder_inputs(state: EncoderState, request: Request) -> None:
    """vLLM ``_free_encoder_inputs`` (after a step executed): an input whose placeholder range is
    computed, past any output placeholder a rejection could roll back into, is stored in the KV
    cache and needs the encoder cache no more."""
    for i in list(state.manager.get_cached_input_ids(request)):
        pos = request.mm_features[i].mm_position
        if pos.offset + pos.length <= request.num_computed_tokens - request.num_output_placeholders:
            state.manager.free_encoder_input(request, i)


def encoder_input_updates(state: EncoderState, scheduled: list[Request], new_requests: list[Request]
                          ) -> dict[str, dict[int, str]]:
    """vLLM ``_get_encoder_input_updates`` (V2 runner): per scheduled request, the items whose
    data the workers install (``"install"``) or release (``"release"``) in this step."""
    for request in new_requests:
        if request.mm_features:
            # sent with the new request, less the items a prefix hit already covers (vLLM
            # strip_covered_mm_data: no encoder run can be scheduled for those)
            state.pending_input_ids[request.request_id] = {
                i for i, f in enumerate(request.mm_features)
                if f.mm_position.offset + f.mm_position.length > request.num_computed_tokens}
    updates: dict[str, dict[int, str]] = {}
    for request in scheduled:
        pending = state.pending_input_ids.get(request.request_id)
        if pending is None:
            continue
        encoding = state.step_inputs.get(request.request_id, ())
        for i in encoding:
            if i not in pending:
                # a running request rewound (rejected drafts) past a released item: install again
                updates.setdefault(request.request_id, {})[i] = "install"
                pending.add(i)
        # confirmed progress: not the in-flight prefill, not speculative placeholders
        computed = request.num_computed_tokens - max(request.num_output_placeholders, request.num_in_flight_tokens)
        for i in sorted(pending):
            if i in encoding:
                continue
            pos = request.mm_features[i].mm_position
            if pos.offset + pos.length <= computed:
                updates.setdefault(request.request_id, {})[i] = "release"
                pending.remove(i)
    return updates
