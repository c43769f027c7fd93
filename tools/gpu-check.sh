#!/usr/bin/env bash
# gpu-check.sh: everything strata can check on a machine with a GPU, in one command that fits
# in 10 minutes of GPU time, needs no network, no compiler and no Python: it runs every
# `gpu`-labelled test, then `strata-bench gpu` (pinned H2D / D2H against the link's measured
# peak, bf16 GEMM through Stream::matmul against cuBLASLt's best, CUDA AdamW against a device
# copy, the simple and tiled model kernels against each other (results and time), a ZeRO-3
# model step with parameters and optimizer state on the host and on NVMe: tokens/s, MFU, the
# GPU's idle share from the trace; and the GPU's losses against the
# CPU-emulated device's), then strata-prof's predictions against measured steps on the GPU
# (a 16-layer, 1024-wide Llama in bf16 planned for 2 GiB of it: the best 3 placements
# validated), writes one JSON summary (gpu-check.json) and prints a short table.
#
#   tools/gpu-check.sh --build DIR            from a source tree: DIR is a build with tests
#   <package>/bin/gpu-check.sh --tests DIR    from an unpacked package (docs/build.md, "Package"):
#                                             DIR holds the test binaries (*_gpu_test, e.g.
#                                             copied from build/tests) or is a build folder
#
# Options: --out DIR (default <build>/gpu-check, or ./gpu-check from a package),
#   --nvme-path DIR (the NVMe placement's swap folder: put it on the NVMe drive; default
#   <out>/nvme), --no-ctest (run the test binaries directly even where ctest exists),
#   --make (configure and build DIR with CUDA first; counts against the 10 minutes),
#   --bench-args "..." (more strata-bench gpu flags, e.g. "--hidden 1024 --layers 16"),
#   --rehearse (where there is no GPU: every step as on a GPU machine, the bench and strata-prof on
#   the CPU-emulated device at small sizes, so this script's own GPU path, its JSON and its table,
#   run end to end; the gpu tests are run and skip; the verdict is REHEARSED or FAIL).
#
# Without a usable GPU every part reports SKIPPED with the reason, gpu-check.json says
# "skipped": true, and it exits 0, unless nvidia-smi lists a GPU: then strata not being able to
# use it (an old driver, CUDA libraries it cannot find) is a failure naming the probe's reason.
# With a usable GPU it exits non-zero when any step fails, any gpu test fails or is skipped for
# want of a usable GPU (tests of the emulated device alone skip by design on CUDA and are counted
# apart), or any benchmark part fails (the loss parity included). Each step has its own time
# limit; the logs are in <out>/<step>.log, the bench's configs, logs and traces in <out>/bench.
# Where STRATA_CUDA_LIBS is unset and python3 imports PyTorch's nvidia-* wheels (an unactivated
# venv, lib64/python3*), their lib folders are given to strata's loader through it.
set -uo pipefail

here=$(cd "$(dirname "$0")" && pwd)
build="" tests="" out="" nvme="" use_ctest=1 make=0 bench_args="" rehearse=0
while [ $# -gt 0 ]; do
  case $1 in
    --build) build=$2; shift 2 ;;
    --tests) tests=$2; shift 2 ;;
    --out) out=$2; shift 2 ;;
    --nvme-path) nvme=$2; shift 2 ;;
    --no-ctest) use_ctest=0; shift ;;
    --make) make=1; shift ;;
    --bench-args) bench_args=$2; shift 2 ;;
    --rehearse) rehearse=1; shift ;;
    -h|--help) sed -n '2,/^set -uo/p' "$0" | sed '$d; s/^# \{0,1\}//'; exit 0 ;;
    *) echo "gpu-check.sh: unknown argument '$1' (see --help)" >&2; exit 2 ;;
  esac
done

# Where the tools and the tests are: a package (this script beside strata-bench, lib/ next
# to bin/), else a build folder (--build, default <source>/build).
if [ -z "$build" ] && [ -x "$here/strata-bench" ] && [ -d "$here/../lib" ]; then
  bin=$here
  lib=$(cd "$here/../lib" && pwd)
  export LD_LIBRARY_PATH="$lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"  # for the test binaries
  out=${out:-$PWD/gpu-check}
else
  given_build=$build
  build=${build:-$here/../build}
  # A build folder that is not there is a typo, not one to make (only --make builds into it).
  [ "$make" = 1 ] && mkdir -p "$build" 2>/dev/null
  [ -d "$build" ] || {
    if [ -n "$given_build" ]; then
      echo "gpu-check.sh: --build $build: no such folder (give the build folder, or add --make to build one there)" >&2
    else
      echo "gpu-check.sh: no build folder at $build (the default): give --build DIR, --tests DIR, or add --make" >&2
    fi
    exit 2
  }
  build=$(cd "$build" && pwd)
  bin=$build/tools
  tests=${tests:-$build}
  out=${out:-$build/gpu-check}
fi
# Every log and the JSON go under --out: a file there (or no permission) is said now, before
# anything runs (an empty $out put them in /).
if [ -n "$nvme" ] && [ -e "$nvme" ] && [ ! -d "$nvme" ]; then
  echo "gpu-check.sh: --nvme-path $nvme is a file: give a folder (on the NVMe drive) for the swap files" >&2
  exit 2
fi
if ! mkdir -p "$out" 2>/dev/null || ! abs=$(cd "$out" 2>/dev/null && pwd) || [ -z "$abs" ]; then
  echo "gpu-check.sh: --out $out cannot be a folder (a file of that name is there, or no permission): give another --out" >&2
  exit 2
fi
out=$abs
nvme=${nvme:-$out/nvme}
started=$(date +%s)

# The CUDA libraries of PyTorch's nvidia-* wheels wherever this python3 keeps them: first in the
# loader's search (STRATA_CUDA_LIBS), unless the user set it.
if [ -z "${STRATA_CUDA_LIBS:-}" ] && command -v python3 >/dev/null; then
  wheels=$(python3 -c '
import glob, os
try:
    import nvidia
except Exception:
    raise SystemExit
print(":".join(d for root in nvidia.__path__ for d in sorted(glob.glob(os.path.join(root, "*", "lib")))))' 2>/dev/null)
  if [ -n "$wheels" ]; then
    export STRATA_CUDA_LIBS=$wheels
    echo "gpu-check.sh: STRATA_CUDA_LIBS=$wheels (PyTorch's nvidia-* wheels)"
  fi
fi
# GPUs the driver lists: with any, strata not using one is a failure, not a skip.
listed=0
command -v nvidia-smi >/dev/null && listed=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU ')
names=() rcs=() secs=()
failed=0

# step NAME TIMEOUT_S FUNCTION : runs FUNCTION in a child bash, its output in $out/NAME.log.
step() {
  local name=$1 limit=$2 fn=$3 t0 rc
  t0=$(date +%s)
  timeout --kill-after=10 "$limit" bash -c "$fn" >"$out/$name.log" 2>&1
  rc=$?
  names+=("$name") rcs+=("$rc") secs+=("$(($(date +%s) - t0))")
  if [ "$rc" -ne 0 ]; then
    failed=1
    [ "$rc" -eq 124 ] && echo "== $name: TIMED OUT after $limit s" || echo "== $name: FAILED (exit $rc)"
    tail -n 20 "$out/$name.log" | sed 's/^/   | /'
  fi
  return "$rc"
}

json_str() {
  local s=$1
  s=${s//\\/\\\\}
  s=${s//\"/\\\"}
  s=${s//$'\n'/\\n}
  s=${s//$'\t'/ }
  s=${s//$'\r'/}
  printf '"%s"' "$s"
}

gpu_info() {
  if command -v nvidia-smi >/dev/null; then nvidia-smi; else echo "nvidia-smi not found"; fi
  "$bin/strata-info"
}

# NCCL required; PyTorch's nvidia-nccl wheel found through python3 where nothing else has it.
configure_and_build() {
  local nccl=() root
  if command -v python3 >/dev/null &&
     root=$(python3 -c 'import nvidia.nccl; print(list(nvidia.nccl.__path__)[0])' 2>/dev/null) && [ -n "$root" ]; then
    nccl=(-DSTRATA_NCCL_ROOT="$root")
  fi
  cmake -S "$here/.." -B "$build" -G Ninja -DSTRATA_CUDA=ON -DSTRATA_NCCL=ON "${nccl[@]}" -DCMAKE_BUILD_TYPE=Release \
    -DSTRATA_BUILD_TESTS=ON -DSTRATA_BUILD_BENCH=OFF && cmake --build "$build" -j "$(nproc)"
}

# Every gpu-labelled test: through ctest where there is a build folder and ctest, else each
# *_gpu_test binary directly (GoogleTest's own summary is counted).
gpu_tests() {
  if [ "$use_ctest" = 1 ] && [ -f "$tests/CTestTestfile.cmake" ] && command -v ctest >/dev/null; then
    echo "runner: ctest"
    # Four at a time: each test is a process with its own CUDA context on the one GPU, and the
    # engine's overlap tests time their streams (16 at once made both flaky).
    ctest --test-dir "$tests" -L gpu --output-on-failure --timeout 200 -j 4
    return
  fi
  echo "runner: gtest"
  local found=0 rc=0 t
  for t in "$tests"/*_gpu_test "$tests"/tests/*_gpu_test; do
    [ -x "$t" ] || continue
    found=1
    echo "== $t"
    # Each binary within its own limit, so that one that hangs is named and the rest still run.
    timeout --kill-after=5 150 "$t" --gtest_color=no
    case $? in
      0) ;;
      124|137) echo "== $t: TIMED OUT after 150 s (its tests are not counted)"; rc=1 ;;
      *) rc=1 ;;
    esac
  done
  [ "$found" = 1 ] || { echo "no *_gpu_test binaries in $tests or $tests/tests"; return 3; }
  return "$rc"
}

bench() {
  local rehearsal=()
  [ "$rehearse" = 1 ] && rehearsal=(--rehearse)  # small sizes on the CPU-emulated device
  # shellcheck disable=SC2086  # --bench-args is split into flags on purpose
  "$bin/strata-bench" gpu "${rehearsal[@]}" --json --out "$out/bench" --overwrite --nvme-path "$nvme" $bench_args
}

# strata-prof on the GPU: predicted vs measured step time of the best 3 placements (issue #9's
# GPU target: within 15%), a model large enough that a step is not all kernel launches
# (254M parameters), planned for 2 GiB of the GPU so that the placements offload.
prof() {
  mkdir -p "$out/prof"
  cat >"$out/prof/model.json" <<'EOF'
{"model_type": "llama", "architectures": ["LlamaForCausalLM"], "vocab_size": 32000, "hidden_size": 1024,
 "intermediate_size": 2816, "num_hidden_layers": 16, "num_attention_heads": 16, "num_key_value_heads": 8,
 "max_position_embeddings": 2048, "rms_norm_eps": 1e-5, "tie_word_embeddings": false}
EOF
  # One micro-batch size (4): the layer timings of B/2, B and 2B took 144 s of the step's time on
  # an NVIDIA H200; with one, the whole step took 146 s.
  local where=(--device cuda --model-config "$out/prof/model.json" --seq-len 512 --micro-batches 4 --dtype bf16
               --device-mem-gb 2 --validate 3)
  # Rehearsed: strata-prof's demo model on the CPU-emulated device, two placements validated.
  [ "$rehearse" = 1 ] && where=(--device cpu --device-mem-gb 0.1 --micro-batches 1 --seq-len 64 --validate 2)
  # The best ones only (--validate-spread 0): the step's 210 s are sized for them, and the spread's
  # last-ranked placement may take many times the best's step.
  "$bin/strata-prof" "${where[@]}" --validate-spread 0 --nvme-path "$nvme" --validate-steps 4 --top 3 --json \
    --out "$out/prof/best.json" --svg "$out/prof/prof.svg" --trace "$out/prof/trace.json" \
    --overwrite  # a check run again into the same --out
}

export bin tests out nvme use_ctest bench_args build here rehearse
export -f gpu_info configure_and_build gpu_tests bench prof

# ---- steps ----
[ "$make" = 1 ] && step build 420 configure_and_build
# --bench-args checked before anything runs (strata-bench gpu checks its flags and --parts names
# before it looks for a GPU): a typo is said now, exit 2, not reported as a failed bench after
# the tests, with the tests counted against it.
if [ -n "$bench_args" ] && [ -x "$bin/strata-bench" ]; then
  probe=(gpu --probe)
  [ "$rehearse" = 1 ] && probe+=(--rehearse)
  # shellcheck disable=SC2086  # split into flags on purpose, as in bench()
  if ! why=$("$bin/strata-bench" "${probe[@]}" $bench_args 2>&1 >/dev/null); then
    echo "gpu-check.sh: --bench-args \"$bench_args\": ${why:-refused by strata-bench gpu}" >&2
    exit 2
  fi
fi
# The limits add up to 590 s (an NVIDIA H200 took 105-110 s for the tests, 40-46 s for the bench
# and 146 s for strata-prof).
step gpu-info 60 gpu_info
if [ -n "$tests" ]; then step gpu-tests 200 gpu_tests; fi
step bench 120 bench

# ---- the bench's JSON (its last line) ----
blog=$out/bench.log
bench_json=$(grep -E '^\{' "$blog" 2>/dev/null | tail -n 1)
[ -n "$bench_json" ] || bench_json="{\"error\": $(json_str "$(tail -n 5 "$blog" 2>/dev/null)")}"
reason=$(sed -n 's/^SKIPPED: //p' "$blog" 2>/dev/null | head -n 1)
no_gpu=0
case $bench_json in *'"skipped":true'*) no_gpu=1 ;; esac
# ---- strata-prof, on a GPU only (its JSON: its last line) ----
prof_json=null
if [ "$no_gpu" = 0 ]; then
  step prof 210 prof
  prof_json=$(grep -E '^\{' "$out/prof.log" 2>/dev/null | tail -n 1)
  [ -n "$prof_json" ] || prof_json="{\"error\": $(json_str "$(tail -n 5 "$out/prof.log" 2>/dev/null)")}"
fi

# ---- test counts ----
log=$out/gpu-tests.log
runner=none total=0 passed=0 skipped=0 failed_tests=0 no_gpu_skips=0
if [ -f "$log" ]; then
  runner=$(sed -n 's/^runner: //p' "$log" | head -n 1)
  if [ "$runner" = ctest ]; then
    lines=$(grep -E '^ *[0-9]+/[0-9]+ Test +#' "$log")
    total=$(printf '%s\n' "$lines" | grep -c 'Test')
    passed=$(printf '%s\n' "$lines" | grep -cE ' Passed +[0-9.]+ sec')
    skipped=$(printf '%s\n' "$lines" | grep -cE 'Skipped|Not Run')
  else
    sum() { sed -n "s/$1/\\1/p" "$log" | awk '{ s += $1 } END { print s + 0 }'; }
    total=$(sum '^\[==========\] \([0-9]*\) tests\{0,1\} from .* ran.*')
    passed=$(sum '^\[  PASSED  \] \([0-9]*\) tests\{0,1\}\..*')
    skipped=$(sum '^\[  SKIPPED \] \([0-9]*\) tests\{0,1\}, listed below.*')
  fi
  failed_tests=$((total - passed - skipped))
  # Skips for want of a usable GPU (the suites say "no usable GPU"), as against tests of the
  # emulated device that skip by design on CUDA. ctest keeps every test's output in LastTest.log.
  skip_log=$log
  [ "$runner" = ctest ] && [ -f "$tests/Testing/Temporary/LastTest.log" ] && skip_log=$tests/Testing/Temporary/LastTest.log
  no_gpu_skips=$(grep -c 'no usable GPU' "$skip_log")
  [ "$no_gpu_skips" -gt "$skipped" ] && no_gpu_skips=$skipped
fi

# ---- verdict ----
if [ "$rehearse" = 1 ]; then
  # Every step ran on the CPU-emulated device: each must have done so, the tests skipping only.
  status=rehearsed
  { [ "$failed" -ne 0 ] || [ "$failed_tests" -gt 0 ]; } && status=failed
  [ -n "$tests" ] && [ "$total" -eq 0 ] && status=failed
  case $bench_json in *'"ok":true'*) ;; *) status=failed ;; esac
  case $bench_json in *'"rehearsal":true'*) ;; *) status=failed ;; esac
elif [ "$no_gpu" = 1 ]; then
  # Nothing could run on a GPU: the check passes as skipped unless a test failed outright, or
  # the driver lists a GPU strata cannot use.
  status=skipped
  [ "$failed_tests" -gt 0 ] && status=failed
  for i in "${!names[@]}"; do
    [ "${names[$i]}" != gpu-tests ] && [ "${rcs[$i]}" -ne 0 ] && status=failed
  done
  [ -n "$tests" ] && [ "$total" -eq 0 ] && status=failed
  if [ "$listed" -gt 0 ]; then
    status=failed
    reason="nvidia-smi lists $listed GPU(s), but strata cannot use them: ${reason:-no reason given}"
  fi
else
  status=passed
  { [ "$failed" -ne 0 ] || [ "$total" -eq 0 ] || [ "$no_gpu_skips" -gt 0 ] || [ "$failed_tests" -gt 0 ]; } && status=failed
  case $bench_json in *'"ok":true'*) ;; *) status=failed ;; esac
fi
if [ -z "$tests" ]; then tests_status="not given (--tests DIR)"
elif [ "$total" -eq 0 ]; then tests_status="none found"
elif [ "$failed_tests" -gt 0 ]; then tests_status="FAILED"
elif [ "$no_gpu" = 1 ] || [ "$rehearse" = 1 ]; then tests_status="SKIPPED"  # the ones that pass need no GPU
elif [ "$no_gpu_skips" -gt 0 ]; then tests_status="FAILED ($no_gpu_skips skipped for want of a usable GPU)"
else tests_status="ok"; fi
[ -z "$tests" ] && [ "$no_gpu" = 0 ] && status=failed
seconds=$(($(date +%s) - started))

# ---- gpu-check.json ----
{
  printf '{\n  "status": "%s",\n  "rehearsal": %s,\n  "ok": %s,\n  "skipped": %s,\n  "reason": %s,\n' "$status" \
    "$([ "$rehearse" = 1 ] && echo true || echo false)" \
    "$([ "$status" = failed ] && echo false || echo true)" "$([ "$no_gpu" = 1 ] && echo true || echo false)" \
    "$([ -n "$reason" ] && json_str "$reason" || echo null)"
  printf '  "date": "%s",\n  "host": %s,\n' "$(date -u +%Y-%m-%dT%H:%M:%SZ)" "$(json_str "$(uname -n)")"
  printf '  "tests": {"status": %s, "runner": "%s", "total": %d, "passed": %d, "failed": %d, "skipped": %d, "skipped_no_gpu": %d},\n' \
    "$(json_str "$tests_status")" "$runner" "$total" "$passed" "$failed_tests" "$skipped" "$no_gpu_skips"
  printf '  "steps": ['
  for i in "${!names[@]}"; do
    [ "$i" -gt 0 ] && printf ','
    printf '\n    {"name": "%s", "exit": %d, "seconds": %d}' "${names[$i]}" "${rcs[$i]}" "${secs[$i]}"
  done
  printf '\n  ],\n  "bench": %s,\n  "prof": %s,\n  "seconds": %d\n}\n' "$bench_json" "$prof_json" "$seconds"
} >"$out/gpu-check.json"

# ---- the table ----
{
  case $status in
    skipped) echo "strata gpu-check: SKIPPED: ${reason:-no usable GPU}" ;;
    passed) echo "strata gpu-check: PASS" ;;
    rehearsed) echo "strata gpu-check: REHEARSED on the CPU-emulated device (no GPU was used)" ;;
    *) echo "strata gpu-check: FAIL${reason:+: $reason}" ;;
  esac
  printf '  %-12s %s (%d tests: %d passed, %d failed, %d skipped, %d of them for want of a usable GPU; %s)\n' \
    "gpu tests" "$tests_status" "$total" "$passed" "$failed_tests" "$skipped" "$no_gpu_skips" "$runner"
  if [ "$no_gpu" = 1 ]; then
    for p in link gemm adamw kernels model parity prof; do printf '  %-12s SKIPPED\n' "$p"; done
  else
    sed -n '/^strata-bench gpu:/,$p' "$blog" | grep -vE '^\{' | sed 's/^/  /'
    printf '  %-12s %s\n' prof "$(grep -E '^worst prediction error' "$out/prof.log" 2>/dev/null || echo "no result: see $out/prof.log")"
  fi
  echo "  $seconds s; summary $out/gpu-check.json, logs in $out"
} | tee "$out/summary.txt"

[ "$status" != failed ]
