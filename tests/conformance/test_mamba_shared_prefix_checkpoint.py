"""Issue #23: the Mamba shared-prefix checkpoint (vLLM's ``enable_mamba_shared_prefix_checkpoint``).

A request whose hit a lagging Mamba group held below the attention hit (the junction,
``shared_prefix_boundary``) has its chunk ended there by the scheduler, and with the feature on the
Mamba "align" manager keys that state inside its block, so a third request sharing the prefix hits
it. vLLM's ``KVCacheManager`` narrows the flag (EAGLE groups, partial hash hits, no MTP tail). Each
test drives vLLM 0.33.0's own ``KVCacheManager`` beside the reference and compares everything
observable after every op (block ids, hashes, events, queue).
"""

from __future__ import annotations

import dataclasses

import pytest

from kvref.impl.interface import PoolConfig
from kvref.impl.reference.kv_cache_manager import KVCacheManager
from kvref.models.conformance.differential import Divergence, Harness
from kvref.models.conformance.trace import Op
from kvref.models.machines.kv_cache_manager import run_machine
from kvref.models.machines.mamba_junction_programs import run_junction_programs
from kvref.spec.errors import InvalidFieldError
from kvref.spec.kv_cache_interface import FullAttentionSpec, KVCacheGroupSpec, MambaSpec
from tests.conftest import profile_examples
from tests.vllm_env import require_vllm

pytestmark = pytest.mark.vllm

_ADMIT = dict(full_sequence_must_fit=False, reserved_blocks=0, in_flight=False, token=1)


@pytest.fixture(scope="module")
def vllm_loaded():
    require_vllm()


def _pool(flag: bool, *, eagle: bool = True, mamba_block: int = 4, num_prefill_lookahead: int = 0) -> PoolConfig:
    fa = FullAttentionSpec(block_size=4, num_kv_heads=1, head_size=8, dtype="float16")
    mamba = MambaSpec(block_size=mamba_block, shapes=((2, 3), (4,)), dtypes=("float16", "float32"),
                      mamba_cache_mode="align")
    return PoolConfig(num_blocks=40, groups=(KVCacheGroupSpec(("full",), fa), KVCacheGroupSpec(("mamba",), mamba)),
                      max_model_len=64, scheduler_block_size=4, hash_block_size=2, use_eagle=eagle,
                      enable_mamba_shared_prefix_checkpoint=flag, enable_kv_cache_events=True,
                      num_prefill_lookahead=num_prefill_lookahead)


def _siblings(h: Harness) -> tuple[int, int]:
    """a computes 16 tokens; b shares its first 10 and stops its first chunk at the junction the
    lookup returns (as the scheduler does); c shares the same 10. Returns (b's junction, the
    junction tokens c got as a hit on the Mamba group's key)."""
    a = list(range(16))
    h.apply(Op("add", dict(rid="a", prompt=a, max_tokens=2, cache_salt=None)))
    h.apply(Op("admit", dict(rid="a", chunk=16, **_ADMIT)))
    h.apply(Op("add", dict(rid="b", prompt=a[:10] + [1] * 8, max_tokens=2, cache_salt=None)))
    ref = h.managers["reference"].manager
    b = h.reqs["b"].request
    _, hit, uncached = ref.coordinator.find_longest_cache_hit(ref.block_hashes(b), b.num_tokens - 1)
    junction = hit + uncached
    h.apply(Op("admit", dict(rid="b", chunk=junction - hit, **_ADMIT)))
    assert b.shared_prefix_boundary == junction  # compared with vLLM's get_computed_blocks answer
    h.apply(Op("new_step", {}))
    hits = h.num_prefix_hits
    h.apply(Op("add", dict(rid="c", prompt=a[:10] + [2] * 8, max_tokens=2, cache_salt=None)))
    h.apply(Op("admit", dict(rid="c", chunk=18, **_ADMIT)))
    return junction, h.num_prefix_hits - hits


def test_the_junction_state_is_keyed_and_hit_as_vllm_does(vllm_loaded):
    """With the feature on, b's state at the sub-block junction is keyed (in vLLM and the
    reference alike) and c resumes there; off, nothing keys it and c gets no hit."""
    seen = {}
    for flag in (True, False):
        h = Harness(_pool(flag), ["reference", "vllm"])
        assert h.managers["vllm"].mamba_shared_prefix_checkpoint is flag
        junction, c_hits = _siblings(h)
        mamba = h.managers["reference"].manager.coordinator.single_type_managers[1]
        keyed = [blk.block_hash_num_tokens for blk in mamba.req_to_blocks["b"]]
        seen[flag] = (junction, junction in keyed, c_hits)
    assert seen[True][0] % 4 and seen[True][0] == seen[False][0], seen
    assert seen[True][1:] == (True, 1) and seen[False][1:] == (False, 0), seen


def test_a_reference_without_the_junction_key_is_caught(vllm_loaded, monkeypatch):
    """The pre-#23 reference (prompt boundary only) diverges from vLLM on the same trace."""
    real = KVCacheManager.__init__

    def without_feature(self, config):
        real(self, config)
        for m in self.coordinator.single_type_managers:
            m.shared_prefix_checkpoint = False

    monkeypatch.setattr(KVCacheManager, "__init__", without_feature)
    with pytest.raises(Divergence):
        _siblings(Harness(_pool(True), ["reference", "vllm"]))


@pytest.mark.parametrize("kwargs", [
    dict(eagle=False),                # no EAGLE group: no sibling resumes at a junction
    dict(mamba_block=2),              # Mamba block == hash block: no partial hash hits
    dict(num_prefill_lookahead=3),    # multi-module MTP tail: cache_blocks is not handed the chunk end
])
def test_vllm_narrows_the_flag_and_the_reference_agrees(vllm_loaded, kwargs):
    h = Harness(_pool(True, **kwargs), ["reference", "vllm"])
    assert h.managers["reference"].mamba_shared_prefix_checkpoint is False
    assert h.managers["vllm"].mamba_shared_prefix_checkpoint is False


def test_a_non_bool_flag_is_refused():
    with pytest.raises(InvalidFieldError, match="enable_mamba_shared_prefix_checkpoint"):
        dataclasses.replace(_pool(False), enable_mamba_shared_prefix_checkpoint=1)


def _run(examples: int, **machine_kwargs):
    """Fixed seeds (reproducible in any process: run_machine drops Hypothesis' module constants);
    up to three batches, the first that diverges ends it. Returns the runs."""
    runs = []
    for seed in (1, 2, 3):
        runs.append(run_machine(("reference", "vllm"), examples, seed=seed, shrink=False, group_sets=("fa+mamba_fine",),
                                eagle="always", shared_prefix_checkpoint="always", **machine_kwargs))
        if not runs[-1].ok or sum(r.stats.junction_checkpoints for r in runs):
            break
    return runs


def test_machine_with_the_shared_prefix_checkpoint(vllm_loaded):
    """Generated fine-grained Mamba "align" pools with EAGLE and the feature on, siblings sharing
    cuts of computed sequences, chunks ending at junctions, everything compared with vLLM after
    every op; junction states are keyed."""
    runs = _run(profile_examples(12, 30))
    assert all(r.ok for r in runs), runs[-1].failure
    assert sum(r.stats.shared_prefix_checkpoint_pools.get("on", 0) for r in runs) > 0
    assert sum(r.stats.junction_checkpoints for r in runs) > 0, [r.stats for r in runs]


def test_junction_programs_agree_with_vllm_and_reach_the_junction(vllm_loaded):
    """conform-kv-manager's sibling programs: vLLM and the reference agree after every op, junction
    states are keyed, siblings hit them (copy-on-write of the shared partial tail)."""
    failure, _, _, seen = run_junction_programs(("reference", "vllm"), profile_examples(20, 60), seed=0)
    assert failure is None, failure
    assert seen["junction_checkpoints"] > 0 and seen["prefix_hits"] > 0 and seen["cow_copies"] > 0, seen
    assert 0 < seen["on"] < seen["programs"], seen  # MTP-tail pools narrow the flag away


@pytest.mark.parametrize("fault_id", ["stm.shared_prefix_junction_ignored", "stm.shared_prefix_past_junction",
                                      "kvm.shared_prefix_checkpoint_under_mtp"])
def test_planted_vllm_faults_are_caught(vllm_loaded, fault_id, tmp_path):
    """The catalogue's faults in vLLM's shared-prefix checkpoint (models/mutants/vllm_source) make
    the sibling programs (and the machine's shared-prefix runs) diverge from the reference."""
    from tests.vllm_faults import planted_vllm_fault

    with planted_vllm_fault(fault_id):
        failure, path, sig, _ = run_junction_programs(("reference", "vllm"), profile_examples(20, 60), seed=0,
                                                      out_dir=str(tmp_path))
        runs = _run(profile_examples(12, 30), prefill_lookahead=fault_id.startswith("kvm."))
    assert failure and sig, fault_id
    assert path is None or path.startswith(str(tmp_path))
    assert not runs[-1].ok and "Divergence" in runs[-1].failure, fault_id
