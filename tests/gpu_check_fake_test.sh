#!/usr/bin/env bash
# gpu_check_verdicts: tools/gpu-check.sh's verdict logic on a fake GPU machine, here where none is.
# A fake build folder holds a strata-bench that answers as on a GPU (or says SKIPPED), a
# strata-info and strata-prof that print a line, and *_gpu_test "binaries" that print GoogleTest's
# output; a fake nvidia-smi lists a GPU or none. Four machines:
#   1. a usable GPU, tests passing, some skipped by design (tests of the emulated device): PASS;
#   2. the same with one test skipped for want of a usable GPU: FAIL, the count said;
#   3. nvidia-smi lists a GPU but strata cannot use it (the bench says SKIPPED): FAIL, naming the
#      probe's reason, not a skip;
#   4. no GPU listed and none usable: SKIPPED, exit 0.
# Usage: gpu_check_fake_test.sh SOURCE_DIR
set -euo pipefail
src=$1
fail() { echo "FAIL: $*" >&2; exit 1; }
command -v python3 >/dev/null || { echo "no python3 to read the JSON"; exit 77; }

root=$(mktemp -d)
trap 'rm -rf "$root"' EXIT
mkdir -p "$root/fakebin"

# make_machine DIR GPU(usable|unusable) TESTS(design|nogpu) LISTED(0|1)
make_machine() {
  local dir=$1 gpu=$2 tests=$3 listed=$4
  mkdir -p "$dir/build/tools" "$dir/build/tests" "$dir/bin"
  cat >"$dir/bin/nvidia-smi" <<EOF
#!/bin/sh
[ "$listed" = 1 ] && [ "\$1" = "-L" ] && echo "GPU 0: NVIDIA H200 (UUID: GPU-fake)"
[ "$listed" = 1 ] || [ "\$1" = "-L" ] || echo "fake nvidia-smi"
exit 0
EOF
  cat >"$dir/build/tools/strata-info" <<'EOF'
#!/bin/sh
echo "strata 0.1.0 (fake)"
EOF
  cat >"$dir/build/tools/strata-prof" <<'EOF'
#!/bin/sh
echo "worst prediction error 3.0% (fake)"
echo '{"worst_error":0.03}'
EOF
  if [ "$gpu" = usable ]; then
    cat >"$dir/build/tools/strata-bench" <<'EOF'
#!/bin/sh
[ "$2" = "--probe" ] && { echo "ok: cuda:0 NVIDIA H200"; exit 0; }
echo "strata-bench gpu: cuda:0 NVIDIA H200 (fake)"
echo '{"command":"gpu","ok":true,"skipped":false,"parts":{"link":"ok"}}'
EOF
  else
    cat >"$dir/build/tools/strata-bench" <<'EOF'
#!/bin/sh
echo "SKIPPED: no CUDA driver (cudaErrorInsufficientDriver, error 35)"
[ "$2" = "--probe" ] && exit 0
echo '{"command":"gpu","ok":true,"skipped":true,"reason":"no CUDA driver (cudaErrorInsufficientDriver, error 35)"}'
EOF
  fi
  # A device suite: two tests pass, one skips by design; the engine suite: one passes, and one
  # skips by design or for want of a usable GPU.
  local second="a property of the emulated device"
  [ "$tests" = nogpu ] && second="no usable GPU: cudaErrorNoDevice"
  [ "$gpu" = usable ] || second="no usable GPU: no CUDA driver"
  cat >"$dir/build/tests/device_gpu_test" <<EOF
#!/bin/sh
echo "[==========] Running 3 tests from 1 test suite."
echo "[ RUN      ] Backends/DeviceTest.A/cuda"
echo "[       OK ] Backends/DeviceTest.A/cuda (1 ms)"
echo "[ RUN      ] Backends/DeviceTest.B/cuda"
echo "[       OK ] Backends/DeviceTest.B/cuda (1 ms)"
echo "[ RUN      ] Backends/DeviceTest.PoisonOnFree/cuda"
echo "device_test.cpp:473: Skipped"
echo "$([ "$gpu" = usable ] && echo "poisoning is a property of the emulated device" || echo "$second")"
echo "[  SKIPPED ] Backends/DeviceTest.PoisonOnFree/cuda (0 ms)"
echo "[==========] 3 tests from 1 test suite ran. (3 ms total)"
echo "[  PASSED  ] 2 tests."
echo "[  SKIPPED ] 1 test, listed below:"
echo "[  SKIPPED ] Backends/DeviceTest.PoisonOnFree/cuda"
EOF
  cat >"$dir/build/tests/engine_gpu_test" <<EOF
#!/bin/sh
echo "[==========] Running 2 tests from 1 test suite."
echo "[ RUN      ] Engine.A"
echo "[       OK ] Engine.A (1 ms)"
echo "[ RUN      ] Engine.B"
echo "engine_test.cpp:63: Skipped"
echo "$second"
echo "[  SKIPPED ] Engine.B (0 ms)"
echo "[==========] 2 tests from 1 test suite ran. (2 ms total)"
echo "[  PASSED  ] 1 test."
echo "[  SKIPPED ] 1 test, listed below:"
echo "[  SKIPPED ] Engine.B"
EOF
  chmod +x "$dir/bin/"* "$dir/build/tools/"* "$dir/build/tests/"*
}

# check NAME GPU TESTS LISTED WANT_EXIT WANT_STATUS WANT_LINE
check() {
  local name=$1 want_rc=$5 want_status=$6 want_line=$7 rc=0
  make_machine "$root/$name" "$2" "$3" "$4"
  PATH="$root/$name/bin:$PATH" STRATA_CUDA_LIBS=/nowhere "$src/tools/gpu-check.sh" --build "$root/$name/build" \
    --out "$root/$name/out" --no-ctest >"$root/$name/stdout" 2>&1 || rc=$?
  cat "$root/$name/stdout"
  [ "$rc" = "$want_rc" ] || fail "$name: exit $rc, not $want_rc"
  grep -qF -- "$want_line" "$root/$name/stdout" || fail "$name: no line '$want_line'"
  python3 - "$root/$name/out/gpu-check.json" "$want_status" <<'PY' || fail "$name: gpu-check.json"
import json, sys
j = json.load(open(sys.argv[1]))
if j["status"] != sys.argv[2]:
    sys.exit(f"status {j['status']}, not {sys.argv[2]}: {json.dumps(j, indent=1)}")
t = j["tests"]
assert t["total"] == 5 and t["passed"] == 3 and t["skipped"] == 2, t
PY
  echo "ok: $name"
}

check usable-gpu usable design 1 0 passed "strata gpu-check: PASS"
grep -qE "gpu tests +ok \(5 tests: 3 passed, 0 failed, 2 skipped, 0 of them for want of a usable GPU" \
  "$root/usable-gpu/stdout" || fail "usable-gpu: the test line"
check skip-for-want-of-gpu usable nogpu 1 1 failed "FAILED (1 skipped for want of a usable GPU)"
check listed-but-unusable unusable nogpu 1 1 failed \
  "strata gpu-check: FAIL: nvidia-smi lists 1 GPU(s), but strata cannot use them: no CUDA driver"
check no-gpu unusable nogpu 0 0 skipped "strata gpu-check: SKIPPED: no CUDA driver"
echo "gpu-check.sh verdicts ok"
