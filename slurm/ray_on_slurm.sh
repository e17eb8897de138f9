# shellcheck shell=bash
# ray_on_slurm.sh - sourced by slurm/train.sbatch: a Ray cluster over the job's nodes.
#
#   ray_cluster_start   head on this node (the batch step's), one worker on every other
#                       node; each is an `srun --overlap` step running ray_node.sh
#   ray_cluster_wait    polls the head until all SLURM_JOB_NUM_NODES nodes are alive
#                       (error after MEGATRON_RL_RAY_WAIT_S, default 300 s); exports
#                       RAY_ADDRESS so a driver started afterwards joins the cluster, and
#                       RAY_gcs_server_request_timeout_seconds (unless set) to the same
#                       wait: Ray's own 60 s for a driver to reach the head's GCS is too
#                       short for a head node under load (seen on a loaded 2-core CI machine)
#   ray_cluster_stop    SIGTERM to the worker step, then to the head step (`scancel --signal`
#                       on the job step ids), and waits for their srun processes to end
#                       (MEGATRON_RL_RAY_STOP_S, 60 s); a step still running then is ended
#                       by Slurm (`scancel JOB.STEP`). Killing the srun process instead
#                       would make srun abort its step (SIGKILL), not pass SIGTERM on.
#
# Settings (environment): MEGATRON_RL_RAY_PORT (the head's GCS port; default
# MEGATRON_RL_RAY_NODE_PORT_BASE when that is set, else a free one),
# MEGATRON_RL_RAY_HEAD_IP (default: the first address of `hostname -I`),
# MEGATRON_RL_SRUN_ARGS (extra srun flags for the Ray steps, split on whitespace),
# MEGATRON_RL_LOG_DIR (each Ray node's log, default the job's working directory), and the
# per-node ones read by ray_node.sh. Needs env.sh sourced and MRL_SLURM_DIR set.

mrl_log() { echo "[megatron-rl $(date +%H:%M:%S)] $*"; }

ray_cluster_start() {
  local nodes head workers srun_extra
  mapfile -t nodes < <(scontrol show hostnames "$SLURM_JOB_NODELIST")
  # The head shares the batch step's node, so the driver reaches it locally.
  head=${SLURMD_NODENAME:-${nodes[0]}}
  workers=()
  for n in "${nodes[@]}"; do [ "$n" = "$head" ] || workers+=("$n"); done
  export MRL_RAY_NODES="$head ${workers[*]}"
  export MRL_RAY_HEAD_IP=${MEGATRON_RL_RAY_HEAD_IP:-$( (hostname -I 2>/dev/null || hostname -i) | awk '{print $1}')}
  # With fixed node ports the GCS port is fixed too (BASE: the head's own services use
  # BASE+1..6): a free port picked at random lies in the ephemeral range, which can
  # overlap the fixed worker ports (BASE+100..), and a firewall must know it anyway.
  if [ -n "${MEGATRON_RL_RAY_PORT:-}" ]; then
    export MRL_RAY_PORT=$MEGATRON_RL_RAY_PORT
  elif [ -n "${MEGATRON_RL_RAY_NODE_PORT_BASE:-}" ]; then
    export MRL_RAY_PORT=$MEGATRON_RL_RAY_NODE_PORT_BASE
  else
    MRL_RAY_PORT=$(mrl_run python -c 'import socket; s = socket.socket(); s.bind(("", 0)); print(s.getsockname()[1])')
    export MRL_RAY_PORT
  fi
  export MRL_RAY_LOG_DIR=${MEGATRON_RL_LOG_DIR:-$PWD}
  read -r -a srun_extra <<<"${MEGATRON_RL_SRUN_ARGS:-}"
  # Ray authenticates connections with a token when it finds one (by default in
  # ~/.ray/auth_token, which can differ between nodes, or exist for the head but not for
  # a client). One token per job, in the environment that every step and the driver
  # inherit, makes them all agree. RAY_AUTH_MODE=disabled turns it off.
  export RAY_AUTH_MODE=${RAY_AUTH_MODE:-token}
  if [ "$RAY_AUTH_MODE" = token ] && [ -z "${RAY_AUTH_TOKEN:-}" ]; then
    RAY_AUTH_TOKEN=$(mrl_run python -c 'import secrets; print(secrets.token_hex(32))')
    export RAY_AUTH_TOKEN
  fi
  MRL_RAY_ADDRESS=$MRL_RAY_HEAD_IP:$MRL_RAY_PORT
  mrl_log "Ray head on $head at $MRL_RAY_ADDRESS; workers on: ${workers[*]:-none}; logs in $MRL_RAY_LOG_DIR/ray-$SLURM_JOB_ID-*.log"
  mrl_log "NCCL settings passed to every node: $(env | grep '^NCCL_' | tr '\n' ' ' || true)"

  # --overlap: the Ray steps share the nodes' CPUs/GPUs with the batch step (the driver)
  # instead of waiting for them. --cpus-per-task: without it a step gets one CPU, and
  # where Slurm confines steps (cgroups) every Ray worker on the node would share it.
  local step_args=(--overlap --ntasks-per-node=1 --kill-on-bad-exit=0 "${srun_extra[@]}")
  if [ -n "${SLURM_CPUS_ON_NODE:-}" ]; then step_args+=(--cpus-per-task="$SLURM_CPUS_ON_NODE"); fi

  srun "${step_args[@]}" --nodes=1 --ntasks=1 --nodelist="$head" --job-name=ray-head \
    bash "$MRL_SLURM_DIR/ray_node.sh" head &
  MRL_RAY_HEAD_PID=$!
  MRL_RAY_HEAD_STEP=$(_step_id ray-head "$MRL_RAY_HEAD_PID")
  MRL_RAY_WORKERS_PID=; MRL_RAY_WORKERS_STEP=
  _ray_wait_for_head || return 1
  if [ "${#workers[@]}" -gt 0 ]; then
    local csv
    csv=$(IFS=,; echo "${workers[*]}")
    # One step for all workers, one task per node.
    srun "${step_args[@]}" --nodes="${#workers[@]}" --ntasks="${#workers[@]}" --nodelist="$csv" --job-name=ray-workers \
      bash "$MRL_SLURM_DIR/ray_node.sh" worker &
    MRL_RAY_WORKERS_PID=$!
    MRL_RAY_WORKERS_STEP=$(_step_id ray-workers "$MRL_RAY_WORKERS_PID")
  fi
}

_step_id() {  # NAME SRUN_PID: JOB.STEP of this job's step NAME, once Slurm lists it
  local id deadline=$(( $(date +%s) + 60 ))
  while _step_running "$2" && [ "$(date +%s)" -lt "$deadline" ]; do
    id=$(squeue -h -s -j "$SLURM_JOB_ID" -o '%i %j' 2>/dev/null | awk -v n="$1" '$2 == n {print $1; exit}')
    if [ -n "$id" ]; then echo "$id"; return 0; fi
    sleep 0.1
  done
  return 0  # no id (the step already ended): ray_cluster_stop falls back to the srun PID
}

_step_running() { [ -n "${1:-}" ] && kill -0 "$1" 2>/dev/null && [ "$(awk '{print $3}' "/proc/$1/stat" 2>/dev/null)" != Z ]; }

_ray_wait_for_head() {
  # Start the workers only once the head's node has registered with its GCS (not when the
  # GCS first answers): a head whose node fails to come up is started again by
  # ray_node.sh, with a new GCS on the same port, which workers that had already joined
  # the first would not follow. One process polls twice a second; it stops early when the
  # head's step has ended.
  mrl_run python - "$MRL_RAY_ADDRESS" "${MEGATRON_RL_RAY_WAIT_S:-300}" "$MRL_RAY_HEAD_PID" <<'EOF' || return 1
import sys, time

from ray._raylet import GcsClient  # what `ray health-check` uses; the public API needs a node

from megatron_rl.cluster.processes import process_start_time  # None: gone or a zombie

address, timeout_s, head_pid = sys.argv[1], float(sys.argv[2]), int(sys.argv[3])
deadline = time.monotonic() + timeout_s
client = None
while time.monotonic() < deadline:
    if process_start_time(head_pid) is None:
        sys.exit("error: the Ray head exited during startup; see the ray-*.log files of the job")
    try:
        client = client or GcsClient(address=address)
        if any(node.state == 0 for node in client.get_all_node_info(timeout=2).values()):  # 0: ALIVE
            sys.exit(0)
    except Exception:  # the GCS is not up yet, or went with a failed start: ask a new one
        client = None
    time.sleep(0.5)
sys.exit(f"error: the Ray head's node did not register at {address} within {timeout_s:.0f}s")
EOF
  mrl_log "Ray head is up"
}

ray_cluster_wait() {
  local expected=${SLURM_JOB_NUM_NODES:-1}
  # Read by Ray at import: every driver from here on (the wait below, the trainer).
  export RAY_gcs_server_request_timeout_seconds=${RAY_gcs_server_request_timeout_seconds:-${MEGATRON_RL_RAY_WAIT_S:-300}}
  # One connection, polled twice a second; it also stops early when a Ray step has died.
  mrl_run python - "$MRL_RAY_ADDRESS" "$expected" "${MEGATRON_RL_RAY_WAIT_S:-300}" \
    "$MRL_RAY_HEAD_PID" "${MRL_RAY_WORKERS_PID:-}" <<'EOF'
import sys, time

import ray

from megatron_rl.cluster.processes import process_start_time  # None: gone or a zombie

address, expected, timeout_s = sys.argv[1], int(sys.argv[2]), float(sys.argv[3])
step_pids = [int(p) for p in sys.argv[4:] if p]

ray.init(address=address, log_to_driver=False, configure_logging=False)
deadline = time.monotonic() + timeout_s
while True:
    alive = [n for n in ray.nodes() if n["Alive"]]
    if len(alive) >= expected:
        break
    dead = [p for p in step_pids if process_start_time(p) is None]
    if dead or time.monotonic() > deadline:
        why = f"a Ray step (srun pid {dead}) exited" if dead else f"waited {timeout_s:.0f}s"
        sys.exit(
            f"error: {len(alive)} of {expected} Ray nodes joined ({why}); see the ray-*.log files of the job"
        )
    time.sleep(0.5)
print(f"all {len(alive)} Ray nodes are alive; resources: {ray.cluster_resources()}", flush=True)
EOF
  export RAY_ADDRESS=$MRL_RAY_ADDRESS
}

ray_cluster_stop() {
  # Workers before the head: a worker whose head is gone first logs reconnect errors.
  _stop_step "${MRL_RAY_WORKERS_STEP:-}" "${MRL_RAY_WORKERS_PID:-}"
  _stop_step "${MRL_RAY_HEAD_STEP:-}" "${MRL_RAY_HEAD_PID:-}"
  MRL_RAY_WORKERS_PID=; MRL_RAY_HEAD_PID=
  mrl_log "Ray stopped"
}

_stop_step() {  # JOB.STEP SRUN_PID
  local step=$1 pid=$2 deadline
  _step_running "$pid" || return 0
  if [ -n "$step" ]; then
    # SIGTERM to the step's processes; ray_node.sh stops Ray and exits 0. (scancel may
    # report an error when the step ends before slurmctld hears back from the node.)
    scancel --signal=TERM "$step" 2>/dev/null || true
  else
    kill -TERM "$pid" 2>/dev/null || true  # no step id: srun then ends its step (SIGKILL)
  fi
  deadline=$(( $(date +%s) + ${MEGATRON_RL_RAY_STOP_S:-60} ))
  while _step_running "$pid" && [ "$(date +%s)" -lt "$deadline" ]; do sleep 0.2; done
  if _step_running "$pid"; then
    mrl_log "warning: Ray step $step (srun pid $pid) still running after ${MEGATRON_RL_RAY_STOP_S:-60}s; ending it" >&2
    if [ -n "$step" ]; then scancel "$step" 2>/dev/null || true; fi
  else
    wait "$pid" 2>/dev/null || true  # reap it; its exit code is not the job's
  fi
}
