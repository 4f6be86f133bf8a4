"""CrossHair checks the contracts in kvref.proofs.contracts within a fixed budget; nothing may be
refuted and every postcondition must have a report (an unanalysable one is reported, not skipped).
A deliberately wrong contract is refuted (the check can fail)."""

from __future__ import annotations

import textwrap

import pytest

from kvref.proofs.contracts import CONTRACTS
from kvref.proofs.crosshair_run import CONFIRMED, NOT_ANALYSED, NOT_REFUTED, REFUTED, run_crosshair


@pytest.fixture(scope="module")
def report():
    # Fixed budget: 5 s per condition, 1 s per path. 2 s per condition left the cap contracts
    # unanalysed ("no report from CrossHair") whenever the machine was loaded (two full-suite runs
    # with a `kvref verify` beside them); those contracts are confirmed over all paths well within
    # the budget, so only a starved run spends it.
    return run_crosshair(per_condition_timeout=5.0, per_path_timeout=1.0)


def test_no_contract_is_refuted(report):
    assert not report.refuted, [(c.function, c.condition, c.message) for c in report.refuted]


def test_every_postcondition_is_reported(report):
    functions = {c.function for c in report.conditions}
    assert functions == {f.__name__ for f in CONTRACTS}
    missing = [(c.function, c.condition) for c in report.conditions if c.status == NOT_ANALYSED]
    assert not missing, f"CrossHair did not analyse: {missing}"
    assert all(c.status in (CONFIRMED, NOT_REFUTED) for c in report.conditions)


def test_cap_contracts_are_confirmed_over_all_paths(report):
    confirmed = {c.function for c in report.conditions if c.status == CONFIRMED}
    assert {"contract_cdiv", "contract_swa_cap", "contract_cl_cap"} <= confirmed


def test_a_wrong_contract_is_refuted(tmp_path):
    module = tmp_path / "wrong_contract.py"
    module.write_text(textwrap.dedent('''
        from kvref.spec import SlidingWindowSpec


        def contract_cap_without_slack(sliding_window: int, block_size: int) -> int:
            """The +1 block is needed: claiming the cap is the bare cdiv is wrong.

            pre: 1 <= sliding_window <= 64 and 1 <= block_size <= 16
            post: __return__ * block_size < sliding_window - 1 + block_size
            """
            spec = SlidingWindowSpec(block_size=block_size, sliding_window=sliding_window,
                                     num_kv_heads=1, head_size=2, dtype="float16")
            return spec.max_admission_blocks_per_request(0, 1 << 20)
    '''))
    r = run_crosshair(str(module), per_condition_timeout=10.0)
    assert [c.status for c in r.conditions] == [REFUTED]
    assert "contract_cap_without_slack(" in r.conditions[0].message
