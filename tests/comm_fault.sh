#!/usr/bin/env bash
# Runs comm_fault_test as 4 ranks and checks the failure contract of the collectives: the job
# ends non-zero within 60 s, and a surviving rank's error names the collective, the rank and the
# elapsed time.  Usage: comm_fault.sh LAUNCHER COMM_FAULT_TEST kill|hang|truncate|owned
# LAUNCHER is mpirun (MPI backend) or torchrun_ranks.sh (torchrun's variables: Gloo backend;
# kill and hang only). (owned is not a fault: the program's own MPI_Init, launch_info() on one
# rank alone; exit 0.)
set -u
launcher=$1 bin=$2 mode=$3
gloo=0
[ "$(basename "$launcher")" = torchrun_ranks.sh ] && gloo=1
launch=("$launcher" -np 4 --oversubscribe)
[ "$gloo" = 1 ] && launch=("$launcher" 4)
# kill: the launcher ends the job at once; the 30-s watchdog is the backstop that would
# still end it within 60 s. hang: only the watchdog can end it, so keep it short.
if [ "$mode" = hang ]; then export STRATA_COMM_TIMEOUT_S=5; else export STRATA_COMM_TIMEOUT_S=30; fi
if [ "$mode" = owned ]; then
  out=$(timeout 30 "$launcher" -np 4 --oversubscribe "$bin" owned 2>&1)
  rc=$?
  printf '%s\n' "$out"
  if [ "$rc" -ne 0 ]; then echo "FAIL: exit $rc (124: hung in launch_info)"; exit 1; fi
  echo "PASS"
  exit 0
fi
start=$(date +%s%N)
out=$(timeout 90 "${launch[@]}" "$bin" "$mode" 2>&1)
rc=$?
elapsed_ms=$(( ($(date +%s%N) - start) / 1000000 ))
printf '%s\n' "$out"
echo "comm_fault.sh: mode $mode: $(basename "$launcher") exit code $rc after ${elapsed_ms} ms"
fail=0
if [ "$rc" -eq 0 ]; then echo "FAIL: the job exited 0"; fail=1; fi
if [ "$rc" -eq 124 ]; then echo "FAIL: the job hung (killed by timeout 90)"; fail=1; fi
if [ "$elapsed_ms" -ge 60000 ]; then echo "FAIL: took ${elapsed_ms} ms, the limit is 60000"; fail=1; fi
# The error: collective, rank and elapsed seconds, from a surviving rank (not rank 2 / 1).
if [ "$mode" = truncate ]; then
  pattern='collective all_gather\(bf16, [0-9]+ elements\) failed on rank 3 of 4 .*MPI_ERR_TRUNCATE.*different sizes or dtypes.*STRATA_COMM_CHECK=1'
elif [ "$mode" = kill ] && [ "$gloo" = 1 ]; then
  # No launcher ends the survivors: each finds its connection to the dead rank closed.
  pattern='collective all_reduce\(max, fp32, 1000 elements\) failed on rank [013] of 4 after [0-9]+\.[0-9]+ s: '
elif [ "$mode" = kill ]; then
  pattern='rank [013] of 4 received SIGTERM .* while collective all_reduce\(max, fp32, 1000 elements\) was in flight for [0-9]+\.[0-9]+ s'
elif [ "$gloo" = 1 ]; then
  # Gloo's own timeout or the watchdog, whichever fires first: the same timeout.
  pattern='collective all_reduce\(max, fp32, 1000 elements\) (on rank [023] of 4 has not completed after|failed on rank [023] of 4 after) [0-9]+\.[0-9]+ s'
else
  pattern='collective all_reduce\(max, fp32, 1000 elements\) on rank [023] of 4 has not completed after [0-9]+\.[0-9] s'
fi
if ! grep -Eq "$pattern" <<<"$out"; then echo "FAIL: no error matching: $pattern"; fail=1; fi
[ "$fail" -eq 0 ] && echo "PASS"
exit "$fail"
