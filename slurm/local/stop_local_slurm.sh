#!/usr/bin/env bash
# stop_local_slurm.sh [--keep-munge] [--purge] - stop what start_local_slurm.sh started,
# by the PIDs in $LOCAL_SLURM_BASE/run (default /tmp/megatron-rl-local-slurm/run).
#   --keep-munge  leave munged running
#   --purge       also delete the controller state and the logs
# munged is stopped only when start_local_slurm.sh started it. Each PID is checked to
# still be the daemon it names before it is signalled (PIDs get reused).
set -euo pipefail

BASE=${LOCAL_SLURM_BASE:-/tmp/megatron-rl-local-slurm}
keep_munge=0; purge=0
for arg in "$@"; do
  case $arg in
    --keep-munge) keep_munge=1 ;;
    --purge) purge=1 ;;
    *) echo "usage: stop_local_slurm.sh [--keep-munge] [--purge]" >&2; exit 2 ;;
  esac
done

# alive = exists and is not a zombie (this VM's init reaps exited daemons late)
alive() { kill -0 "$1" 2>/dev/null && [ "$(awk '{print $3}' "/proc/$1/stat" 2>/dev/null)" != Z ]; }

stop_by_pidfile() {  # PIDFILE NAME: TERM, then KILL after 5 s, only if PID still runs NAME
  local pidfile=$1 name=$2 pid
  [ -s "$pidfile" ] || return 0
  pid=$(cat "$pidfile")
  if alive "$pid" && [ "$(cat "/proc/$pid/comm" 2>/dev/null)" = "$name" ]; then
    kill -TERM "$pid"
    for _ in $(seq 1 50); do alive "$pid" || break; sleep 0.1; done
    if alive "$pid"; then kill -KILL "$pid"; echo "[stop_local_slurm] $name (pid $pid) needed SIGKILL"; fi
    echo "[stop_local_slurm] stopped $name (pid $pid)"
  fi
  rm -f "$pidfile"
}

# slurmds first: a slurmd that outlives the controller keeps retrying to register.
for pidfile in "$BASE"/run/slurmd-*.pid; do
  [ -e "$pidfile" ] && stop_by_pidfile "$pidfile" slurmd
done
stop_by_pidfile "$BASE/run/slurmctld.pid" slurmctld
if [ "$keep_munge" = 0 ]; then stop_by_pidfile "$BASE/run/munged.pid" munged; fi
if [ "$purge" = 1 ]; then
  rm -rf "$BASE/state" "$BASE/logs"
  echo "[stop_local_slurm] deleted $BASE/state and $BASE/logs"
fi
