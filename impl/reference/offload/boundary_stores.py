"""Stores of Mamba "align" boundary states: the OffloadingConnector's aligned-boundary store jobs.

vLLM: ``OffloadingConnectorScheduler._build_aligned_boundary_store_jobs`` and ``_make_boundary_key``
(``kv_connector/v1/offloading/scheduler.py``), fed by the GPU cache's boundary-state hand-offs
(``KVCacheManager.take_boundary_state_offloads``, ``SchedulerOutput.kv_connector_block_state``).

A Mamba group in "align" mode keeps one recurrent state per block boundary, in a block the request's
table does not hold for long (the state before the last computed token is all it keeps). The
connector therefore never reads these states from its copy of the table: the ordinary store path
skips the group (``requires_cow_source``), and the GPU cache hands each newly cached boundary state
over with its exact block, ``(group, block_id, boundary_tokens)``, in the step that caches it. The
connector stores a hand-off when

* the block is real (not the null block 0),
* the boundary is within what the request may offload (prompt only by default, ``max_offload_tokens``),
* the boundary ends an offload chunk of that group (``boundary % tokens_per_chunk == 0``);

keyed by the request's block hash at the boundary (``hash_idx = boundary // tokens_per_hash - 1``)
and the group. Each accepted state is its own store job whose one source block is fenced at once:
the block can leave the request (and be re-allocated) in the very next step, so a step that
re-allocates it must flush (wait for) the copy — otherwise the CPU chunk keeps another request's
state (the partial-tail corruption class of bugs). A full manager counts an allocation failure;
an already stored (or already offered) key makes no job.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

from kvref.spec.errors import InvalidFieldError, check_int

from .keys import OffloadKey, RequestContext, make_offload_key

#: ``{request_id: [(group_id, block_id, boundary_tokens), ...]}`` as the GPU cache hands them over
Handoffs = Mapping[str, Sequence[tuple[int, int, int]]]


def check_handoffs(handoffs: object) -> None:
    """A mapping request id -> list of ``(group_id, block_id, boundary_tokens)`` non-negative ints."""
    if not isinstance(handoffs, Mapping):
        raise InvalidFieldError("boundary_state_offloads", handoffs,
                                "a dict request id -> [(group_id, block_id, boundary_tokens), ...]")
    for rid, entries in handoffs.items():
        if not isinstance(rid, str) or not isinstance(entries, (list, tuple)):
            raise InvalidFieldError(f"boundary_state_offloads[{rid!r}]", entries,
                                    "a list of (group_id, block_id, boundary_tokens)")
        for e in entries:
            if not isinstance(e, (list, tuple)) or len(e) != 3:
                raise InvalidFieldError(f"boundary_state_offloads[{rid!r}]", e, "(group_id, block_id, boundary_tokens)")
            for name, v in zip(("group_id", "block_id", "boundary_tokens"), e):
                check_int(f"boundary_state_offloads[{rid!r}].{name}", v, minimum=0)


def make_boundary_key(block_hashes: Sequence[bytes], group_idx: int, boundary_tokens: int, tokens_per_hash: int,
                      ctx: RequestContext) -> OffloadKey:
    """The key of a group's state at ``boundary_tokens`` (vLLM ``_make_boundary_key``): the request's
    hash ending there plus the group; its position is recorded in the request's context."""
    check_int("tokens_per_hash", tokens_per_hash, minimum=1)
    check_int("boundary_tokens", boundary_tokens, minimum=tokens_per_hash)
    if not isinstance(block_hashes, (list, tuple)):
        raise InvalidFieldError("block_hashes", block_hashes, "the request's block hashes (a list of bytes)")
    if not isinstance(ctx, RequestContext):
        raise InvalidFieldError("ctx", ctx, "a RequestContext")
    hash_idx = boundary_tokens // tokens_per_hash - 1
    if hash_idx >= len(block_hashes):
        raise InvalidFieldError("boundary_tokens", boundary_tokens,
                                f"<= {len(block_hashes) * tokens_per_hash} (the request's hashed tokens)")
    key = make_offload_key(block_hashes[hash_idx], group_idx)
    ctx.set_offload_key_position(key, boundary_tokens)
    return key


def aligned_boundary_stores(handoffs: Handoffs, tokens_per_chunk: Mapping[int, int],
                            max_boundary: Callable[[str], int | None]) -> list[tuple[str, int, int, int]]:
    """The hand-offs worth a store, in hand-off order, as ``(request_id, group_id, block_id,
    boundary_tokens)``: of an offloaded group (``tokens_per_chunk`` by group), a real block, a chunk
    end, within ``max_boundary(request_id)`` (what the request may offload; None = the connector no
    longer tracks the request: its hand-offs are dropped)."""
    check_handoffs(handoffs)
    if not isinstance(tokens_per_chunk, Mapping):
        raise InvalidFieldError("tokens_per_chunk", tokens_per_chunk, "a dict group id -> tokens per chunk")
    for g, tpc in tokens_per_chunk.items():
        check_int(f"tokens_per_chunk[{g!r}]", tpc, minimum=1)
    if not callable(max_boundary):
        raise InvalidFieldError("max_boundary", max_boundary, "a callable request id -> int or None")
    out = []
    for rid, entries in handoffs.items():
        limit = max_boundary(rid)
        if limit is None:
            continue
        for group_idx, block_id, boundary in entries:
            tpc = tokens_per_chunk.get(group_idx)
            if tpc is None or block_id == 0 or boundary > limit or boundary % tpc:
                continue
            out.append((rid, group_idx, block_id, boundary))
    return out
