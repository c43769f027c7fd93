#!/usr/bin/env bash
# One command for a machine with a GPU: builds strata with CUDA, runs the `gpu` tests and
# strata-info's self-check, and writes a summary (summary.txt, summary.json, one log per
# step) into ${OUT:-build-gpu/gpu-check}.
#
# Exits non-zero when any step fails, when any gpu test fails, or when any is skipped: on a
# machine with a GPU a skip means the GPU was not usable, which is the thing to find out.
# Meant to finish well under 10 minutes; each step has its own time limit.
#
# To add a check, add one `step NAME TIMEOUT_S COMMAND...` line in the steps section below.
# A step that should not fail the run when absent checks for itself and exits 0.
set -uo pipefail
cd "$(dirname "$0")/.."

build=${BUILD_DIR:-build-gpu}
out=${OUT:-$build/gpu-check}
mkdir -p "$out"
jobs=$(nproc)
started=$(date +%s)

names=()
rcs=()
secs=()
failed=0

# step NAME TIMEOUT_S COMMAND... : runs COMMAND with its output in $out/NAME.log.
step() {
  local name=$1 limit=$2
  shift 2
  local t0 rc
  t0=$(date +%s)
  echo "== $name: $*"
  timeout --kill-after=10 "$limit" bash -c '"$@"' "$name" "$@" >"$out/$name.log" 2>&1
  rc=$?
  names+=("$name")
  rcs+=("$rc")
  secs+=("$(($(date +%s) - t0))")
  if [ "$rc" -eq 0 ]; then
    echo "   ok ($(($(date +%s) - t0)) s)"
  else
    [ "$rc" -eq 124 ] && echo "   TIMED OUT after $limit s" || echo "   FAILED (exit $rc)"
    tail -n 30 "$out/$name.log" | sed 's/^/   | /'
    failed=1
  fi
  return "$rc"
}

gpu_info() {
  if command -v nvidia-smi >/dev/null; then nvidia-smi; else echo "nvidia-smi not found"; fi
  nvcc --version 2>/dev/null || /usr/local/cuda/bin/nvcc --version 2>/dev/null || echo "nvcc not on PATH"
}

configure() {
  cmake -S . -B "$build" -G Ninja -DSTRATA_CUDA=ON -DCMAKE_BUILD_TYPE=Release \
    -DSTRATA_BUILD_TESTS=ON -DSTRATA_BUILD_BENCH=OFF
}

build_all() { cmake --build "$build" -j "$jobs"; }

gpu_tests() {
  ctest --test-dir "$build" -L gpu --output-on-failure --timeout 300 -j "$jobs"
}

self_check() {
  if [ -x "$build/tools/strata-info" ]; then
    "$build/tools/strata-info" --self-check
  else
    echo "no $build/tools/strata-info: skipped"
  fi
}

# ---- steps (add new checks here; step functions run in a child bash, so export them) ----
export build out jobs
export -f gpu_info configure build_all gpu_tests self_check
step gpu-info 60 gpu_info
if step configure 120 configure && step build 420 build_all; then
  step gpu-tests 300 gpu_tests
  step self-check 60 self_check
fi

# ---- test counts from the ctest log ----
log="$out/gpu-tests.log"
total=0 passed=0 skipped=0 failed_tests=0
if [ -f "$log" ]; then
  total=$(grep -cE '^ *[0-9]+/[0-9]+ Test +#' "$log")
  passed=$(grep -E '^ *[0-9]+/[0-9]+ Test +#' "$log" | grep -cE ' Passed +[0-9.]+ sec')
  skipped=$(grep -E '^ *[0-9]+/[0-9]+ Test +#' "$log" | grep -cE 'Skipped|Not Run')
  failed_tests=$((total - passed - skipped))
fi
if [ -f "$log" ] && { [ "$total" -eq 0 ] || [ "$skipped" -gt 0 ] || [ "$failed_tests" -gt 0 ]; }; then
  failed=1
fi

# ---- summary ----
ok=true
[ "$failed" -ne 0 ] && ok=false
{
  echo "strata gpu-check: $([ "$ok" = true ] && echo PASS || echo FAIL)"
  echo "gpu tests: $total total, $passed passed, $failed_tests failed, $skipped skipped"
  for i in "${!names[@]}"; do
    printf '  %-12s exit %-4s %5s s\n' "${names[$i]}" "${rcs[$i]}" "${secs[$i]}"
  done
  if [ -f "$log" ]; then
    grep -E '^ *[0-9]+/[0-9]+ Test +#' "$log" | grep -vE ' Passed ' | sed 's/^/  not passed: /'
  fi
  echo "total time: $(($(date +%s) - started)) s; logs in $out"
} | tee "$out/summary.txt"

{
  printf '{\n  "ok": %s,\n' "$ok"
  printf '  "tests": {"total": %d, "passed": %d, "failed": %d, "skipped": %d},\n' \
    "$total" "$passed" "$failed_tests" "$skipped"
  printf '  "steps": ['
  for i in "${!names[@]}"; do
    [ "$i" -gt 0 ] && printf ','
    printf '\n    {"name": "%s", "exit": %d, "seconds": %d}' "${names[$i]}" "${rcs[$i]}" "${secs[$i]}"
  done
  printf '\n  ],\n  "seconds": %d\n}\n' "$(($(date +%s) - started))"
} >"$out/summary.json"

[ "$ok" = true ]
