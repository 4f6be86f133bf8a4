"""Partial tails: offloaded states that end on a hash boundary inside a block.

vLLM: ``OffloadingConnectorScheduler._lookup``, ``_lookup_partial_tail``,
``_build_partial_tail_store_jobs`` and the partial-tail branch of ``update_state_after_alloc``
(``kv_connector/v1/offloading/scheduler.py``), ``SchedulerOffloadConfig.from_spec``'s
``supports_partial_tail``.

A Mamba "align" group with blocks wider than the request hashes (``tokens_per_block >
tokens_per_hash``) lets the GPU cache hit at the prompt's last *hash* boundary inside a block: the
state there is copied (COW) into a block of its own and handed to the connector like an aligned
boundary state. The connector turns such a hand-off into one store job holding every group's block
at that boundary: the Mamba group's COW block, and each attention group's table block that holds
the boundary (not yet full). Every key is the request's hash ending at the boundary plus the group
(``make_boundary_key``), so a later lookup finds the tail by the same hash.

Only where one boundary identifies every group's source (``supports_partial_tail``): one block per
offload chunk, one block size for all groups, some Mamba "align" group wider than a hash, every group
full attention or Mamba "align", no decode context parallelism.

EAGLE/MTP drafter groups (vLLM ``_eagle_proof_margins``, ``_partial_tail_key_tokens``): the GPU cache
matches a drafter group a *proof margin* past a hit and drops it (``eagle_proof_margin``: one hash
where hits are fine-grained - always so on these pools, whose groups are full attention and Mamba
"align" - else one block), so the connector keys a drafter group's partial-tail block by the hash
ending ``boundary + margin`` (the tail's own proof), the other groups' by the boundary's. With a
margin the lookup searches two blocks past the complete hit (the complete lookup popped the
drafter's last chunk, and a tail carrying its proof may lie in the block after it: the bridge chunk
is then loaded too), and no boundary whose proof hash the request has not got yet
(``len(block_hashes) * tokens_per_hash - margin``); a tail is stored only by a request that loaded
from the offload tier (one that did not keeps its EAGLE tail in the GPU prefix cache) and only if
this step computes the prompt tokens up to its proof (the hand-off is not offered again).

Lookup: after the complete-chunk lookup, boundaries from the largest allowed down to just past the
complete hit are tried, each needing a HIT for every group's key at that boundary. A boundary in the
block after the complete hit's block also loads that block's complete chunk (the "bridge"): its
attention keys the complete lookup did not confirm are looked up first (a MISS caps the boundary
below the bridge). A pending key makes the request come back later, but only if no complete chunk
hit.

Stores: only hand-offs off the block grid (``boundary % block_size``), all at one boundary per
request and step, within the prompt and ``max_offload_tokens`` (where vLLM reads 0 as "no cap":
``max_offload_tokens or num_prompt_tokens``); a tail past that cap is not stored (vLLM 0.33.0
asserts ``boundary <= max_boundary`` there and the engine dies: a deliberate difference,
docs/differences.md); a request whose table does not reach the boundary's block yet is skipped. The sources are fenced at once (the COW block leaves the request at the next
step, the attention block is still written past the boundary but never before it).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from kvref.spec.mathutil import round_down

from .boundary_stores import Handoffs, make_boundary_key
from .keys import LookupResult, OffloadKey, OffloadStateError

if TYPE_CHECKING:
    from .offloading_scheduler import GroupOffloadConfig, TransferJob, _ReqState


class PartialTails:
    """The partial-tail half of :class:`~.offloading_scheduler.OffloadingConnectorScheduler` (mixed
    into it): the scheduler's groups, hash size, manager, events tracker, request states and job
    bookkeeping (``_register_store_job``) are its own."""

    groups: tuple[GroupOffloadConfig, ...]
    tokens_per_hash: int
    blocks_per_chunk: int
    manager: Any
    events_tracker: Any
    block_hasher: Any
    _req_status: dict
    _chunks_being_loaded: set
    _stats: dict

    def _init_partial_tails(self) -> None:
        """vLLM ``SchedulerOffloadConfig.supports_partial_tail`` (DCP = 1) and
        ``_partial_tail_block_size`` (the first group's block size; 0 without partial tails): one
        block a chunk there, so a block index is a chunk index."""
        groups = self.groups
        self.supports_partial_tail = (
            self.blocks_per_chunk == 1
            and len({c.tokens_per_block for c in groups}) == 1
            and any(c.requires_cow_source and c.tokens_per_block > self.tokens_per_hash for c in groups)
            and all(c.window is None or c.requires_cow_source for c in groups))
        self.partial_tail_block_size = groups[0].tokens_per_block if self.supports_partial_tail else 0
        # vLLM ``_eagle_proof_margins``: per drafter group (not a COW source) of a partial-tail pool;
        # its hits are fine-grained (every group full attention or Mamba "align", one Mamba block
        # wider than a hash: vLLM's ``cache_hit_alignment_tokens`` is the hash size)
        self.eagle_proof_margins = {
            c.group_idx: _eagle_proof_margin(self.partial_tail_block_size, self.tokens_per_hash, True)
            for c in groups if self.supports_partial_tail and c.is_eagle_group and not c.requires_cow_source}
        self.max_eagle_proof_margin = max(self.eagle_proof_margins.values(), default=0)
        # what the partial tails did, for coverage summaries (vLLM keeps no such counts; never
        # compared): tail hits, those loading the bridge chunk too, stores, and stores skipped for
        # the EAGLE margin (request not loaded from the offload tier / proof not computed yet)
        self.partial_tail_counts: Counter = Counter()

    def _lookup_with_partial_tail(self, st: _ReqState, complete_hit: int | None,
                                  hit_ends: Sequence[int]) -> int | None:
        """The hit of ``st``'s lookup (vLLM ``_lookup``): ``complete_hit`` (complete chunks), or a
        partial tail past it (then ``st.partial_tail_boundary`` is set). ``hit_ends``: per group, the
        end of the chunks the complete lookup confirmed (vLLM ``lookup_hit_end_chunk_idx``)."""
        st.partial_tail_boundary = None
        if complete_hit is None or not self.supports_partial_tail:
            return complete_hit
        local = st.num_locally_computed_tokens
        complete_boundary = local + complete_hit
        tph, bs = self.tokens_per_hash, self.partial_tail_block_size
        margin = self.max_eagle_proof_margin
        # with a drafter group the complete lookup popped its last chunk: a tail carrying its own
        # proof may lie in the block after it, so two blocks are searched
        max_boundary = min(st.req.num_prompt_tokens - 1, complete_boundary + (2 if margin else 1) * bs - 1)
        if margin:  # the proof key needs a hash of this request past the boundary
            max_boundary = min(max_boundary, len(self.block_hasher(st.req)) * tph - margin)
        if st.max_load_tokens is not None:
            max_boundary = min(max_boundary, local + st.max_load_tokens)
        max_boundary = round_down(max_boundary, tph)
        if max_boundary <= complete_boundary:
            return complete_hit
        # A boundary past the complete hit's block also loads that block's chunk (the "bridge").
        # Without EAGLE proof margins a hit ends at most a block minus a hash past a chunk-aligned
        # complete boundary, so this is reached only from an unaligned local hit; with them it is
        # the common case (the drafter's popped chunk is the bridge).
        bridge_chunk_idx = complete_boundary // bs
        bridge_boundary = (bridge_chunk_idx + 1) * bs
        unconfirmed: list[tuple[GroupOffloadConfig, OffloadKey]] = []
        pending = False
        if max_boundary >= bridge_boundary:
            for c, g in zip(self.groups, st.groups):
                if c.requires_cow_source:
                    continue
                key = g.offload_keys[bridge_chunk_idx]
                pending |= key in self._chunks_being_loaded
                if hit_ends[c.group_idx] <= bridge_chunk_idx:
                    unconfirmed.append((c, key))
            for _, key in unconfirmed:
                result = self.manager.lookup(key, st.ctx)
                if result is LookupResult.MISS:
                    max_boundary = bridge_boundary - tph
                    break
                pending |= result is not LookupResult.HIT
        bridge_pending = pending
        for boundary in range(max_boundary, complete_boundary, -tph):
            loads_bridge = boundary >= bridge_boundary
            hit, boundary_pending = self._lookup_partial_tail(st, boundary, loads_bridge and bridge_pending)
            if hit:
                if loads_bridge:  # the complete lookup recorded the bridge keys it confirmed itself
                    for c, key in unconfirmed:
                        self.events_tracker.record_lookup(key, self._snapshot(st, c, bridge_chunk_idx))
                st.partial_tail_boundary = boundary
                self.partial_tail_counts["tail_hits"] += 1
                self.partial_tail_counts["bridge_hits"] += loads_bridge
                return boundary - local
            pending |= boundary_pending
        if pending and complete_hit == 0:
            return None
        return complete_hit

    def _lookup_partial_tail(self, st: _ReqState, boundary: int, bridge_pending: bool) -> tuple[bool, bool]:
        """(hit, pending) of every group's key at ``boundary`` (vLLM ``_lookup_partial_tail``): a hit
        needs all of them ready; the lookup stops at the first MISS; pending if a key looked up
        before it (or the bridge) is not ready yet."""
        pending = bridge_pending
        found: list[tuple[GroupOffloadConfig, OffloadKey]] = []
        for c in self.groups:
            key = self._partial_tail_key(st, c, boundary)
            result = self.manager.lookup(key, st.ctx)
            if result is LookupResult.MISS:
                return False, pending
            pending |= result is not LookupResult.HIT
            found.append((c, key))
        if pending:
            return False, True
        for c, key in found:
            self.events_tracker.record_partial_lookup(key, self._partial_snapshot(st, c, boundary))
        return True, False

    def _partial_tail_key(self, st: _ReqState, c: GroupOffloadConfig, boundary: int) -> OffloadKey:
        """Group ``c``'s key of ``st``'s partial tail at ``boundary``: the hash ending at the
        boundary, a drafter group's at its proof past it (vLLM ``_partial_tail_key_tokens``)."""
        return make_boundary_key(self.block_hasher(st.req), c.group_idx, self._partial_tail_key_tokens(c, boundary),
                                 self.tokens_per_hash, st.ctx)

    def _partial_tail_key_tokens(self, c: GroupOffloadConfig, boundary: int) -> int:
        """The token position whose hash keys group ``c``'s partial-tail block at ``boundary``."""
        return boundary + self.eagle_proof_margins.get(c.group_idx, 0)

    def _partial_snapshot(self, st: _ReqState, c: GroupOffloadConfig, boundary: int):
        t = self.events_tracker
        if not t.enabled:
            return None
        return t.snapshot_partial_tail(self.block_hasher(st.req), st.req.all_token_ids, c.group_idx,
                                       c.window is not None, c.tokens_per_chunk, self.tokens_per_hash,
                                       self._partial_tail_key_tokens(c, boundary))

    def _build_partial_tail_store_jobs(self, handoffs: Handoffs,
                                       num_scheduled_tokens: dict[str, int]) -> dict[int, TransferJob]:
        """One store job per request with a hand-off off the block grid (vLLM's loop in
        ``_build_partial_tail_store_jobs``), job ids after the aligned boundary stores'.
        ``num_scheduled_tokens``: this step's tokens per request (a drafter's proof must be computed
        by the end of the step)."""
        out: dict[int, TransferJob] = {}
        if not self.supports_partial_tail:
            return out
        bs = self.partial_tail_block_size
        cow_groups = {c.group_idx for c in self.groups if c.requires_cow_source}
        for rid, entries in handoffs.items():
            entries = [e for e in entries if e[2] % bs]
            if not entries:
                continue
            st = self._req_status.get(rid)
            if st is None:
                raise OffloadStateError(f"boundary_state_offloads: a partial tail of request {rid!r}, which the "
                                        "connector does not track")
            if self.max_eagle_proof_margin and not st.loaded_from_offload:
                self.partial_tail_counts["unloaded_skips"] += 1
                continue  # it keeps its EAGLE tail in the GPU prefix cache (vLLM skips the store)
            boundaries = {b for _, _, b in entries}
            if len(boundaries) != 1:
                raise OffloadStateError(f"boundary_state_offloads: request {rid!r} hands over partial tails at "
                                        f"{sorted(boundaries)} in one step (one boundary expected)")
            boundary = boundaries.pop()
            req = st.req
            # vLLM reads a max_offload_tokens of 0 as "no cap" here (``or``)
            max_boundary = min(req.num_prompt_tokens, st.max_offload_tokens or req.num_prompt_tokens)
            if boundary % self.tokens_per_hash:
                raise OffloadStateError(f"boundary_state_offloads: request {rid!r}'s partial tail at {boundary} is "
                                        f"off the hash grid ({self.tokens_per_hash} tokens)")
            if boundary > max_boundary:
                # past the request's max_offload_tokens: not stored (vLLM 0.33.0 asserts here and the
                # engine dies; docs/differences.md)
                continue
            if self.max_eagle_proof_margin and not self._proof_computed(st, boundary, num_scheduled_tokens):
                self.partial_tail_counts["proof_skips"] += 1
                continue
            cow_blocks = {g: bid for g, bid, _ in entries}
            if not cow_groups <= cow_blocks.keys():
                raise OffloadStateError(f"boundary_state_offloads: request {rid!r}'s partial tail lacks a state "
                                        f"of group(s) {sorted(cow_groups - cow_blocks.keys())}")
            block_idx = boundary // bs
            if any(c.group_idx not in cow_groups and block_idx >= len(st.groups[c.group_idx].block_ids)
                   for c in self.groups):
                continue  # the table does not reach the boundary's block yet
            keys = [self._partial_tail_key(st, c, boundary) for c in self.groups]
            block_ids = [cow_blocks[c.group_idx] if c.group_idx in cow_groups
                         else st.groups[c.group_idx].block_ids[block_idx] for c in self.groups]
            if 0 in block_ids:
                raise OffloadStateError(f"request {rid!r}'s partial tail at {boundary} has a null source block")
            res = self.manager.prepare_store(keys, st.ctx)
            if res is None:
                self._stats["allocation_failures"] += 1
                continue
            if not res.keys_to_store:
                continue
            for c, key in zip(self.groups, keys):
                if key in res.keys_to_store:
                    self.events_tracker.record_store(key, self._partial_snapshot(st, c, boundary))
            by_key = {key: i for i, key in enumerate(keys)}
            sources = [block_ids[by_key[key]] for key in res.keys_to_store]
            job, transfer = self._register_store_job(st, res, sources)  # its sources fenced from creation
            out[job] = transfer
            self.partial_tail_counts["tail_stores"] += 1
        return out

    def _proof_computed(self, st: _ReqState, boundary: int, num_scheduled_tokens: dict[str, int]) -> bool:
        """Whether the drafter's proof of a tail at ``boundary`` is computed by the end of this step
        (vLLM: the COW hand-off arrives on the step that computes the prompt past the boundary and
        is not offered again; workers store after this step's forward, so this step's prompt tokens
        count)."""
        req = st.req
        after = min(req.num_computed_tokens + num_scheduled_tokens.get(req.request_id, 0), req.num_prompt_tokens)
        return boundary + self.max_eagle_proof_margin <= after


def _eagle_proof_margin(block_size: int, tokens_per_hash: int, fine_grained_lookup: bool) -> int:
    """Tokens the GPU cache matches an EAGLE group past a hit before dropping them (vLLM 0.33.0
    ``kv_cache_utils.eagle_proof_margin``): one hash where lookups are fine-grained and blocks wider
    than a hash, else one block."""
    return tokens_per_hash if fine_grained_lookup and block_size > tokens_per_hash else block_size
