"""Generated vLLM source faults (issue #22): mutation operators at sampled sites of vLLM's KV-cache
modules, the unbiased counterpart of the hand-written catalogue.

Cheap (a few seconds at CI=true): the generator only reads and parses vLLM's files; the faults are
applied to the installed text and to overlays, never run through ``kvref verify`` here (the
measurement is ``kvref mutants --target vllm --generated N``, BENCHMARKS.md session 21).
"""

from __future__ import annotations

import ast
import os

import pytest

from kvref import cli
from kvref.models.mutants.vllm_source.generated import ModuleExclusions, find_sites, generate
from kvref.models.mutants.vllm_source.overlay import GENERATED, build_overlay, installed_vllm_dir
from kvref.spec.errors import InvalidFieldError
from tests.vllm_env import require_vllm

_POOL = "v1/core/block_pool.py"
_SCHED = "v1/core/sched/scheduler.py"
_CORE = [_POOL, "v1/core/kv_cache_manager.py", "v1/core/single_type_kv_cache_manager.py",
         "v1/core/kv_cache_coordinator.py", _SCHED]


@pytest.fixture(scope="module")
def vllm_dir():
    require_vllm()
    return installed_vllm_dir()


def _text(vllm_dir: str, path: str) -> str:
    with open(os.path.join(vllm_dir, path), encoding="utf-8") as fh:
        return fh.read()


# --------------------------------------------------------------------------------------------
# operators and what is never mutated, on a synthetic module

_SOURCE = '''
import logging
from typing import TYPE_CHECKING
logger = logging.getLogger(__name__)
LIMIT = 8

if TYPE_CHECKING:
    from x import y


class Pool:
    size: int = 4

    def grow(self, n: int = 3) -> int:
        """Docstring with a < b and 1 + 2."""
        assert n > 0, "n must be positive"
        logger.debug("growing by %d", n + 1)
        if n < self.size and not self.frozen:
            self.size += n
        total = min(self.size, LIMIT) - 1
        self.touch(total)
        label = f"size {n + 1}"
        if self.flag:
            return True
        return False

    def skipped(self):
        self.size = 0

    def partly(self):
        if self.outside is not None:
            self.size = 99
        self.size = 1
'''


def _sites(excl: ModuleExclusions = ModuleExclusions()):
    sites, statements = find_sites(_SOURCE, excl)
    return {(s.line, s.operator): s.new_line.strip() for s in sites}, statements


def test_each_operator_edits_its_site():
    sites, _ = _sites()
    lines = _SOURCE.splitlines()
    at = {text.strip(): i + 1 for i, text in enumerate(lines)}
    cond = at["if n < self.size and not self.frozen:"]
    assert sites[(cond, "rel")] == "if n <= self.size and not self.frozen:"
    assert sites[(cond, "bool")] == "if n < self.size or not self.frozen:"
    assert sites[(cond, "not")] == "if n < self.size and self.frozen:"
    assert sites[(cond, "if-true")] == "if True:"
    assert sites[(cond, "if-false")] == "if False:"
    aug = at["self.size += n"]
    assert sites[(aug, "drop")] == "pass"
    tot = at["total = min(self.size, LIMIT) - 1"]
    assert sites[(tot, "minmax")] == "total = max(self.size, LIMIT) - 1"
    assert sites[(tot, "arith")] == "total = min(self.size, LIMIT) + 1"
    assert sites[(tot, "inc")] == "total = min(self.size, LIMIT) - 2"
    assert sites[(tot, "dec")] == "total = min(self.size, LIMIT) - 0"
    assert sites[(at["self.touch(total)"], "drop")] == "pass"
    assert sites[(at["return True"], "return")] == "return False"
    assert sites[(at["return False"], "return")] == "return True"


def test_docstrings_logging_asserts_annotations_and_module_code_are_never_mutated():
    sites, _ = _sites()
    lines = _SOURCE.splitlines()
    mutated = {lines[ln - 1].strip() for ln, _ in sites}
    for never in ('"""Docstring with a < b and 1 + 2."""', 'assert n > 0, "n must be positive"',
                  'logger.debug("growing by %d", n + 1)', "def grow(self, n: int = 3) -> int:",
                  "size: int = 4", "LIMIT = 8", "logger = logging.getLogger(__name__)", "from x import y"):
        assert never not in mutated, never
    label = [op for (ln, op) in sites if lines[ln - 1].strip() == 'label = f"size {n + 1}"']
    assert label == ["drop"], "an f-string's text is never mutated (the statement may be dropped)"


def test_excluded_functions_and_blocks_are_never_mutated():
    lines = _SOURCE.splitlines()
    at = {text.strip(): i + 1 for i, text in enumerate(lines)}
    base, n_base = _sites()
    assert (at["self.size = 0"], "drop") in base and (at["self.size = 99"], "drop") in base
    sites, n = _sites(ModuleExclusions(functions=frozenset({"Pool.skipped"}),
                                       blocks=frozenset({"if self.outside is not None:"})))
    assert (at["self.size = 0"], "drop") not in sites, "an excluded function"
    assert (at["self.size = 99"], "drop") not in sites, "the body of an excluded block"
    assert (at["self.size = 1"], "drop") in sites, "code after the block stays"
    assert (at["if self.outside is not None:"], "rel") in sites, "the header itself stays counted"
    assert n == n_base - 2, "excluded statements do not weigh in the sampling"
    assert find_sites(_SOURCE, ModuleExclusions(whole_module=True)) == ([], 0)


def test_generation_is_deterministic_and_proportional():
    srcs = {"a.py": _SOURCE, "b/c.py": _SOURCE.replace("LIMIT", "CAP")}
    one = generate(srcs, 6, seed=1)
    assert one == generate(srcs, 6, seed=1)
    assert [f.id for f in one] != [f.id for f in generate(srcs, 6, seed=2)]
    assert sum(f.path == "a.py" for f in one) == 3, "equal statement counts, equal shares"
    assert all(f.kind == GENERATED and f.id.startswith("gen.") for f in one)
    assert len({f.id for f in one}) == 6
    for f in one:
        compile(f.apply_to(srcs[f.path]), f.path, "exec")


@pytest.mark.parametrize("n, seed, field", [(0, 0, "--generated"), (-1, 0, "--generated"), (10**6, 0, "--generated"),
                                            (True, 0, "--generated"), (3, -1, "--seed")])
def test_bad_counts_raise_invalid_field(n, seed, field):
    with pytest.raises(InvalidFieldError) as e:
        generate({"a.py": _SOURCE}, n, seed)
    assert e.value.field == field


# --------------------------------------------------------------------------------------------
# on the installed vLLM


def test_generated_faults_apply_once_and_compile(vllm_dir, tmp_path):
    from kvref.vllm_campaign import generated_faults

    faults = generated_faults(60, seed=0)
    assert faults == generated_faults(60, seed=0), "same files, same seed: same faults"
    assert len({f.id for f in faults}) == 60 and len({f.path for f in faults}) > 10, "spread over modules"
    texts = {}
    for f in faults:
        text = texts.setdefault(f.path, _text(vllm_dir, f.path))
        edited = f.apply_to(text)  # FaultDoesNotApplyError unless its old text is found exactly once
        assert edited != text
        compile(edited, f.path, "exec")
    for i, f in enumerate(faults[:3]):
        ov = build_overlay(f, str(tmp_path / str(i)), vllm_dir)
        with open(ov.mutated, encoding="utf-8") as fh:
            assert fh.read() == f.apply_to(texts[f.path])


def test_excluded_functions_and_logging_of_the_installed_scheduler_are_never_sites(vllm_dir):
    from kvref.reach_exclusions import collapse
    from kvref.vllm_campaign import module_exclusions

    excl = module_exclusions()[_SCHED]
    assert excl.functions and excl.blocks, "the reviewed file excludes functions and blocks of the scheduler"
    text = _text(vllm_dir, _SCHED)
    sites, _ = find_sites(text, excl, collapse)
    everything, _ = find_sites(text, ModuleExclusions(), collapse)
    assert len(sites) < len(everything)
    assert not [s for s in sites if s.function in excl.functions]
    assert [s for s in everything if s.function in excl.functions], "the exclusions do take sites out"
    lines = text.splitlines()
    assert not [s for s in sites if "logger." in lines[s.line - 1] or lines[s.line - 1].lstrip().startswith("assert ")]


def test_restricting_modules_keeps_ids_stable(vllm_dir):
    from kvref.vllm_campaign import generated_faults

    only_pool = generated_faults(4, seed=0, modules=[_POOL])
    assert {f.path for f in only_pool} == {_POOL}
    core = generated_faults(16, seed=0, modules=_CORE)
    assert {f.path for f in core} <= set(_CORE)
    assert all(f.id.startswith("gen.core-block_pool.") for f in only_pool), "stem told apart from hisparse's"


# --------------------------------------------------------------------------------------------
# the CLI


def test_cli_lists_generated_faults(vllm_dir, capsys):
    assert cli.main(["mutants", "--target", "vllm", "--generated", "3", "--modules", _POOL, "--list"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert len(out) == 3 and all(line.startswith("gen.core-block_pool.") and " generated " in line for line in out)


@pytest.mark.parametrize("argv, flag", [
    (["--generated", "0"], "--generated"),
    (["--generated", "-2"], "--generated"),
    (["--generated", "100000"], "--generated"),
    (["--generated", "2", "--modules", "v1/core/nosuch.py"], "--modules"),
    (["--generated", "2", "--modules", ","], "--modules"),
    (["--modules", _POOL], "--modules"),
    (["--generated", "9999", "--modules", _POOL], "--generated"),
])
def test_cli_rejects_bad_generated_values_with_exit_2(vllm_dir, argv, flag, capsys):
    assert cli.main(["mutants", "--target", "vllm", *argv, "--list"]) == 2
    assert flag in capsys.readouterr().err


def test_saved_result_with_generated_rows_renders(vllm_dir, tmp_path, capsys):
    import json

    from kvref.models.mutants.vllm_source.catalogue import FAULTS
    from kvref.vllm_campaign import KILLED, SURVIVED, CampaignResult, FaultResult, generated_faults

    a, b = generated_faults(2, seed=0, modules=[_POOL])
    res = CampaignResult([FaultResult(a, KILLED, 3.0, "conform-kv-manager"), FaultResult(b, SURVIVED, 9.0)],
                         ("conform-kv-manager",), "fast", 0, 12.0)
    assert "generated: 1 killed of 2 (survivors may be equivalent mutants)" in res.summary()
    assert res.bug_recall is None and res.ok(), "generated faults do not count in the recall goal"
    saved = tmp_path / "res.json"
    saved.write_text(json.dumps(res.to_dict()))
    again = CampaignResult.from_dict(json.loads(saved.read_text()), FAULTS)
    assert [r.fault for r in again.results] == [a, b]
    assert cli.main(["mutants", "--target", "vllm", "--from-json", str(saved), "--markdown"]) == 0
    assert "| generated (survivors may be equivalent) | 2 | 1 |" in capsys.readouterr().out


def test_ray_units_carry_a_generated_fault_itself(vllm_dir, monkeypatch):
    """``--ray``: a generated fault is in no catalogue, so its unit ships the fault (not its id)
    and the worker runs exactly that edit; the Ray pool is faked, the units run here."""
    from kvref import ray_mutants, vllm_campaign
    from kvref.ray_runner import RunOutcome, UnitOutcome
    from kvref.vllm_campaign import SURVIVED, FaultResult, generated_faults

    ran = []

    def fake_run_fault(fault, checks, profile, seed, timeout, vllm_dir=None):
        ran.append(fault)
        return FaultResult(fault, SURVIVED, 0.0, checks={c: "passed" for c in checks})

    def fake_run_units(units, on_done=None, max_retries=1, modules=None):
        outs = [UnitOutcome(u.key, value=u.fn(*u.args)) for u in units]
        for o in outs:
            on_done(o)
        return RunOutcome(outs)

    monkeypatch.setattr(vllm_campaign, "run_fault", fake_run_fault)
    monkeypatch.setattr(ray_mutants, "run_units", fake_run_units)
    [fault] = generated_faults(1, seed=3, modules=[_POOL])
    res = ray_mutants.run_vllm_faults([fault], ("conform-kv-manager",), "fast", 0, None)
    assert ran == [None, fault], "the clean vLLM, then the generated fault itself"
    assert [r.fault for r in res.results] == [fault] and res.results[0].outcome == SURVIVED
