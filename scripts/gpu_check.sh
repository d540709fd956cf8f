#!/usr/bin/env bash
# The first checks on one GPU (an H100 or H200), at most 8 minutes in all.
#   bash scripts/gpu_check.sh [--name NAME] [--out DIR] [--cpu]
# Each stage runs under its own timeout (seconds below); a stage that fails or times out is
# recorded and the next one runs; the script exits 1 if any stage failed. It writes
# DIR/NAME.json (default assets/gpu/<the GPU's name, slugified, e.g. h200>.json: the device,
# torch, CUDA, the date, and per stage its status, seconds, command and key numbers, by
# scripts/gpu_report.py), and DIR/NAME/ (the benchmarks' JSONs and plots, the jobs' metrics,
# every stage's log). The jobs' dump folders (checkpoints off, exports on) go to a temporary
# folder, removed at the end.
#
#   pytest_gpu              (70)  pytest tests/gpu: kernels, ring and engine on CUDA in bf16
#   main_job               (120)  the main job on one GPU (torchrun, 1 process): a Qwen3-0.6B-shaped
#                                 random policy, bf16, compiled ([compile] enable), 4 warm-start
#                                 and 3 RL steps of the arithmetic task (train_configs/debug_cpu.toml
#                                 with overrides); KV blocks of 256 (the paged flash kernel's)
#   bench_rollout_eager     (60)  bench_rollout.py on CUDA: batch 1, 8, 64; plain vs speculative
#                                 (k 2/4/6 and adaptive, untrained and trained draft); KV blocks of 256
#   bench_rollout_compiled (110)  the same with the compiled engine (CUDA graphs), k = 4 only
#                                 (one graph per k, each compiled cold)
#   bench_compile           (70)  bench_compile.py on CUDA: co-training step and decoding, eager vs compiled
#   branch_memory           (40)  bench_branch_memory.py on CUDA: branch attention forward + backward,
#                                 peak memory and time, 8K-128K tokens, against the dense baseline
#
# --cpu: what CI runs (tests/test_gpu_scripts.py): the same entry points on CPU at tiny shapes,
# the stages that need CUDA skipped ("skipped: needs CUDA" in the JSON); the report goes to --out
# (default: a new temporary folder), never assets/. Differences, each noted in the JSON: the
# main job on the debug-sized Qwen3 and eager (compiling it takes minutes on 2 cores;
# tests/test_train.py runs a compiled job); bench_compile's co-training step only (decoding's
# graphs are CUDA graphs' business; tests/engine/test_acceptance.py compiles the engine on CPU);
# pytest_gpu and bench_rollout_compiled skipped (tests/gpu skip themselves without a GPU in
# the suite's own run).
set -uo pipefail
CALLER=$PWD
cd "$(dirname "$0")/.."

source scripts/gpu_stages.sh
stages_begin gpu_check "" "import torch, sys; sys.exit(not torch.cuda.is_available())" \
    "no CUDA device visible" "$@"

# -- pytest_gpu
if [ "$CPU" = 1 ]; then
    skip_stage pytest_gpu "$PYTHON" -m pytest -q tests/gpu
else
    run_stage pytest_gpu 70 "$PYTHON" -m pytest -q tests/gpu --junitxml "$RUN/pytest_gpu.xml"
fi

# -- main_job
JOB=(--job.config_file train_configs/debug_cpu.toml --model.name qwen3 --training.mixed_precision_param bfloat16
     --rollout.kv_block_size 256 --checkpoint.no-enable --metrics.no-enable_tensorboard
     --job.dump_folder "$SCRATCH/main_job")
if [ "$CPU" = 1 ]; then
    STAGE_NOTE="--cpu: the debug-sized Qwen3, eager, 2 + 2 steps of 2 x 4 short rollouts" \
    run_stage main_job 90 "${TORCHRUN[@]}" --nproc_per_node 1 -m titan_cotrain.train "${JOB[@]}" \
        --model.flavor debugmodel --task.sft_steps 2 --task.sft_batch_size 8 --training.steps 2 \
        --rl.prompts_per_step 2 --rl.group_size 4 --rollout.max_new_tokens 16 --training.seq_len 64
else
    run_stage main_job 120 "${TORCHRUN[@]}" --nproc_per_node 1 -m titan_cotrain.train "${JOB[@]}" \
        --model.flavor 0.6B --compile.enable --task.sft_steps 4 --training.steps 3
fi
mkdir -p "$RUN/main_job"
cp "$SCRATCH/main_job/metrics.jsonl" "$RUN/main_job/" 2> /dev/null

# -- bench_rollout_eager, bench_rollout_compiled
ROLLOUT=("$PYTHON" scripts/bench_rollout.py)
EAGER=(--json "$RUN/bench_rollout_eager.json" --png "$RUN/bench_rollout_eager.png")
COMPILED=(--json "$RUN/bench_rollout_compiled.json" --png "$RUN/bench_rollout_compiled.png" --compile --ks 4
          --no-adaptive)
if [ "$CPU" = 1 ]; then
    STAGE_NOTE="--cpu: 16 new tokens, 1 repeat, target and draft fitted for 10 steps" \
    run_stage bench_rollout_eager 90 "${ROLLOUT[@]}" "${EAGER[@]}" --new-tokens 16 --repeats 1 \
        --target-steps 10 --draft-steps 10 --adaptive-warmup 1
    skip_stage bench_rollout_compiled "${ROLLOUT[@]}" "${COMPILED[@]}" --device cuda
else
    GPU_ROLLOUT=(--device cuda --kv-block-size 256 --repeats 3 --new-tokens 64)
    run_stage bench_rollout_eager 60 "${ROLLOUT[@]}" "${EAGER[@]}" "${GPU_ROLLOUT[@]}"
    run_stage bench_rollout_compiled 110 "${ROLLOUT[@]}" "${COMPILED[@]}" "${GPU_ROLLOUT[@]}"
fi

# -- bench_compile
COMPILE=(scripts/bench_compile.py --json "$RUN/bench_compile.json" --png "$RUN/bench_compile.png")
if [ "$CPU" = 1 ]; then
    STAGE_NOTE="--cpu: the co-training step only, 2 rows of 64 tokens, 1 repeat" \
    run_stage bench_compile 90 "$PYTHON" "${COMPILE[@]}" --parts cotrain_step --rows 2 --seq-len 64 --repeats 1
else
    run_stage bench_compile 70 "$PYTHON" "${COMPILE[@]}" --device cuda
fi

# -- branch_memory
MEMORY=(scripts/bench_branch_memory.py --json "$RUN/branch_memory.json" --png "$RUN/branch_memory.png")
if [ "$CPU" = 1 ]; then
    STAGE_NOTE="--cpu: packed rows of 512-token documents, 1K-4K tokens, a fresh process per point" \
    run_stage branch_memory 90 "$PYTHON" "${MEMORY[@]}" --layouts packed --seq-lens 1024 2048 4096 \
        --fit-from 2048 --doc-len 512
else
    run_stage branch_memory 40 "$PYTHON" "${MEMORY[@]}" --device cuda --repeats 3 \
        --seq-lens 8192 16384 32768 65536 131072 --fit-from 8192 --naive-budget-gb 60
fi

"$PYTHON" scripts/gpu_report.py write --run "$RUN" --out "$OUT/$NAME.json" --script gpu_check \
    $([ "$CPU" = 1 ] && echo --cpu) || FAILED+=(report)
if [ ${#FAILED[@]} -gt 0 ]; then
    echo "gpu_check: failed: ${FAILED[*]}" >&2
    exit 1
fi
