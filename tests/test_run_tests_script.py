"""scripts/run-tests.sh (the README's test command, what CI runs): its two passes and its exit codes.

The parallel pass skips the ``serial`` files and the second pass runs only them, so a file named in
``SERIAL_FILES`` that no longer exists would silently move its tests into the parallel pass.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from tests.conftest import ISOLATED_FILES, SERIAL_FILES

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "scripts" / "run-tests.sh"


def test_every_serial_file_exists():
    missing = sorted(f for f in SERIAL_FILES | ISOLATED_FILES if not (ROOT / f).is_file())
    assert not missing, f"SERIAL_FILES / ISOLATED_FILES name files that are gone: {missing}"


def test_serial_files_are_marked_and_nothing_else_is(pytestconfig):
    out = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-m", "serial",
                          "tests/cli/test_ray.py", "tests/hardening/test_interrupts.py", "tests/test_layering.py"],
                         cwd=ROOT, capture_output=True, text=True, timeout=300)
    ids = [line for line in out.stdout.splitlines() if "::" in line]
    files = {i.split("::", 1)[0] for i in ids}
    assert "tests/hardening/test_interrupts.py" in files, out.stdout[-2000:]
    assert "tests/test_layering.py" not in files


def _script(tmp_path, *args, env=None):
    return subprocess.run(["bash", str(SCRIPT), sys.executable, *args], cwd=ROOT, capture_output=True,
                          text=True, timeout=300, env={**os.environ, **(env or {})})


def test_no_tests_collected_is_a_failure_not_a_pass(tmp_path):
    p = _script(tmp_path, "-k", "no_test_has_this_name_zzz", "tests/test_layering.py")
    assert p.returncode == 1, (p.returncode, p.stderr[-2000:])
    assert "collected no tests" in p.stderr

