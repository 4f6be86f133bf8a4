"""Generated programs on a HiSparse pool, run on vLLM's HiSparse managers and the reference's
(issue #23): after every operation the admission counts of each group, the new block ids of each
group, every table (resident tables as residency rows), both pools' free counts and free-queue
orders, and the hot managers' ``hot_required`` / ``has_hot`` must agree.

Programs admit requests cold, on a host prefix hit (null resident pages, a hot region) or with a
KV-connector import (a writable resident tail page, a hot region), grow them in chunks (running
requests), sometimes through the full-sequence admission gate (the resident cap), ask for hot
regions (``require_hot``, what the coordinator does when a page is lost), run the coordinator's
``update_residency`` transition rule, point host-only pages at another request's GPU block and
pin it (``adopt_resident_page``, as the coordinator adopts GPU copies of host pages) or stop
reading it (``drop_resident_page``, then the pin is released), and free. With prefix caching on, a
hit can end inside the source's last hit block, so the host source copies it on write: the pending
pairs (ids and ref counts) are compared after every op and drained for the worker by ``host_copies``. Pools are small (a few pages of GPU and host
blocks) so host exhaustion (the admission sentinel) and the transition watermark are reached.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from typing import Any

from hypothesis import strategies as st

from kvref.impl.reference.hisparse_pool import HiSparsePool
from kvref.spec.hisparse import HiSparsePoolConfig
from kvref.spec.mathutil import cdiv


@st.composite
def hisparse_pool_configs(draw) -> HiSparsePoolConfig:
    bs = draw(st.sampled_from((1, 2, 4)))
    max_model_len = draw(st.integers(4, 32))
    pages = cdiv(max_model_len, bs)
    groups = draw(st.sampled_from((1, 1, 2)))
    # small pools refuse and exhaust; roomy ones (every group can hold a long request and a half)
    # keep requests running long enough for write-backs to complete and pages to be unpinned; tight
    # ones (one long request and its hot regions) make a second request reuse unpinned blocks
    roomy = 3 * (groups + 1) * pages // 2 + 4
    tight = (groups + 1) * pages + 3 * groups + 1
    return HiSparsePoolConfig(
        block_size=bs,
        num_gpu_blocks=draw(st.one_of(st.integers(2, 3 * pages + 6), st.integers(roomy, roomy + pages),
                                      st.integers(tight, tight + pages // 2),
                                      st.integers((groups + 1) * pages // 3 + 2, (groups + 1) * pages // 2 + 2))),
        host_num_blocks=draw(st.integers(2, 3 * pages + 2)),
        blocks_per_request=draw(st.integers(1, 3)),
        num_resident_groups=groups,
        max_model_len=max_model_len,
        max_in_flight_tokens=draw(st.one_of(st.integers(1, 16), st.just(max_model_len))),
        enable_caching=draw(st.booleans()),
    )


@st.composite
def host_only_pool_configs(draw) -> HiSparsePoolConfig:
    """A host source and its indexer without resident or hot groups: vLLM's
    ``HiSparseCoordinator`` accepts such a layout (it binds the host pool, ``has_host_cache``) and
    every per-step entry point (write-back planning, residency, the offload command, row mirrors,
    import completion) must then plan nothing. The host pool holds three full requests: with no
    GPU pool vLLM's host admission sentinel has nothing to size itself by (it asserts one exists),
    a limit of vLLM's that the layout builder never meets (it always adds a resident group)."""
    bs = draw(st.sampled_from((1, 2, 4)))
    max_model_len = draw(st.integers(4, 32))
    pages = cdiv(max_model_len, bs)
    return HiSparsePoolConfig(
        block_size=bs, num_gpu_blocks=draw(st.integers(2, 2 * pages + 4)), host_num_blocks=3 * pages + 4,
        blocks_per_request=1, num_resident_groups=0, max_model_len=max_model_len,
        max_in_flight_tokens=draw(st.one_of(st.integers(1, 16), st.just(max_model_len))),
        enable_caching=draw(st.booleans()))


def prompt_of(idx: int, length: int) -> list[int]:
    """Request ``idx``'s prompt: r0 and r1 (and every request re-admitted under its id) share one
    token stream, so prefix caching finds the other's (or its own earlier) published pages; r2
    leaves it half-way."""
    return [t if idx % 3 < 2 or t < length // 2 else 1000 + t for t in range(length)]


#: (op, request index, chunk, host-hit pages, imported tokens (> 4: an import of that many), full-sequence gate)
#: the coordinator's ops reuse the fields: ``complete`` with the gate set or a hit field below 2
#: reports every transfer sent run by one worker, else picks one with the index and reports
#: ``1 + chunk % 2`` enqueuing workers and ``imported % 3`` completions;
#: ``import_done`` fails the import when ``imported`` is even
OPS = st.tuples(st.sampled_from(("schedule", "schedule", "schedule", "schedule", "schedule", "require_hot",
                                 "require_hot", "update", "update", "adopt", "adopt", "adopt", "drop", "drop", "free",
                                 "offload", "offload", "complete", "complete", "complete", "import_done",
                                 "import_done", "residency", "mirrors", "host_copies")),
                st.integers(0, 2), st.integers(1, 12), st.sampled_from((0, 0, 1, 2, 3)), st.integers(0, 9),
                st.integers(0, 3).map(lambda k: k == 0))

#: prompt lengths of the three requests a program uses
LENGTHS = st.lists(st.integers(1, 32), min_size=3, max_size=3)
#: programs long enough to admit two requests and change residency between them
#: a request that takes its hot region, writes back a long prefix and has it completed, so the
#: programs after it run with clean and unpinned pages in the pool (else rare in short programs)
WRITE_BACK_PREFIX = [("require_hot", 0, 1, 0, 0, False), ("schedule", 0, 11, 0, 0, False),
                     ("offload", 0, 1, 0, 0, False), ("complete", 0, 1, 0, 0, True), ("update", 1, 1, 0, 0, False)]
#: with prefix caching: r0 publishes what it computed, is finished while its write-backs are in
#: flight (its host blocks are kept for the publication its last completion makes), then r1, on
#: the same prompt, hits the published host pages and adopts their GPU copies
#: with prefix caching: r0 writes back and publishes while running, then r1 on the same prompt
#: hits its host pages and adopts r0's GPU blocks as copies
COPY_PREFIX = [("require_hot", 0, 1, 0, 0, False), ("schedule", 0, 5, 0, 0, False), ("offload", 0, 1, 0, 0, False),
               ("complete", 0, 1, 0, 0, True), ("schedule", 1, 5, 0, 0, False)]
FINISH_IN_FLIGHT_PREFIX = [("require_hot", 0, 1, 0, 0, False), ("schedule", 0, 11, 0, 0, False),
                           ("offload", 0, 1, 0, 0, False), ("free", 0, 1, 0, 0, False),
                           ("complete", 0, 1, 0, 0, True), ("schedule", 1, 5, 0, 0, False)]
#: with prefix caching: r1's hit on r0's published pages ends inside a host block, so the host
#: source copies that block on write (drained for the worker by ``host_copies``)
HOST_COW_PREFIX = COPY_PREFIX[:-1] + [("schedule", 1, 5, 2, 0, False)]
#: the worker's copy work drained, the requests freed, drained again (copies still pending are handed over)
HOST_COW_DRAIN = [("host_copies", 0, 1, 0, 0, False), ("free", 0, 1, 0, 0, False), ("free", 1, 1, 0, 0, False),
                  ("host_copies", 0, 1, 0, 0, False)]
#: the write-back of WRITE_BACK_PREFIX reported by workers a step apart (TP > 1): one enqueued it,
#: then a straggler says two did and one completed (the first enqueue report fixed the count: the
#: transfer is done), then a straggler's report for a transfer already completed (ignored)
#: (the second transfer sent, so its page is written back before the first's: out of order)
STRAGGLER_PREFIX = WRITE_BACK_PREFIX[:3] + [("complete", 1, 2, 2, 0, False), ("complete", 1, 1, 3, 0, False),
                                            ("complete", 0, 3, 3, 0, False), ("update", 1, 1, 0, 0, False)]
PROGRAMS = st.one_of(st.lists(OPS, min_size=20, max_size=40),
                     st.lists(OPS, min_size=5, max_size=35).map(lambda ops: WRITE_BACK_PREFIX + ops),
                     st.lists(OPS, min_size=5, max_size=30).map(lambda ops: FINISH_IN_FLIGHT_PREFIX + ops),
                     st.lists(OPS, min_size=5, max_size=30).map(lambda ops: COPY_PREFIX + ops),
                     st.lists(OPS, min_size=5, max_size=30).map(lambda ops: HOST_COW_PREFIX + ops + HOST_COW_DRAIN),
                     st.lists(OPS, min_size=5, max_size=30).map(lambda ops: STRAGGLER_PREFIX + ops))


#: an import admitted, its receive completed (``import_done`` with an odd ``imported``), the restore
#: sent and completed, the request grown and written back, a second request admitted, the first freed
IMPORT_RESTORE = [("require_hot", 0, 1, 0, 0, False), ("schedule", 0, 12, 0, 7, False),
                  ("import_done", 0, 1, 0, 1, False), ("offload", 0, 1, 0, 0, False), ("complete", 0, 1, 0, 0, True),
                  ("schedule", 0, 4, 0, 0, False), ("update", 1, 1, 0, 0, False), ("offload", 0, 1, 0, 0, False),
                  ("complete", 0, 1, 0, 0, True),
                  ("schedule", 1, 8, 0, 0, False), ("free", 0, 1, 0, 0, False)]

#: with prefix caching on a pool of 24 blocks: r0 writes back, publishes and is freed (its blocks
#: stay indexed as GPU copies of its host pages), r2 and r1 hit the published pages and grow until
#: the pool hands out a copy's block (the copy is dropped from the index; a reader loses the page)
COPY_REUSED = [("require_hot", 0, 1, 0, 0, False), ("schedule", 0, 8, 0, 0, False), ("offload", 0, 1, 0, 0, False),
               ("complete", 0, 1, 0, 0, True), ("update", 1, 1, 0, 0, False), ("offload", 0, 1, 0, 0, False),
               ("complete", 0, 1, 0, 0, True), ("free", 0, 1, 0, 0, False),
               ("schedule", 2, 12, 0, 0, False), ("schedule", 2, 12, 0, 0, False), ("schedule", 1, 8, 0, 0, False),
               ("schedule", 1, 8, 0, 0, False), ("free", 2, 1, 0, 0, False), ("schedule", 0, 8, 0, 0, False)]


#: fixed programs every run starts with, so the rare paths are reached whatever the draws: a
#: reused unpinned block loses its page (a tight pool), a published prefix is hit and its GPU copies
#: adopted, a finished request publishes after its last write-back (roomy pools, caching on)
HAND_PROGRAMS = [
    (HiSparsePoolConfig(block_size=1, num_gpu_blocks=25, host_num_blocks=20, blocks_per_request=1,
                        num_resident_groups=1, max_model_len=16, max_in_flight_tokens=16),
     [8, 4, 4], WRITE_BACK_PREFIX[:1] + [("schedule", 0, 8, 0, 0, False)] + WRITE_BACK_PREFIX[2:]
     + [("residency", 0, 1, 0, 0, False), ("schedule", 1, 4, 0, 0, False), ("residency", 0, 1, 0, 0, False),
        ("schedule", 0, 1, 0, 0, False)]),
    (HiSparsePoolConfig(block_size=2, num_gpu_blocks=40, host_num_blocks=30, blocks_per_request=1,
                        num_resident_groups=1, max_model_len=32, max_in_flight_tokens=32, enable_caching=True),
     [20, 20, 20], COPY_PREFIX + [("update", 1, 1, 0, 0, False)]),
    (HiSparsePoolConfig(block_size=2, num_gpu_blocks=40, host_num_blocks=30, blocks_per_request=1,
                        num_resident_groups=1, max_model_len=32, max_in_flight_tokens=32, enable_caching=True),
     [20, 20, 20], FINISH_IN_FLIGHT_PREFIX),
    (HiSparsePoolConfig(block_size=2, num_gpu_blocks=40, host_num_blocks=30, blocks_per_request=1,
                        num_resident_groups=1, max_model_len=32, max_in_flight_tokens=32, enable_caching=True),
     [20, 20, 20], HOST_COW_PREFIX + [("free", 1, 1, 0, 0, False), ("host_copies", 0, 1, 0, 0, False)]),
    # a KV-connector import that lands: the coordinator marks the imported pages valid and plans a
    # restore of the writable tail page, whose completion records the tail's GPU copy (a host page
    # not yet published has no hash to index it by); then the request runs on and a second one hits
    *((HiSparsePoolConfig(block_size=bs, num_gpu_blocks=40, host_num_blocks=30, blocks_per_request=1,
                          num_resident_groups=1, max_model_len=32, max_in_flight_tokens=32, enable_caching=caching),
       [20, 20, 20], IMPORT_RESTORE) for caching in (False, True) for bs in (1, 2)),
    (HiSparsePoolConfig(block_size=2, num_gpu_blocks=24, host_num_blocks=40, blocks_per_request=1,
                        num_resident_groups=1, max_model_len=32, max_in_flight_tokens=32, enable_caching=True),
     [16, 16, 16], COPY_REUSED),
]
#: a host hit leaves r1's first pages host-only: it adopts r0's GPU blocks for two of them, and is
#: refused a page past its table, a page already read from the GPU and any page of a request with
#: no table (both sides refuse, nothing changes); then one adopted page is dropped again
HAND_PROGRAMS.append((HiSparsePoolConfig(block_size=2, num_gpu_blocks=40, host_num_blocks=30, blocks_per_request=1,
                                         num_resident_groups=1, max_model_len=32, max_in_flight_tokens=32),
                      [20, 20, 20], [("schedule", 0, 8, 0, 0, False), ("schedule", 1, 8, 2, 0, False),
                                     ("adopt", 1, 3, 0, 0, False), ("adopt", 1, 4, 1, 0, False),
                                     ("drop", 1, 1, 0, 0, False)]))
#: the first program on two resident groups: a lost page is read from one block per group, so when
#: the pool hands out one group's block the other group's block stops being read by the page too
HAND_PROGRAMS.append((HiSparsePoolConfig(block_size=1, num_gpu_blocks=34, host_num_blocks=20, blocks_per_request=1,
                                         num_resident_groups=2, max_model_len=16, max_in_flight_tokens=16),
                      *HAND_PROGRAMS[0][1:]))

#: the straggler reports on one pool, always run (the page written back out of order is then
#: skipped by the write-back planning the end-of-program probes ask for)
HAND_PROGRAMS.append((HiSparsePoolConfig(block_size=1, num_gpu_blocks=25, host_num_blocks=20, blocks_per_request=1,
                                         num_resident_groups=1, max_model_len=16, max_in_flight_tokens=16),
                      [12, 4, 4], STRAGGLER_PREFIX))


class HiSparseDivergence(AssertionError):
    """A difference between the reference and vLLM on a HiSparse pool. ``signature`` names what
    differed without ids or values, so a baseline (``kvref verify --baseline``) can accept it and
    the search goes on past it, as for every other conformance difference."""

    def __init__(self, message: str, what: str) -> None:
        super().__init__(message)
        self.signature = f"HiSparse pool: {what} differs"


def _compare(step: str, ref: Any, got: Any, what: str) -> None:
    if ref != got:
        raise HiSparseDivergence(f"HiSparse divergence after {step}: {what}: reference {ref!r} != vLLM {got!r}", what)


def _pending_host_copies(pool: Any) -> list[tuple[int, int, int, int]]:
    """The host source's copy-on-write pairs not yet drained for the worker, as (source id, source
    ref count, copy id, copy ref count): both endpoints must stay referenced until the worker has
    copied (vLLM's ``_apply_cow`` gives the copy an extra ref)."""
    return [(src.block_id, src.ref_cnt, dst.block_id, dst.ref_cnt) for src, dst in pool.managers[0]._pending_cow_copies]


def run_hisparse_program(config: HiSparsePoolConfig, lengths: list[int], ops: list[tuple],
                         make_vllm: Callable[[HiSparsePoolConfig], Any]) -> Counter:
    """Run ``ops`` on both pools; raise AssertionError at the first divergence. Returns which
    paths the run took (for the tests' reach assertions)."""
    ref, vll = HiSparsePool(config), make_vllm(config)
    seen: Counter = Counter()
    _compare("build", ref.transition_watermark, vll.transition_watermark, "transition watermark")
    _compare("build", ref.observe(), vll.observe(), "state")
    # asked again, each side returns the coordinator it built (memoised on the managers), unchanged
    _compare("build", (ref.bound_coordinator() is ref.coordinator, ref.observe()),
             (vll.bound_coordinator() is vll.coordinator, vll.observe()), "coordinator asked again, and the state")
    computed: dict[str, int] = {}
    num_unpinned, hot_required = 0, [[] for _ in range(config.num_resident_groups)]
    num_copy_pages = 0
    num_cached_host = 0
    adopted: set[tuple[str, int]] = set()  # (request, page) pointed at a pinned donor block
    importing: set[str] = set()  # requests whose import the connector has not finished
    sent: list[int] = []  # transfer ids handed to the workers, not yet completed
    ever_sent: list[int] = []  # every transfer id handed to the workers (for straggler reports)
    bs = config.block_size
    for n, (op, idx, chunk, hit_pages, imported, gate) in enumerate(ops):
        rid = f"r{idx}"
        length = min(lengths[idx % len(lengths)], config.max_model_len)
        step = f"op {n} {op}({rid})"
        if op == "schedule":
            new = rid not in computed
            if new and config.enable_caching:  # the host source's published pages (and the indexer's)
                prompt = prompt_of(idx, length)
                hit = ref.find_longest_cache_hit(rid, prompt, length - 1)
                _compare(step, hit, vll.find_longest_cache_hit(rid, prompt, length - 1), "prefix-cache hit")
                local = hit[0]
                if hit_pages >= 2 and bs > 1 and local:
                    # a reconciled hit ending inside the source's last hit block (what a
                    # fine-grained hash-block hit of a Mamba-align group makes of it): the source
                    # shares that block and copies it on write (host copy-on-write, issue #23)
                    local -= 1 + (hit_pages - 2 + chunk) % (bs - 1)
                    seen["partial_host_hit"] += 1
                external = min(imported, length - 1 - local) if imported > 4 else 0
            elif new:
                local = min(hit_pages * bs, length - 1)
                external = min(imported, length - 1 - local) if imported > 4 else 0
            else:
                local, external = computed[rid], 0
            total = min(local + external, config.max_model_len)
            num_tokens = min(total + chunk, length)
            if num_tokens <= total:
                continue
            free = ref.gpu_pool.get_num_free_blocks()
            if gate:
                args = (rid, length, total, local, True)
                counts = ref.get_num_blocks_to_allocate(*args)
                _compare(step, counts, vll.get_num_blocks_to_allocate(*args), "admission-gate counts per group")
                if sum(counts) > free:
                    seen["refused_gate"] += 1
                    continue
            args = (rid, num_tokens, total, local, False)
            counts = ref.get_num_blocks_to_allocate(*args)
            _compare(step, counts, vll.get_num_blocks_to_allocate(*args), "allocation counts per group")
            if sum(counts) > free:
                seen["refused_host" if counts[0] > 0 else "refused_gpu"] += 1
                continue
            try:
                got_ref = ref.allocate(rid, num_tokens, local, external)
            except Exception as exc:  # vLLM's own counts can under-reserve (the hot region)
                try:
                    vll.allocate(rid, num_tokens, local, external)
                except Exception as vexc:
                    _compare(step, type(exc).__name__, type(vexc).__name__, "allocation failure")
                    seen["allocation_failed"] += 1
                    return seen
                raise HiSparseDivergence(f"{step}: the reference failed ({exc!r}) where vLLM allocated",
                                         "allocation outcome") from exc
            _compare(step, got_ref, vll.allocate(rid, num_tokens, local, external), "new block ids per group")
            computed[rid] = num_tokens
            seen["host_hit" if new and local else "import" if new and external else "admit" if new else "grow"] += 1
            if new and external:
                importing.add(rid)
            if config.enable_caching:
                seen["cache_hit"] += bool(new and local)
                if rid not in importing:  # an async load delays caching until it lands
                    ref.cache_blocks(rid, num_tokens)
                    vll.cache_blocks(rid, num_tokens)
                    seen["cache_blocks"] += 1
            if any(got_ref[i] for i, k in enumerate(config.group_kinds) if k == "hot"):
                seen["hot_allocated"] += 1
            if chunk % 3:  # the step's write-back planning and residency rule (the HiSparse connector)
                ref.advance_scheduled([(rid, num_tokens)])
                vll.advance_scheduled([(rid, num_tokens)])
                seen["advance"] += 1
        elif op == "require_hot":
            ref.require_hot(rid)
            vll.require_hot(rid)
        elif op == "update":  # the coordinator runs it for scheduled (running) requests
            if not computed:
                continue
            if idx == 0:  # the residency rule alone
                rid = sorted(computed)[chunk % len(computed)]
                ref.update_residency(rid)
                vll.update_residency(rid)
            else:  # a step that schedules every running request (write-back planning + residency)
                running = [(r, computed[r]) for r in sorted(computed)]
                ref.advance_scheduled(running)
                vll.advance_scheduled(running)
                seen["advance"] += 1
        elif op in ("adopt", "drop"):  # residency changes on host pages (the coordinator's adoption)
            # an adopted page the coordinator unpinned (written back) no longer holds the adoption's pin
            states = ref.coordinator.request_states
            adopted = {(r, p) for r, p in adopted if r not in states or p not in states[r].unpinned_pages}
            if op == "drop" and adopted:
                rid, page = sorted(adopted)[chunk % len(adopted)]
                _compare(step, ref.drop(rid, page), vll.drop(rid, page), "dropped block per resident group")
                adopted.discard((rid, page))
                seen["drop"] += 1
                ref.check_invariants()
                _compare(step, ref.observe(), vll.observe(), "state")
                continue
            if op == "drop" or len(computed) < 2 or not config.num_resident_groups:
                continue
            rows = ref.observe()["tables"][2]  # the first resident group's rows
            readers = sorted(r for r in computed if 0 in rows.get(r, ()))
            if not readers:
                continue
            rid = readers[idx % len(readers)]
            donors = sorted(r for r in computed if r != rid and any(rows.get(r, ())))
            if not donors:
                continue
            donor, donor_row = donors[idx % len(donors)], rows[donors[idx % len(donors)]]
            host_pages = [i for i, b in enumerate(rows[rid]) if b == 0]
            page = host_pages[chunk % len(host_pages)]
            donor_page = [i for i, b in enumerate(donor_row) if b][hit_pages % sum(1 for b in donor_row if b)]
            # pages a request cannot adopt, refused by both without a change: one past its table, one
            # already read from the GPU, and any page of a request with no table
            resident = [i for i, b in enumerate(rows[rid]) if b]
            for bad_rid, bad_page in ((rid, len(rows[rid]) + chunk % 3), ("r-none", page),
                                      *(((rid, resident[chunk % len(resident)]),) if resident else ())):
                got = ref.adopt(bad_rid, bad_page, donor, donor_page)
                _compare(step, got, vll.adopt(bad_rid, bad_page, donor, donor_page), "refused adoption")
                seen["adopt_refused"] += not any(got)
            got = ref.adopt(rid, page, donor, donor_page)
            _compare(step, got, vll.adopt(rid, page, donor, donor_page), "adopted per resident group")
            if all(got):
                adopted.add((rid, page))
                seen["adopt"] += 1
        elif op == "offload":  # the step's offload command: the transfers planned since the last one
            got = ref.build_offload_command()
            _compare(step, got, vll.build_offload_command(), "page transfers")
            got = got or []  # None: a host-only layout has no offload command
            sent.extend(t[0] for t in got)
            ever_sent.extend(t[0] for t in got)
            seen["transfers_sent"] += len(got)
            seen["restores_sent"] += sum(1 for t in got if t[4])
        elif op == "complete":  # a worker report: enqueued / completed counts per transfer id
            straggler = hit_pages == 3 and (gate or not imported % 3)
            if not sent and not (straggler and ever_sent):
                continue
            if (gate or hit_pages < 2) and not straggler:  # one worker ran every transfer sent
                enqueued = completed = dict.fromkeys(sent, 1)
            elif straggler:
                # a straggler worker (TP > 1, reporting a step late) enqueued and completed a
                # transfer: still pending, its enqueued count counts only as the first report and
                # its completion adds up; already completed and gone, the report is ignored
                gone = [t for t in ever_sent if t not in ref.coordinator.pending_spills] or ever_sent
                tid = sent[idx % len(sent)] if sent and chunk % 3 else gone[(idx + chunk) % len(gone)]
                enqueued, completed = {tid: 2}, {tid: 1}
                seen["straggler_report"] += 1
                seen["straggler_after_done"] += tid not in ref.coordinator.pending_spills
            else:
                tid = sent[idx % len(sent)]
                enqueued = {tid: 1 + chunk % 2} if hit_pages == 2 else {}
                completed = {tid: imported % 3} if imported % 3 else {}
            before = len(ref.coordinator.pending_spills)
            detached = sum(p.request_state.publication is not None
                           and p.request_state.publication.detached_blocks is not None
                           for p in ref.coordinator.pending_spills.values())
            ref.update_spills(enqueued, completed)
            vll.update_spills(enqueued, completed)
            done = before - len(ref.coordinator.pending_spills)
            if detached and not any(p.request_state.publication is not None
                                    and p.request_state.publication.detached_blocks is not None
                                    for p in ref.coordinator.pending_spills.values()):
                seen["detached_published"] += 1  # a finished request's last write-back published it
            if done:
                sent = [t for t in sent if t in ref.coordinator.pending_spills]
                seen["transfers_done"] += done
        elif op == "import_done":  # the connector's receive finished (or failed)
            if not importing:
                continue
            rid = sorted(importing)[idx % len(importing)]
            importing.discard(rid)
            ref.finish_host_import(rid, imported % 2 == 0)
            vll.finish_host_import(rid, imported % 2 == 0)
            seen["import_failed" if imported % 2 == 0 else "import_done"] += 1
        elif op == "residency":  # what the worker is sent for the scheduled requests
            got = ref.take_residency_updates(sorted(computed))
            _compare(step, got, vll.take_residency_updates(sorted(computed)), "residency updates")
            seen["residency_updates"] += len(got)
        elif op == "mirrors":  # row mirrors and the all-resident fast path of a step
            if not computed:
                continue
            rid = sorted(computed)[idx % len(computed)]
            rows = [(rid, max(0, computed[rid] - chunk), min(chunk, computed[rid]))]
            got = ref.build_row_mirrors(rows)
            _compare(step, got, vll.build_row_mirrors(rows), "row mirrors")
            resident = ref.all_context_pages_resident(rows)
            _compare(step, resident, vll.all_context_pages_resident(rows), "all context pages resident")
            seen["mirrors"] += len(got)
            seen["all_resident"] += resident
            # the whole context (host-only pages have no mirror source, a request with no table no
            # rows): read-only, so the draws after it are those of the step without it
            whole = [(rid, 0, computed[rid]), ("r-none", 0, chunk)]
            got = ref.build_row_mirrors(whole)
            _compare(step, got, vll.build_row_mirrors(whole), "row mirrors of the whole context")
            first = ref.resident_managers[0] if ref.resident_managers else None
            if first is None or len(first.req_to_blocks.get(rid, ())) < cdiv(computed[rid] + chunk, bs):
                # rows past the request's table: not all resident, decided before any state changes
                past = [(rid, computed[rid], chunk)]
                got = ref.all_context_pages_resident(past)
                _compare(step, got, vll.all_context_pages_resident(past), "all context pages resident past the table")
                seen["mirrors_past_table"] += 1
        elif op == "host_copies":  # the step's host copy-on-write work, run and reported by the worker
            got = ref.take_host_block_copies()
            _compare(step, got, vll.take_host_block_copies(), "host block copies")
            ref.release_completed_host_copies([dst for _, dst in got])
            vll.release_completed_host_copies([dst for _, dst in got])
            seen["host_copies"] += len(got)
            if got:  # the same completions reported again release nothing more (compared below)
                ref.release_completed_host_copies([dst for _, dst in got])
                vll.release_completed_host_copies([dst for _, dst in got])
        else:
            # a finished request's publication outlives it; a preempted one's is dropped
            finished = chunk % 4 != 0
            ref.free(rid, finished)
            vll.free(rid, finished)
            seen["free_finished" if finished else "free_preempted"] += 1
            computed.pop(rid, None)
            importing.discard(rid)
            adopted.difference_update({(r, p) for r, p in adopted if r == rid})
            seen["free"] += 1
        ref.check_invariants()
        state = ref.observe()
        _compare(step, state, vll.observe(), "state")
        pending = _pending_host_copies(ref)
        _compare(step, pending, _pending_host_copies(vll), "pending host copy-on-write pairs")
        seen["host_cow_pending"] += bool(pending)
        if op in ("update", "schedule") and any(set(now) - set(was) for now, was
                                                  in zip(state["hot_required"], hot_required)):
            seen["transition"] += 1  # the residency rule asked for a hot region
        hot_required = state["hot_required"]
        unpinned = sum(len(r["unpinned"]) for r in state["request_states"].values())
        # host-hit pages (null in the append-only table) the coordinator pointed at a GPU copy of
        # their published host page (not the program's own "adopt" op)
        first = ref.resident_managers[0] if ref.resident_managers else None  # none: a host-only layout
        copy_pages = 0 if first is None else sum(
            1 for r, table in first.req_to_blocks.items() for i, b in enumerate(table)
            if b.is_null and (r, i) not in adopted and first.get_resident_page(r, i) is not None)
        if copy_pages > num_copy_pages:
            seen["copy_adopted"] += 1
        num_copy_pages = copy_pages
        if len(state["cached"][1]) > num_cached_host:
            seen["host_published"] += 1
        num_cached_host = len(state["cached"][1])
        if unpinned > num_unpinned:
            seen["unpinned"] += 1
        elif unpinned < num_unpinned and op != "free":  # the pool reused an unpinned page's block
            seen["page_lost"] += 1
        num_unpinned = unpinned
    _probe_coordinator_entry_points(ref, vll, computed, bs, seen)
    return seen


def _probe_coordinator_entry_points(ref: Any, vll: Any, computed: dict[str, int], bs: int, seen: Counter) -> None:
    """After the program, the coordinator's own entry points called directly with what the
    connector may pass but the programs never do (#22): an import completed for a request with no
    host table (nothing to restore) or of no tokens (nothing to restore either), on every layout a
    host-only one included (which plans nothing), and write-back planned up to past each request's
    table, the re-prefillable tail included. State compared after each call."""
    probes = [("complete_host_import", "r-none", 0), ("complete_host_import", "r-none", 3 * bs + 1),
              ("plan_prefix_materialization", "r-none", 4 * bs)]
    probes += [("plan_prefix_materialization", rid, n + 2 * bs) for rid, n in sorted(computed.items())]
    for name, rid, tokens in probes:
        step = f"probe {name}({rid}, {tokens})"
        getattr(ref, name)(rid, tokens)
        getattr(vll, name)(rid, tokens)
        ref.check_invariants()
        _compare(step, ref.observe(), vll.observe(), "state")
        got = ref.build_offload_command()
        _compare(step, got, vll.build_offload_command(), "page transfers")
        seen["probe_transfers"] += len(got or ())
    seen["probes"] += len(probes)


def run_hisparse_programs(make_vllm: Callable[[HiSparsePoolConfig], Any], examples: int,
                          seed: int | None = None) -> tuple[str | None, Counter, str | None]:
    """``examples`` generated programs (derandomized unless ``seed`` is given), for ``kvref verify``.
    Returns the first divergence (None when all agree), the paths reached and the divergence's
    signature. A divergence the active baseline accepts discards its program and the search goes on."""
    from hypothesis import HealthCheck, given, reject, settings
    from hypothesis.errors import Unsatisfiable
    from hypothesis import seed as hypothesis_seed

    from kvref.models.conformance.accepted import is_accepted
    from kvref.models.hypothesis_runs.reproducible import same_inputs_in_every_process

    seen: Counter = Counter()

    @settings(max_examples=examples, deadline=None, database=None, derandomize=seed is None,
              suppress_health_check=list(HealthCheck), print_blob=False)
    @given(hisparse_pool_configs(), LENGTHS, PROGRAMS)
    def run(config, lengths, ops):
        try:
            seen.update(run_hisparse_program(config, lengths, ops, make_vllm))
        except HiSparseDivergence as exc:
            if is_accepted(exc.signature):
                reject()
            raise

    @settings(max_examples=max(2, examples // 8), deadline=None, database=None, derandomize=seed is None,
              suppress_health_check=list(HealthCheck), print_blob=False)
    @given(host_only_pool_configs(), LENGTHS, PROGRAMS)
    def run_host_only(config, lengths, ops):
        try:
            seen.update(run_hisparse_program(config, lengths, ops, make_vllm))
        except HiSparseDivergence as exc:
            if is_accepted(exc.signature):
                reject()
            raise
        seen["host_only"] += 1

    if seed is not None:
        run = hypothesis_seed(seed)(run)
        run_host_only = hypothesis_seed(seed)(run_host_only)
    try:
        for config, lengths, ops in HAND_PROGRAMS:
            try:
                seen.update(run_hisparse_program(config, lengths, ops, make_vllm))
            except HiSparseDivergence as exc:
                if not is_accepted(exc.signature):
                    raise
        with same_inputs_in_every_process():
            run()
        try:
            with same_inputs_in_every_process():
                run_host_only()
        except Unsatisfiable:  # every host-only program ended at a difference the baseline accepts
            pass
        # which group layouts the coordinator accepts (a pool class without the builder: none)
        build = getattr(make_vllm, "coordinator_for_layout", None)
        if build is not None:
            from kvref.models.machines.hisparse_layouts import run_hisparse_layouts

            failure, layouts = run_hisparse_layouts(build, max(2, examples // 10), seed=seed)
            seen.update(layouts)
            if failure:
                return failure, seen, "HiSparse pool: accepted group layouts differ"
    except AssertionError as exc:
        return str(exc), seen, getattr(exc, "signature", None)
    except Unsatisfiable:  # every program ended at a difference the baseline accepts
        return None, seen, None
    return None, seen, None
