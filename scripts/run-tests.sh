#!/usr/bin/env bash
# Runs the whole test suite with the given interpreter. pytest's exit code 5 ("no tests were
# collected") is a failure here, never a pass.
set -uo pipefail
PY=${1:?usage: run-tests.sh PYTHON [pytest args...]}
shift
if [ "${CI:-}" = "true" ]; then export KVREF_HYPOTHESIS_PROFILE=${KVREF_HYPOTHESIS_PROFILE:-ci}; fi
export VLLM_CACHE_ROOT=${VLLM_CACHE_ROOT:-$(mktemp -d)}
"$PY" -m pytest "$@"
rc=$?
if [ $rc -eq 5 ]; then
  echo "run-tests: pytest collected no tests; treating that as a failure" >&2
  exit 1
fi
exit $rc
