"""`kvref replay` re-runs a proof counterexample file: fails on its variant, holds on the reference."""

from __future__ import annotations

import pytest

from kvref import cli
from kvref.proofs import run_all
from kvref.spec.errors import InvalidFieldError


def test_replay_a_proof_reproducer(tmp_path, capsys):
    [result] = run_all(variant="pre-41069-override-ignored", out_dir=str(tmp_path))
    assert result.reproducer
    assert cli.main(["replay", result.reproducer]) == 1
    assert "COUNTEREXAMPLE" in capsys.readouterr().out
    assert cli.main(["replay", result.reproducer, "--kinds", "reference"]) == 0
    assert "OK: the reproducer holds on reference" in capsys.readouterr().out


def test_replay_of_a_missing_file_is_a_clear_error(tmp_path):
    with pytest.raises(InvalidFieldError):
        from kvref.cli_replay import _run_reproducer

        _run_reproducer(str(tmp_path / "nope.py"), None, False)
    assert cli.main(["replay", str(tmp_path / "nope.py")]) == 2
