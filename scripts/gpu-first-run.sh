#!/usr/bin/env bash
# The first run of strata on a bare GPU node: one with a driver, the CUDA toolkit and PyTorch's
# nvidia-* wheels (cuBLAS, NCCL), but none of the Debian packages strata is built with, and no
# network. Everything the node lacks travels as one archive, made here:
#
#   scripts/gpu-first-run.sh prepare [BUILD]   here, after a build with CUDA (default build/):
#       installs the relocatable package (docs/build.md, "Package": strata's tools and libraries and
#       every library they load that a minimal Debian root lacks), adds the gpu test binaries
#       with their RUNPATH pointed at the package's lib/, and packs both into
#       .gpu-carry/strata.tar.xz (.gpu-carry/ is ignored by git; a few tens of MiB).
#   scripts/gpu-first-run.sh run OUT           there, from the repository root, with .gpu-carry
#       carried: unpacks the archive under /tmp, runs the package's gpu-check.sh (every gpu test,
#       strata-bench gpu, strata-prof on the GPU; its logs and the swap files under /tmp) and
#       copies seven files to OUT: gpu-check.json, summary.txt, the gpu-info, gpu-tests, bench
#       and prof logs, and out.tgz (the whole output folder: the bench's traces, logs and configs,
#       strata-prof's picture, trace and best configuration). Exits as gpu-check.sh does.
#       `run OUT --rehearse` does the same where there is no GPU (gpu-check.sh --rehearse: every
#       step on the CPU-emulated device), to try the archive.
#
# With the device tool: run(command="scripts/gpu-first-run.sh run \"$OUT\"", carry=[".gpu-carry"],
# timeout_s=600); the check itself is sized to fit in 10 minutes (tools/gpu-check.sh).
set -euo pipefail
cd "$(dirname "$0")/.."
carry=.gpu-carry

case ${1:-} in
  prepare)
    build=${2:-build}
    [ -f "$build/CMakeCache.txt" ] || { echo "gpu-first-run.sh: no build in $build: build first (README)" >&2; exit 2; }
    [ -f "$build/src/gpu/libstrata_cuda.so" ] ||
      { echo "gpu-first-run.sh: $build has no CUDA module (libstrata_cuda.so): configure where nvcc is found" >&2; exit 2; }
    command -v patchelf >/dev/null || { echo "gpu-first-run.sh: patchelf is needed (scripts/setup.sh installs it)" >&2; exit 2; }
    cmake --build "$build" >/dev/null
    grep -qxF "/$carry/" .git/info/exclude 2>/dev/null || echo "/$carry/" >>.git/info/exclude
    rm -rf "$carry"
    mkdir -p "$carry/stage"
    cmake --install "$build" --prefix "$carry/stage/strata" --strip >/dev/null
    mkdir -p "$carry/stage/strata/tests"
    for t in "$build"/tests/*_gpu_test; do
      cp "$t" "$carry/stage/strata/tests/"
      patchelf --set-rpath '$ORIGIN/../lib' "$carry/stage/strata/tests/$(basename "$t")"
    done
    # The test binaries resolve every library inside the package (the CUDA ones aside).
    for t in "$carry"/stage/strata/tests/*; do
      missing=$(env -u LD_LIBRARY_PATH ldd "$t" | grep 'not found' | grep -vE 'libcuda|libcudart|libcublas|libnccl' || true)
      [ -z "$missing" ] || { echo "gpu-first-run.sh: $t: $missing" >&2; exit 1; }
    done
    tar -C "$carry/stage" -cJf "$carry/strata.tar.xz" strata
    rm -rf "$carry/stage"
    echo "gpu-first-run.sh: $carry/strata.tar.xz ($(du -h "$carry/strata.tar.xz" | cut -f1)); there: scripts/gpu-first-run.sh run OUT"
    ;;
  run)
    out=${2:?usage: gpu-first-run.sh run OUT}
    [ -f "$carry/strata.tar.xz" ] ||
      { echo "gpu-first-run.sh: no $carry/strata.tar.xz: run 'scripts/gpu-first-run.sh prepare' here and carry $carry" >&2; exit 2; }
    root=/tmp/strata-first-run
    rm -rf "$root" && mkdir -p "$root" "$out"
    tar -C "$root" -xJf "$carry/strata.tar.xz"
    rc=0
    rehearse=()
    [ "${3:-}" = --rehearse ] && rehearse=(--rehearse)
    "$root/strata/bin/gpu-check.sh" --tests "$root/strata/tests" --out "$root/out" --nvme-path "$root/nvme" \
      "${rehearse[@]}" || rc=$?
    for f in gpu-check.json summary.txt gpu-info.log gpu-tests.log bench.log prof.log; do
      [ -f "$root/out/$f" ] && cp "$root/out/$f" "$out/"
    done
    tar -C "$root" -czf "$out/out.tgz" out || true  # the swap files are under $root/nvme
    exit "$rc"
    ;;
  *)
    sed -n '2,/^set -euo/p' "$0" | sed '$d; s/^# \{0,1\}//'
    [ "${1:-}" = "-h" ] || [ "${1:-}" = "--help" ] || exit 2
    ;;
esac
