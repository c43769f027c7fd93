#!/usr/bin/env bash
# The include rule of the source tree: no arrow from a lower layer to a higher one, nor between
# two folders of one layer. The layers, lowest first:
#   0 core
#   1 cpu gpu nvme
#   2 comm model text
#   3 cuda_module scheduler
#   4 trainer, src/runtime.cpp (the umbrella library)
#   5 tools tests
# A file in src/<folder>/ (or tests/) may include "<other>/..." only when <other> is its own
# folder (tests/engine/ is the tests' own) or in a lower layer; "strata/..." (the public headers)
# anywhere. The model calls kernels through the Device (Device::model_kernels()), never a
# backend's headers: model/ may not include cpu/ or gpu/ though they are lower. A tool is a program a user could have written: a file in tools/ may include only
# "strata/..." and files of tools/ (the build gives the tools no src/ either). Prints each
# offending line as file:line: and exits 1; run by CI (.ci/run) and by scripts/test.sh.
#
#   scripts/check-layers.sh [ROOT]      (ROOT: the repository, default: this script's parent)
set -euo pipefail
root=${1:-$(cd "$(dirname "$0")/.." && pwd)}
cd "$root"

declare -A layer=([core]=0 [cpu]=1 [gpu]=1 [nvme]=1 [comm]=2 [model]=2 [text]=2 [cuda_module]=3 [scheduler]=3
                  [trainer]=4 [runtime.cpp]=4 [tools]=5 [tests]=5)
# Lower folders a folder may still not include.
declare -A barred=([model]="cpu gpu")

bad=0
while IFS= read -r hit; do
  file=${hit%%:*}
  rest=${hit#*:}
  line=${rest%%:*}
  inc=$(sed -E 's/.*#include "([a-z_]+)\/.*/\1/' <<<"$rest")
  [ "$inc" = strata ] && continue
  case $file in
    src/*) from=$(cut -d/ -f2 <<<"$file") ;;
    *) from=$(cut -d/ -f1 <<<"$file") ;;
  esac
  [ "$inc" = "$from" ] && continue
  path=$(sed -E 's/.*#include "([^"]+)".*/\1/' <<<"$rest")
  case $file in src/*) ;; *) [ -e "$from/$path" ] && continue ;; esac
  if [[ " ${barred[$from]:-} " == *" $inc "* ]]; then
    echo "$file:$line: $from/ includes $inc/: the model reaches a backend's kernels through the Device (Device::model_kernels()), not its headers" >&2
    bad=1
  elif [ -z "${layer[$from]+x}" ] || [ -z "${layer[$inc]+x}" ]; then
    echo "$file:$line: \"$inc/\" from \"$from/\": a folder scripts/check-layers.sh does not place; add it to its layers" >&2
    bad=1
  elif [ "${layer[$inc]}" -ge "${layer[$from]}" ]; then
    echo "$file:$line: $from/ (layer ${layer[$from]}) includes $inc/ (layer ${layer[$inc]}): only lower layers may be included" >&2
    bad=1
  fi
done < <(grep -rnE '^[[:space:]]*#[[:space:]]*include[[:space:]]+"[a-z_]+/' src tests \
           --include='*.h' --include='*.cpp' --include='*.cu' --include='*.c' || true)

# tools/: every quoted #include, with or without a folder.
while IFS= read -r hit; do
  file=${hit%%:*}
  rest=${hit#*:}
  line=${rest%%:*}
  path=$(sed -E 's/.*#[[:space:]]*include[[:space:]]+"([^"]+)".*/\1/' <<<"$rest")
  if [[ $path != *..* ]]; then
    case $path in strata/*) continue ;; esac
    [ -e "$(dirname "$file")/$path" ] && continue
  fi
  echo "$file:$line: tools/ includes \"$path\": a tool may include only \"strata/...\" (include/strata/) and files of tools/" >&2
  bad=1
done < <(grep -rnE '^[[:space:]]*#[[:space:]]*include[[:space:]]+"' tools \
           --include='*.h' --include='*.cpp' --include='*.cu' --include='*.c' || true)

if [ "$bad" = 0 ]; then echo "check-layers: every #include goes down the layers; the tools include only strata/ and their own"; fi
exit "$bad"
