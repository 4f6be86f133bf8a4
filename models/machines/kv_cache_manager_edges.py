"""Aiming a KV cache manager trace at the pool's edge (issue #13): the functions the rules of
:func:`kvref.models.machines.kv_cache_manager.kv_cache_manager_machine` call to choose operations.

Faults in how a predictor counts blocks (a cap that clamps a step's need, a cap that forgets a
term) and in the order blocks are taken (one group's allocation evicting another group's hits)
change nothing while the pool has blocks to spare: they show only when an operation needs exactly
what is free, or one block more. These functions find that edge on a scratch copy of the reference
(``Harness.probe``) and return only the plain ops chosen, so a saved trace replays without them.
vLLM #33775's setting (a full pool whose free queue holds a later group's hits ahead of a
connector's external blocks) is built the same way.

The rules (what a trace may do, and the oracle after every op) stay in the machine; this module
only chooses arguments (#26: the two were one 900-line function, then a mixin reading the
machine's attributes). Each function takes what it reads: the
:class:`~kvref.models.conformance.differential.Harness` ``h``, Hypothesis' ``data`` where it
draws, the trace's :class:`RequestIds` where it names new requests, the :class:`EdgeCounts` it
adds to, and (the one function that applies ops between its draws) an ``apply`` callback. Draws
happen in a fixed order, so a seed gives the same trace whatever calls these.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from hypothesis import strategies as st

from kvref.models.conformance.differential import Harness
from kvref.models.conformance.trace import Op
from kvref.models.strategies.pools import CACHE_SALTS, tokens_from_seed

#: requests alive at once in a trace (fillers count: the edge functions add at most two)
MAX_LIVE_REQUESTS = 6


class RequestIds:
    """The ids ``r0, r1, ...`` a trace gives its requests, in order of arrival. Aiming builds
    filler ops under the next id on the scratch reference (:meth:`peek`) and takes the id
    (:meth:`take`) only for a filler it keeps, so the ids of a saved trace have no gaps."""

    def __init__(self) -> None:
        self.taken = 0

    def peek(self, ahead: int = 0) -> str:
        return f"r{self.taken + ahead}"

    def take(self) -> str:
        rid = self.peek()
        self.taken += 1
        return rid


@dataclass
class EdgeCounts:
    """Ops aimed at the pool's exact edge in one trace (the machine's stats sum them, issue #13)."""

    #: admissions under the largest reservation that still fits (or one block more)
    reservations: int = 0
    #: steps/admissions after a filler request left them exactly the blocks they need (or one short)
    fills: int = 0
    #: vLLM #33775's connector follow-ups on a pool a filler made full
    full_pool_follow_ups: int = 0


def can_aim(h: Harness | None) -> bool:
    """Aiming probes a scratch copy of the reference: only where the reference is driven."""
    return h is not None and "reference" in h.managers


def fits(h: Harness, ops: list[Op]) -> bool:
    """Every op applies on the scratch reference and none is refused (admission/step None)."""
    probed = h.probe(ops)
    return probed is not None and all(not r.skipped and (r.op.name not in ("admit", "step") or r.value is not None)
                                      for r in probed.probe_results)


def filler(h: Harness, rid: str, seed: int, chunk: int) -> list[Op]:
    """A request nobody shares a prefix with (its own cache salt) of ``max_model_len - 1``
    tokens, admitted with one and stepped to ``chunk``: it holds the blocks of ``chunk``
    tokens and keeps running."""
    length = h.pool_config.max_model_len - 1
    ops = [Op("add", dict(rid=rid, prompt=tokens_from_seed(seed, length), max_tokens=1,
                          cache_salt=f"fill-{rid}")),
           Op("admit", dict(rid=rid, chunk=1, full_sequence_must_fit=False, reserved_blocks=0,
                            in_flight=False, token=0))]
    if chunk > 1:  # a running request's step: the watermark holds back admissions only
        ops.append(Op("step", dict(rid=rid, chunk=chunk - 1, lookahead=0, in_flight=False, token=0)))
    return ops


def fill_to_edge(h: Harness, data, rids: RequestIds, counts: EdgeCounts, then: list[Op],
                 short: bool) -> list[Op]:
    """Filler ops (at most two requests) after which ``then`` still applies with no block to
    spare (``short``: one filler token more, so its last op is refused by about a block): the
    edge where a predictor that under-counts a step's or an admission's blocks makes vLLM raise
    mid-allocation instead of refusing. ``then`` empty: fill the pool as full as fillers can.
    [] when no filler fits first."""
    longest = h.pool_config.max_model_len - 2  # filler chunks: 1..longest
    if longest < 1 or len(h.live()) + 2 > MAX_LIVE_REQUESTS:
        return []
    prefix: list[Op] = []
    seed = data.draw(st.integers(0, 2**16), label="filler_seed")
    for _ in range(2):
        rid = rids.peek()
        if not fits(h, prefix + filler(h, rid, seed, 1) + then):
            return prefix
        rids.take()
        if fits(h, prefix + filler(h, rid, seed, longest) + then):
            prefix += filler(h, rid, seed, longest)  # room left: a second filler
            continue
        lo, hi = 1, longest  # fits at lo, not at hi
        while hi - lo > 1:
            mid = (lo + hi) // 2
            if fits(h, prefix + filler(h, rid, seed, mid) + then):
                lo = mid
            else:
                hi = mid
        if short and then and fits(h, prefix + filler(h, rid, seed, hi)):
            lo = hi  # the filler still fits, what follows it is refused
        counts.fills += 1
        return prefix + filler(h, rid, seed, lo)
    return prefix


def edge_reserved(h: Harness, op: Op, short: bool, counts: EdgeCounts) -> int | None:
    """The largest ``reserved_blocks`` under which admission ``op`` still succeeds on the
    reference (``short``: one more, so it is refused by a block); None if it never fits. The
    admission check then decides by one block: a cap that clamps or forgets a term shows there.

    A request being admitted holds no blocks, so nothing is freed first: the blocks its
    admission takes (new ones and touched hits that sat in the free queue) are what the
    check counted. One probe finds them; a search only where the probe ends the request."""
    pc = h.pool_config
    free = h.managers[h.kinds[0]].get_num_free_blocks()

    def probe(reserved: int) -> Harness | None:
        scratch = h.probe([Op("admit", {**op.args, "reserved_blocks": reserved, "reserve_slack": -1})])
        return scratch if scratch is not None and scratch.probe_results[0].value is not None else None

    scratch = probe(0)
    if scratch is None:
        return None
    if scratch.reqs[op.rid].holds_blocks:
        watermark = int(pc.watermark * pc.num_blocks) if h.running() else 0
        edge = free - (free - scratch.managers["reference"].get_num_free_blocks()) - watermark
    else:  # admitted, ran to its end and freed everything: search
        lo, hi = 0, free + 1  # fits at lo, not at hi
        while hi - lo > 1:
            mid = (lo + hi) // 2
            lo, hi = (mid, hi) if probe(mid) is not None else (lo, mid)
        edge = lo
    counts.reservations += 1
    return max(0, edge + short)


def full_pool_follow_up(h: Harness, data, rids: RequestIds, counts: EdgeCounts,
                        apply: Callable[[list[Op]], None]) -> None:
    """vLLM #33775's setting, built from an empty pool (every live request finishes first):
    a request's prompt is computed and cached on every group; fillers take the free blocks;
    it finishes (its cached blocks to the free queue's tail in group order, its uncached
    ones to the head), then the fillers (their cached blocks behind: room for what
    follows); a drain request takes what sits ahead of its cached blocks; a request sharing
    that prompt is admitted with a long tail a KV connector claims. The first group's
    external blocks then come from the queue's head, which (once that group's own hits are
    touched) holds the later groups' hits. ``apply`` runs ops on every implementation (the
    machine's oracle after each); ``h`` follows them."""
    pc = h.pool_config
    sbs = pc.scheduler_block_size
    limit = max(1, min(pc.max_model_len - 1, 64))
    apply([Op("finish", dict(rid=r)) for r in reversed(h.live())])
    first = h.managers[h.kinds[0]]
    base_rid = rids.take()
    base_seed = data.draw(st.integers(0, 2**16), label="base_seed")
    salt = data.draw(CACHE_SALTS)

    def base_ops(blocks: int) -> list[Op]:
        return [Op("add", dict(rid=base_rid, prompt=tokens_from_seed(base_seed, blocks * sbs + 1), max_tokens=8,
                               cache_salt=salt)),
                Op("admit", dict(rid=base_rid, chunk=blocks * sbs, full_sequence_must_fit=False,
                                 reserved_blocks=0, in_flight=False, token=0))]

    # a block-aligned computed prompt (no uncached last block), a third to half of what fits
    most = max(1, (limit - 1) // sbs)
    blocks = next((b for b in range(most, 0, -1) if fits(h, base_ops(b))), 0)
    if blocks < 2:
        return
    apply(base_ops(max(2, blocks * data.draw(st.sampled_from((1, 2, 2, 3)), label="share") // 6)))
    base = h.reqs[base_rid].request
    shared = list(base.all_token_ids[:base.num_computed_tokens])
    base_blocks = {b for group in first.get_block_ids(base_rid) for b in group if b}
    fillers = fill_to_edge(h, data, rids, counts, [], short=False)
    apply(fillers)
    apply([Op("finish", dict(rid=base_rid))])
    apply([Op("finish", dict(rid=op.rid)) for op in fillers if op.name == "add"])
    cached = base_blocks & {b for (_, b) in first.cached_blocks()}
    room = max(1, limit - len(shared))
    seed = data.draw(st.integers(0, 2**16), label="tail_seed")
    chunk = data.draw(st.sampled_from((4, 16, 1024)), label="chunk")
    # a few blocks keep a later sliding/chunked window's hits inside it (they are touched);
    # 64 tokens reach deepest into the queue (full-attention later groups)
    external = data.draw(st.sampled_from((sbs, 2 * sbs, 3 * sbs, 64, 64)), label="external")
    async_load = data.draw(st.booleans(), label="async_load")
    drain_rid, follow_rid = rids.take(), rids.take()
    drain_seed = data.draw(st.integers(0, 2**16), label="drain_seed")

    def follow_up(tail: int) -> list[Op]:
        return [Op("add", dict(rid=follow_rid, prompt=shared + tokens_from_seed(seed, tail), max_tokens=8,
                               cache_salt=salt)),
                Op("admit", dict(rid=follow_rid, chunk=chunk, full_sequence_must_fit=False, reserved_blocks=0,
                                 in_flight=False, token=0, external=external, async_load=async_load))]

    # the longest tail the pool admits after a drain that clears the queue's head up to the
    # prompt's cached blocks (else after the largest drain that leaves room for it)
    fallback: list[Op] = []
    for tail in sorted({t for t in (room, (2 * room) // 3, room // 3, 2 * sbs + 1) if 1 <= t <= room},
                       reverse=True):
        then = follow_up(tail)
        if not fits(h, then):
            continue
        drain = drain_to(h, drain_rid, drain_seed, cached, then)
        scratch = h.probe(drain)
        if scratch is not None and (not scratch.managers["reference"].free_block_queue()
                                    or scratch.managers["reference"].free_block_queue()[0] in cached):
            fallback = drain + then
            break
        fallback = fallback or drain + then
    apply(fallback or follow_up(1))
    counts.full_pool_follow_ups += 1


def drain_to(h: Harness, rid: str, seed: int, blocks: set[int], then: list[Op]) -> list[Op]:
    """A filler as large as leaves every one of ``blocks`` free and ``then`` still applying:
    it takes what sits ahead of them in the free queue, so that the next allocation starts
    at them (vLLM #33775: the connector's external blocks meet a later group's hits); [] if
    nothing is ahead of them or no filler fits."""
    queue = h.managers[h.kinds[0]].free_block_queue()
    longest = h.pool_config.max_model_len - 2
    if not blocks or not queue or queue[0] in blocks or longest < 1:
        return []

    def spares(chunk: int) -> bool:
        scratch = h.probe(filler(h, rid, seed, chunk))
        return (scratch is not None and scratch.reqs[rid].holds_blocks
                and blocks <= set(scratch.managers["reference"].free_block_queue())
                and fits(h, filler(h, rid, seed, chunk) + then))

    if not spares(1):
        return []
    lo, hi = 1, longest + 1  # spares(lo); not at hi
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if spares(mid) else (lo, mid)
    return filler(h, rid, seed, lo)
