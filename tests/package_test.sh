#!/usr/bin/env bash
# The relocatable package (cmake/package.cmake) in a minimal Debian 12 root: no -dev package, no
# compiler, none of strata's build dependencies, no CUDA. Builds the tarball with cpack, unpacks
# it inside the root and, through chroot, checks that
#   - every binary and library of the package resolves its dependencies there (only the CUDA
#     module may lack the CUDA libraries, which are never shipped);
#   - the public headers are there (include/strata/);
#   - strata-info runs, reports CUDA as unavailable naming where it looked, and self-checks the
#     CPU-emulated device;
#   - with the host's CUDA libraries mounted in, the CUDA module loads through STRATA_CUDA_LIBS
#     and through an nvidia-* wheel layout (CUDA builds only; no GPU needed);
#   - the embedded demo trains (strata-train --steps 10) and its loss falls.
#
# usage: package_test.sh BUILD_DIR CUDA_SONAMES CUDA_LIB_DIRS
#   CUDA_SONAMES: the libraries the CUDA module needs, colon-separated ("" without CUDA);
#   CUDA_LIB_DIRS: the host folders that hold them, colon-separated.
# Exits 77 (ctest: skipped) when it cannot run here: not root, no debootstrap, or the Debian
# mirror is unreachable. The root is built once, cached in $STRATA_PACKAGE_ROOT (default
# /var/cache/strata/debian12-minbase), and used through an overlay, so it stays pristine.
set -euo pipefail

build=$(cd "$1" && pwd)
cuda_sonames=${2:-}
cuda_lib_dirs=${3:-}
cache=${STRATA_PACKAGE_ROOT:-/var/cache/strata/debian12-minbase}
mirror=${STRATA_DEBIAN_MIRROR:-http://deb.debian.org/debian}

skip() {
  echo "SKIPPED: $*"
  exit 77
}
fail() {
  echo "FAILED: $*" >&2
  exit 1
}
note() { echo "== $*"; }

[ "$(id -u)" -eq 0 ] || skip "needs root (debootstrap, mount and chroot); run as root, e.g. in CI"
for tool in debootstrap chroot mount umount cpack flock; do
  command -v "$tool" >/dev/null || skip "$tool is not installed (scripts/setup.sh installs debootstrap)"
done
[ -f "$build/CPackConfig.cmake" ] || fail "$build/CPackConfig.cmake is missing: configure the build first"

t_start=$(date +%s)
work=$(mktemp -d /tmp/strata-package-test.XXXXXX)
root=$work/root
mounted=()
cleanup() {
  local i
  for ((i = ${#mounted[@]} - 1; i >= 0; i--)); do
    umount -R "${mounted[i]}" 2>/dev/null || umount -R -l "${mounted[i]}" 2>/dev/null || true
  done
  rm -rf "$work"
}
trap cleanup EXIT
trap 'exit 130' INT TERM

# ---- the package ----
note "cpack"
cpack --config "$build/CPackConfig.cmake" -B "$work/cpack" >"$work/cpack.log" 2>&1 ||
  { cat "$work/cpack.log"; fail "cpack failed"; }
tarball=$(ls "$work"/cpack/strata-*.tar.gz)
name=$(basename "$tarball" .tar.gz)
echo "   $name.tar.gz: $(stat -c %s "$tarball") bytes ($(du -h "$tarball" | cut -f1))"

# ---- the root: debootstrap once, then cached ----
mkdir -p "$(dirname "$cache")"
exec 9>"$cache.lock"
flock 9
if [ ! -f "$cache/.strata-complete" ]; then
  note "debootstrap --variant=minbase bookworm $cache (once; cached for later runs)"
  rm -rf "$cache.tmp"
  if ! debootstrap --variant=minbase bookworm "$cache.tmp" "$mirror" >"$work/debootstrap.log" 2>&1; then
    tail -n 5 "$work/debootstrap.log"
    rm -rf "$cache.tmp"
    if grep -qE "Failed getting release file|Couldn't download|Temporary failure resolving|Could not resolve|Connection refused|Network is unreachable|No route to host" "$work/debootstrap.log"; then
      skip "debootstrap cannot reach the Debian mirror $mirror (set STRATA_DEBIAN_MIRROR to a reachable one)"
    fi
    fail "debootstrap failed (log above)"
  fi
  touch "$cache.tmp/.strata-complete"
  mv "$cache.tmp" "$cache"
fi
flock -u 9

# A writable view of the cached root: an overlay, else a copy.
mkdir -p "$root" "$work/upper" "$work/overlay-work"
if mount -t overlay overlay -o "lowerdir=$cache,upperdir=$work/upper,workdir=$work/overlay-work" "$root" 2>/dev/null; then
  mounted+=("$root")
else
  note "overlayfs refused; copying the root"
  cp -a "$cache/." "$root/"
fi
mount -t proc proc "$root/proc" && mounted+=("$root/proc")
for d in sys dev; do
  mount --rbind "/$d" "$root/$d" && mount --make-rslave "$root/$d" && mounted+=("$root/$d")
done

# Runs a command in the root with a clean environment.
in_root() { chroot "$root" /usr/bin/env -i PATH=/usr/sbin:/usr/bin:/sbin:/bin HOME=/root "$@"; }

# ---- the root is what it claims: no compiler, no -dev package ----
for cc in cc c++ gcc g++ clang nvcc; do
  if in_root sh -c "command -v $cc" >/dev/null; then fail "the root has a compiler ($cc)"; fi
done
dev_pkgs=$(in_root dpkg-query -W -f '${Package}\n' | grep -E -- '-dev(:|$)' || true)
[ -z "$dev_pkgs" ] || fail "the root has -dev packages: $dev_pkgs"

# ---- unpack with the root's own tar ----
cp "$tarball" "$root/tmp/"
in_root tar -xzf "/tmp/$name.tar.gz" -C /opt
pkg=/opt/$name
for f in bin/strata-info bin/strata-train bin/strata-export bin/strata-generate bin/strata-plot bin/strata-bench \
  bin/strata-prep bin/gpu-check.sh; do
  [ -x "$root$pkg/$f" ] || fail "the package lacks $f"
done
for h in device.h engine.h system_info.h; do
  [ -f "$root$pkg/include/strata/$h" ] || fail "the package lacks include/strata/$h (the public headers)"
done
shipped_cuda=$(ls "$root$pkg/lib" | grep -E '^lib(cuda|cudart|cublas|cublasLt|nccl)\.so' || true)
[ -z "$shipped_cuda" ] || fail "the package ships CUDA libraries: $shipped_cuda"
echo "   lib/: $(ls "$root$pkg/lib" | tr '\n' ' ')"

# ---- every dependency resolves in the root ----
note "ldd of every binary and library"
allowed_missing=" ${cuda_sonames//:/ } "
for f in "$root$pkg"/bin/strata-* "$root$pkg"/lib/*.so*; do
  rel=${f#"$root"}
  out=$(in_root ldd "$rel" 2>&1) || fail "ldd $rel: $out"
  while read -r lib _; do
    if [ "$(basename "$rel")" = libstrata_cuda.so ] && [[ $allowed_missing == *" $lib "* ]]; then continue; fi
    fail "$rel: $lib not found in the minimal root"
  done < <(grep "not found" <<<"$out" || true)
  # Nothing may come from outside the root's system folders or the package.
  outside=$(grep -E '=> /' <<<"$out" | grep -vE "=> ($pkg/|/lib/|/usr/lib/|/lib64/)" || true)
  [ -z "$outside" ] || fail "$rel resolves a library outside the package and the system: $outside"
done

# ---- strata-info without CUDA libraries ----
note "strata-info --self-check"
info=$(in_root "$pkg/bin/strata-info" --self-check 2>&1) || { echo "$info"; fail "strata-info failed"; }
echo "$info" | sed 's/^/   | /'
grep -q "self-check cpu: ok" <<<"$info" || fail "strata-info: no passing self-check of the CPU-emulated device"
if [ -n "$cuda_sonames" ]; then
  grep -q "CUDA backend on" <<<"$info" || fail "strata-info: the CUDA backend is not reported as built"
  grep -q "no usable GPU: CUDA libraries not found: " <<<"$info" ||
    fail "strata-info: CUDA is not reported as unavailable for want of its libraries"
  for place in "STRATA_CUDA_LIBS (unset)" "/usr/local/cuda" "nvidia-* Python wheels" "the loader's default path"; do
    grep -qF "$place" <<<"$info" || fail "strata-info: the reason does not say it looked in '$place'"
  done
else
  grep -q "no usable GPU: built without CUDA" <<<"$info" || fail "strata-info: no 'built without CUDA' reason"
fi

# ---- the CUDA module with the host's CUDA libraries (no GPU needed: it loads, then finds no driver) ----
if [ -n "$cuda_sonames" ] && [ -n "$cuda_lib_dirs" ]; then
  i=0
  libs_in_root=()
  IFS=: read -r -a host_dirs <<<"$cuda_lib_dirs"
  for d in "${host_dirs[@]}"; do
    mkdir -p "$root/opt/cuda-libs/$i"
    mount --bind -o ro "$d" "$root/opt/cuda-libs/$i" && mounted+=("$root/opt/cuda-libs/$i")
    libs_in_root+=("/opt/cuda-libs/$i")
    i=$((i + 1))
  done
  note "strata-info with STRATA_CUDA_LIBS"
  dirs=$(IFS=:; echo "${libs_in_root[*]}")
  info=$(in_root STRATA_CUDA_LIBS="$dirs" "$pkg/bin/strata-info" 2>&1) || { echo "$info"; fail "strata-info failed"; }
  echo "$info" | sed -n '/^cuda libraries:/,/^cpu:/p;/no usable GPU/p' | sed 's/^/   | /'
  grep -qE "^  libstrata_cuda\.so +$pkg/lib/libstrata_cuda\.so$" <<<"$info" ||
    fail "strata-info: the CUDA module was not loaded from the package"
  for so in ${cuda_sonames//:/ }; do
    grep -qE "^  ${so//./\\.} +/opt/cuda-libs/[0-9]+/${so//./\\.}$" <<<"$info" ||
      fail "strata-info: $so was not loaded from STRATA_CUDA_LIBS"
  done
  grep -q "CUDA libraries not found" <<<"$info" && fail "strata-info: CUDA libraries still not found"

  note "strata-info with the libraries in an nvidia-* wheel layout"
  major=$(grep -oE 'libcudart\.so\.[0-9]+' <<<"$cuda_sonames" | grep -oE '[0-9]+$')
  site=/usr/local/lib/python3.11/dist-packages/nvidia
  for so in ${cuda_sonames//:/ }; do
    sub=cu$major
    [[ $so == libnccl* ]] && sub=nccl
    src=$(cd "$root" && ls opt/cuda-libs/*/"$so" | head -n 1)
    mkdir -p "$root$site/$sub/lib"
    ln -s "/$src" "$root$site/$sub/lib/$so"
  done
  info=$(in_root "$pkg/bin/strata-info" 2>&1) || { echo "$info"; fail "strata-info failed"; }
  for so in ${cuda_sonames//:/ }; do
    grep -qE "^  ${so//./\\.} +$site/(cu$major|nccl)/lib/${so//./\\.}$" <<<"$info" ||
      fail "strata-info: $so was not loaded from the wheel folders under $site"
  done
  rm -rf "${root:?}/usr/local/lib/python3.11"
fi

# ---- the demo ----
note "strata-train --steps 10 (the embedded demo)"
t0=$(date +%s)
demo=$(in_root "$pkg/bin/strata-train" --steps 10 2>&1) || { echo "$demo"; fail "the demo failed"; }
echo "$demo" | sed 's/^/   | /'
grep -q "NVMe folder: /root/.cache/strata/demo-nvme" <<<"$demo" ||
  fail "the demo's NVMe folder is not the user's cache folder"
[ "$(grep -c "no usable GPU" <<<"$demo")" -eq 1 ] || fail "the demo should say once that no GPU is usable"
first=$(grep -oE '^step 1/10 +loss [0-9.]+' <<<"$demo" | awk '{print $NF}')
last=$(grep -oE '^step 10/10 +loss [0-9.]+' <<<"$demo" | awk '{print $NF}')
[ -n "$first" ] && [ -n "$last" ] || fail "the demo did not print steps 1 and 10"
awk -v a="$first" -v b="$last" 'BEGIN { exit !(b < a) }' || fail "the demo's loss did not fall ($first -> $last)"
echo "   loss $first -> $last in $(($(date +%s) - t0)) s"

# ---- gpu-check.sh from the package: no GPU here, so every part SKIPPED, exit 0, and the JSON says so ----
note "gpu-check.sh (from the package, no GPU)"
gc=$(in_root STRATA_CUDA_LIBS="${dirs:-}" "$pkg/bin/gpu-check.sh" --out /tmp/gpu-check 2>&1) ||
  { echo "$gc"; fail "gpu-check.sh failed without a GPU"; }
echo "$gc" | sed 's/^/   | /'
grep -q "^strata gpu-check: SKIPPED: " <<<"$gc" || fail "gpu-check.sh: no SKIPPED verdict"
grep -q '"skipped": true' "$root/tmp/gpu-check/gpu-check.json" || fail "gpu-check.json does not say skipped"
if command -v python3 >/dev/null; then
  python3 -c 'import json, sys; j = json.load(open(sys.argv[1])); assert j["status"] == "skipped" and j["bench"]["skipped"], j' \
    "$root/tmp/gpu-check/gpu-check.json" || fail "gpu-check.json is not the skipped summary"
fi

echo "package test passed in $(($(date +%s) - t_start)) s"
