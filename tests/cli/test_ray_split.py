"""``kvref verify --split N`` (issue #27): a check as N seed ranges of its examples, merged into
one row; on Ray a unit per part, with the findings of the local run of the same split.
"""

from __future__ import annotations

import random

import pytest

from tests.cli.ray_cluster import local_and_ray, ray_cluster  # noqa: F401  (the module's cluster)

from kvref import cli
from kvref.baseline import Baseline
from kvref.check_context import Check, VerifyContext
from kvref.ray_split import merge, part_context, part_seed, run_split, run_split_on_ray
from kvref.report import ERROR, FAILED, PASSED, CheckResult


def test_parts_have_distinct_deterministic_seeds_and_share_the_budget():
    seeds = [part_seed(7, i) for i in range(64)]
    assert seeds[0] == 7 and len(set(seeds)) == 64 and seeds == [part_seed(7, i) for i in range(64)]
    assert part_seed(8, 1) != part_seed(7, 1)
    for total, n in [(60, 4), (61, 4), (5, 3), (2, 5)]:
        shares = [part_context(VerifyContext(profile="ci"), i, n).examples(1, total) for i in range(n)]
        assert sum(shares) == max(total, n) or (total < n and shares == [1] * n)
        assert max(shares) - min(shares) <= 1
    ctx = part_context(VerifyContext(seed=7, profile="ci", out_dir="o"), 2, 4)
    assert (ctx.seed, ctx.profile, ctx.out_dir, ctx.part, ctx.parts, ctx.used) == (part_seed(7, 2), "ci", "o", 2, 4, False)


def test_the_first_failing_part_in_order_decides_the_row():
    ctxs = [part_context(VerifyContext(seed=1), i, 3) for i in range(3)]
    rows = [CheckResult("c", PASSED, "ok", examined=5), CheckResult("c", FAILED, "bad at 7", artifacts=["a"]),
            CheckResult("c", ERROR, "crashed", artifacts=["b"])]
    m = merge("c", list(zip(ctxs, rows)))
    assert m.status == FAILED and m.summary == f"part 2 of 3 (seed {part_seed(1, 1)}): bad at 7"
    assert m.artifacts == ["a", "b"] and m.examined == 5 and len(m.details) == 3
    ok = merge("c", list(zip(ctxs, [CheckResult("c", PASSED, f"ok {i}", examined=i + 1) for i in range(3)])))
    assert ok.status == PASSED and ok.examined == 6 and "3 seed ranges" in ok.summary


# --------------------------------------------------------------------------------------------
# a planted fault: a check whose cases come from its seed and budget (module level: workers import it)


def planted(ctx) -> CheckResult:
    """Draws ``examples`` numbers from its seed; a multiple of 23 is the planted fault."""
    rng = random.Random(ctx.seed)
    n = ctx.examples(40, 40)
    for i in range(n):
        x = rng.randrange(10**6)
        if x % 23 == 0:
            return CheckResult("planted", FAILED, f"case {i}: {x} is a multiple of 23", examined=i + 1)
    return CheckResult("planted", PASSED, f"{n} cases", examined=n)


def fixed(ctx) -> CheckResult:
    return CheckResult("fixed", PASSED, "one table", examined=3)


PLANTED = Check("planted", "a planted fault", planted)
FIXED = Check("fixed", "no example budget", fixed)


def test_a_planted_fault_splits_into_the_same_findings_on_ray_and_locally():
    ctx = VerifyContext(seed=13)  # 40 cases: parts of 14, 13, 13; only part 2's seed meets the fault
    local = [run_split(c, ctx, Baseline(), False, 3) for c in (PLANTED, FIXED)]
    remote, interrupted = run_split_on_ray([PLANTED, FIXED], ctx, Baseline(), False, False, 3, lambda s: None)
    assert interrupted is None
    strip = [(r.name, r.status, r.summary, r.details, r.examined) for r in local]
    assert strip == [(r.name, r.status, r.summary, r.details, r.examined) for r in remote]
    planted_row, fixed_row = local
    assert planted_row.status == FAILED and planted_row.summary.startswith(f"part 2 of 3 (seed {part_seed(13, 1)}): case 5")
    assert [d.split(":")[0] for d in planted_row.details] == [f"part {i}/3 seed {part_seed(13, i - 1)}" for i in (1, 2, 3)]
    assert planted_row.examined == 14 + 6 + 13
    assert fixed_row.status == PASSED and "not split" in fixed_row.details[-1]


def test_a_part_whose_unit_died_is_the_row_s_error(monkeypatch):
    from kvref import ray_runner
    from kvref.ray_runner import RunOutcome, UnitOutcome

    def fake(units, on_done=None, max_retries=1, modules=None):
        outs = []
        for u in units:
            name, part = u.key
            if part == 2:
                outs.append(UnitOutcome(u.key, error="WorkerCrashedError on Ray after 2 attempt(s)"))
            else:
                ctx = u.args[1]
                res = planted(ctx) if name == "planted" else fixed(ctx)
                outs.append(UnitOutcome(u.key, value={"result": res, "used": ctx.used or name == "planted"}))
        return RunOutcome(outs)

    monkeypatch.setattr(ray_runner, "run_units", fake)
    rows, interrupted = run_split_on_ray([FIXED, PLANTED], VerifyContext(seed=2), Baseline(), False, False, 4,
                                         lambda s: None)
    assert interrupted is None and rows[0].status == PASSED
    assert rows[1].status == ERROR and rows[1].summary.startswith(f"part 3 of 4 (seed {part_seed(2, 2)}): WorkerCrashed")


def test_cli_split_on_ray_gives_the_rows_of_the_local_split(ray_cluster, tmp_path):
    """Generated-trace checks with a seed: the same traces part by part (op counts, preemptions...)."""
    local, remote, _ = local_and_ray(["verify", "--only", "spec", "machine-reference", "--json", "--seed", "3",
                                      "--split", "2", "--out", str(tmp_path)], ray_cluster)
    rows = [[(c["name"], c["status"], c["summary"], c["details"], c["examined"]) for c in r["checks"]]
            for r in (local, remote)]
    assert rows[0] == rows[1]
    spec, machine = rows[0]
    assert "not split" in spec[3][-1] and machine[2].startswith("2 seed ranges (seeds 3, ")


@pytest.mark.parametrize("bad", ["0", "-1", "2000"])
def test_a_bad_split_is_exit_2(bad, capsys):
    assert cli.main(["verify", "--only", "spec", "--split", bad]) == 2
    assert "--split" in capsys.readouterr().err
