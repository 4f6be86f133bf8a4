"""Mamba "align" groups in the OffloadingConnector scheduler reference: boundary-state stores
(:mod:`kvref.impl.reference.offload.boundary_stores`), their fences, hits rounded to the Mamba chunk
and the state loaded with them; generated engine traces under the content model; bad input."""

from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvref.impl.reference.offload.boundary_stores import check_handoffs, make_boundary_key
from kvref.impl.reference.offload.keys import RequestContext, get_offload_group_idx
from kvref.impl.reference.offload.offloading_scheduler import OffloadingStep
from kvref.models.offload.offloading_connector_world import OffloadingConfig, OffloadingWorld
from kvref.models.offload.traces import apply_offloading_op, random_ops
from kvref.spec.errors import InvalidFieldError
from tests.conftest import profile_examples

MAMBA = 1  # FA is group 0, the Mamba "align" group 1 (no window, no chunked local)


def _mamba_keys(keys):
    return [k for k in keys if get_offload_group_idx(k) == MAMBA]


def test_boundary_states_are_stored_fenced_and_loaded():
    """Each handed-over chunk-end state becomes its own store job with one source block, fenced at
    once; a re-allocated source flushes its job; a later hit ends on a Mamba chunk and loads the
    state there with the attention chunks, all of its tokens from the CPU tier."""
    w = OffloadingWorld(OffloadingConfig(block_size=4, num_gpu_blocks=24, num_cpu_chunks=32, mamba_align=True))
    r0 = w.add_request(list(range(100, 118)))  # 18 tokens; prompt-only stores: states at 8 and 16
    fenced_jobs, flushed = set(), set()
    for _ in range(3):
        loads, stores, flush, _ = w.step(8)
        flushed |= set(flush)
        for j, rid, keys, blocks, chunks in stores:
            if _mamba_keys(keys):
                assert len(keys) == 1 and len(blocks) == 1, "a boundary state is a job of its own"
                assert j in w.b.conn._block_id_to_pending_jobs[blocks[0]], "fenced from creation"
                fenced_jobs.add(j)
    assert len(fenced_jobs) == 2
    assert fenced_jobs & flushed, "the state block left the request and was re-allocated: its copy is waited for"
    while w.jobs:
        w.complete(0, 2)
    w.finish(r0, aborted=False)
    w.step(4)
    assert w.reset_gpu_prefix_cache()
    r1 = w.add_request(list(range(100, 118)) + [5, 6])
    loads, _, _, lookups = w.step(8)
    assert lookups == ((r1, 0, 16),)
    (_, _, keys, blocks, _), = loads
    assert len(_mamba_keys(keys)) == 1 and len(keys) == 5  # 4 attention chunks + the state at 16
    assert w.hit_sources[-1] == (r1, (("host", 16),))


def test_a_pure_mamba_model_stores_and_loads_states_alone():
    """No attention group: hits align to the Mamba chunk itself (vLLM ``from_spec``'s fallback to
    the largest chunk) and a hit loads one state, the one at its end."""
    w = OffloadingWorld(OffloadingConfig(block_size=4, num_gpu_blocks=12, num_cpu_chunks=32, mamba_align=True,
                                         mamba_only=True))
    assert len(w.b.conn.groups) == 1 and w.b.conn.alignment_tokens == 4
    r0 = w.add_request(list(range(100, 118)))
    for _ in range(3):
        w.step(8)
    while w.jobs:
        w.complete(0, 2)
    w.finish(r0, aborted=False)
    w.step(4)
    assert w.reset_gpu_prefix_cache()
    r1 = w.add_request(list(range(100, 118)) + [5, 6])
    loads, _, _, lookups = w.step(8)
    assert lookups == ((r1, 0, 16),)
    (_, _, keys, blocks, _), = loads
    assert len(keys) == 1 == len(blocks) and w.b.conn._req_status[r1].ctx.get_offload_key_position(keys[0]) == 16


def test_only_chunk_end_states_within_the_offload_window_are_stored():
    """Two blocks per chunk: states at odd block ends are not chunk ends; prompt-only offload: a
    decode state past the prompt is not stored."""
    w = OffloadingWorld(OffloadingConfig(block_size=4, blocks_per_chunk=2, num_gpu_blocks=24, num_cpu_chunks=32,
                                         mamba_align=True))
    w.add_request(list(range(100, 121)), max_out=9)  # 21 prompt tokens: states at 4, 8, ..., 20 (+ decode 24)
    positions = []
    for _ in range(12):
        for _, rid, keys, _, _ in w.step(8)[1]:
            positions += [w.b.conn._req_status[rid].ctx.get_offload_key_position(k) for k in _mamba_keys(keys)]
        while w.jobs:
            w.complete(0, 2)
    assert positions == [8, 16]


@settings(max_examples=profile_examples(15, 60), deadline=None)
@given(seed=st.integers(0, 2**32 - 1), bpc=st.sampled_from([1, 2]), workers=st.integers(1, 2),
       cpu=st.sampled_from([2, 6, 32]), prompt_only=st.booleans())
def test_engine_traces_with_mamba_keep_the_offload_invariants(seed, bpc, workers, cpu, prompt_only):
    """The content model (strict) and check_invariants after every call on FA + Mamba "align" pools:
    a boundary store reads the block holding that boundary's state, no fenced source is overwritten
    unflushed; after draining, nothing stays pinned or fenced."""
    rnd = random.Random(seed)
    w = OffloadingWorld(OffloadingConfig(block_size=4, blocks_per_chunk=bpc, num_gpu_blocks=rnd.randint(14, 22),
                                         num_cpu_chunks=cpu, num_workers=workers, offload_prompt_only=prompt_only,
                                         mamba_align=True))
    for op in random_ops(rnd, rnd.randint(20, 60)):
        apply_offloading_op(w, op)
    for rid in w.live():
        w.finish(rid)
    w.step(4)
    while w.jobs:
        w.complete(0, 2)
    conn = w.b.conn
    assert conn._jobs == {} and conn._block_id_to_pending_jobs == {} and conn._req_status == {}
    assert all(ref == 0 for _, ref in w.b.manager.chunk_state().values())


def test_bad_handoffs_and_boundaries_are_named():
    with pytest.raises(InvalidFieldError, match="boundary_state_offloads"):
        check_handoffs([("r0", 1, 3, 8)])
    with pytest.raises(InvalidFieldError, match="boundary_tokens"):
        check_handoffs({"r0": [(1, 3, -8)]})
    with pytest.raises(InvalidFieldError, match="group_id, block_id, boundary_tokens"):
        check_handoffs({"r0": [(1, 3)]})
    with pytest.raises(InvalidFieldError, match="boundary_tokens"):
        make_boundary_key([b"h0", b"h1"], 1, 12, 4, RequestContext("r0"))  # only 8 tokens hashed
    with pytest.raises(InvalidFieldError, match="boundary_tokens"):
        make_boundary_key([b"h0"], 1, 2, 4, RequestContext("r0"))  # before the first hash boundary
    w = OffloadingWorld(OffloadingConfig(mamba_align=True))
    with pytest.raises(InvalidFieldError, match="boundary_state_offloads"):
        w.b.conn.build_connector_meta(OffloadingStep(boundary_state_offloads={"r0": [(1, "3", 8)]}))
    w.b.conn.check_invariants()  # nothing half-updated
