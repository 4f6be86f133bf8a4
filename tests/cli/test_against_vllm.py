"""`kvref verify --against vllm` on a vLLM with a re-introduced KV-cache bug reports it."""

from __future__ import annotations

import json

import pytest

from kvref import cli
from tests.models.test_startup_liveness import uncapped_sliding_window_admission
from tests.vllm_env import require_vllm


@pytest.fixture(scope="module")
def vllm():
    return require_vllm()


@pytest.mark.vllm
def test_verify_against_clean_vllm_passes(vllm, capsys):
    rc = cli.main(["verify", "--only", "startup-liveness", "--against", "vllm", "--json"])
    out = json.loads(capsys.readouterr().out)
    assert rc == 0, out
    assert "vllm" in out["checks"][0]["summary"]


@pytest.mark.vllm
def test_verify_against_patched_vllm_reports_the_bug(vllm, monkeypatch, capsys):
    uncapped_sliding_window_admission(monkeypatch, vllm)
    rc = cli.main(["verify", "--only", "startup-liveness", "--against", "vllm", "--json"])
    out = json.loads(capsys.readouterr().out)
    assert rc == 1
    check = out["checks"][0]
    assert check["status"] == "failed"
    assert any(line.startswith("vllm: the full-sequence admission gate rejected") for line in check["details"])
    assert not any(line.startswith("reference:") for line in check["details"]), "the reference is not patched"
