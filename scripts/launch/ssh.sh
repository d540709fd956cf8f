#!/usr/bin/env bash
# A multi-node job over ssh: one torchrun per host, rendezvous (c10d) at the first host.
#   bash scripts/launch/ssh.sh --hosts node1,node2 [--gpus-per-node 8] [--port 29500] [--dry-run] \
#       --job.config_file train_configs/qwen3_8b_fsdp_cp.toml [--section.key value ...]
# Every host must see this repository at the same path (a shared file system) with its .venv
# built (bash scripts/setup_env.sh), and reach the first host's port. The config is checked
# once, here, for the whole world (hosts x gpus per node) before anything starts. A job resumes
# from the latest checkpoint in its dump folder: run the same command again after a failure.
# --dry-run checks the config and prints the commands instead of running them.
set -euo pipefail
REPO="$(cd "$(dirname "$0")/../.." && pwd)"
hosts="" gpus=8 port=29500 dry=0 args=()
while [ $# -gt 0 ]; do
    case "$1" in
        --hosts) hosts="$2"; shift 2 ;;
        --gpus-per-node) gpus="$2"; shift 2 ;;
        --port) port="$2"; shift 2 ;;
        --dry-run) dry=1; shift ;;
        *) args+=("$1"); shift ;;
    esac
done
if [ -z "$hosts" ]; then
    echo "ssh.sh: --hosts h1,h2,... is required" >&2; exit 2
fi
IFS=, read -r -a nodes <<< "$hosts"
world=$(( ${#nodes[@]} * gpus ))
run_id="titan_cotrain_$(date +%s)"
check=("$REPO/.venv/bin/python" -m titan_cotrain.config.check --world-size "$world" "${args[@]}")
[ "$dry" = 1 ] && { printf '%q ' "${check[@]}"; echo; }
(cd "$REPO" && "${check[@]}") || exit $?
pids=()
for rank in "${!nodes[@]}"; do
    launch=(cd "$REPO" '&&' "$REPO/.venv/bin/torchrun" --nnodes "${#nodes[@]}" --node_rank "$rank"
            --nproc_per_node "$gpus" --rdzv_backend c10d --rdzv_endpoint "${nodes[0]}:$port" --rdzv_id "$run_id"
            -m titan_cotrain.train)
    remote="$(printf '%q ' "${launch[@]}" | sed 's/\\&\\&/\&\&/')"
    [ ${#args[@]} -gt 0 ] && remote+="$(printf '%q ' "${args[@]}")"
    if [ "$dry" = 1 ]; then
        echo "ssh ${nodes[$rank]} $remote"
    else
        ssh "${nodes[$rank]}" "$remote" &
        pids+=($!)
    fi
done
status=0
for pid in "${pids[@]}"; do
    wait "$pid" || status=$?
done
exit $status
