"""Random call sequences, valid and invalid mixed, on the block pool itself and on both CPU-offload
schedulers (issue #15): out-of-order and repeated calls — completions never issued, duplicated or
zero; a request finished twice; loads reported for requests that load nothing; a block freed twice,
freed by another pool, touched after it was freed; steps that are not steps.

Every invalid call must raise a ``ValueError`` subclass and leave the object's pickled state as it
was, with ``check_invariants()`` holding; the valid calls in between run through the offload
worlds (:mod:`kvref.models.offload`), whose content model checks every step. Where vLLM allows a
call (touching a free block is a prefix hit), it may succeed, and the invariants must hold after.
"""

from __future__ import annotations

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule
from kvref.impl.reference.block_pool import BlockPool
from kvref.models.offload.offloading_connector_world import (
    OffloadingConfig,
    OffloadingWorld,
)
from kvref.models.offload.simple_cpu_world import (
    SimpleOffloadConfig,
    SimpleOffloadWorld,
)

from tests.conftest import profile_examples
from tests.hardening.api_targets import snapshot


def rejected(obj, check_invariants, call) -> None:
    """``call()`` must raise a ValueError subclass with a message and change nothing."""
    before = snapshot(obj)
    try:
        call()
    except ValueError as exc:
        assert str(exc).strip()
        assert snapshot(obj) == before, f"rejected with {exc!r} after changing state"
        check_invariants()
        return
    raise AssertionError("an invalid call was accepted")


def rejected_or_harmless(obj, check_invariants, call) -> bool:
    """``call()`` may work (then the invariants hold) or be rejected with nothing changed; True
    when it worked."""
    before = snapshot(obj)
    try:
        call()
    except ValueError as exc:
        assert str(exc).strip()
        assert snapshot(obj) == before, f"rejected with {exc!r} after changing state"
        check_invariants()
        return False
    check_invariants()
    return True


PREFIXES = [list(range(100, 140)), list(range(200, 240))]


def _prompt(world, fam: int, n: int) -> list[int]:
    return [1000 + 40 * len(world.order) + i for i in range(n)] if fam == 2 else PREFIXES[fam][:n]


# ------------------------------------------------------------------------------- block pool


class BlockPoolMisuse(RuleBasedStateMachine):
    """A BlockPool and the references this caller holds: valid allocations, frees, touches and
    caching mixed with frees of blocks not held (twice, foreign, null, None), wrong hashes."""

    def __init__(self) -> None:
        super().__init__()
        self.pool = BlockPool(10, True, 4)
        self.other = BlockPool(10, True, 4)
        self.held: list = []  # one entry per reference this caller holds (a block may repeat)
        self.next_hash = 0

    def _bad(self, call):
        rejected(self.pool, self.pool.check_invariants, call)

    @rule(n=st.integers(0, 4))
    def allocate(self, n):
        rejected_or_harmless(self.pool, self.pool.check_invariants,
                             lambda: self.held.extend(self.pool.get_new_blocks(n)))

    @rule(n=st.sampled_from([-1, 10**30, 11, None, True, 2.0]))
    def allocate_wrong(self, n):
        self._bad(lambda: self.pool.get_new_blocks(n))

    @precondition(lambda self: self.held)
    @rule(k=st.integers(1, 3), data=st.data())
    def free(self, k, data):
        picks = data.draw(st.lists(st.integers(0, len(self.held) - 1), min_size=1, max_size=k, unique=True))
        blocks = [self.held[i] for i in picks]
        self.pool.free_blocks(blocks)
        for i in sorted(picks, reverse=True):
            del self.held[i]

    @rule(i=st.integers(1, 9))
    def free_not_held(self, i):
        """A block nobody holds (free twice / never allocated), one of another pool, the null block."""
        block = self.pool.blocks[i]
        if block.ref_cnt == 0:
            self._bad(lambda: self.pool.free_blocks([block]))
        self._bad(lambda: self.pool.free_blocks([self.other.blocks[i]]))
        self._bad(lambda: self.pool.free_blocks([None]))

    @rule(i=st.integers(0, 9))
    def touch(self, i):
        """Touching a free block is a prefix hit in vLLM (it leaves the free queue); may work."""
        block = self.pool.blocks[i]
        if rejected_or_harmless(self.pool, self.pool.check_invariants,
                                lambda: self.pool.touch([block])) and not block.is_null:
            self.held.append(block)

    @rule(i=st.integers(1, 9))
    def touch_wrong(self, i):
        self._bad(lambda: self.pool.touch([self.other.blocks[i]]))
        self._bad(lambda: self.pool.touch([i]))
        self._bad(lambda: self.pool.touch(None))

    @precondition(lambda self: self.held)
    @rule(n=st.integers(1, 3), short=st.booleans())
    def cache(self, n, short):
        blocks = [b for b in dict.fromkeys(self.held) if b.block_hash is None][:n]
        if not blocks:
            return
        hashes = [(self.next_hash + j).to_bytes(32, "big") for j in range(len(blocks))]
        if short:  # too few hashes for the range: rejected before the first key is published
            self._bad(lambda: self.pool.cache_full_blocks(hashes[:-1], blocks, 0, len(blocks), 4, 0))
            return
        self.next_hash += len(blocks)
        rejected_or_harmless(self.pool, self.pool.check_invariants,
                             lambda: self.pool.cache_full_blocks(hashes, blocks, 0, len(blocks), 4, 0))

    @rule(ids=st.lists(st.integers(-1, 11), max_size=3))
    def evict(self, ids):
        rejected_or_harmless(self.pool, self.pool.check_invariants, lambda: self.pool.evict_blocks(ids))

    @rule()
    def reset(self):
        self.pool.reset_prefix_cache()

    @invariant()
    def holds(self):
        self.pool.check_invariants()
        refs = {}
        for b in self.held:
            refs[b.block_id] = refs.get(b.block_id, 0) + 1
        for b in self.pool.blocks[1:]:
            assert b.ref_cnt == refs.get(b.block_id, 0), f"block {b.block_id}: ref_cnt {b.ref_cnt}, held {refs}"


BlockPoolMisuse.TestCase.settings = settings(max_examples=profile_examples(30, 150), stateful_step_count=30,
                                             deadline=None)
test_block_pool_misuse_sequences = BlockPoolMisuse.TestCase


# ------------------------------------------------------------------------------- SimpleCPU offload

SIMPLE = SimpleOffloadConfig(block_size=4, num_gpu_blocks=12, num_cpu_blocks=24, world_size=2)


class SimpleOffloadMisuse(RuleBasedStateMachine):
    """SimpleCPUOffloadScheduler driven by the offload world, with invalid calls in between."""

    def __init__(self) -> None:
        super().__init__()
        self.w = SimpleOffloadWorld(SIMPLE, "reference")

    @property
    def conn(self):
        return self.w.b.conn

    def _bad(self, call):
        rejected(self.w.b, self.w.b.check_invariants, call)

    # valid calls (the world checks content and invariants after each)
    @rule(fam=st.integers(0, 2), n=st.sampled_from([13, 20, 9, 30, 2]))
    def add_request(self, fam, n):
        self.w.add_request(_prompt(self.w, fam, n))

    @rule(chunk=st.sampled_from([8, 4, 12, 64]))
    def step(self, chunk):
        self.w.step(chunk)

    @precondition(lambda self: self.w.stores)
    @rule(pick=st.integers(0, 99), count=st.integers(1, 2))
    def complete_store(self, pick, count):
        self.w.complete_store(pick, count)

    @precondition(lambda self: self.w.loads)
    @rule(pick=st.integers(0, 99))
    def complete_load(self, pick):
        self.w.complete_load(pick)

    @rule(pick=st.integers(0, 99))
    def abort(self, pick):
        self.w.abort(pick)

    @rule()
    def reset(self):
        self.w.reset()

    # invalid calls
    @rule(event=st.integers(0, 40), count=st.sampled_from([1, 0, -1, 3]))
    def completion_not_in_flight(self, event, count):
        """Never issued, already completed (a duplicated completion event), or a count that is no count."""
        c = self.conn
        issued = event in c._store_event_to_blocks or event in c._abandoned_store_event_to_blocks
        if issued and 1 <= count <= c.world_size - c._store_event_pending_counts.get(event, 0):
            return  # a valid completion (issued, not yet fully reported): the world's rule sends those
        self._bad(lambda: self.conn.update_connector_output((), {event: count}))

    @rule(rid=st.sampled_from(["ghost", "r0", "r1"]))
    def load_completion_without_a_load(self, rid):
        if rid in self.w.loads:
            return
        self._bad(lambda: self.conn.update_connector_output((rid,), {}))

    @precondition(lambda self: any(r.phase == "done" for r in self.w.reqs.values()))
    @rule(data=st.data())
    def finished_request_again(self, data):
        done = [r for r in self.w.reqs.values() if r.phase == "done" and r.rid not in self.w.finished_pending]
        if not done:
            return
        r = data.draw(st.sampled_from(done))
        self._bad(lambda: self.conn.request_finished(r.req, self.w.b.table(r.rid)))
        self._bad(lambda: self.conn.get_num_new_matched_tokens(r.req, 0))

    @precondition(lambda self: self.w.reqs)
    @rule(data=st.data(), how=st.sampled_from(["groups", "external", "computed"]))
    def wrong_alloc_arguments(self, data, how):
        r = data.draw(st.sampled_from(list(self.w.reqs.values())))
        n = len(SIMPLE.kvref_groups())
        if how == "groups":
            self._bad(lambda: self.conn.update_state_after_alloc(r.req, tuple([1] for _ in range(n + 1)), 0))
        elif how == "external":
            self._bad(lambda: self.conn.update_state_after_alloc(r.req, self.w.b.table(r.rid), -4))
        else:
            self._bad(lambda: self.conn.get_num_new_matched_tokens(r.req, -1))

    @rule(step=st.sampled_from([None, {"scheduled": []}, [], "step"]))
    def not_a_step(self, step):
        self._bad(lambda: self.conn.build_connector_meta(step))

    @rule()
    def bind_another_pool(self):
        """Binding a second GPU pool used to be accepted, orphaning the blocks transfers hold."""
        self._bad(lambda: self.conn.bind_gpu_block_pool(BlockPool(SIMPLE.num_gpu_blocks, True, 4)))
        rejected_or_harmless(self.w.b, self.w.b.check_invariants,
                             lambda: self.conn.bind_gpu_block_pool(self.w.b.mgr.block_pool))

    @invariant()
    def holds(self):
        self.w._check()


SimpleOffloadMisuse.TestCase.settings = settings(max_examples=profile_examples(20, 60), stateful_step_count=25,
                                                 deadline=None)
test_simple_offload_misuse_sequences = SimpleOffloadMisuse.TestCase


# ------------------------------------------------------------------------------- OffloadingConnector

CONNECTOR = OffloadingConfig(block_size=4, num_gpu_blocks=24, num_cpu_chunks=12, blocks_per_chunk=1, num_workers=2)


class ConnectorMisuse(RuleBasedStateMachine):
    """OffloadingConnectorScheduler driven by the offloading world, with invalid calls in between."""

    def __init__(self) -> None:
        super().__init__()
        self.w = OffloadingWorld(CONNECTOR, "reference")

    @property
    def conn(self):
        return self.w.b.conn

    def _bad(self, call):
        rejected(self.w.b, self.w.b.check_invariants, call)

    @rule(fam=st.integers(0, 2), n=st.sampled_from([13, 20, 9, 30]))
    def add_request(self, fam, n):
        self.w.add_request(_prompt(self.w, fam, n))

    @rule(chunk=st.sampled_from([8, 4, 12, 64]))
    def step(self, chunk):
        self.w.step(chunk)

    @precondition(lambda self: self.w.jobs)
    @rule(pick=st.integers(0, 99), count=st.integers(1, 2))
    def complete(self, pick, count):
        self.w.complete(pick, count)

    @precondition(lambda self: self.w.order)
    @rule(pick=st.integers(0, 99))
    def finish(self, pick):
        live = [rid for rid in self.w.order if self.w.reqs[rid].phase != "done"]
        if live:
            self.w.finish(live[pick % len(live)])

    @rule()
    def reset(self):
        self.w.reset()

    # invalid calls
    @rule(job=st.integers(0, 60), count=st.sampled_from([1, 0, -2, 3]))
    def completion_not_in_flight(self, job, count):
        """A job never issued or already complete (duplicated completion), or a wrong count."""
        c = self.conn
        if job < c._stale_job_threshold and count >= 1:
            return  # jobs from before a reset only count down the fence: vLLM ignores them too
        if job in c._jobs and 1 <= count <= c._jobs[job].pending_count:
            return  # a valid completion: the world's rule sends those
        self._bad(lambda: c.update_connector_output({job: count}))

    @rule(what=st.sampled_from([None, [], "jobs", {"1": 1}]))
    def not_completions(self, what):
        self._bad(lambda: self.conn.update_connector_output(what))

    @rule(step=st.sampled_from([None, {"scheduled": []}, [], "step"]))
    def not_a_step(self, step):
        self._bad(lambda: self.conn.build_connector_meta(step))

    @precondition(lambda self: self.w.reqs)
    @rule(data=st.data(), how=st.sampled_from(["external", "computed", "blocks"]))
    def wrong_arguments(self, data, how):
        r = data.draw(st.sampled_from(list(self.w.reqs.values())))
        if how == "external":
            self._bad(lambda: self.conn.update_state_after_alloc(r.req, [[]], -1))
        elif how == "computed":
            self._bad(lambda: self.conn.get_num_new_matched_tokens(r.req, -1))
        else:
            self._bad(lambda: self.conn.update_state_after_alloc(r.req, [[(1, "no")], [(2, False)], []], 0))

    @rule()
    def unknown_request(self):
        from kvref.impl.request import Request

        ghost = Request("ghost", list(range(8)), max_tokens=2)
        self._bad(lambda: self.conn.get_num_new_matched_tokens(ghost, 0))
        # no external tokens: only the batch's allocated blocks are noted (none here), as in vLLM
        rejected_or_harmless(self.w.b, self.w.b.check_invariants,
                             lambda: self.conn.update_state_after_alloc(ghost, [[]], 0))
        self._bad(lambda: self.conn.update_state_after_alloc(ghost, [[(1, False)]], 4))

    @precondition(lambda self: self.w.reqs)
    @rule(data=st.data())
    def new_request_twice(self, data):
        r = data.draw(st.sampled_from(list(self.w.reqs.values())))
        if r.phase != "done":
            self._bad(lambda: self.conn.on_new_request(r.req))

    @invariant()
    def holds(self):
        self.w.b.check_invariants()


ConnectorMisuse.TestCase.settings = settings(max_examples=profile_examples(20, 100), stateful_step_count=25,
                                             deadline=None)
test_connector_misuse_sequences = ConnectorMisuse.TestCase
