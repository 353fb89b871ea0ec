#!/usr/bin/env bash
# LoGRA RL of Qwen2.5-1.5B on one GPU (recipe qwen2.5-1.5b: TP 1, micro-batch 4 x 4096 tokens, full
# recompute, rank 128, paper recipe with predicted-KL step control, an in-process SGLang engine with 30%
# of the GPU). With GPUS=8 the same recipe runs data-parallel on a node.
# Memory plan of one 80 GB GPU (the run's own preflight prints the same; 8 x 4096 would be OOM by 1.1%):
#   megatron-logra memory --model qwen2.5-1.5b --tp 1 --gpus 1 --micro-batch 4 --seq-len 4096 --rank 128 \
#     --recompute full --engine-fraction 0.3 --gpu-memory 81559MiB --optimizer logra --freeze-native
#   -> 57.94 GiB of 79.65 GiB, fit (+27.3% headroom)
#
#   HF_PATH=/ckpt/Qwen2.5-1.5B-Instruct bash examples/train_1.5b_1gpu.sh [extra overrides...]
#
# Env: HF_PATH (required), GPUS (default 1), RUN_DIR (default runs/qwen2_5-1.5b),
#      IMPL / FP8 as in examples/train_27b_8gpu.sh (FP8 alone selects IMPL=transformer_engine),
#      DATA / EVAL_DATA: task.datasets / task.eval_datasets (examples/gpu_impl.bash).
set -euo pipefail
: "${HF_PATH:?set HF_PATH to a local Hugging Face checkpoint directory}"
GPUS="${GPUS:-1}"
RUN_DIR="${RUN_DIR:-runs/qwen2_5-1.5b}"
source "$(dirname "$0")/gpu_impl.bash"
gpu_impl_args 0
exec torchrun --standalone --nproc-per-node "$GPUS" -m megatron_logra.cli train qwen2.5-1.5b \
  --model.hf_path "$HF_PATH" train.run_dir="$RUN_DIR" ${EXTRA[@]+"${EXTRA[@]}"} "$@"
