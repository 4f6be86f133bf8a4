#!/usr/bin/env bash
# Runs the whole test suite with the given interpreter. pytest's exit code 5 ("no tests were
# collected") is a failure here, never a pass.
#
# With pytest-xdist installed (requirements/test.txt pins it) and no pytest arguments given, the
# suite runs in three passes (the third: each `isolated` file in a process of its own, last): every test file not marked `serial` spread over one process per core
# (at most 4; CI has 2), file by file (--dist loadfile: a module's fixtures and its vLLM set-up stay
# in one process), then the `serial` tests in this one process. `serial` (tests/conftest.py) marks
# the files that start their own Ray cluster or time a signal against a wall clock: two Ray clusters
# on one machine stalled a retry test for 20 minutes, and a SIGINT moment means nothing on a loaded
# core. Why: on CI's 2 cores and 90 minutes the one-process suite ran past 5,400 s (stop 33).
# KVREF_TEST_WORKERS=1 (or any pytest argument) runs everything in one process as before.
set -uo pipefail
PY=${1:?usage: run-tests.sh PYTHON [pytest args...]}
shift
if [ "${CI:-}" = "true" ]; then export KVREF_HYPOTHESIS_PROFILE=${KVREF_HYPOTHESIS_PROFILE:-ci}; fi
export VLLM_CACHE_ROOT=${VLLM_CACHE_ROOT:-$(mktemp -d)}

no_tests() {
  echo "run-tests: pytest collected no tests; treating that as a failure" >&2
  exit 1
}

cores=$(nproc 2>/dev/null || echo 1)
workers=${KVREF_TEST_WORKERS:-$(( cores > 4 ? 4 : cores ))}
if [ $# -eq 0 ] && [ "$workers" -gt 1 ] && "$PY" -c "import xdist" 2>/dev/null; then
  echo "run-tests: pass 1 of 2, the suite but its serial files, in $workers processes" >&2
  "$PY" -m pytest -n "$workers" --dist loadfile -m "not serial and not isolated"
  rc1=$?
  [ $rc1 -eq 5 ] && no_tests
  echo "run-tests: pass 2 of 3, the serial files (Ray clusters, signal timing), in one process" >&2
  "$PY" -m pytest -m "serial and not isolated"
  rc2=$?
  [ $rc2 -eq 5 ] && no_tests
  rc3=0
  for f in $("$PY" -c "from tests.conftest import ISOLATED_FILES; print(' '.join(sorted(ISOLATED_FILES)))"); do
    echo "run-tests: pass 3 of 3, $f in a process of its own (it leaves native threads busy)" >&2
    "$PY" -m pytest "$f"
    rc=$?
    [ $rc -eq 5 ] && no_tests
    [ $rc -ne 0 ] && rc3=$rc
  done
  [ $rc1 -ne 0 ] && exit $rc1
  [ $rc2 -ne 0 ] && exit $rc2
  exit $rc3
fi
"$PY" -m pytest "$@"
rc=$?
[ $rc -eq 5 ] && no_tests
exit $rc
