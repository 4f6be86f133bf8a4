"""vLLM 0.33.0's ``build_offloading_config`` parallelism gate (offloaded groups, bytes per block,
``is_parallelism_agnostic``, ``replicated_layout``) against the reference on generated layer sets,
and faults planted in vLLM's gate (monkeypatched for the test) that the same cases find (#22)."""

from __future__ import annotations

import random

import pytest

from tests.conftest import profile_examples
from tests.vllm_env import require_vllm

pytestmark = pytest.mark.vllm


def _cases(n: int, seed: int = 0):
    from kvref.models.machines.offload_layout_gate import gate_cases

    return gate_cases(random.Random(seed), n)


def test_gate_matches_reference():
    """Every answer agrees; the generated sets reach each side of the gate."""
    require_vllm()
    from kvref.models.machines.offload_layout_gate import compare_gate

    cases = _cases(profile_examples(150, 300))
    refs = [c.reference() for c in cases]
    answers = [r for r in refs if r != "refused"]
    assert "refused" in refs and any(r["parallelism_agnostic"] for r in answers)
    assert any(r["replicated_layout"] for r in answers) and any(not r["parallelism_agnostic"] for r in answers)
    # the canonical layout widening the gate: agnostic sets that the plain gate refuses
    assert any(r["parallelism_agnostic"] and (len(c.groups) > 1 or c.groups[0].uniform
                                             or c.groups[0].layers[0].kind != "full")
               for c, r in zip(cases, refs) if r != "refused")
    assert [d for d in map(compare_gate, cases) if d] == []


def _uniform_bytes_as_shared(monkeypatch):
    """A UniformTypeKVCacheSpecs group's bytes per block counted as its first spec times its layers."""
    from vllm.distributed.kv_transfer.kv_connector.v1.offloading import config

    monkeypatch.setattr(config, "_group_kv_bytes_per_block",
                        lambda group: group.kv_cache_spec.page_size_bytes * len(group.layer_names)
                        if not hasattr(group.kv_cache_spec, "kv_cache_specs")
                        else next(iter(group.kv_cache_spec.kv_cache_specs.values())).page_size_bytes
                        * len(group.layer_names))


def _transfer_flag_ignored(monkeypatch):
    """Groups out of KV transfer offloaded too."""
    from vllm.distributed.kv_transfer.kv_connector.v1.offloading import config

    monkeypatch.setattr(config, "get_offloading_group_ids", lambda kcfg: tuple(
        i for i, g in enumerate(kcfg.kv_cache_groups) if g.kv_cache_spec.prefix_cacheable))


def _first_layer_certifies_group(monkeypatch):
    """The canonical gate certifies a UniformTypeKVCacheSpecs group by its first layer only."""
    from vllm.distributed.kv_transfer.kv_connector.v1.offloading import config

    real = config.iter_layer_specs
    monkeypatch.setattr(config, "iter_layer_specs", lambda spec: tuple(real(spec))[:1])


def _hisparse_layout_ignored(monkeypatch):
    """The connector asks for the layer-outermost layout under HiSparse too."""
    from vllm.distributed.kv_transfer.kv_connector.v1.offloading_connector import OffloadingConnector

    monkeypatch.setattr(OffloadingConnector, "get_required_kvcache_layout", classmethod(lambda cls, vc: "LBHNC"))


@pytest.mark.parametrize("fault", [_uniform_bytes_as_shared, _transfer_flag_ignored, _first_layer_certifies_group,
                                   _hisparse_layout_ignored],
                         ids=lambda f: f.__name__.strip("_"))
def test_gate_fault_is_found(fault, monkeypatch):
    require_vllm()
    from kvref.models.machines.offload_layout_gate import compare_gate

    fault(monkeypatch)
    assert any(compare_gate(c) for c in _cases(profile_examples(150, 300)))
