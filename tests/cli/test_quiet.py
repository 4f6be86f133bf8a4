"""Quiet by default (issue #16): third-party log noise off unless ``--verbose``; progress lines on
stderr neither wrap nor carry a ``file.py:NN`` suffix."""

from __future__ import annotations

import logging
import os
import subprocess
import sys

import pytest

from kvref.quiet import NOISY_LOGGERS, progress_console, quiet_third_party


@pytest.fixture
def restore_logging(monkeypatch):
    monkeypatch.setenv("VLLM_LOGGING_LEVEL", "INFO")
    monkeypatch.delenv("NIXL_LOG_LEVEL", raising=False)
    levels = {name: logging.getLogger(name).level for name in NOISY_LOGGERS}
    import warnings

    with warnings.catch_warnings():
        yield
    for name, level in levels.items():
        logging.getLogger(name).setLevel(level)


def test_quiet_raises_levels_and_vllm_env(restore_logging):
    quiet_third_party(verbose=False)
    assert os.environ["VLLM_LOGGING_LEVEL"] == "ERROR"
    for name in NOISY_LOGGERS:
        assert logging.getLogger(name).getEffectiveLevel() == logging.ERROR
    assert not logging.getLogger("vllm.platforms.cpu").isEnabledFor(logging.WARNING)
    assert logging.getLogger("vllm.platforms.cpu").isEnabledFor(logging.ERROR)


def test_quiet_hides_nixl_info_and_planted_load_failures_but_not_other_errors(restore_logging):
    """NIXL reads its level from NIXL_LOG_LEVEL when it configures its logger (after ours), and
    conform-connector fails KV loads on purpose: vLLM's ERROR line for each is kvref's own doing."""
    quiet_third_party(verbose=False)
    assert os.environ["NIXL_LOG_LEVEL"] == "ERROR"
    assert not logging.getLogger("nixl.api").isEnabledFor(logging.INFO)
    sched = logging.getLogger("vllm.v1.core.sched.scheduler")

    def record(msg):
        return logging.LogRecord(sched.name, logging.ERROR, __file__, 1, msg, (2, 4, {"r1"}), None)

    assert not sched.filter(record("Failing %d request(s) due to KV load failure "
                                   "(failure_policy=fail, %d tokens affected). Request IDs: %s"))
    assert not sched.filter(record("Unexpected: grammar rejected tokens %s for request %s. Terminating request."))
    assert sched.filter(record("Cannot get %d free blocks %s"))  # any other error still shows
    quiet_third_party(verbose=False)
    assert len(sched.filters) == len(set(map(type, sched.filters)))  # called twice: one filter


def test_verbose_changes_nothing(restore_logging):
    logging.getLogger("vllm").setLevel(logging.INFO)
    quiet_third_party(verbose=True)
    assert os.environ["VLLM_LOGGING_LEVEL"] == "INFO"
    assert logging.getLogger("vllm").getEffectiveLevel() == logging.INFO


def test_progress_console_neither_wraps_nor_names_a_source_line(capsys):
    console = progress_console()
    message = "machine-reference: passed (16.9s) " + "x" * 150
    console.log(message, markup=False)
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and message in err
    assert "test_quiet.py" not in err and ".py:" not in err


def test_verify_is_quiet_by_default_and_verbose_on_request(tmp_path):
    """The offload conformance check drives vLLM's CPU platform and OffloadingConnector, which log
    warnings on this machine; by default none of them reach stderr."""
    env = {**os.environ, "VLLM_TARGET_DEVICE": "cpu", "HF_HUB_OFFLINE": "1"}
    env.pop("VLLM_LOGGING_LEVEL", None)
    cmd = [sys.executable, "-m", "kvref.cli", "verify", "--only", "conform-offload", "--json", "--out", str(tmp_path)]
    quiet = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600)
    assert quiet.returncode in (0, 1), quiet.stderr[-2000:]
    noise = ("cannot store chunks", "CPU backend prefers", "Triton is not installed", "Failed to import from vllm._C")
    assert [n for n in noise if n in quiet.stderr] == [], quiet.stderr[-2000:]
    assert "cli/verify.py:" not in quiet.stderr
    assert [line for line in quiet.stderr.splitlines() if "conform-offload:" in line]  # kvref's own progress stays
    loud = subprocess.run(cmd + ["--verbose"], capture_output=True, text=True, env=env, timeout=600)
    assert "cannot store chunks" in loud.stderr, loud.stderr[-2000:]  # the noise exists: quiet hides it
