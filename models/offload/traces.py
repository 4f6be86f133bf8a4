"""Random engine traces for the offload worlds (shared by conformance, state-machine and CLI use).

An operation is a 9-tuple ``(kind, family, prompt_len, tail, chunk, repeat, pick, count, flag)``;
``apply_op`` / ``apply_offloading_op`` interpret it on a :class:`SimpleOffloadWorld` /
:class:`OffloadingWorld`. Traces are drawn from a ``random.Random`` (Hypothesis passes a seeded
one): list strategies rarely build a prefix, evict it from the GPU and then hit it on the CPU,
which takes a dozen coordinated steps.
"""

from __future__ import annotations

from kvref.models.offload.simple_cpu_world import SimpleOffloadConfig, SimpleOffloadWorld
from kvref.models.offload.offloading_connector_world import OffloadingWorld

PREFIXES = [list(range(100, 140)), list(range(200, 240))]

KINDS = ["step"] * 6 + ["add"] * 3 + ["drain"] * 3 + ["cstore"] * 2 + ["cload"] * 2 + ["abort", "preempt", "reset"]


def random_ops(rnd, n):
    """``n`` operations drawn from ``rnd``."""
    return [(rnd.choice(KINDS), rnd.choice([0, 0, 0, 1, 2, 2, 2]), rnd.choice([13, 20, 30, 9, 2]), rnd.randint(0, 3),
             rnd.choice([8, 4, 12, 64]), rnd.randint(1, 4), rnd.randint(0, 99), rnd.randint(1, 2),
             rnd.random() < 0.5) for _ in range(n)]


def apply_op(w: SimpleOffloadWorld, op):
    kind, fam, n, tail, chunk, rep, pick, count, flag = op
    if kind == "add":
        # An earlier request's tokens cut to a block boundary: a prompt wholly offloaded (and maybe
        # evicted from the GPU) is looked up again, where a CPU hit must stop short of its last token.
        if flag and count == 2 and (rid := w.readd(pick, drop_last_block=rep == 4)) is not None:
            return rid
        max_out = (2, 2, 5, 9)[rep - 1]  # longer decodes cross block boundaries (placeholders, stores)
        if fam == 2:  # unrelated tokens: pressure on the GPU pool
            return w.add_request([1000 + 40 * len(w.order) + i for i in range(n)], max_out)
        return w.add_request(PREFIXES[fam][:n] + [7] * tail, max_out)
    if kind == "step":
        return [w.step(chunk) for _ in range(rep)]
    if kind == "drain":  # deliver every pending completion, stores newest first or oldest first
        out = []
        while w.stores or w.loads:
            out.append((w.complete_store(-1 if flag else 0, 2), w.complete_load(0)))
        return out
    if kind == "cstore":
        return w.complete_store(pick, count)
    if kind == "cload":
        return w.complete_load(pick)
    if kind == "abort":
        return w.abort(pick)
    if kind == "preempt":  # flag: the request furthest along, whose stores are done or in flight
        return w.preempt(pick, furthest=flag)
    if not flag:  # half the resets (which drop every store cursor) preempt the furthest request instead
        return w.preempt(pick, furthest=True)
    return w.reset()


def revisit(w: OffloadingWorld, rid: str, cut: int, tail: int) -> str:
    """A new request for ``rid``'s prompt less 0-2 blocks, plus ``tail`` new tokens."""
    prompt = w.prompts[rid]
    return w.add_request(prompt[:max(1, len(prompt) - 4 * (cut % 3))] + [5] * tail)


def apply_offloading_op(w: OffloadingWorld, op):
    w.check_started()  # a connector that refused the configuration at startup fails the first op
    kind, fam, n, tail, chunk, rep, pick, count, flag = op
    if kind == "add":
        # Half the unrelated arrivals, and a second arrival after half the others, ask for an
        # earlier prompt again, cut or extended: lookups over prefixes the GPU and the CPU pool have
        # partly evicted (gaps inside cached runs, windows across a miss).
        again = [w.order[(pick if fam == 2 and flag else pick // 3) % len(w.order)]] if w.order else []
        if fam == 2 and flag and again:
            return revisit(w, again[0], pick, tail)
        # longer prompts than SimpleCPU's (rep 2-4: 8 tokens more; rep 1, as in the directed traces,
        # unchanged): hits of several chunks per group, windows inside them
        n += 8 * (rep > 1)
        rid = w.add_request([1000 + 50 * len(w.order) + i for i in range(n)] if fam == 2
                            else PREFIXES[fam][:n] + [7] * tail)
        return (rid, revisit(w, again[0], pick // 7, 3 - tail)) if count == 2 and again else rid
    if kind == "step":
        # An idle engine gets an earlier prompt again first (steps of an empty engine compare nothing),
        # half the time after forgetting its GPU prefix cache (the lookup then starts at chunk 0).
        again = None
        if w.order and not w.live():
            again = (flag and w.reset_gpu_prefix_cache(), revisit(w, w.order[pick % len(w.order)], pick // 3, tail))
        return again, [w.step(chunk) for _ in range(rep)]
    if kind == "drain":
        out = []
        while w.jobs:
            out.append(w.complete(-1 if flag else 0, 2))
        return out
    if kind == "cload" and flag:
        # vLLM's reset_prefix_cache() (reset_connector=False): the GPU forgets its prefix cache when
        # idle, the CPU pool keeps every chunk, so the next arrivals look their prefixes up there.
        return w.reset_gpu_prefix_cache()
    if kind in ("cstore", "cload"):
        return w.complete(pick, count)
    if kind == "abort":
        return w.abort(pick)
    if kind == "preempt":
        return w.preempt(pick)
    return w.reset()


# --- directed traces (docs/offload.md) ------------------------------------------------------

FA_ONLY = SimpleOffloadConfig(block_size=4, num_gpu_blocks=12, num_cpu_blocks=24)


def pre_fix_41289_trace(world: SimpleOffloadWorld) -> SimpleOffloadWorld:
    """A second request hits the first one's GPU prefix while that prefix's store is in flight."""
    world.add_request(list(range(100, 113)))
    world.step(16)  # r0 computes its prompt
    world.step(16)  # its blocks are confirmed: store event 0 (not completed)
    world.add_request(list(range(100, 113)) + [5])
    world.step(16)  # r1 hits r0's blocks on the GPU; its scan sees them again
    return world


# The PR 42903 trace: one request, FA + SWA(window 4), 4-token blocks, 7 usable GPU blocks, 4 usable
# CPU blocks. The CPU fills in step 2, so the SWA cursor lags; SWA block 5 leaves the window, is freed
# and re-allocated to SWA slot 3 of the same request; the next scan meets block 5 at stale slot 1 and
# at slot 3 and stores it twice in one event.
PR42903 = SimpleOffloadConfig(block_size=4, num_gpu_blocks=8, num_cpu_blocks=5, sliding_window=4)


def run_pr42903(world: SimpleOffloadWorld) -> SimpleOffloadWorld:
    world.add_request(list(range(100, 120)))
    world.step(12)
    world.step(4)
    world.complete_store(0)
    world.step(4)
    world.step(4)
    return world
