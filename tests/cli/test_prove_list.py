"""``kvref prove --list``: every name one must type appears whole at any width; ``--json`` lists them."""

from __future__ import annotations

import json

import pytest
from kvref.proofs import THEOREMS, VARIANTS

from kvref.cli import main


@pytest.mark.parametrize("columns", ["60", "80", "200"])
def test_list_never_cuts_a_name(capsys, monkeypatch, columns):
    monkeypatch.setenv("COLUMNS", columns)
    assert main(["prove", "--list"]) == 0
    out = capsys.readouterr().out
    for name in [v.name for v in VARIANTS] + [t.name for t in THEOREMS]:
        assert name in out, f"{name} cut at {columns} columns"
    assert "…" not in out


def test_list_json(capsys):
    assert main(["prove", "--list", "--json"]) == 0
    listed = json.loads(capsys.readouterr().out)
    assert [v["name"] for v in listed["variants"]] == [v.name for v in VARIANTS]
    assert [t["id"] for t in listed["theorems"]] == [t.id for t in THEOREMS]
    assert {v["breaks"] for v in listed["variants"]} <= {t.id for t in THEOREMS}
