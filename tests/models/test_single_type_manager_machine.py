"""The manager machine: the reference managers under any call order, with M1/M3/free-order/hit
checks."""

from __future__ import annotations

import pytest
from hypothesis import settings
from hypothesis.stateful import run_state_machine_as_test

from kvref.models.mutants.catalogue import CATALOGUE
from kvref.models.machines.single_type_manager import CONFIGS, make_manager_machine, run_manager_machines
from tests.conftest import profile_examples


@pytest.mark.parametrize("config", CONFIGS, ids=lambda c: f"{c.kind}-{c.num_blocks}-bs{c.block_size}")
def test_reference_managers_pass_the_machine(config):
    machine = make_manager_machine(config)
    run_state_machine_as_test(machine, settings=settings(max_examples=profile_examples(30, 120),
                                                         stateful_step_count=30))
    c = machine.coverage
    assert c.get("admissions", 0) and c.get("frees", 0) and c.get("hits", 0), c


@pytest.mark.parametrize("name,text", [
    ("manager.predictor_undercount", "M3"),
    ("manager.evictable_hits_uncounted", "M3"),
    ("manager.free_head_first", "free order"),
    ("kvm.no_cache_blocks", "hit"),
])
def test_machine_kills_mutants_the_explorer_cannot_see(name, text):
    with CATALOGUE[name].applied():
        why = run_manager_machines(100)
    assert why is not None and text in why


@pytest.mark.vllm
def test_reference_managers_agree_with_vllm():
    from tests.vllm_env import require_vllm

    require_vllm()
    from kvref.models.machines.single_type_manager import VLLM_CONFIGS

    for config in VLLM_CONFIGS:
        machine = make_manager_machine(config, "reference", "vllm")
        run_state_machine_as_test(machine, settings=settings(max_examples=profile_examples(15, 60),
                                                             stateful_step_count=30))
        assert machine.coverage.get("admissions", 0) and machine.coverage.get("frees", 0), machine.coverage


@pytest.mark.vllm
@pytest.mark.parametrize("name", ["pool.cache_ignores_mask", "kvm.no_full_sequence_gate"])
def test_vllm_pairing_kills_what_safety_checks_cannot(name):
    from tests.vllm_env import require_vllm

    require_vllm()
    with CATALOGUE[name].applied():
        why = run_manager_machines(50, ("reference", "vllm"))
    assert why is not None and "vllm" in why


def test_unknown_machine_target_is_rejected():
    with pytest.raises(ValueError, match="targets"):
        make_manager_machine(CONFIGS[0], "torch-someday")
