#!/usr/bin/env bash
# gpu-check.sh — the one command for a CUDA machine (issue #24): kvref's GPU data path, compiled,
# on the machine's own python / torch / triton, with kvref installed from a wheel of this checkout.
#
#   bash scripts/gpu-check.sh [--python PY] [--wheel FILE] [--out DIR] [--budget SECONDS] [--only TEXT] [--plan]
#
# Steps (each under its own timeout, all under --budget, default 450 s; < 8 minutes with the
# wheel build): prerequisites -> wheel (pip wheel --no-deps --no-build-isolation, installed with
# --no-deps --no-index into a scratch --target directory: the machine's environment is not
# changed, nothing is downloaded) -> every kernel and `gpu` test of tests/impl/torch compiled on
# CUDA tensors (TRITON_INTERPRET unset) -> the correctness check (bench_triton_attention.py
# --check-only) -> the benchmarks (decode vs SDPA and device copy, a tuning sweep in one process,
# sliding window, batch/context sizes, offload through the Triton and torch copiers). The
# correctness steps ("[check]") run first and side by side (they wait on compiles, which 16 cores
# do in parallel; pytest spreads over processes where pytest-xdist is installed), then the timed
# steps one at a time on an idle device, in the order a short budget must not lose; see --plan.
# Prints ONE Markdown table (also DIR/table.md; every step's log in DIR).
#
# Installs nothing the machine lacks: a missing pytest / hypothesis / setuptools is named and the
# steps needing it are not run (exit 3). Without a CUDA device it says so and exits 2 — it never
# reports a pass it did not run.
#
# Exit status: 0 every step passed; 1 a step failed or timed out; 2 no CUDA device, or bad
# arguments; 3 a prerequisite is missing (named), the rest ran.
set -uo pipefail

usage() {
  awk 'NR > 1 && !/^#/ { exit } NR > 1 { sub(/^# ?/, ""); print }' "$0"
}

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
PY=""
WHEEL=""
OUT=""
BUDGET=450
PLAN=0
ONLY=""
while [ $# -gt 0 ]; do
  case "$1" in
    -h|--help) usage; exit 0 ;;
    --python) [ $# -ge 2 ] || { echo "gpu-check: --python needs a path" >&2; exit 2; }; PY=$2; shift 2 ;;
    --wheel) [ $# -ge 2 ] || { echo "gpu-check: --wheel needs a file" >&2; exit 2; }; WHEEL=$2; shift 2 ;;
    --out) [ $# -ge 2 ] || { echo "gpu-check: --out needs a directory" >&2; exit 2; }; OUT=$2; shift 2 ;;
    --budget)
      [ $# -ge 2 ] || { echo "gpu-check: --budget needs seconds" >&2; exit 2; }
      case "$2" in ''|*[!0-9]*) echo "gpu-check: --budget=$2: expected a positive number of seconds" >&2; exit 2 ;; esac
      [ "$2" -ge 1 ] || { echo "gpu-check: --budget=$2: expected a positive number of seconds" >&2; exit 2; }
      BUDGET=$2; shift 2 ;;
    --plan) PLAN=1; shift ;;
    --only) [ $# -ge 2 ] || { echo "gpu-check: --only needs a step name (part of one)" >&2; exit 2; }; ONLY=$2; shift 2 ;;
    *) echo "gpu-check: unknown option '$1' (see --help)" >&2; exit 2 ;;
  esac
done

if [ -z "$PY" ]; then PY=$(command -v python3 || command -v python || true); fi
if [ -z "$PY" ] || ! [ -x "$(command -v "$PY" 2>/dev/null || echo "$PY")" ]; then
  echo "gpu-check: no python interpreter '${PY:-python3}' (give --python PATH)" >&2
  exit 2
fi
if [ -n "$WHEEL" ] && ! [ -f "$WHEEL" ]; then
  echo "gpu-check: --wheel $WHEEL: no such file" >&2
  exit 2
fi

# step name | timeout (s) | arguments of $PY (run in the scratch run directory, see below)
# Steps whose name starts with "[check]" only judge correctness: they run side by side, first (the
# compiles of each distinct kernel configuration, not the GPU, are what they wait on: 16 cores
# compile in parallel), pytest with -n 6 where pytest-xdist is installed. The timed steps then run
# one at a time on an otherwise idle device.
# pytest in two steps, so that a timeout in one does not cost the other's verdict
KERNEL_TESTS="tests/impl/torch/test_triton_kernels.py tests/impl/torch/test_triton_real_shapes.py \
tests/impl/torch/test_triton_shared_memory.py tests/impl/torch/test_triton_compile.py \
tests/impl/torch/test_triton_offload_launches.py tests/impl/torch/test_kernel_device.py \
tests/impl/torch/test_pinned_host.py tests/impl/torch/test_offload_copy.py tests/impl/torch/test_gpu.py \
tests/impl/torch/test_paged_attention.py"
SCENARIO_TESTS="tests/impl/torch/test_triton_datapath.py tests/impl/torch/test_triton_backend_selector.py \
tests/impl/torch/test_triton_benchmarks.py"
# the gpu test that runs --check-only in a subprocess: the check is its own step below
DESELECT="tests/impl/torch/test_triton_kernels.py::test_compiled_kernels_on_cuda_match_the_torch_path"
PYTEST="-m pytest -q -p no:cacheprovider --maxfail=20 -rf"
# in order of what a short budget must not lose: the verdicts first, then the timings
STEPS=(
  "[check] correctness check (--check-only)|150|benchmarks/bench_triton_attention.py --check-only"
  "[check] kernel + gpu tests (compiled, CUDA tensors)|170|$PYTEST XDIST6 --deselect $DESELECT $KERNEL_TESTS"
  "[check] data-path scenarios through the kernels|170|$PYTEST XDIST4 $SCENARIO_TESTS"
  "decode bf16 64x4096 GQA4 (default tuning)|45|benchmarks/bench_triton_attention.py"
  "decode tuning sweep (tile x warps x stages x splits)|100|benchmarks/bench_triton_attention.py --sweep 70 --repeats 3"
  "offload, Triton + torch copiers, kernel tunings|50|benchmarks/bench_triton_offload.py --sweep"
  "decode, window 1024|30|benchmarks/bench_triton_attention.py --window 1024"
  "decode 256x4096|30|benchmarks/bench_triton_attention.py --batch 256"
  "decode 16x32768|30|benchmarks/bench_triton_attention.py --batch 16 --context 32768"
  "offload, torch copier|30|benchmarks/bench_torch_offload.py --device cuda"
  "bookkeeping per step, torch on CUDA vs reference|40|benchmarks/bench_torch_bookkeeping.py --device cuda --no-vllm"
)
if [ -n "$ONLY" ]; then
  KEEP=()
  for s in "${STEPS[@]}"; do [[ "${s%%|*}" == *"$ONLY"* ]] && KEEP+=("$s"); done
  if [ ${#KEEP[@]} -eq 0 ]; then echo "gpu-check: --only '$ONLY' names no step (see --plan)" >&2; exit 2; fi
  STEPS=("${KEEP[@]}")
fi
if [ $PLAN -eq 1 ]; then
  echo "gpu-check plan (python: $PY, budget ${BUDGET} s):"
  echo "  prerequisites: torch with CUDA, triton, pytest, hypothesis, setuptools (for the wheel); pytest-xdist if there"
  echo "  wheel: ${WHEEL:-pip wheel --no-deps --no-build-isolation $ROOT}; pip install --no-deps --no-index --target SCRATCH"
  for s in "${STEPS[@]}"; do
    IFS='|' read -r name limit cmd <<<"$s"
    cmd=${cmd/XDIST6/[-n 6 with pytest-xdist]}; cmd=${cmd/XDIST4/[-n 4 with pytest-xdist]}
    echo "  [$limit s] $name: \$PY $cmd"
  done
  exit 0
fi

START=$(date +%s)
elapsed() { echo $(( $(date +%s) - START )); }

# --- prerequisites: CUDA first (no device: exit 2 before anything is built) -------------------
PRE=$("$PY" - <<'EOF' 2>&1
import importlib, sys
def ver(name):
    try:
        return getattr(importlib.import_module(name), "__version__", "?")
    except Exception as exc:  # noqa: BLE001 - report what is missing, do not install it
        return None
import torch
cuda = torch.cuda.is_available()
print("cuda", "yes" if cuda else "no")
print("device", torch.cuda.get_device_name(0) if cuda else "-")
print("python", sys.version.split()[0])
for mod in ("torch", "triton", "numpy", "pytest", "hypothesis", "setuptools", "wheel", "xdist"):
    print(mod, ver(mod) or "MISSING")
EOF
)
PRE_RC=$?
if [ $PRE_RC -ne 0 ]; then
  echo "gpu-check: $PY cannot import torch:" >&2
  echo "$PRE" | tail -5 >&2
  exit 2
fi
get() { echo "$PRE" | awk -v k="$1" '$1 == k { $1 = ""; sub(/^ /, ""); print; exit }'; }
if [ "$(get cuda)" != "yes" ]; then
  echo "gpu-check: no CUDA device here (torch $(get torch) on $PY). This command checks and times the compiled" \
       "Triton kernels on a GPU; without one there is nothing it can run honestly. On CPU, run the kernel tests" \
       "in Triton's interpreter instead: python -m pytest tests/impl/torch" >&2
  exit 2
fi
MISSING=""
for mod in triton pytest hypothesis setuptools; do
  [ "$(get $mod)" = "MISSING" ] && MISSING="$MISSING $mod"
done

OUT=${OUT:-$(mktemp -d -t kvref-gpu-check.XXXXXX)}
mkdir -p "$OUT" || { echo "gpu-check: cannot create --out $OUT" >&2; exit 2; }
OUT=$(cd "$OUT" && pwd)
SCRATCH=$(mktemp -d -t kvref-gpu-site.XXXXXX)
ROWS=()
STATUS=0
row() { ROWS+=("| $1 | $2 | $3 | $4 |"); }

# --- wheel --------------------------------------------------------------------------------------
T0=$(elapsed)
if [ -z "$WHEEL" ]; then
  if [[ " $MISSING " == *" setuptools "* ]]; then
    row "wheel" "not run" 0 "setuptools missing: pass --wheel FILE built elsewhere (pip wheel --no-deps .)"
    STATUS=3
  else
    timeout 120 "$PY" -m pip wheel -q --no-deps --no-build-isolation --no-index "$ROOT" -w "$SCRATCH/wheel" \
      >"$OUT/wheel.log" 2>&1
    WHEEL=$(ls "$SCRATCH"/wheel/kvref-*.whl 2>/dev/null | head -1)
  fi
fi
if [ -n "$WHEEL" ]; then
  if timeout 60 "$PY" -m pip install -q --no-deps --no-index --target "$SCRATCH/site" "$WHEEL" >>"$OUT/wheel.log" 2>&1; then
    row "wheel" "ok" $(( $(elapsed) - T0 )) "$(basename "$WHEEL") -> scratch --target (no deps, no index)"
  else
    row "wheel" "FAILED" $(( $(elapsed) - T0 )) "see $OUT/wheel.log (setuptools $(get setuptools), wheel $(get wheel))"
    WHEEL=""
    STATUS=1
  fi
elif [ $STATUS -ne 3 ]; then
  row "wheel" "FAILED" $(( $(elapsed) - T0 )) "pip wheel built nothing (setuptools $(get setuptools), wheel $(get wheel); setuptools < 70.1 needs the wheel package): see $OUT/wheel.log"
  STATUS=1
fi

# The tests and benchmarks run from a scratch directory holding links to the checkout's tests/
# and benchmarks/ (and its pytest configuration), so `import kvref` is the wheel, never the
# checkout's kvref/ directory (which is only the CLI part of the package).
RUN="$SCRATCH/run"
mkdir -p "$RUN"
ln -s "$ROOT/tests" "$RUN/tests"
ln -s "$ROOT/benchmarks" "$RUN/benchmarks"
cp "$ROOT/pyproject.toml" "$RUN/pyproject.toml"
export PYTHONPATH="$SCRATCH/site${PYTHONPATH:+:$PYTHONPATH}"
unset TRITON_INTERPRET
export VLLM_TARGET_DEVICE=${VLLM_TARGET_DEVICE:-cpu} HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1

if [ -n "$WHEEL" ]; then
  WHERE=$(cd "$RUN" && "$PY" -c "import kvref, kvref.impl.torch.triton_kernels.attention as a; print(a.__file__)" 2>&1)
  if [[ "$WHERE" != "$SCRATCH/site"* ]]; then
    row "kvref import" "FAILED" 0 "not the wheel: $WHERE"
    STATUS=1
    WHEEL=""
  fi
fi

figure() {  # the line of a step's log that says what it measured or decided
  grep -E "goal[:( ]|sweep best:|check (passed|failed)|[0-9]+ (passed|failed)|^FAIL|Error|error:" "$1" | tail -2 | tr '|' '/' \
    | tr '\n' ' ' | cut -c1-220
}

# xdist: the checks' pytest runs spread over processes where pytest-xdist is installed
xdist_args() { if [ "$(get xdist)" != "MISSING" ]; then echo "-n $1"; fi; }

run_step() {  # n name limit cmd: runs one step into step$n.log, writes step$n.rc and step$n.secs
  local n=$1 name=$2 limit=$3 cmd=$4 t0
  cmd=${cmd/XDIST6/$(xdist_args 6)}
  cmd=${cmd/XDIST4/$(xdist_args 4)}
  t0=$(date +%s)
  # shellcheck disable=SC2086 # the arguments are split on purpose
  (cd "$RUN" && timeout "$limit" "$PY" $cmd) >"$OUT/step$n.log" 2>&1
  echo $? >"$OUT/step$n.rc"
  echo $(( $(date +%s) - t0 )) >"$OUT/step$n.secs"
}

report_step() {  # n name limit
  local n=$1 name=$2 limit=$3 rc secs st
  rc=$(cat "$OUT/step$n.rc" 2>/dev/null || echo 1)
  secs=$(cat "$OUT/step$n.secs" 2>/dev/null || echo 0)
  if [ "$rc" -eq 0 ]; then st="ok"; elif [ "$rc" -eq 124 ]; then st="TIMEOUT (${limit} s)"; STATUS=1; else st="FAILED (exit $rc)"; STATUS=1; fi
  row "$name" "$st" "$secs" "$(figure "$OUT/step$n.log")"
  # the benchmark tables themselves, for BENCHMARKS.md
  grep -E "^\|" "$OUT/step$n.log" >"$OUT/step$n.table.md" 2>/dev/null
  rm -f "$OUT/step$n.rc" "$OUT/step$n.secs"
}

runnable() {  # name cmd -> 0 when the step may run; else adds its "not run" row
  local name=$1 cmd=$2
  if [ -z "$WHEEL" ]; then row "$name" "not run" 0 "no kvref wheel installed"; return 1; fi
  if [[ "$cmd" == *pytest* ]] && [ -n "$MISSING" ]; then
    row "$name" "not run" 0 "missing on this machine:$MISSING (not installed by this script)"
    STATUS=3
    return 1
  fi
  return 0
}

clip() {  # limit -> the limit cut to what is left of the budget, or nothing when < 10 s are left
  local left=$(( BUDGET - $(elapsed) ))
  if [ $left -lt 10 ]; then return 1; fi
  if [ "$1" -gt $left ]; then echo $left; else echo "$1"; fi
}

# phase 1: the [check] steps side by side
n=0
PIDS=()
PAR=()
for s in "${STEPS[@]}"; do
  IFS='|' read -r name limit cmd <<<"$s"
  n=$((n + 1))
  [[ "$name" == "[check]"* ]] || continue
  runnable "$name" "$cmd" || continue
  if ! limit=$(clip "$limit"); then row "$name" "not run" 0 "budget of $BUDGET s spent"; STATUS=1; continue; fi
  run_step "$n" "$name" "$limit" "$cmd" &
  PIDS+=($!)
  PAR+=("$n|$name|$limit")
done
for p in "${PIDS[@]}"; do wait "$p"; done
for e in "${PAR[@]}"; do IFS='|' read -r k name limit <<<"$e"; report_step "$k" "$name" "$limit"; done

# phase 2: the timed steps, one at a time
n=0
for s in "${STEPS[@]}"; do
  IFS='|' read -r name limit cmd <<<"$s"
  n=$((n + 1))
  [[ "$name" == "[check]"* ]] && continue
  runnable "$name" "$cmd" || continue
  if ! limit=$(clip "$limit"); then row "$name" "not run" 0 "budget of $BUDGET s spent"; [ $STATUS -eq 0 ] && STATUS=1; continue; fi
  run_step "$n" "$name" "$limit" "$cmd"
  report_step "$n" "$name" "$limit"
done

{
  echo "gpu-check: $(get device); python $(get python), torch $(get torch), triton $(get triton), numpy $(get numpy); kvref wheel: ${WHEEL:+$(basename "$WHEEL")}"
  echo
  echo "| step | status | seconds | figure |"
  echo "|---|---|---|---|"
  printf '%s\n' "${ROWS[@]}"
  echo
  echo "total $(elapsed) s; logs and each benchmark's own table in $OUT"
} | tee "$OUT/table.md"
rm -rf "$SCRATCH"
exit $STATUS
