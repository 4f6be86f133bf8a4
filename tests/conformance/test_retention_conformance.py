"""Sparse prefix-cache retention against vLLM 0.33.0 (issue #23): the reference's masks, replay
boundaries and validation against vLLM's own functions on generated inputs, and generated traces
on sliding-window and Mamba pools with retention intervals compared op by op with vLLM's
``KVCacheManager`` (which blocks are published, hits, junctions, checkpoint reservations)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.stateful import run_state_machine_as_test

from kvref.impl.interface import PoolConfig
from kvref.impl.reference.mamba_manager import MambaManager
from kvref.impl.reference.sliding_window_manager import SlidingWindowManager
from kvref.models.hypothesis_runs.reproducible import same_inputs_in_every_process
from kvref.models.machines.kv_cache_manager import kv_cache_manager_machine
from kvref.spec.errors import InvalidFieldError
from kvref.spec.kv_cache_interface import FullAttentionSpec, KVCacheGroupSpec, MambaSpec, SlidingWindowSpec
from kvref.spec.prefix_cache_retention import replay_boundaries, validate_prefix_cache_retention_interval
from tests.conftest import profile_examples
from tests.vllm_env import require_vllm

pytestmark = pytest.mark.vllm


def _vllm():
    require_vllm()
    from vllm.v1.core import kv_cache_coordinator as coordinator
    from vllm.v1.core import single_type_kv_cache_manager as managers

    from kvref.impl.vllm.kv_cache_manager import to_vllm_kv_cache_config, to_vllm_spec

    return coordinator, managers, to_vllm_spec, to_vllm_kv_cache_config


@st.composite
def mask_inputs(draw):
    block_size = draw(st.sampled_from((1, 2, 4)))
    mamba = draw(st.booleans())
    if mamba:
        spec = MambaSpec(block_size=block_size, shapes=((2,),), dtypes=("float16",), mamba_cache_mode="align")
    else:
        spec = SlidingWindowSpec(block_size=block_size, num_kv_heads=1, head_size=1, dtype="float16",
                                 sliding_window=draw(st.integers(1, 6 * block_size)))
    # alignments: whole multiples of the block, and now and then a sub-block one (fine-grained hits)
    alignment = draw(st.one_of(st.integers(1, 4).map(lambda k: k * block_size), st.sampled_from((1, 2, 3))))
    retention = draw(st.one_of(st.none(), st.just(0), st.integers(1, 6).map(lambda k: k * alignment)))
    start = draw(st.integers(0, 20))
    end = draw(st.integers(start, 30))
    boundaries = draw(st.lists(st.integers(0, 130), max_size=4))
    return spec, start, end, alignment, draw(st.booleans()), retention, boundaries


@given(mask_inputs())
@settings(max_examples=profile_examples(200, 1000), deadline=None)
def test_reachable_block_masks_match_vllm(inputs):
    _c, managers, to_vllm_spec, _ = _vllm()
    spec, start, end, alignment, use_eagle, retention, boundaries = inputs
    ours_cls, theirs_cls = (MambaManager, managers.MambaManager) if isinstance(spec, MambaSpec) \
        else (SlidingWindowManager, managers.SlidingWindowManager)
    ours = ours_cls.reachable_block_mask(start, end, alignment, spec, use_eagle, retention, boundaries)
    theirs = theirs_cls.reachable_block_mask(start_block=start, end_block=end, alignment_tokens=alignment,
                                             kv_cache_spec=to_vllm_spec(spec), use_eagle=use_eagle,
                                             retention_interval=retention, reachable_boundaries=boundaries)
    assert ours == theirs


@given(st.integers(0, 70), st.sampled_from((1, 2, 4, 8)), st.booleans())
@settings(max_examples=profile_examples(100, 400), deadline=None)
def test_replay_boundaries_match_vllm(num_prompt_tokens, block, use_eagle):
    coordinator, *_ = _vllm()
    assert replay_boundaries(num_prompt_tokens, block, use_eagle) == \
        coordinator.replay_boundaries(num_prompt_tokens, block, use_eagle)


_SPECS = {
    "fa": FullAttentionSpec(block_size=4, num_kv_heads=1, head_size=1, dtype="float16"),
    "swa": SlidingWindowSpec(block_size=4, num_kv_heads=1, head_size=1, dtype="float16", sliding_window=6),
    "mamba": MambaSpec(block_size=4, shapes=((2,),), dtypes=("float16",), mamba_cache_mode="align"),
}


@given(st.lists(st.sampled_from(sorted(_SPECS)), min_size=1, max_size=3), st.sampled_from((4, 8)),
       st.one_of(st.none(), st.integers(-9, 40)))
@settings(max_examples=profile_examples(100, 400), deadline=None)
def test_validation_matches_vllm(kinds, scheduler_block_size, retention):
    """kvref rejects (InvalidFieldError naming the field) exactly the intervals vLLM's coordinator
    rejects (ValueError), for the same groups."""
    coordinator, _m, _s, to_vllm_kv_cache_config = _vllm()
    groups = tuple(KVCacheGroupSpec((f"l{i}",), _SPECS[k]) for i, k in enumerate(kinds))
    pool = PoolConfig(num_blocks=8, groups=groups, max_model_len=32, scheduler_block_size=scheduler_block_size,
                      hash_block_size=4)
    try:
        coordinator._validate_prefix_cache_retention_interval(retention, scheduler_block_size,
                                                              to_vllm_kv_cache_config(pool))
        vllm_ok = True
    except ValueError:
        vllm_ok = False
    try:
        validate_prefix_cache_retention_interval(retention, scheduler_block_size, groups)
        ours_ok = True
    except InvalidFieldError as exc:
        assert exc.field == "prefix_cache_retention_interval" and exc.value == retention
        ours_ok = False
    assert ours_ok == vllm_ok


SPARSE_SETS = ("fa+swa", "swa", "fa+swa+swa", "fa+mamba_align", "fa+mamba_fine")


def test_generated_traces_with_retention_match_vllm():
    """Every pool with a sliding-window or Mamba group runs under a drawn retention interval (0 or
    1-4 scheduler blocks); reference and vLLM compared after every op. Derandomized (the assertions
    on what was reached must hold under every profile): retention pools of both kinds ran, and
    some admission's hit was held below a longer full-attention hit by a sparse group (the
    shared-prefix junction the request then keeps)."""
    require_vllm()
    machine = kv_cache_manager_machine(("reference", "vllm"), group_sets=SPARSE_SETS, retention="always")
    with same_inputs_in_every_process():
        run_state_machine_as_test(machine, settings=settings(max_examples=profile_examples(30, 60),
                                                             derandomize=True, database=None,
                                                             stateful_step_count=40, deadline=None))
    stats = machine.stats
    assert not stats.unsupported_reasons, stats.unsupported_reasons
    assert stats.retention_pools.get("0*sbs", 0) > 0, stats.retention_pools
    assert sum(n for k, n in stats.retention_pools.items() if k not in ("dense", "0*sbs")) > 0, stats.retention_pools
    assert stats.retention_junctions > 0
    assert stats.prefix_hits > 0
    # every pool also probed an interval against vLLM's coordinator: some refused, some accepted
    assert stats.retention_probes.get("refused", 0) > 0 and stats.retention_probes.get("accepted", 0) > 0


@given(retention=st.sampled_from((None, 0, 0, 4, 8)), alignment=st.sampled_from((1, 2, 4)),
       prompt_len=st.integers(2, 60), chunks=st.lists(st.integers(1, 20), min_size=1, max_size=8),
       shared=st.integers(0, 60))
@settings(max_examples=profile_examples(60, 300), deadline=None)
def test_mamba_prefill_checkpoints_under_retention_match_vllm(retention, alignment, prompt_len, chunks, shared):
    """A chunked prefill on FA + Mamba "align" with prefill-checkpoint blocks: under interval 0 only
    the chunk reaching the prefill end reserves a checkpoint block, block-aligned checkpoints stay
    only where retention keeps them; a second request sharing a prefix then hits (or not) alike.
    Block ids, cached blocks and hits compared after every chunk."""
    require_vllm()
    from kvref.impl.interface import make_manager
    from kvref.impl.request import Request

    mamba = MambaSpec(block_size=4, shapes=((2,),), dtypes=("float16",), mamba_cache_mode="align",
                      num_prefill_checkpoint_blocks=1, prefill_checkpoint_alignment=alignment)
    pool = PoolConfig(num_blocks=80, groups=(KVCacheGroupSpec(("a",), _SPECS["fa"]), KVCacheGroupSpec(("m",), mamba)),
                      max_model_len=64, scheduler_block_size=4, hash_block_size=4,
                      prefix_cache_retention_interval=retention)
    managers = [make_manager("reference", pool), make_manager("vllm", pool)]
    prompt = list(range(prompt_len))
    requests = [Request("r0", list(prompt), max_tokens=2) for _ in managers]
    for chunk in chunks:
        remaining = prompt_len - requests[0].num_computed_tokens
        if remaining <= 0:
            break
        n = min(chunk, remaining)
        outs = []
        for m, r in zip(managers, requests):
            m.new_step_starts()
            outs.append((m.allocate_slots(r, n), m.cached_blocks()))
            r.num_computed_tokens += n
        assert outs[0] == outs[1], (chunk, outs)
    second = prompt[:min(shared, prompt_len)] + [99] * 3
    hits = [m.get_computed_blocks(Request("r1", list(second), max_tokens=2)) for m in managers]
    assert hits[0] == hits[1]
