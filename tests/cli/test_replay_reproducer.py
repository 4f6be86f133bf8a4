"""`kvref replay` re-runs a proof counterexample file: fails on its variant, holds on the reference."""

from __future__ import annotations

import pytest

from kvref import cli
from kvref.proofs import run_all
from kvref.spec.errors import InvalidFieldError


def test_replay_a_proof_reproducer(tmp_path, capsys):
    [result] = run_all(variant="pre-41069-override-ignored", out_dir=str(tmp_path))
    assert result.reproducer
    assert cli.main(["replay", result.reproducer, "--exec-python"]) == 1
    assert "COUNTEREXAMPLE" in capsys.readouterr().out
    assert cli.main(["replay", result.reproducer, "--exec-python", "--kinds", "reference"]) == 0
    assert "OK: the reproducer holds on reference" in capsys.readouterr().out


def test_replay_of_a_missing_file_is_a_clear_error(tmp_path):
    with pytest.raises(InvalidFieldError):
        from kvref.cli.replay import _run_reproducer

        _run_reproducer(str(tmp_path / "nope.py"), None, False)
    assert cli.main(["replay", str(tmp_path / "nope.py"), "--exec-python"]) == 2


def test_a_python_reproducer_runs_only_with_exec_python(tmp_path, capsys):
    """Running a .py file executes its code: refused (exit 2, nothing run) unless asked for."""
    script = tmp_path / "r.py"
    script.write_text("import pathlib\npathlib.Path(__file__).with_suffix('.ran').write_text('x')\n"
                      "def test_x():\n    pass\n")
    assert cli.main(["replay", str(script)]) == 2
    assert "--exec-python" in capsys.readouterr().err
    assert not (tmp_path / "r.ran").exists()
    assert cli.main(["replay", str(script), "--exec-python"]) == 0
    assert (tmp_path / "r.ran").exists()


def test_a_python_file_that_is_no_reproducer_is_an_input_error(tmp_path, capsys):
    broken = tmp_path / "b.py"
    broken.write_text("def test_x(:\n")
    assert cli.main(["replay", str(broken), "--exec-python"]) == 2
    assert "COUNTEREXAMPLE" not in capsys.readouterr().out
