#!/usr/bin/env bash
# The CI smoke test of an 8-GPU node (torchrun, NCCL), at most 10 minutes; exits 1 on any failure.
#   bash scripts/smoke_8gpu.sh [--name NAME] [--out DIR] [--cpu]
# Each stage runs under its own timeout (seconds below), and the next one runs whatever it
# did. Writes DIR/NAME_smoke_8gpu.json (default assets/gpu/<the GPU's name>_smoke_8gpu.json:
# the machine and per stage its status, seconds, command and key numbers) and
# DIR/NAME_smoke_8gpu/ (the jobs' metrics, the ring's JSON, every stage's log); the jobs'
# dump folders go to a temporary folder, removed at the end.
#
# The training stages run the shipped real-scale configs at their widths, cut to a few layers
# ([model] n_layers), with random weights (no hf_path): one warm-start step and 2 RL steps of the
# synthetic arithmetic task (a random policy's rewards within a group are nearly always equal,
# which zeroes its RL gradient; the warm start's is not zero) with the project's tokenizer
# (assets/tokenizer: nothing is downloaded), short rollouts and rows, checkpoints off:
#   fsdp_cp   (180)  qwen3_8b_fsdp_cp.toml, 4 layers: FSDP 2 x CP 4, with --simulate.check_at_start
#                    (every rank runs the scale simulator's check of this job before it starts;
#                    its report, scale_check.json, lands beside the job's measured memory)
#   pp_cp_dp  (150)  qwen3_32b_pp_cp.toml, 4 layers: PP 2 x CP 2 x DP 2, Interleaved1F1B (4 stages)
#   tp_engine (180)  llama3_70b_pp_cp.toml, 8 layers (Interleaved1F1B over PP 4 is 8 stages): PP 4 x
#                    CP 2, [rollout] tensor_parallel_degree 8 (its layout for one data-parallel
#                    coordinate)
#   ring       (60)  scripts/ring_check.py: the ring attention at W = 8 (bf16, NCCL) against one GPU
# The check at start is on the first job only: every rank simulates in a process of its own, and
# a pipeline job's check (two simulated ranks) takes minutes of CPU.
#
# --cpu: what CI runs (tests/test_gpu_scripts.py): gloo, the same configs and entry points on
# the debug-sized models (qwen3 / llama3 "debugmodel", 4 layers), 128-token rows, 12-token
# responses, in smaller worlds, 8 processes being too many for 2 cores: FSDP 2 x CP 2 (4
# processes; its check at start makes it the slowest stage, about 100 s on 2 cores), PP 2 x CP 2
# (4: the three axes together need 8; PP with DP is tests/test_train.py's), PP 2 with the engine
# tensor-parallel over the 2 stages (2: the debug model has 2 KV heads), the ring at W = 4 in
# fp32. The report goes to --out (default: a new temporary folder), never assets/.
set -uo pipefail
CALLER=$PWD
cd "$(dirname "$0")/.."

source scripts/gpu_stages.sh
stages_begin smoke_8gpu _smoke_8gpu "import torch, sys; sys.exit(torch.cuda.device_count() < 8)" \
    "fewer than 8 CUDA devices visible" "$@"

COMMON=(--model.hf_assets_path assets/tokenizer --task.name arithmetic --draft.vocab_size 0 --task.sft_steps 1
        --task.sft_batch_size 8 --training.steps 2 --checkpoint.no-enable --metrics.no-enable_tensorboard)
FOUR_LAYERS=(--model.n_layers 4 --draft.tap_layers 0 1 2)  # EAGLE-3's default taps need 7 layers
P=--parallelism
if [ "$CPU" = 1 ]; then
    COMMON+=(--model.flavor debugmodel --training.seq_len 128 --rollout.max_new_tokens 12
             --rollout.max_prompt_tokens 64 --rl.prompts_per_step 4 --rl.group_size 2 --rollout.kv_cache_gib 0)
    FSDP_CP=(4 "$P.data_parallel_shard_degree" 2 "$P.context_parallel_degree" 2)
    PP_CP_DP=(4 "$P.pipeline_parallel_degree" 2 "$P.context_parallel_degree" 2 "$P.data_parallel_shard_degree" 1)
    TP_ENGINE=(2 "${FOUR_LAYERS[@]}" "$P.pipeline_parallel_degree" 2 "$P.context_parallel_degree" 1
               "$P.data_parallel_shard_degree" 1 --rollout.tensor_parallel_degree 2)
    RING=(4 --seq-len 1000)
else
    COMMON+=(--training.seq_len 4096 --rollout.max_new_tokens 128 --rollout.max_prompt_tokens 256
             --rl.prompts_per_step 16 --rl.group_size 4 --rollout.kv_cache_gib 4)
    FSDP_CP=(8 "$P.data_parallel_shard_degree" 2 "$P.context_parallel_degree" 4)
    PP_CP_DP=(8 "$P.pipeline_parallel_degree" 2 "$P.context_parallel_degree" 2 "$P.data_parallel_shard_degree" 2)
    TP_ENGINE=(8 --model.n_layers 8 "$P.pipeline_parallel_degree" 4 "$P.context_parallel_degree" 2
               "$P.data_parallel_shard_degree" 1 --rollout.tensor_parallel_degree 8)
    RING=(8 --seq-len 4096)
fi

cpu_note() { [ "$CPU" = 1 ] && echo "--cpu: $1"; }  # STAGE_NOTE of a stage: how --cpu mode runs it

job() {  # job STAGE LIMIT CONFIG NPROC FLAGS...: the main job, its metrics kept in the run folder
    local stage=$1 limit=$2 config=$3 nproc=$4
    shift 4
    run_stage "$stage" "$limit" "${TORCHRUN[@]}" --nproc_per_node "$nproc" -m titan_cotrain.train \
        --job.config_file "train_configs/$config" "${COMMON[@]}" --job.dump_folder "$SCRATCH/$stage" "$@"
    mkdir -p "$RUN/$stage"
    cp "$SCRATCH/$stage/metrics.jsonl" "$SCRATCH/$stage/scale_check.json" "$RUN/$stage/" 2> /dev/null
}

STAGE_NOTE=$(cpu_note "FSDP 2 x CP 2 (4 processes), the debug-sized Qwen3") \
    job fsdp_cp 180 qwen3_8b_fsdp_cp.toml "${FSDP_CP[@]}" "${FOUR_LAYERS[@]}" --simulate.check_at_start
STAGE_NOTE=$(cpu_note "PP 2 x CP 2 x DP 1 (4 processes), the debug-sized Qwen3") \
    job pp_cp_dp 150 qwen3_32b_pp_cp.toml "${PP_CP_DP[@]}" "${FOUR_LAYERS[@]}"
STAGE_NOTE=$(cpu_note "PP 2, the engine tensor-parallel over both stages (2 processes), the debug-sized Llama-3") \
    job tp_engine 180 llama3_70b_pp_cp.toml "${TP_ENGINE[@]}"
STAGE_NOTE=$(cpu_note "W = 4, gloo, fp32") \
    run_stage ring 60 "${TORCHRUN[@]}" --nproc_per_node "${RING[0]}" scripts/ring_check.py "${RING[@]:1}" \
        --json "$RUN/ring.json"

"$PYTHON" scripts/gpu_report.py write --run "$RUN" --out "$OUT/$NAME.json" --script smoke_8gpu \
    $([ "$CPU" = 1 ] && echo --cpu) || FAILED+=(report)
if [ ${#FAILED[@]} -gt 0 ]; then
    echo "smoke_8gpu: failed: ${FAILED[*]}" >&2
    exit 1
fi
