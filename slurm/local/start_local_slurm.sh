#!/usr/bin/env bash
# start_local_slurm.sh [NODES] - a real Slurm cluster of NODES fake nodes on this one host,
# for testing the sbatch scripts (tests/slurm). Idempotent: running it again with the same
# settings leaves a running cluster alone.
#
# What it does (as root, no systemd, no cgroups, no accounting database):
#   1. installs Debian's slurmctld, slurmd, slurm-client and munge if they are missing;
#   2. starts munged unless one already answers;
#   3. writes $BASE/etc/slurm.conf with nodes n1..nN (NODES >= 2: one slurmd per node,
#      each on its own port) and starts slurmctld and the slurmds;
#   4. waits until every node is idle.
# /etc/slurm is never touched: clients find the cluster through SLURM_CONF, which this
# script prints (`export SLURM_CONF=$BASE/etc/slurm.conf`).
#
# Settings (environment):
#   LOCAL_SLURM_BASE        state, logs and PID files (default /tmp/megatron-rl-local-slurm)
#   LOCAL_SLURM_CTLD_PORT   slurmctld port (default 16817)
#   LOCAL_SLURM_SLURMD_PORT slurmd port; node i listens on PORT + i (default 16900)
#   LOCAL_SLURM_TIMEOUT     seconds to wait for the daemons and idle nodes (default 60)
# Stop with stop_local_slurm.sh (same LOCAL_SLURM_BASE): it stops by the PID files.
#
# Exit codes: 0 ready; 1 a daemon did not come up; 3 the packages cannot be installed
# (tests skip on 3).
set -euo pipefail

BASE=${LOCAL_SLURM_BASE:-/tmp/megatron-rl-local-slurm}
NODES=${1:-2}
CTLD_PORT=${LOCAL_SLURM_CTLD_PORT:-16817}
SLURMD_PORT=${LOCAL_SLURM_SLURMD_PORT:-16900}
TIMEOUT=${LOCAL_SLURM_TIMEOUT:-60}
CONF=$BASE/etc/slurm.conf
HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)

log() { echo "[start_local_slurm] $*"; }
die() { echo "[start_local_slurm] error: $*" >&2; exit "${2:-1}"; }
# A daemon that died but was not reaped yet (its parent is this VM's init) is a zombie:
# kill -0 still succeeds on it, so check the process state too.
alive() { [ -n "${1:-}" ] && kill -0 "$1" 2>/dev/null && [ "$(awk '{print $3}' "/proc/$1/stat" 2>/dev/null)" != Z ]; }
pid_in() { if [ -s "$1" ]; then cat "$1"; fi; }
# Poll until "$@" succeeds or TIMEOUT seconds pass (daemons start in well under a second).
wait_for() {
  local deadline=$(( $(date +%s) + TIMEOUT ))
  until "$@" >/dev/null 2>&1; do
    [ "$(date +%s)" -lt "$deadline" ] || return 1
    sleep 0.1
  done
}

[ "$(id -u)" = 0 ] || die "must run as root (slurmd runs jobs as their users)" 3
[[ "$NODES" =~ ^[1-9][0-9]*$ ]] || die "NODES must be a positive integer, got '$NODES'"
mkdir -p "$BASE"/{etc,run,logs,state}

# ------------------------------------------------------------------- 1. packages
missing=0
for cmd in slurmctld slurmd sbatch srun scontrol sinfo munged munge unmunge; do
  command -v "$cmd" >/dev/null 2>&1 || missing=1
done
if [ "$missing" = 1 ]; then
  command -v apt-get >/dev/null 2>&1 || die "Slurm is not installed and there is no apt-get to install it" 3
  log "installing slurmctld slurmd slurm-client munge (log: $BASE/logs/apt.log)"
  # Package scripts must not try to start services (no systemd here): a policy-rc.d that
  # says "no", created only if there is none, and removed again only if we created it.
  policy=/usr/sbin/policy-rc.d; own_policy=0
  if [ ! -e "$policy" ]; then
    printf '#!/bin/sh\nexit 101\n' >"$policy"; chmod 755 "$policy"; own_policy=1
  fi
  export DEBIAN_FRONTEND=noninteractive
  pkgs=(slurmctld slurmd slurm-client munge)
  ok=1
  # The package index of a fresh machine may be missing or stale: update only then.
  apt-get install -y -q --no-install-recommends "${pkgs[@]}" >"$BASE/logs/apt.log" 2>&1 \
    || { apt-get update -q >>"$BASE/logs/apt.log" 2>&1 \
         && apt-get install -y -q --no-install-recommends "${pkgs[@]}" >>"$BASE/logs/apt.log" 2>&1; } \
    || ok=0
  if [ "$own_policy" = 1 ]; then rm -f "$policy"; fi
  [ "$ok" = 1 ] || die "apt-get could not install ${pkgs[*]}; see $BASE/logs/apt.log" 3
  log "installed $(slurmd -V)"
fi

# ------------------------------------------------------------------- 2. munge
# Slurm authenticates every message with munge; one munged serves all fake nodes.
if munge -n 2>/dev/null | unmunge >/dev/null 2>&1; then
  log "munged is already running"
else
  if [ ! -s /etc/munge/munge.key ]; then runuser -u munge -- mungekey -c; fi
  chown munge:munge /etc/munge/munge.key && chmod 0400 /etc/munge/munge.key
  install -d -o munge -g munge -m 0755 /run/munge
  runuser -u munge -- /usr/sbin/munged
  wait_for bash -c 'munge -n | unmunge' || die "munged did not answer within ${TIMEOUT}s"
  # Our copy of the PID marks munged as ours: the stop script stops it only then.
  cp /run/munge/munged.pid "$BASE/run/munged.pid"
  log "munged started (pid $(cat "$BASE/run/munged.pid"))"
fi

# ------------------------------------------------------------------- 3. slurm.conf
# Every fake node advertises the whole host's CPUs and an equal share of its memory.
hw=$(slurmd -C | head -1)
cpus=$(sed -n 's/.*CPUs=\([0-9]*\).*/\1/p' <<<"$hw")
mem=$(sed -n 's/.*RealMemory=\([0-9]*\).*/\1/p' <<<"$hw")
nodes=(); node_lines=""
for i in $(seq 1 "$NODES"); do
  nodes+=("n$i")
  node_lines+="NodeName=n$i NodeHostname=localhost NodeAddr=127.0.0.1 Port=$((SLURMD_PORT + i)) CPUs=$cpus RealMemory=$((mem * 9 / 10 / NODES)) State=UNKNOWN"$'\n'
done

conf=$(cat <<EOF
# written by start_local_slurm.sh: $NODES fake node(s) on one host
ClusterName=megatron-rl-local
SlurmctldHost=localhost
SlurmctldPort=$CTLD_PORT
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
StateSaveLocation=$BASE/state/ctld
SlurmdSpoolDir=$BASE/state/slurmd-%n
SlurmctldPidFile=$BASE/run/slurmctld.pid
SlurmdPidFile=$BASE/run/slurmd-%n.pid
SlurmctldLogFile=$BASE/logs/slurmctld.log
SlurmdLogFile=$BASE/logs/slurmd-%n.log
# No cgroups, no accounting: a plain process tracker, and finished jobs stay visible to
# 'scontrol show job' for MinJobAge seconds (there is no sacct without slurmdbd).
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
MinJobAge=600
MpiDefault=none
SwitchType=switch/none
MailProg=/bin/true
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
SchedulerType=sched/backfill
# The default batch_sched_delay=3 makes every submission wait ~3 s.
SchedulerParameters=batch_sched_delay=0
ReturnToService=2
KillWait=5
$node_lines
PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP
EOF
)

ctld_pid=$(pid_in "$BASE/run/slurmctld.pid")
if [ "$(cat "$CONF" 2>/dev/null)" != "$conf" ]; then
  if alive "$ctld_pid" || compgen -G "$BASE/run/slurmd-*.pid" >/dev/null; then
    log "the configuration changed: restarting the Slurm daemons"
    LOCAL_SLURM_BASE=$BASE "$HERE/stop_local_slurm.sh" --keep-munge
  fi
  # A new node list needs a fresh controller state (old jobs name nodes that are gone).
  rm -rf "$BASE/state/ctld" "$BASE"/state/slurmd-*
  printf '%s\n' "$conf" >"$CONF"
fi
mkdir -p "$BASE/state/ctld"
for n in "${nodes[@]}"; do mkdir -p "$BASE/state/slurmd-$n"; done
export SLURM_CONF=$CONF

# ------------------------------------------------------------------- 4. daemons
ctld_pid=$(pid_in "$BASE/run/slurmctld.pid")
if alive "$ctld_pid"; then
  log "slurmctld is already running (pid $ctld_pid)"
else
  slurmctld -f "$CONF" || die "slurmctld did not start; see $BASE/logs/slurmctld.log"
  wait_for bash -c 'scontrol ping | grep -q "is UP"' \
    || die "slurmctld did not answer within ${TIMEOUT}s; see $BASE/logs/slurmctld.log"
  log "slurmctld started (pid $(pid_in "$BASE/run/slurmctld.pid"))"
fi
for n in "${nodes[@]}"; do
  pidfile=$BASE/run/slurmd-$n.pid
  if alive "$(pid_in "$pidfile")"; then log "slurmd $n is already running"; continue; fi
  # -N: this slurmd plays node n (Debian's slurmd is built with multiple-slurmd support).
  slurmd -f "$CONF" -N "$n" || die "slurmd $n did not start; see $BASE/logs/slurmd-$n.log"
  wait_for test -s "$pidfile" || die "slurmd $n wrote no PID file; see $BASE/logs/slurmd-$n.log"
  log "slurmd $n started (pid $(cat "$pidfile"))"
done

# ------------------------------------------------------------------- 5. idle nodes
deadline=$(( $(date +%s) + TIMEOUT ))
while :; do
  states=$(sinfo -h -N -o '%N %T' 2>/dev/null | sort -u || true)
  ready=$(awk '$2 == "idle" || $2 == "mixed" || $2 == "allocated"' <<<"$states" | wc -l)
  [ "$ready" -ge "$NODES" ] && break
  # A node left DOWN or DRAINED by an unclean stop comes back only when told to.
  awk '$2 ~ /down|drain/ {print $1}' <<<"$states" | while read -r n; do
    scontrol update NodeName="$n" State=RESUME >/dev/null 2>&1 || true
  done
  [ "$(date +%s)" -lt "$deadline" ] || { sinfo -N -l >&2 || true; die "nodes not idle after ${TIMEOUT}s"; }
  sleep 0.2
done
log "ready: nodes ${nodes[*]} ($cpus CPUs each)"
echo "export SLURM_CONF=$CONF"
