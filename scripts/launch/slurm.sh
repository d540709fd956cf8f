#!/usr/bin/env bash
# A multi-node job under Slurm: one torchrun per node (srun), rendezvous (c10d) at the first
# node, requeued on preemption and resumed from the latest checkpoint in its dump folder.
#   bash scripts/launch/slurm.sh --nodes 4 [--gpus-per-node 8] [--port 29500] [--time 48:00:00] \
#       [--partition P] [--dry-run] --job.config_file train_configs/qwen3_8b_fsdp_cp.toml [--section.key value ...]
# Run from a login node: the config is checked there for the whole world (nodes x gpus per
# node), then the script submits itself with sbatch. Inside the allocation (SLURM_JOB_ID set)
# it starts torchrun on every node. Slurm sends SIGUSR1 two minutes before the time limit or
# a preemption; the script then requeues the job, which starts again from the latest
# checkpoint ([checkpoint] interval sets how much a requeue repeats). --dry-run checks the
# config and prints the commands instead of running them.
#SBATCH --ntasks-per-node=1
#SBATCH --requeue
#SBATCH --signal=B:USR1@120
#SBATCH --open-mode=append
set -euo pipefail
REPO="${TITAN_COTRAIN_REPO:-$(cd "$(dirname "$0")/../.." && pwd)}"
nodes=1 gpus=8 port=29500 time_limit="48:00:00" partition="" dry=0 args=()
while [ $# -gt 0 ]; do
    case "$1" in
        --nodes) nodes="$2"; shift 2 ;;
        --gpus-per-node) gpus="$2"; shift 2 ;;
        --port) port="$2"; shift 2 ;;
        --time) time_limit="$2"; shift 2 ;;
        --partition) partition="$2"; shift 2 ;;
        --dry-run) dry=1; shift ;;
        *) args+=("$1"); shift ;;
    esac
done
run() {  # a command, or its printout under --dry-run
    if [ "$dry" = 1 ]; then printf '%q ' "$@"; echo; else "$@"; fi
}

if [ -z "${SLURM_JOB_ID:-}" ]; then  # the login node: check (also under --dry-run), then submit this script
    check=("$REPO/.venv/bin/python" -m titan_cotrain.config.check --world-size $(( nodes * gpus )) "${args[@]}")
    [ "$dry" = 1 ] && { printf '%q ' "${check[@]}"; echo; }
    (cd "$REPO" && "${check[@]}") || exit $?
    submit=(sbatch --job-name titan_cotrain --nodes "$nodes" --gpus-per-node "$gpus" --time "$time_limit"
            --output "$REPO/outputs/slurm-%j.out" --export "ALL,TITAN_COTRAIN_REPO=$REPO")
    [ -n "$partition" ] && submit+=(--partition "$partition")
    run "${submit[@]}" "$REPO/scripts/launch/slurm.sh" --nodes "$nodes" --gpus-per-node "$gpus" --port "$port" \
        "${args[@]}"
    exit 0
fi

# Inside the allocation.
if command -v scontrol > /dev/null; then
    # The whole list, then its first line: "| head -n 1" would close the pipe early, and under
    # pipefail a SIGPIPE'd scontrol could end the script before it launches anything.
    hosts="$(scontrol show hostnames "$SLURM_JOB_NODELIST")"
    head_node="${hosts%%$'\n'*}"
elif [ "$dry" = 1 ]; then
    head_node="<first node of $SLURM_JOB_NODELIST>"
else
    echo "slurm.sh: scontrol not found: run this inside a Slurm allocation (or submit it from a login node)" >&2
    exit 2
fi
requeue() {
    echo "slurm.sh: SIGUSR1 (time limit or preemption): requeueing job $SLURM_JOB_ID" >&2
    scontrol requeue "$SLURM_JOB_ID"
}
trap requeue USR1
launch=(srun --nodes "$nodes" --ntasks-per-node 1 --kill-on-bad-exit=1
        "$REPO/.venv/bin/torchrun" --nnodes "$nodes" --nproc_per_node "$gpus" --rdzv_backend c10d
        --rdzv_endpoint "$head_node:$port" --rdzv_id "$SLURM_JOB_ID" -m titan_cotrain.train "${args[@]}")
if [ "$dry" = 1 ]; then
    run "${launch[@]}"
    exit 0
fi
cd "$REPO"
"${launch[@]}" &
wait $!  # returns early on SIGUSR1, so the trap runs while the job still holds its nodes
