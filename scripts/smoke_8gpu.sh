#!/usr/bin/env bash
# The CI smoke test of an 8-GPU node (torchrun, NCCL), in one 10-minute slot; exits 1 if a stage
# failed or was not run.
#   bash scripts/smoke_8gpu.sh [--name NAME] [--out DIR] [--budget-s SECONDS] [--wheels DIR] [--cpu]
# Writes two files to DIR (default assets/gpu/), rewritten after every stage (scripts/gpu_stages.sh):
# NAME_smoke_8gpu.json (default NAME: the GPU's name), the report (the machine, the torch and triton
# found, the budget, and per stage its status, seconds, command and key numbers), and
# NAME_smoke_8gpu.tar.gz (the jobs' metrics, the ring's JSON, every stage's log). --wheels DIR: the
# offline wheels of scripts/gpu_wheels.sh, behind the node's own packages; filled with --pipeline,
# since pp_cp_dp and tp_engine import datasets, pyarrow and pandas through torchtitan's pipeline
# module (scripts/gpu_closure.py). The budget (--budget-s,
# default 540 s), not the stage limits, keeps the run in its slot: a stage whose limit is more
# than what is left is "not run: budget". The stages, most valuable first, with their limits in
# seconds on the GPUs (estimates: no GPU run has been made; the report's seconds set the next ones):
#
#   ring       (60)  scripts/ring_check.py: the ring attention at W = 8 (bf16, NCCL) against one GPU.
#                    First because it is the cheapest check that NCCL works across the 8 GPUs, which
#                    every job needs: the process group's start and a few collectives, 10-20 s
# The training stages run the shipped real-scale configs at their widths, cut to a few layers
# ([model] n_layers), with random weights (no hf_path): one warm-start step and 2 RL steps of the
# synthetic arithmetic task (a random policy's rewards within a group are nearly always equal,
# which zeroes its RL gradient; the warm start's is not zero) with the project's tokenizer
# (assets/tokenizer: nothing is downloaded), short rollouts and rows, checkpoints off:
#   fsdp_cp   (180)  qwen3_8b_fsdp_cp.toml, 4 layers: FSDP 2 x CP 4, with --simulate.check_at_start
#                    (every rank runs the scale simulator's check of this job before it starts;
#                    its report, scale_check.json, lands beside the job's measured memory). The
#                    check runs on the host's CPU (a third of the stage in --cpu mode), then
#                    3 steps of 4K-token rows
#   pp_cp_dp  (150)  qwen3_32b_pp_cp.toml, 4 layers: PP 2 x CP 2 x DP 2, Interleaved1F1B (4 stages):
#                    the 32B widths' 4 layers initialised, then 3 steps
#   tp_engine (180)  llama3_70b_pp_cp.toml, 8 layers (Interleaved1F1B over PP 4 is 8 stages): PP 4 x
#                    CP 2, [rollout] tensor_parallel_degree 8 (its layout for one data-parallel
#                    coordinate): the 70B widths' 8 layers, the engine's copy spread over 8 GPUs
# The check at start is on the first job only: every rank simulates in a process of its own, and
# a pipeline job's check (two simulated ranks) takes minutes of CPU.
#
# --cpu: what CI runs (tests/test_gpu_scripts.py): gloo, the same configs and entry points on
# the debug-sized models (qwen3 / llama3 "debugmodel", 4 layers), 128-token rows, 12-token
# responses, in smaller worlds, 8 processes being too many for 2 cores: FSDP 2 x CP 2 (4
# processes; its check at start makes it the slowest stage), PP 2 x CP 2
# (4: the three axes together need 8; PP with DP is tests/test_train.py's), PP 2 with the engine
# tensor-parallel over the 2 stages (2: the debug model has 2 KV heads), the ring at W = 4 in
# fp32. The report goes to --out (default: a new temporary folder), never assets/; the budget is
# 1800 s. Each --cpu limit is at least 3x the stage's seconds on the 2-core machine, which others
# load (the slower of two runs, at load averages 6 and 8, 2026-12-06): ring 15 s, fsdp_cp 140 s,
# pp_cp_dp 44 s, tp_engine 27 s.
set -uo pipefail
CALLER=$PWD
cd "$(dirname "$0")/.."

source scripts/gpu_stages.sh
stages_begin smoke_8gpu _smoke_8gpu "import torch, sys; sys.exit(torch.cuda.device_count() < 8)" \
    "fewer than 8 CUDA devices visible" "$@"

COMMON=(--model.hf_assets_path assets/tokenizer --task.name arithmetic --draft.vocab_size 0 --task.sft_steps 1
        --task.sft_batch_size 8 --training.steps 2 --checkpoint.no-enable --metrics.no-enable_tensorboard
        --draft.prefit_steps 2 --draft.prefit_warmup_steps 1)  # the configs' 50-step prefit, cut to 2
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
    declare -A LIMITS=([ring]=60 [fsdp_cp]=480 [pp_cp_dp]=150 [tp_engine]=90)
else
    COMMON+=(--training.seq_len 4096 --rollout.max_new_tokens 128 --rollout.max_prompt_tokens 256
             --rl.prompts_per_step 16 --rl.group_size 4 --rollout.kv_cache_gib 4)
    FSDP_CP=(8 "$P.data_parallel_shard_degree" 2 "$P.context_parallel_degree" 4)
    PP_CP_DP=(8 "$P.pipeline_parallel_degree" 2 "$P.context_parallel_degree" 2 "$P.data_parallel_shard_degree" 2)
    TP_ENGINE=(8 --model.n_layers 8 "$P.pipeline_parallel_degree" 4 "$P.context_parallel_degree" 2
               "$P.data_parallel_shard_degree" 1 --rollout.tensor_parallel_degree 8)
    RING=(8 --seq-len 4096)
    declare -A LIMITS=([ring]=60 [fsdp_cp]=180 [pp_cp_dp]=150 [tp_engine]=180)
fi

cpu_note() { [ "$CPU" = 1 ] && echo "--cpu: $1"; }  # STAGE_NOTE of a stage: how --cpu mode runs it

job() {  # job STAGE LIMIT CONFIG NPROC FLAGS...: the main job, its metrics kept in the run folder
    local stage=$1 limit=$2 config=$3 nproc=$4
    shift 4
    run_stage "$stage" "$limit" "${TORCHRUN[@]}" --nproc_per_node "$nproc" -m titan_cotrain.train \
        --job.config_file "train_configs/$config" "${COMMON[@]}" --job.dump_folder "$SCRATCH/jobs/$stage" "$@"
    mkdir -p "$RUN/$stage"
    cp "$SCRATCH/jobs/$stage/metrics.jsonl" "$SCRATCH/jobs/$stage/scale_check.json" "$RUN/$stage/" 2> /dev/null
}

STAGE_NOTE=$(cpu_note "W = 4, gloo, fp32") \
    run_stage ring "${LIMITS[ring]}" "${TORCHRUN[@]}" --nproc_per_node "${RING[0]}" scripts/ring_check.py \
        "${RING[@]:1}" --json "$RUN/ring.json"

STAGE_NOTE=$(cpu_note "FSDP 2 x CP 2 (4 processes), the debug-sized Qwen3") \
    job fsdp_cp "${LIMITS[fsdp_cp]}" qwen3_8b_fsdp_cp.toml "${FSDP_CP[@]}" "${FOUR_LAYERS[@]}" --simulate.check_at_start
STAGE_NOTE=$(cpu_note "PP 2 x CP 2 x DP 1 (4 processes), the debug-sized Qwen3") \
    job pp_cp_dp "${LIMITS[pp_cp_dp]}" qwen3_32b_pp_cp.toml "${PP_CP_DP[@]}" "${FOUR_LAYERS[@]}"
STAGE_NOTE=$(cpu_note "PP 2, the engine tensor-parallel over both stages (2 processes), the debug-sized Llama-3") \
    job tp_engine "${LIMITS[tp_engine]}" llama3_70b_pp_cp.toml "${TP_ENGINE[@]}"

stages_end
