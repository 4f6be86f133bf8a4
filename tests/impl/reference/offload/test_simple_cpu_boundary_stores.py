"""SimpleCPU reference on FA + Mamba "align" pools: boundary-state hand-offs, their outcome
counters, the full-attention partial tail stored at finish, and bad input (#22)."""

from __future__ import annotations

import pytest

from kvref.impl.reference.offload.simple_cpu_boundary_stores import _find_fa_partial_tail_source
from kvref.impl.reference.offload.simple_cpu_offload_scheduler import SimpleCPUOffloadScheduler, SimpleOffloadStep
from kvref.models.offload.simple_cpu_mamba_world import SimpleOffloadMambaConfig, SimpleOffloadMambaWorld
from kvref.spec.errors import InvalidFieldError

CFG = SimpleOffloadMambaConfig(num_gpu_blocks=16, num_cpu_blocks=16)
PROMPT = list(range(100, 113))  # 13 tokens: the last hash boundary (12) falls inside the second 8-token block


def _prefilled(cfg=CFG, prompt=PROMPT):
    w = SimpleOffloadMambaWorld(cfg, "reference")
    rid = w.add_request(prompt, 2)
    outs = [w.step(8) for _ in range(3)]
    return w, rid, outs


def test_mamba_states_are_stored_from_the_hand_offs():
    w, rid, outs = _prefilled()
    handoffs = [h for _, h, _ in outs]
    # the 8-token boundary state, then (sub-block) the prompt-tail state's copy-on-write target
    assert [(g, tokens) for g, _, tokens in handoffs[0][rid]] == [(1, 8)]
    assert w.b.table(rid)[1][0] == 0, "the state's table slot is nulled later: only the hand-off names it"
    assert handoffs[2][rid][0][2] == 12 and outs[2][2], "the tail state is handed off as its CoW copy"
    stored = [gid for (_, _, _, ev, sg, _, _), h, _ in outs for gid in sg if ev >= 0]
    for entries in filter(None, handoffs):
        assert entries[rid][0][1] in stored
    conn = w.b.conn
    assert conn.take_save_outcomes() == {("stored",): 2}
    assert conn.take_save_outcomes() == {}, "drained"
    assert conn.get_boundary_store_stats()["published"] == 2
    conn.check_invariants()


def test_the_prompt_tail_block_is_flushed_at_finish():
    w, rid, _ = _prefilled()
    tail_block = w.b.table(rid)[0][1]  # FA block 1 holds tokens 8..15, boundary 12 is inside it
    w.finish(rid)
    flushed = [g for t in w.b.conn._pending_finished_stores for g in t.gpu_block_ids]
    assert tail_block in flushed
    meta = w.step(8)[0]
    assert tail_block in meta[4]


def test_the_tail_source_is_found_only_inside_a_block():
    w, rid, _ = _prefilled()
    req, table = w.reqs[rid].req, w.b.table(rid)
    assert _find_fa_partial_tail_source(w.b.conn, req, table) == table[0][1]
    w2, rid2, _ = _prefilled(prompt=list(range(100, 117)))  # 17 tokens: last hash boundary 16, a block edge
    assert _find_fa_partial_tail_source(w2.b.conn, w2.reqs[rid2].req, w2.b.table(rid2)) is None
    w.finish(rid)
    assert _find_fa_partial_tail_source(w.b.conn, req, table) is None, "already being stored"


def test_declined_hand_offs_are_counted_by_reason():
    w, rid, _ = _prefilled()
    conn, gpu = w.b.conn, w.b.gpu_pool
    while w.stores:
        w.complete_store(0, CFG.world_size)
    conn.take_save_outcomes()
    on_cpu = conn.cpu_block_pool.cached_block_hash_to_block.get_one_block
    cached = next(b.block_id for b in gpu.blocks if b.block_hash is not None and on_cpu(b.block_hash) is not None)
    fresh = next(b.block_id for b in gpu.blocks if b.block_hash is not None and on_cpu(b.block_hash) is None)
    unhashed = next(b.block_id for b in gpu.blocks[1:] if b.block_hash is None)
    step = SimpleOffloadStep(boundary_state_offloads={rid: [(1, 0, 8), (1, unhashed, 8), (1, fresh, 8),
                                                            (1, fresh, 8), (1, cached, 8)]})
    conn.build_connector_meta(step)
    assert conn.take_save_outcomes() == {("dropped_null_block",): 1, ("dropped_not_hashed",): 1, ("stored",): 1,
                                         ("skipped_in_flight",): 1, ("skipped_already_cached",): 1}
    gone = SimpleOffloadStep(finished_req_ids={rid}, boundary_state_offloads={rid: [(1, fresh, 8)] * 2})
    conn.build_connector_meta(gone)
    assert conn.take_save_outcomes() == {("dropped_request_gone",): 2}
    conn.check_invariants()


def test_cpu_full_and_reset_keeps_undrained_outcomes():
    w, rid, _ = _prefilled(SimpleOffloadMambaConfig(num_gpu_blocks=16, num_cpu_blocks=1))
    conn = w.b.conn
    assert conn.boundary_store_stats.counts["dropped_cpu_full"] == 2
    w.finish(rid)
    w.step(1)
    assert conn.reset()
    assert conn.take_save_outcomes() == {("dropped_cpu_full",): 2}, "a reset mid-interval loses no outcome"
    assert conn.get_boundary_store_stats()["dropped_cpu_full"] == 2


@pytest.mark.parametrize("bad", [[(1, 2)], [(1, 10**6, 8)], [(5, 2, 8)], [(1, -1, 8)], "x", [(1, 2.0, 8)]])
def test_bad_hand_offs_are_rejected_and_change_nothing(bad):
    w, rid, _ = _prefilled()
    conn = w.b.conn
    def snapshot():
        return (conn.get_boundary_store_stats(), sorted(conn._store_event_to_blocks),
                sorted(conn._in_flight_store_gpu_blocks),
                [b.ref_cnt for b in w.b.gpu_pool.blocks], [b.ref_cnt for b in conn.cpu_block_pool.blocks],
                conn.cpu_block_pool.get_num_free_blocks())

    before = snapshot()
    with pytest.raises(InvalidFieldError, match="boundary_state_offloads"):
        conn.build_connector_meta(SimpleOffloadStep(boundary_state_offloads={rid: bad}))
    with pytest.raises(InvalidFieldError, match="boundary_state_offloads"):
        conn.build_connector_meta(SimpleOffloadStep(boundary_state_offloads=[("r0", bad)]))
    assert snapshot() == before


def test_mamba_pools_refuse_what_is_not_modelled():
    groups = CFG.kvref_groups()
    with pytest.raises(InvalidFieldError, match="lazy_offload"):
        SimpleCPUOffloadScheduler(groups, 8, 256, 8, 4, lazy_offload=True)
    with pytest.raises(InvalidFieldError, match="block_size"):
        SimpleCPUOffloadScheduler(groups, 8, 256, 12, 4)  # 8-token groups do not divide the scheduler block
    with pytest.raises(InvalidFieldError, match="hash_block_size"):
        SimpleCPUOffloadScheduler(groups[:1], 8, 256, 8, 4)  # finer hashes without Mamba: not modelled


def test_kv_events_on_a_mamba_pool_carry_block_and_hash_unit_payloads():
    """With KV events on, a 13-token prompt's second 8-token block first holds the prompt's last
    hash boundary (12 tokens: a partial-hash key), then fills up with decoded tokens and is stored
    under its full key: it publishes that primary key with its 8 tokens, and the boundary key (a
    secondary key of the GPU block) with the 4 tokens of that hash unit and ``block_size=4``, both
    chained to the hash of tokens 104-107; Mamba states stored from hand-offs carry no payload."""
    from dataclasses import replace

    w = SimpleOffloadMambaWorld(replace(CFG, kv_events=True), "reference")
    rid = w.add_request(PROMPT, 6)
    for _ in range(10):
        w.step(8)
    assert w.reqs[rid].phase == "done"
    while w.stores:
        w.complete_store(0, w.cfg.world_size)
    stored = [e for e in w.b.take_kv_events() if e["type"] == "BlockStored"]
    fa = [e for e in stored if e["group_idx"] == 0]
    assert [(e["block_size"], e["token_ids"][:5]) for e in fa] == [
        (8, [100, 101, 102, 103, 104]), (8, [108, 109, 110, 111, 112]), (4, [108, 109, 110, 111])]
    assert fa[0]["parent_block_hash"] is None and fa[1]["parent_block_hash"] == fa[2]["parent_block_hash"] is not None
    mamba = [e for e in stored if e["group_idx"] == 1]
    assert mamba and all(e["token_ids"] == [] and e["block_size"] == 8 for e in mamba)
