#!/usr/bin/env bash
# Installs the Debian 12 packages strata builds and tests with. Idempotent: quiet and quick
# when everything is already there. Needs root (or sudo) only when something is missing.
set -euo pipefail

packages=(
  build-essential cmake ninja-build pkg-config git ccache
  liburing-dev libhwloc-dev libtbb-dev
  libdnnl-dev ocl-icd-opencl-dev opencl-headers
  libgtest-dev libgmock-dev libbenchmark-dev
  nlohmann-json3-dev libcli11-dev libfmt-dev libspdlog-dev
  libxxhash-dev libpcre2-dev libutf8proc-dev libsentencepiece-dev
  libopenmpi-dev openmpi-bin libgloo-dev
  fio python3
  python3-torch
  patchelf debootstrap
  chromium fonts-dejavu-core
)

missing=()
for p in "${packages[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
[ ${#missing[@]} -eq 0 ] && exit 0

echo "setup: installing ${missing[*]}"
sudo=""
[ "$(id -u)" -ne 0 ] && sudo="sudo"
export DEBIAN_FRONTEND=noninteractive
$sudo apt-get update -qq
$sudo apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
echo "setup: done"
