#!/usr/bin/env bash
# One task of a Timeslice Slurm job, started by srun from rl-job.sbatch:
#   timeslice-task.sh rank    one rank of the RL job: `timeslice job worker`, rank = SLURM_PROCID
#   timeslice-task.sh agent   this node's node agent, its task queue named after SLURMD_NODENAME
# It reads the variables rl-job.sbatch exports, and Temporal's own client settings
# (TEMPORAL_ADDRESS / TEMPORAL_NAMESPACE / TEMPORAL_API_KEY / TEMPORAL_TLS_* or a config profile
# through TEMPORAL_CONFIG_FILE and TEMPORAL_PROFILE) from the environment srun passes on.
set -euo pipefail

role=${1:?usage: timeslice-task.sh rank|agent}
timeslice=${TIMESLICE_BIN:-timeslice}

case "$role" in
    rank)
        : "${TIMESLICE_JOB_ID:?TIMESLICE_JOB_ID must name the RL job}"
        : "${TIMESLICE_WORKLOAD:?TIMESLICE_WORKLOAD must name the workload (grpo-toy, MODULE:FACTORY)}"
        : "${TIMESLICE_CHECKPOINT_DIR:?TIMESLICE_CHECKPOINT_DIR must be a folder every node sees}"
        rank=${SLURM_PROCID:?SLURM_PROCID is unset: run this under srun}
        # exec: the rank process is launched with TIMESLICE_JOB_ID in its environment (exported
        # here), which the node agent checks before it checkpoints the process.
        export TIMESLICE_JOB_ID
        args=(job worker --job-id "$TIMESLICE_JOB_ID" --rank "$rank"
            --workload "$TIMESLICE_WORKLOAD" --checkpoint-dir "$TIMESLICE_CHECKPOINT_DIR")
        if [[ -n ${TIMESLICE_METRICS_PORT:-} ]]; then
            # One port per rank on a node: base + the rank's local index.
            args+=(--metrics-port "$((TIMESLICE_METRICS_PORT + ${SLURM_LOCALID:-0}))")
        fi
        if [[ -n ${SLURM_CPUS_PER_TASK:-} ]]; then
            args+=(--threads "$SLURM_CPUS_PER_TASK")
        fi
        exec "$timeslice" "${args[@]}"
        ;;
    agent)
        node=${SLURMD_NODENAME:-$(hostname -s)}
        exec "$timeslice" agent --node "$node"
        ;;
    *)
        echo "timeslice-task.sh: unknown role '$role' (use rank or agent)" >&2
        exit 2
        ;;
esac
