#!/usr/bin/env bash
# Starts N copies of a command the way `torchrun --standalone --nproc-per-node N` starts its
# workers (no torchrun needed): RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR,
# MASTER_PORT and TORCHELASTIC_RUN_ID set per process; waits for all and exits with the worst
# exit code. Once a rank has failed, it ends the others (SIGTERM) as torchrun does, but only
# after STRATA_TEST_GRACE_S (default 10) seconds: the tests check that the ranks that can end
# themselves do (a rank stalled on purpose cannot).
#   torchrun_ranks.sh N COMMAND [ARGS...]
# MASTER_ADDR (default 127.0.0.1) and MASTER_PORT (default: a free port) may be given;
# STRATA_TEST_RANKS="0 2" starts only those ranks (a job with missing peers).
# STRATA_TEST_LAUNCHER=slurm sets a Slurm step's variables instead (srun without --mpi: SLURM_PROCID,
# SLURM_STEP_NUM_TASKS, SLURM_LOCALID, SLURM_NODEID, SLURM_STEP_NODELIST=localhost, and
# SLURM_JOB_ID such that the default port 20000 + SLURM_JOB_ID % 20000 is the free one).
set -u
if [ $# -lt 2 ]; then echo "usage: torchrun_ranks.sh N COMMAND [ARGS...]" >&2; exit 2; fi
n=$1
shift
addr=${MASTER_ADDR:-127.0.0.1}
port=${MASTER_PORT:-}
if [ -z "$port" ]; then
  for _ in $(seq 100); do
    p=$((20000 + RANDOM % 20000))
    if ! command -v ss >/dev/null || [ -z "$(ss -Htan "sport = :$p" 2>/dev/null)" ]; then
      port=$p
      break
    fi
  done
fi
ranks=${STRATA_TEST_RANKS:-$(seq 0 $((n - 1)))}
pids=()
for r in $ranks; do
  if [ "${STRATA_TEST_LAUNCHER:-torchrun}" = slurm ]; then
    env -u MASTER_ADDR -u MASTER_PORT SLURM_PROCID=$r SLURM_STEP_NUM_TASKS=$n SLURM_NTASKS=$n \
      SLURM_STEP_ID=0 SLURM_LOCALID=$r SLURM_NODEID=0 SLURM_STEP_NUM_NODES=1 \
      SLURM_STEP_TASKS_PER_NODE=$n SLURM_STEP_NODELIST=localhost \
      SLURM_JOB_ID=$((port >= 20000 && port < 40000 ? port - 20000 : 0)) "$@" &
  else
    RANK=$r WORLD_SIZE=$n LOCAL_RANK=$r LOCAL_WORLD_SIZE=$n MASTER_ADDR=$addr MASTER_PORT=$port \
      TORCHELASTIC_RUN_ID=harness-$port "$@" &
  fi
  pids+=($!)
done
rc=0
killer=
running=("${pids[@]}")
while [ ${#running[@]} -gt 0 ]; do
  finished=
  wait -n -p finished "${running[@]}"
  c=$?
  [ -z "$finished" ] && break  # nothing left to wait for
  running=($(printf '%s\n' "${running[@]}" | grep -vx "$finished"))
  [ "$c" -gt "$rc" ] && rc=$c
  if [ "$c" -ne 0 ] && [ -z "$killer" ]; then
    # Not holding the caller's output open: a test reads it to the end.
    (sleep "${STRATA_TEST_GRACE_S:-10}" && kill -TERM "${pids[@]}") >/dev/null 2>&1 &
    killer=$!
  fi
done
[ -n "$killer" ] && kill "$killer" 2>/dev/null
exit "$rc"
