#!/usr/bin/env bash
# sbatch_wait.sh [sbatch flags] SCRIPT [script args] - submit a job, wait for it to end,
# and exit with its exit code (1 when it ended in any state but COMPLETED with code 0).
#
# Polls `scontrol show job` five times a second: on the local test cluster that notices
# the end of a job within 0.2 s, where `sbatch --wait` polls with a growing back-off (tens
# of seconds). Too chatty for a shared production controller: use `sbatch --wait` there.
# Prints "job ID STATE exit=CODE" and the job's StdOut path on stderr when it ends.
#   SBATCH_WAIT_TIMEOUT  seconds before the job is cancelled and this exits 124 (default 900)
set -euo pipefail

timeout=${SBATCH_WAIT_TIMEOUT:-900}
job=$(sbatch --parsable "$@")
job=${job%%;*}  # "ID;cluster" on federated setups
echo "[sbatch_wait] submitted job $job" >&2
deadline=$(( $(date +%s) + timeout ))
while :; do
  info=$(scontrol show job "$job" 2>/dev/null || true)
  state=$(grep -oP '\bJobState=\K\S+' <<<"$info" || true)
  case $state in
    COMPLETED|FAILED|CANCELLED|TIMEOUT|NODE_FAIL|OUT_OF_MEMORY|PREEMPTED|BOOT_FAIL|DEADLINE) break ;;
  esac
  if [ "$(date +%s)" -ge "$deadline" ]; then
    scancel "$job" || true
    echo "[sbatch_wait] job $job still $state ($(grep -oP '\bReason=\K\S+' <<<"$info" || true)) after ${timeout}s: cancelled" >&2
    exit 124
  fi
  sleep 0.2
done
# ExitCode=CODE:SIGNAL of the batch script
code=$(grep -oP '\bExitCode=\K[0-9]+' <<<"$info" || echo 1)
echo "[sbatch_wait] job $job $state exit=$code stdout=$(grep -oP '\bStdOut=\K\S+' <<<"$info" || true)" >&2
if [ "$state" != COMPLETED ] && [ "$code" = 0 ]; then exit 1; fi
exit "$code"
