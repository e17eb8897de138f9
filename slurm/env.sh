# shellcheck shell=bash
# env.sh - sourced by the sbatch scripts and by ray_node.sh: the software environment.
#
#   MEGATRON_RL_ACTIVATE   a file to source first on every node (a venv's bin/activate, a
#                          script of `module load`s, a conda activation, ...)
#   MEGATRON_RL_CONTAINER  a command prefix that runs a program in the container, split on
#                          whitespace, e.g. "apptainer exec --nv --bind /ckpt /images/mrl.sif"
#                          (ray, python and megatron-rl are then found inside the image)
#
# Defines MRL_RUN (an array: the container prefix, maybe empty), mrl_run CMD [ARGS] and
# mrl_exec CMD [ARGS] (the same, replacing the shell: started with `&`, $! is then the
# program itself, which a signal sent to $! must reach, not a subshell around it).

if [ -n "${MEGATRON_RL_ACTIVATE:-}" ]; then
  if [ ! -r "$MEGATRON_RL_ACTIVATE" ]; then
    echo "error: MEGATRON_RL_ACTIVATE=$MEGATRON_RL_ACTIVATE is not a readable file" >&2
    exit 2
  fi
  # Activation scripts (conda's in particular) read unset variables: no `set -u` inside.
  set +u
  # shellcheck disable=SC1090
  source "$MEGATRON_RL_ACTIVATE"
  set -u
fi

read -r -a MRL_RUN <<<"${MEGATRON_RL_CONTAINER:-}"

mrl_run() { "${MRL_RUN[@]}" "$@"; }
mrl_exec() { exec "${MRL_RUN[@]}" "$@"; }
