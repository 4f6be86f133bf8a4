"""The edge-aiming functions on their own (#26: plain functions of the harness, testable without the
machine): what each returns decides at the pool's exact edge on the reference, by one block."""

from __future__ import annotations

from kvref.impl.interface import PoolConfig
from kvref.models.conformance.differential import Harness
from kvref.models.conformance.trace import Op
from kvref.models.machines import kv_cache_manager_edges as edges
from kvref.spec.kv_cache_interface import FullAttentionSpec, KVCacheGroupSpec


def _harness(num_blocks: int = 12) -> Harness:
    fa = FullAttentionSpec(block_size=4, num_kv_heads=1, head_size=1, dtype="float16")
    pool = PoolConfig(num_blocks=num_blocks, groups=(KVCacheGroupSpec(("l",), fa),), max_model_len=32,
                      scheduler_block_size=4, hash_block_size=4)
    h = Harness(pool, ["reference"])
    h.apply(Op("add", dict(rid="a", prompt=list(range(10)), max_tokens=2, cache_salt=None)))
    return h


def _admit(**kw) -> Op:
    args = dict(rid="a", chunk=64, full_sequence_must_fit=True, reserved_blocks=0, in_flight=False, token=1)
    return Op("admit", {**args, **kw})


class _FixedDraws:
    """Stands in for Hypothesis' ``data``: fill_to_edge draws only a filler seed."""

    def draw(self, strategy, label=None):
        return 7


def test_request_ids_are_taken_in_order_and_a_peek_takes_none():
    rids = edges.RequestIds()
    assert (rids.peek(), rids.peek(1)) == ("r0", "r1")
    assert (rids.take(), rids.take(), rids.peek()) == ("r0", "r1", "r2")


def test_edge_reserved_is_the_largest_reservation_the_admission_still_fits_under():
    h = _harness()
    counts = edges.EdgeCounts()
    edge = edges.edge_reserved(h, _admit(), False, counts)
    assert edge is not None and counts.reservations == 1
    assert edges.fits(h, [_admit(reserved_blocks=edge, reserve_slack=-1)])
    assert not edges.fits(h, [_admit(reserved_blocks=edge + 1, reserve_slack=-1)])
    assert edges.edge_reserved(h, _admit(), True, counts) == edge + 1  # short: refused by a block
    assert h.num_applied == 1  # probes only: the compared harness still holds the arrival alone


def test_fill_to_edge_leaves_the_next_op_no_block_to_spare():
    h = _harness(num_blocks=10)  # 9 free: a filler of 8 blocks leaves too few, so the filler is searched
    then = [_admit()]
    rids, counts = edges.RequestIds(), edges.EdgeCounts()
    fillers = edges.fill_to_edge(h, _FixedDraws(), rids, counts, then, short=False)
    added = [op.args["rid"] for op in fillers if op.name == "add"]
    assert added and added == [f"r{i}" for i in range(rids.taken)] and counts.fills == 1
    assert edges.fits(h, fillers + then)
    short = edges.fill_to_edge(h, _FixedDraws(), edges.RequestIds(), edges.EdgeCounts(), then, short=True)
    assert edges.fits(h, short) and not edges.fits(h, short + then)  # one filler token more: refused
