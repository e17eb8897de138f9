#!/usr/bin/env bash
# shellcheck source-path=SCRIPTDIR
# ray_node.sh head|worker - one Ray node, in the foreground, as the srun task on its node.
#
# Started by ray_on_slurm.sh, which exports MRL_RAY_HEAD_IP, MRL_RAY_PORT (the head's GCS
# port) and MRL_RAY_NODES (the job's nodes, head first). The node lives as long as this
# task: ray_on_slurm.sh stops it by signalling the srun step (SIGTERM), which this script
# passes to `ray start --block`; that process then stops exactly the Ray processes it
# started. Nothing searches for Ray processes by name (`ray stop` would also kill the
# Ray processes of other jobs or other fake nodes on the same host).
#
# Per-node settings (environment, all optional):
#   MEGATRON_RL_CPUS_PER_NODE / MEGATRON_RL_GPUS_PER_NODE  Ray's CPUs/GPUs on each node
#       (default: Slurm's allocation on the node, SLURM_CPUS_ON_NODE / SLURM_GPUS_ON_NODE;
#       without it Ray counts the devices itself)
#   MEGATRON_RL_RAY_TMPDIR              Ray's --temp-dir (default /tmp/ray-JOBID); keep it
#       short and node-local: Ray puts its Unix sockets there
#   MEGATRON_RL_RAY_OBJECT_STORE_BYTES  object store size per node (default: Ray's, 30% of RAM)
#   MEGATRON_RL_RAY_START_TRIES         starts of a node that exits before it comes up (3)
#   MEGATRON_RL_RAY_NODE_PORT_BASE      fixed ports (for firewalled clusters): node k uses
#       BASE + k*STRIDE + 1..6 for its own services and BASE + k*STRIDE + 100.. for workers
#       (the head's GCS port is BASE unless MEGATRON_RL_RAY_PORT says otherwise)
#   MEGATRON_RL_RAY_PORT_STRIDE         per-node port offset, 0 by default; set it (>= 200,
#       e.g. 1000) when several Slurm nodes share one host
# Without MEGATRON_RL_RAY_NODE_PORT_BASE Ray picks its ports, except the dashboard agent's
# (Ray's default 52365 is fixed, so a free one is picked here).
set -euo pipefail

role=${1:-}
[[ "$role" == head || "$role" == worker ]] || { echo "usage: ray_node.sh head|worker" >&2; exit 2; }
: "${MRL_RAY_HEAD_IP:?set by ray_on_slurm.sh}" "${MRL_RAY_PORT:?}" "${MRL_RAY_NODES:?}"
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
# shellcheck source=env.sh
source "$here/env.sh"

node=${SLURMD_NODENAME:-$(hostname -s)}
args=(--disable-usage-stats --block)

cpus=${MEGATRON_RL_CPUS_PER_NODE:-${SLURM_CPUS_ON_NODE:-}}
gpus=${MEGATRON_RL_GPUS_PER_NODE:-${SLURM_GPUS_ON_NODE:-}}
if [ -n "$cpus" ]; then args+=(--num-cpus="$cpus"); fi
if [ -n "$gpus" ]; then args+=(--num-gpus="$gpus"); fi
# Not Ray's default /tmp/ray: `ray start` leaves the address of its cluster in
# TMPDIR/ray_current_cluster, and a plain `ray.init()` on the node would later try to
# join that (dead) cluster instead of starting its own. A directory per job keeps the
# job's Ray apart from anything else on the node; the pointer is removed at the end.
tmp_dir=${MEGATRON_RL_RAY_TMPDIR:-/tmp/ray-${SLURM_JOB_ID:-$$}}
args+=(--temp-dir="$tmp_dir")
if [ -n "${MEGATRON_RL_RAY_OBJECT_STORE_BYTES:-}" ]; then
  args+=(--object-store-memory="$MEGATRON_RL_RAY_OBJECT_STORE_BYTES")
fi

free_port() { mrl_run python -c 'import socket; s = socket.socket(); s.bind(("", 0)); print(s.getsockname()[1])'; }

if [ -n "${MEGATRON_RL_RAY_NODE_PORT_BASE:-}" ]; then
  stride=${MEGATRON_RL_RAY_PORT_STRIDE:-0}
  if [ "$stride" != 0 ] && [ "$stride" -lt 200 ]; then
    echo "error: MEGATRON_RL_RAY_PORT_STRIDE=$stride: use 0 or >= 200 (each node needs room for its workers' ports)" >&2
    exit 2
  fi
  index=0
  for n in $MRL_RAY_NODES; do
    [ "$n" = "$node" ] && break
    index=$((index + 1))
  done
  base=$((MEGATRON_RL_RAY_NODE_PORT_BASE + index * stride))
  args+=(
    --node-manager-port=$((base + 1)) --object-manager-port=$((base + 2))
    --runtime-env-agent-port=$((base + 3)) --dashboard-agent-grpc-port=$((base + 4))
    --dashboard-agent-listen-port=$((base + 5)) --metrics-export-port=$((base + 6))
    --min-worker-port=$((base + 100)) --max-worker-port=$((base + (stride > 0 ? stride - 1 : 999)))
  )
fi

if [ "$role" = head ]; then
  # Cluster-wide settings (every node's raylet takes them from the head): no idle Python
  # workers started ahead, which no actor of the run could use (cluster/local_ray.py).
  system_config=$(mrl_run python -c 'import json; from megatron_rl.cluster.local_ray import LEAN_RAY_SYSTEM_CONFIG as c; print(json.dumps(c))')
  args+=(--head --node-ip-address="$MRL_RAY_HEAD_IP" --port="$MRL_RAY_PORT" --system-config="$system_config")
  if [ -n "${MEGATRON_RL_RAY_DASHBOARD_PORT:-}" ]; then
    args+=(--include-dashboard=true --dashboard-host=0.0.0.0 --dashboard-port="$MEGATRON_RL_RAY_DASHBOARD_PORT")
  else
    args+=(--include-dashboard=false)
  fi
else
  args+=(--address="$MRL_RAY_HEAD_IP:$MRL_RAY_PORT")
fi

# On SIGTERM, `ray start --block` first drains the node for up to this long (made for
# services moving traffic away); at the end of a job there is nothing to move.
export RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S=${RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S:-0}

# Ray is chatty: its output goes to a log per node; the job's output (fd 3) gets the
# start, the warnings below and errors before this line.
log=${MRL_RAY_LOG_DIR:-.}/ray-${SLURM_JOB_ID:-local}-$node.log
echo "[ray_node $node] starting the Ray $role; log: $log"
exec 3>&2 >>"$log" 2>&1

# SIGTERM/SIGINT from the batch script (through srun): stop Ray and report success. A
# Ray node that exits on its own is a failure, reported with its exit code.
stopping=0
ray_pid=
trap 'stopping=1; if [ -n "$ray_pid" ]; then kill -TERM "$ray_pid" 2>/dev/null || true; fi' TERM INT

# A node that exits before it comes up is started again, up to MEGATRON_RL_RAY_START_TRIES
# times (3): Ray's raylet gives its dashboard agent a fixed 15 s to report its ports and
# aborts otherwise, which a node whose cores are all busy can miss (`ray start` then fails
# with "The current node timed out during startup"). The head's retry binds the same GCS
# port and the workers start only once the head's node has registered
# (ray_on_slurm.sh), so the retry is invisible to the rest of the job.
tries=${MEGATRON_RL_RAY_START_TRIES:-3}
for ((try = 1; ; try++)); do
  try_args=("${args[@]}")
  if [ -z "${MEGATRON_RL_RAY_NODE_PORT_BASE:-}" ]; then
    try_args+=(--dashboard-agent-listen-port="$(free_port)")
  fi
  if [ "$stopping" = 1 ]; then break; fi
  offset=$(stat -c %s "$log")
  echo "[ray_node $node] ray start ${try_args[*]}"
  # The try's mark, in the environment of every process it starts (see below).
  MRL_RAY_TRY="$node-$try-$$" mrl_exec ray start "${try_args[@]}" &  # $! is ray itself: the TERM trap signals it
  ray_pid=$!
  rc=0
  while :; do
    wait "$ray_pid" && rc=0 || rc=$?
    # `wait` also returns (with 128+signal) when a trapped signal arrives: only a gone
    # process means Ray has stopped.
    kill -0 "$ray_pid" 2>/dev/null || break
  done
  if [ "$stopping" = 1 ] || [ "$try" -ge "$tries" ] || tail -c +$((offset + 1)) "$log" | grep -q "Ray runtime started"; then
    break
  fi
  echo "[ray_node $node] warning: the Ray $role exited with code $rc before it came up (try $try of $tries); starting it again" | tee /dev/fd/3
  # Kill what the failed try left: its dashboard agent outlives the raylet (orphaned, so
  # no longer below this script) and, with fixed ports, would hold the next try's. Every
  # process the try started carries its mark in its environment; nothing else does.
  for _ in $(seq 50); do
    left=$(grep -lzx "MRL_RAY_TRY=$node-$try-$$" /proc/[0-9]*/environ 2>/dev/null | cut -d/ -f3 || true)
    if [ -z "$left" ]; then break; fi
    echo "[ray_node $node] killing what try $try left:" $left
    # shellcheck disable=SC2086  # one pid per word
    kill -KILL $left 2>/dev/null || true
    sleep 0.2
  done
done
rm -f "$tmp_dir/ray_current_cluster"
if [ "$stopping" = 1 ]; then
  echo "[ray_node $node] stopped"
  exit 0
fi
echo "[ray_node $node] ray exited on its own with code $rc" | tee /dev/fd/3
exit "$rc"
