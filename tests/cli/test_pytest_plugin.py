"""`pytest -p kvref.pytest_plugin --kvref`: kvref's checks as test items in someone else's run."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from tests.vllm_env import require_vllm

# The vLLM under test, with #39734 re-introduced (managers lose their admission cap) — what a
# developer's broken checkout would look like.
BROKEN_VLLM_CONFTEST = '''
from vllm.v1.core import single_type_kv_cache_manager as stm

_original = stm.SingleTypeKVCacheManager.__init__

def _uncapped(self, *args, **kwargs):
    _original(self, *args, **kwargs)
    self.max_admission_blocks_per_request = None

stm.SingleTypeKVCacheManager.__init__ = _uncapped
'''


def _pytest(tmp_path, *args):
    env = {**os.environ, "VLLM_TARGET_DEVICE": "cpu", "KVREF_HYPOTHESIS_PROFILE": "fast"}
    return subprocess.run([sys.executable, "-m", "pytest", "-p", "kvref.pytest_plugin", "-q", "-p", "no:cacheprovider",
                           *args], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)


def test_plugin_adds_nothing_without_the_flag(tmp_path):
    out = _pytest(tmp_path)
    assert out.returncode == 5, out.stdout  # pytest's "no tests collected"


def test_plugin_rejects_unknown_checks(tmp_path):
    out = _pytest(tmp_path, "--kvref", "--kvref-checks", "no-such-check")
    assert out.returncode == 4 and "no-such-check" in out.stderr


@pytest.mark.vllm
def test_plugin_passes_on_vllm_and_fails_on_a_broken_one(tmp_path):
    require_vllm()
    ok = _pytest(tmp_path, "--kvref", "--kvref-checks", "spec,startup-liveness")
    assert ok.returncode == 0, ok.stdout[-2000:]
    assert "2 passed" in ok.stdout
    (tmp_path / "conftest.py").write_text(BROKEN_VLLM_CONFTEST)
    broken = _pytest(tmp_path, "--kvref", "--kvref-checks", "spec,startup-liveness")
    assert broken.returncode == 1, broken.stdout[-2000:]
    assert "kvref check startup-liveness: failed" in broken.stdout
    assert "vllm: the full-sequence admission gate rejected" in broken.stdout


@pytest.mark.vllm
def test_plugin_applies_a_baseline_and_rejects_a_broken_one(tmp_path):
    """A fork that changed the admission gate on purpose lists the finding in a baseline file: the
    item passes; the baseline is read as in `kvref verify` (a broken file is a usage error)."""
    require_vllm()
    import json

    from kvref.models.conformance.accepted import signature

    (tmp_path / "conftest.py").write_text(BROKEN_VLLM_CONFTEST)
    summary = "1 case(s) where startup accepted but runtime did not serve"
    (tmp_path / "b.json").write_text(json.dumps({"kvref_baseline": 1, "accepted": [
        {"check": "startup-liveness", "signature": signature(summary), "reason": "gate changed on purpose"}]}))
    accepted = _pytest(tmp_path, "--kvref", "--kvref-checks", "startup-liveness", "--kvref-baseline", "b.json")
    assert accepted.returncode == 0, accepted.stdout[-2000:]
    (tmp_path / "bad.json").write_text('{"kvref_baseline": 1, "accepted": [{"check": 3}]}')
    bad = _pytest(tmp_path, "--kvref", "--kvref-checks", "spec", "--kvref-baseline", "bad.json")
    assert bad.returncode == 4 and "accepted[0].check" in bad.stderr
