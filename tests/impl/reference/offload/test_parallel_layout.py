"""The reference of build_offloading_config's parallelism gate on hand-picked layer sets (#22): each
rule of kvref.impl.reference.offload.parallel_layout once, with the case that tips it."""

from __future__ import annotations

import pytest

from kvref.impl.reference.offload.parallel_layout import (
    OffloadGroup,
    OffloadLayer,
    OffloadParallel,
    layer_certifiable,
    offloaded_groups,
    parallelism_agnostic,
    replicated_layout,
    worker_kv_bytes_per_block,
)
from kvref.spec.errors import InvalidFieldError

FULL = OffloadLayer("full", 1, 64, 4)
MLA = OffloadLayer("mla", 1, 32, 4)


def test_offloaded_groups_and_bytes():
    ring = OffloadGroup((OffloadLayer("circular", 1, 64, 4),))
    groups = [OffloadGroup((FULL, FULL)), ring, OffloadGroup((FULL,), transfer=False),
              OffloadGroup((FULL, MLA), uniform=True)]
    assert offloaded_groups(groups) == (0, 3)
    assert worker_kv_bytes_per_block(groups, 8, None) == 2 * 64 + (64 + 32)
    assert worker_kv_bytes_per_block(groups, 8, 1000) == 125 and worker_kv_bytes_per_block(groups, 0, None) == 0
    with pytest.raises(InvalidFieldError, match="groups"):
        offloaded_groups([ring])


def test_plain_gate_needs_one_head_sharded_full_group():
    par = OffloadParallel(tp=2, total_kv_heads=2)
    assert parallelism_agnostic([OffloadGroup((FULL, FULL))], par, False)
    assert not parallelism_agnostic([OffloadGroup((FULL,))], OffloadParallel(tp=2, total_kv_heads=4), False)
    assert not parallelism_agnostic([OffloadGroup((FULL,))], OffloadParallel(tp=2, total_kv_heads=2, dcp=2), False)
    assert not parallelism_agnostic([OffloadGroup((FULL,)), OffloadGroup((FULL,))], par, False)
    assert not parallelism_agnostic([OffloadGroup((FULL,))], OffloadParallel(2, 2, v2_runner=True), False)


def test_canonical_gate_certifies_every_layer():
    par = OffloadParallel(tp=4, total_kv_heads=2)  # replicated heads: one per rank
    swa = OffloadLayer("swa", 1, 64, 4)
    assert parallelism_agnostic([OffloadGroup((FULL,)), OffloadGroup((swa, FULL), uniform=True)], par, True)
    assert not parallelism_agnostic([OffloadGroup((FULL, OffloadLayer("chunked", 1, 64, 4)), uniform=True)], par,
                                    True)
    assert not layer_certifiable(OffloadLayer("full", 1, 64, 4, per_token_head=True), 2, 4)
    assert not layer_certifiable(OffloadLayer("full", 1, 64, 4), 3, 2)  # 3 heads over 2 ranks
    assert layer_certifiable(MLA, 1, 8) and not layer_certifiable(OffloadLayer("mla", 1, 32, 4, tokens_per_state=2),
                                                                   1, 8)
    assert not layer_certifiable(OffloadLayer("hidden_state", 1, 32, 4), 1, 8)
    assert not parallelism_agnostic([OffloadGroup((FULL,))], OffloadParallel(4, 2, world_size=8), True)


def test_replicated_layout():
    mla = [OffloadGroup((MLA,))]
    par = OffloadParallel(tp=2, total_kv_heads=1, use_mla=True, kv_tp_replicas=2)
    assert replicated_layout(mla, par, False, 32) and not replicated_layout(mla, par, False, 0)
    assert not replicated_layout(mla, OffloadParallel(2, 1, use_mla=True, kv_tp_replicas=2, backend="ray"), False, 32)
    assert replicated_layout(mla, par, True, 0)  # canonical: agnostic MLA, one node, mp
    assert not replicated_layout(mla, OffloadParallel(2, 1, use_mla=True, nnodes=2), True, 32)
