"""``kvref prove``: table, exit status, reproducer files, bad input."""

from __future__ import annotations

import argparse
import json
import os

import pytest

from kvref.cli import prove as cli_prove


def _run(argv):
    parser = argparse.ArgumentParser()
    sub = parser.add_subparsers(dest="command")
    cli_prove.add_parser(sub)
    args = parser.parse_args(["prove", *argv])
    return cli_prove.run(args)


def test_proved_theorem_exits_zero(capsys):
    assert _run(["T8", "T1"]) == 0
    out = capsys.readouterr().out
    assert "T8" in out and "proved" in out


def test_variant_exits_nonzero_and_writes_reproducer(tmp_path, capsys):
    rc = _run(["--variant", "pre-44560-async-load-no-reservation", "--out", str(tmp_path)])
    assert rc == 1
    out = capsys.readouterr().out
    assert "counterexample" in out
    files = os.listdir(tmp_path)
    assert files == ["cex_t8_pre_44560_async_load_no_reservation.py"]


def test_json_output(capsys):
    assert _run(["T6", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data[0]["theorem"] == "T6" and data[0]["status"] == "proved"


def test_list(capsys):
    assert _run(["--list"]) == 0
    out = capsys.readouterr().out
    assert "pre-40946-gate" in out and "T5" in out


@pytest.mark.parametrize("argv", [["T42"], ["--variant", "nope"], ["T1", "--timeout", "0"]])
def test_bad_input_is_a_value_error(argv):
    with pytest.raises(ValueError):
        _run(argv)


def test_verify_check_passes_and_writes_reproducers_only_on_request(tmp_path):
    from kvref.proofs import HISTORIC
    from kvref.verify import VerifyContext

    quiet = cli_prove.verify_check(VerifyContext(out_dir=str(tmp_path / "default")))
    assert quiet.status == "passed", (quiet.summary, quiet.details)
    assert quiet.artifacts == [] and not (tmp_path / "default").exists()  # a passing run leaves nothing

    result = cli_prove.verify_check(VerifyContext(out_dir=str(tmp_path), write_reproducers=True))
    assert result.status == "passed", (result.summary, result.details)
    assert len(result.artifacts) == len(HISTORIC)
    assert all(os.path.exists(p) for p in result.artifacts)
    # named so that a user's plain `pytest` never collects these (they fail by design)
    assert all(os.path.basename(p).startswith("cex_") for p in result.artifacts)


def test_solver_timeout_is_reported_unknown_and_fails(capsys):
    rc = _run(["T5", "--timeout", "0.001", "--json"])
    data = json.loads(capsys.readouterr().out)
    assert rc == 1
    assert data[0]["status"] == "unknown"
    assert any(lemma["status"] == "unknown" for lemma in data[0]["lemmas"])
