"""Which group layouts vLLM's ``HiSparseCoordinator`` accepts, against the reference's, and the
host-only layout's programs (issue #22): the runs ``kvref verify``'s conform-kv-manager makes,
derandomized, with the outcomes each must reach."""

from __future__ import annotations

import pytest

from kvref.impl.reference.hisparse_group_layout import check_group_layout, hisparse_coordinator_for_layout
from kvref.models.machines.hisparse_layouts import FAULTS, run_hisparse_layouts
from kvref.spec.errors import InvalidFieldError
from tests.vllm_env import require_vllm


@pytest.mark.vllm
def test_vllm_and_reference_accept_the_same_layouts():
    require_vllm()
    from kvref.impl.vllm.hisparse import vllm_hisparse_coordinator_for_layout

    failure, seen = run_hisparse_layouts(vllm_hisparse_coordinator_for_layout, 4)
    assert failure is None, failure
    # the builder's own layout is accepted, every fault but a host block size is rejected (a host
    # group of another block size is fine while no resident group shares the pool)
    assert seen["none:accepted"] == 4
    for fault in FAULTS[1:]:
        assert seen[f"{fault}:rejected"] >= 1, (fault, seen)
        assert fault == "host_size" or not seen[f"{fault}:accepted"], (fault, seen)


@pytest.mark.vllm
def test_host_only_programs_refusals_and_probes_agree():
    require_vllm()
    from kvref.impl.vllm.hisparse import VllmHiSparsePool
    from kvref.models.machines.hisparse_pool import run_hisparse_programs

    failure, seen, _ = run_hisparse_programs(VllmHiSparsePool, 16)
    assert failure is None, failure
    assert seen["host_only"] >= 2 and seen["admit"] and seen["free"]
    assert seen["adopt_refused"] and seen["mirrors_past_table"]
    assert seen["import_done"] >= 4 and seen["restores_sent"] >= 4  # the landed imports' restores
    assert seen["none:accepted"] and seen["two_sources:rejected"]


@pytest.mark.vllm
def test_a_reused_copy_block_is_dropped_from_the_copy_index():
    require_vllm()
    from kvref.impl.vllm.hisparse import VllmHiSparsePool
    from kvref.models.machines.hisparse_pool import COPY_REUSED, HAND_PROGRAMS, run_hisparse_program

    (config, lengths, _), = [p for p in HAND_PROGRAMS if p[2] is COPY_REUSED]

    def copies_after(ops):
        pools = []
        seen = run_hisparse_program(config, lengths, ops, lambda c: pools.append(VllmHiSparsePool(c)) or pools[-1])
        return {b.block_id for blocks in pools[0].coordinator.copies.values() for b in blocks}, seen

    published, _ = copies_after(COPY_REUSED[:8])  # r0 written back, published and freed
    left, seen = copies_after(COPY_REUSED)
    assert published and published - left, (published, left)  # the pool handed a copy's block out
    assert seen["copy_adopted"] and seen["page_lost"], seen


@pytest.mark.vllm
def test_a_page_lost_on_two_resident_groups():
    require_vllm()
    from kvref.impl.vllm.hisparse import VllmHiSparsePool
    from kvref.models.machines.hisparse_pool import HAND_PROGRAMS, run_hisparse_program

    (config, lengths, ops), = [p for p in HAND_PROGRAMS if p[0].num_resident_groups == 2]
    seen = run_hisparse_program(config, lengths, ops, VllmHiSparsePool)
    assert seen["unpinned"] and seen["page_lost"], seen


@pytest.mark.vllm
def test_refused_adoptions_change_nothing_on_either_side():
    require_vllm()
    from kvref.impl.vllm.hisparse import VllmHiSparsePool
    from kvref.models.machines.hisparse_pool import HAND_PROGRAMS, run_hisparse_program

    (config, lengths, ops), = [p for p in HAND_PROGRAMS if p[2][-1][0] == "drop"]
    seen = run_hisparse_program(config, lengths, ops, VllmHiSparsePool)
    assert seen["adopt"] == 2 and seen["adopt_refused"] >= 4 and seen["drop"] == 1, seen


def test_reference_rejects_each_faulty_layout_naming_the_field():
    good = [("source", 2), ("indexer", 2), ("resident", 2), ("hot", 2)]
    c = hisparse_coordinator_for_layout(good, 8, 20, 16)
    assert (c.host_group_id, len(c.resident_managers), len(c.hot_managers), c.max_spill_pages) == (0, 1, 1, 8)
    assert c.transition_watermark == 2  # max(one hot region of 1 block, 20 // 10)
    host_only = hisparse_coordinator_for_layout(good[:2], 8, 20, 16)
    assert (host_only.resident_managers, host_only.transition_watermark, host_only.max_spill_pages) == ((), 0, 0)
    for layout, host, field in (([("source", 2), ("source", 2)] + good[1:], 8, "managers"),
                                ([good[2], good[0], good[1], good[3]], 8, "managers"),
                                ([("source", 4)] + good[1:], 8, "block_size"),
                                (good[1:], 8, "managers"),
                                ([("full", 2)], 8, "managers"),
                                (good, None, "hisparse_host_num_blocks")):
        with pytest.raises(InvalidFieldError) as exc:
            hisparse_coordinator_for_layout(layout, host, 20, 16)
        assert exc.value.field == field, (layout, exc.value)
    for bad, field in (([], "layout"), ([("sink", 2)], "layout[0]"), ([("source", 0)], "layout[0].block_size"),
                       ("source", "layout")):
        with pytest.raises(InvalidFieldError) as exc:
            check_group_layout(bad)
        assert exc.value.field == field
