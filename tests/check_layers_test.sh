#!/usr/bin/env bash
# scripts/check-layers.sh: the repository's #include lines go down the layers, and the script
# names an upward include, a sideways one, a folder it does not place, the model reaching a
# backend's headers and a tool that reaches past the public headers (fake trees).
set -uo pipefail
src=$1
check=$src/scripts/check-layers.sh
fail() { echo "FAIL: $*" >&2; exit 1; }

"$check" "$src" || fail "the repository breaks the layering (above)"

t=$(mktemp -d)
trap 'rm -rf "$t"' EXIT
mkdir -p "$t/src/core" "$t/src/gpu" "$t/src/comm" "$t/src/model" "$t/src/scheduler" "$t/src/widgets" "$t/tools" "$t/tests/engine"
printf '#include "strata/device.h"\n#include "core/a.h"\n' >"$t/src/core/a.cpp"
printf '#include "core/a.h"\n' >"$t/src/gpu/g.cpp"
printf '#include "core/a.h"\n#include "strata/model_ops.h"\n' >"$t/src/model/m.cpp"
printf '#include "gpu/g.h"\n#include "cpu/c.h"\n' >"$t/src/comm/c.cpp"
printf '#include "strata/engine.h"\n#include "tool.h"\n' >"$t/tools/tool.cpp"
touch "$t/tools/tool.h"
touch "$t/tests/engine/linear_model.h"
printf '#include "engine/linear_model.h"\n' >"$t/tests/t.cpp"
"$check" "$t" >"$t/out" 2>&1 || fail "a tree that keeps the rule was refused: $(cat "$t/out")"

printf '#include "scheduler/layout.h"\n' >>"$t/src/core/a.cpp"   # up
printf 'int x;\n#include "nvme/io.h"\n' >"$t/src/gpu/side.cpp"      # sideways
printf '#include "widgets/w.h"\n' >"$t/src/scheduler/s.cpp"         # unplaced
printf '#include "gpu/model_kernels.h"\n' >>"$t/src/model/m.cpp"   # a backend's kernels
printf '#include "scheduler/s.h"\n#include "../src/core/a.h"\n' >"$t/tools/inner.cpp"  # a tool past strata/
"$check" "$t" >"$t/out" 2>&1 && fail "upward, sideways, unplaced, backend and a tool's internal includes passed"
grep -q 'src/core/a.cpp:3: core/ (layer 0) includes scheduler/ (layer 3)' "$t/out" || fail "upward: $(cat "$t/out")"
grep -q 'src/gpu/side.cpp:2: gpu/ (layer 1) includes nvme/ (layer 1)' "$t/out" || fail "sideways: $(cat "$t/out")"
grep -q 'src/scheduler/s.cpp:1: "widgets/" .* does not place' "$t/out" || fail "unplaced: $(cat "$t/out")"
grep -q 'src/model/m.cpp:3: model/ includes gpu/: the model reaches a backend' "$t/out" || fail "backend: $(cat "$t/out")"
grep -q 'tools/inner.cpp:1: tools/ includes "scheduler/s.h": a tool may include only' "$t/out" || fail "tool: $(cat "$t/out")"
grep -q 'tools/inner.cpp:2: tools/ includes "../src/core/a.h"' "$t/out" || fail "tool, relative: $(cat "$t/out")"
[ "$(grep -c . "$t/out")" = 6 ] || fail "expected exactly the six lines: $(cat "$t/out")"
echo "check-layers: the tree passes; upward, sideways, unplaced, a backend's headers from the model and a tool's internal includes are named"
