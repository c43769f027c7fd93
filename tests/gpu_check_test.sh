#!/usr/bin/env bash
# gpu_check_skipped: tools/gpu-check.sh on a machine where no GPU is usable (CI, this VM). What
# can run here does: the gpu test binaries (each must skip, none fail), strata-bench gpu (it
# must say SKIPPED with the reason and exit 0), the summary; and gpu-check.json must be
# well-formed and say "skipped" for every part. Then `gpu-check.sh --rehearse` runs every step on
# the CPU-emulated device at small sizes, and its JSON must hold every figure. Where a GPU is usable this test is skipped
# (exit 77): the check itself is then the test, and takes minutes.
#
# The tests run through the binaries directly (--no-ctest), the path a package without ctest
# takes: a ctest inside this ctest would share the build folder's Testing/ logs with it.
#
# Usage: gpu_check_test.sh BUILD_DIR SOURCE_DIR
set -euo pipefail
build=$1 src=$2
fail() { echo "FAIL: $*" >&2; exit 1; }

probe=$("$build/tools/strata-bench" gpu --probe) || fail "strata-bench gpu --probe exited $?"
case $probe in
  SKIPPED:*) ;;
  *) echo "a GPU is usable here ($probe): run tools/gpu-check.sh itself"; exit 77 ;;
esac
command -v python3 >/dev/null || { echo "no python3 to read the JSON"; exit 77; }

out=$(mktemp -d)
trap 'rm -rf "$out"' EXIT
"$src/tools/gpu-check.sh" --build "$build" --out "$out" --no-ctest >"$out/stdout" 2>&1 ||
  { cat "$out/stdout"; fail "gpu-check.sh exited non-zero without a GPU"; }
cat "$out/stdout"
grep -q "^strata gpu-check: SKIPPED: ${probe#SKIPPED: }" "$out/stdout" || fail "no SKIPPED verdict with the reason"
for part in "gpu tests" link gemm adamw kernels model parity prof; do
  grep -qE "^  $part +SKIPPED" "$out/stdout" || fail "part '$part' not reported SKIPPED"
done

# A typo in --bench-args (a --parts name) is refused before anything runs, naming it.
typo=0
"$src/tools/gpu-check.sh" --build "$build" --out "$out/typo" --no-ctest --bench-args "--parts link,gemmm" \
  >"$out/typo.stdout" 2>"$out/typo.stderr" || typo=$?
[ "$typo" = 2 ] || { cat "$out/typo.stdout" "$out/typo.stderr"; fail "--bench-args with a typo: exit $typo, not 2"; }
grep -q "'gemmm' is not one of link, gemm, adamw, kernels, model, parity" "$out/typo.stderr" ||
  { cat "$out/typo.stderr"; fail "--bench-args with a typo: the bad part is not named"; }
[ ! -e "$out/typo/gpu-tests.log" ] || fail "--bench-args with a typo: the tests ran first"
# ... and so is a value the model part would refuse (it passed until the GPU run).
bad=0
"$src/tools/gpu-check.sh" --build "$build" --out "$out/bad" --no-ctest --bench-args "--vocab 70000" \
  >"$out/bad.stdout" 2>"$out/bad.stderr" || bad=$?
[ "$bad" = 2 ] || { cat "$out/bad.stdout" "$out/bad.stderr"; fail "--bench-args --vocab 70000: exit $bad, not 2"; }
grep -q -- "--vocab 70000 must be in 1..65536" "$out/bad.stderr" ||
  { cat "$out/bad.stderr"; fail "--bench-args --vocab 70000: the bad value is not named"; }
[ ! -e "$out/bad/gpu-tests.log" ] || fail "--bench-args --vocab 70000: the tests ran first"
# Folders that cannot be what they name are refused before anything runs (exit 2), and nothing
# is written elsewhere: an --out that is a file put every log and the JSON in / (exit 0); a
# mistyped --build was created; an --nvme-path that is a file surfaced as failed gpu tests.
touch "$out/afile"
refused() {  # refused WHAT EXPECTED-TEXT ARGS...
  local what=$1 text=$2 rc=0
  shift 2
  "$src/tools/gpu-check.sh" "$@" >"$out/ref.stdout" 2>"$out/ref.stderr" || rc=$?
  [ "$rc" = 2 ] || { cat "$out/ref.stdout" "$out/ref.stderr"; fail "$what: exit $rc, not 2"; }
  grep -qF -- "$text" "$out/ref.stderr" || { cat "$out/ref.stderr"; fail "$what: not named ('$text')"; }
}
refused "--out a file" "--out $out/afile cannot be a folder (a file of that name is there" \
  --build "$build" --out "$out/afile" --no-ctest
refused "--build missing" "--build $out/no-build: no such folder" --build "$out/no-build" --out "$out/nb" --no-ctest
[ ! -e "$out/no-build" ] || fail "--build missing: the folder was created"
refused "--nvme-path a file" "--nvme-path $out/afile is a file: give a folder" \
  --build "$build" --out "$out/nv" --no-ctest --nvme-path "$out/afile"
[ ! -e "$out/nv" ] || fail "--nvme-path a file: --out was made first"

python3 - "$out/gpu-check.json" "${probe#SKIPPED: }" <<'PY'
import json, sys
path, reason = sys.argv[1], sys.argv[2]
j = json.load(open(path))
def need(cond, what):
    if not cond:
        sys.exit(f"gpu-check.json: {what}: {json.dumps(j, indent=1)}")
need(j["status"] == "skipped" and j["ok"] is True and j["skipped"] is True, "status")
need(j["reason"] == reason, "reason")
t = j["tests"]
need(t["runner"] == "gtest" and t["total"] > 0 and t["skipped"] == t["total"] and t["failed"] == 0, "tests")
need(t["status"] == "SKIPPED", "tests status")
b = j["bench"]
need(b["skipped"] is True and b["reason"] == reason and b["command"] == "gpu", "bench")
need(b["parts"] == {p: "skipped" for p in ["link", "gemm", "adamw", "kernels", "model", "parity"]}, "bench parts")
need([s["name"] for s in j["steps"]] == ["gpu-info", "gpu-tests", "bench"], "steps")  # no prof without a GPU
need(j["prof"] is None, "prof")
need(all(s["exit"] == 0 for s in j["steps"]), "step exits")
need(isinstance(j["seconds"], int) and j["date"].endswith("Z"), "seconds, date")
print(f"gpu-check.json ok: {t['total']} gpu tests skipped, every bench part skipped: {reason}")
PY

# The whole check rehearsed (--rehearse): its GPU path end to end, the bench's every part and
# strata-prof on the CPU-emulated device at small sizes (configs and data written, both placements
# trained and traced, the trace read, parity, two placements validated), the JSON and the table.
nvme=$build/gpu-check-test-nvme.$$
trap 'rm -rf "$out" "$nvme"' EXIT
"$src/tools/gpu-check.sh" --build "$build" --out "$out/rehearse" --no-ctest --rehearse --nvme-path "$nvme" \
  >"$out/rehearse.log" 2>&1 || { cat "$out/rehearse.log"; fail "gpu-check.sh --rehearse failed"; }
cat "$out/rehearse.log"
grep -q "^strata gpu-check: REHEARSED on the CPU-emulated device" "$out/rehearse.log" || fail "no REHEARSED verdict"
grep -qE "^  prof +worst prediction error" "$out/rehearse.log" || fail "no strata-prof line in the table"
python3 - "$out/rehearse/gpu-check.json" <<'PY'
import json, sys
c = json.load(open(sys.argv[1]))
def need(cond, what, j=c):
    if not cond:
        sys.exit(f"gpu-check --rehearse: {what}: {json.dumps(j, indent=1)}")
need(c["status"] == "rehearsed" and c["rehearsal"] is True and c["ok"] is True and c["skipped"] is False, "verdict")
need([s["name"] for s in c["steps"]] == ["gpu-info", "gpu-tests", "bench", "prof"], "steps")
need(all(s["exit"] == 0 for s in c["steps"]), "step exits")
need(c["tests"]["total"] > 0 and c["tests"]["failed"] == 0, "tests")
p = c["prof"]
need(isinstance(p, dict) and len(p["candidates"]) >= 2 and "measured_step_s" in p["candidates"][0], "prof", p)
need("median of all its timed steps" in p.get("reference", ""), "prof reference", p)
j = c["bench"]
need(j["ok"] is True and j["rehearsal"] is True and j["skipped"] is False, "bench verdict", j)
need(j["parts"] == {p: "ok" for p in ["link", "gemm", "adamw", "kernels", "model", "parity"]}, "parts", j)
# every part names what its figures are held to
need(all(isinstance(j[p].get("reference"), str) and j[p]["reference"]
         for p in ["link", "gemm", "adamw", "kernels", "model", "parity"]), "references", j)
k = j["kernels"]
ops = ["attention_forward", "attention_backward", "rmsnorm_backward", "layernorm_backward", "bias_backward",
       "embedding_backward"]
need(k["ok"] is True and all(k[op + "_tiled_repeatable"] is True and k[op + "_simple_ms"] > 0
                             and k[op + "_tiled_ms"] > 0 for op in ops), "kernels", j)
l = j["link"]
need(all(l[k] > 0 for k in ["h2d_gbps", "d2h_gbps", "peak_h2d_gbps", "peak_d2h_gbps"]) and len(l["chunks"]) == 2, "link", j)
need(j["gemm"]["peak_tflops"] > 0 and j["adamw"]["adamw_gbps"] > 0 and j["adamw"]["d2d_copy_gbps"] > 0, "gemm, adamw", j)
m = j["model"]
need(m["flops_per_step"] > 0 and sorted(m["placements"]) == ["host", "nvme"], "model", j)
for name, pl in m["placements"].items():
    need(pl["tokens_per_s"] > 0 and pl["mfu"] > 0 and 0 <= pl["gpu_idle_share"] <= 1 and 0 < pl["gpu_busy_s"], name, j)
    need(pl.get("broken_bound") is False, name + ": a rehearsal's MFU is no bound", j)
    need(len(pl["losses"]) == 3 and all(x == x for x in pl["losses"]), name + " losses", j)
# host and NVMe placements train the same model on the same data: the same losses, bit for bit
need(m["placements"]["host"]["losses"] == m["placements"]["nvme"]["losses"], "host vs nvme losses", j)
par = j["parity"]
need(par["ok"] is True and len(par["cuda_losses"]) == 8 and par["max_rel_diff"] == 0, "parity", j)
print("gpu-check.sh --rehearse ok: every step ran on the CPU-emulated device")
PY
