"""The first hour of a new user (issue #25): no vLLM log line leaks from a command, a wrong name is
reported under the flag the user typed, the reset-swa connector finding replays on vLLM too."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from kvref.cli import main
from tests.vllm_env import require_vllm

#: vLLM 0.33.0 vLLM's reset-swa finding (``kvref explore --scope reset-swa --out``): a connector
#: reset after an abort, then a store job reads a partial block
RESET_SWA_ACTIONS = [["arrive", 0], ["arrive", 1], ["step"], ["step"], ["step"], ["step"], ["abort", 1],
                     ["reset"], ["step"]]
#: lines vLLM, its CPU platform and the OffloadingConnector log on a machine without a GPU
NOISE = ("cannot store chunks", "CPU backend prefers", "Triton is not installed", "Failed to import from vllm._C",
         "Model Runner V2 requires Triton")


def _reset_swa(tmp_path) -> str:
    path = tmp_path / "explore-reset-swa-violation-1.json"
    path.write_text(json.dumps({"format": "kvref-explorer-trace", "version": 1, "scope": "reset-swa", "toy": False,
                                "set": [], "max_depth": 9, "kind": "violation", "message": "",
                                "actions": RESET_SWA_ACTIONS}))
    return str(path)


@pytest.mark.vllm
def test_replay_on_vllm_leaks_no_vllm_log_line(tmp_path) -> None:
    """Driving vLLM's OffloadingConnector logs "cannot store chunks" per refused store; replay is
    quiet like verify (it was not: every command but verify left vLLM's logging on)."""
    require_vllm()
    env = {**os.environ, "VLLM_TARGET_DEVICE": "cpu", "HF_HUB_OFFLINE": "1"}
    env.pop("VLLM_LOGGING_LEVEL", None)
    proc = subprocess.run([sys.executable, "-m", "kvref.cli", "replay", _reset_swa(tmp_path)], capture_output=True,
                          text=True, env=env, timeout=600)
    assert proc.returncode == 1, proc.stdout + proc.stderr[-2000:]
    assert [n for n in NOISE if n in proc.stderr] == [], proc.stderr[-2000:]
    assert "REPRODUCED (violation) on the reference" in proc.stdout
    assert "on vLLM: vLLM's world broke a rule: store job" in proc.stdout  # vLLM 0.33.0 has the bug too


def test_mutants_only_names_the_flag(capsys) -> None:
    assert main(["mutants", "--list", "--only", "nosuch"]) == 2
    err = capsys.readouterr().err
    assert "--only='nosuch'" in err and "mutant=" not in err
