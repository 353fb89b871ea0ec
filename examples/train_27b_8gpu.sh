#!/usr/bin/env bash
# LoGRA RL of a 27B-class model on one 8-GPU node (recipe 27b: TP 8, full recompute, rank 128,
# fp32 masters, paper recipe with predicted-KL step control; see docs/memory.md for the memory plan).
#
#   HF_PATH=/ckpt/Qwen3-32B bash examples/train_27b_8gpu.sh [extra overrides...]
#
# The recipe's shapes are Gemma-3-27B's sizes (for the memory plan), but Gemma checkpoints are not
# supported (its (1+w) norms, GeGLU, embedding scale and sliding windows are refused by name): give a
# Llama / Qwen2 / Qwen3 checkpoint of this class; its config.json replaces the recipe's shapes, so
# plan it first with the memory command below.
#
# Env:
#   HF_PATH   local Hugging Face checkpoint (config.json, safetensors, tokenizer); required
#   GPUS      processes on this node (default 8); DP = GPUS / TP
#   RUN_DIR   run directory (default runs/27b)
#   IMPL      local (default: forward-mode KL probe) or transformer_engine (TE spec with
#             sequence parallelism; the KL probe runs by finite differences, kl.probe=auto)
#   FP8       hybrid or e4m3 FP8 training GEMMs (H100 / H200); TE only: FP8 alone selects
#             IMPL=transformer_engine, FP8 with IMPL=local is refused
#   DATA      task.datasets (jsonl:/data/train.jsonl, parquet:..., reasoning-gym names; comma-separated)
#   EVAL_DATA task.eval_datasets: held-out benchmarks of their own (jsonl:/data/math500.jsonl, ...)
# Check the plan first (the recipe's micro-batch, engine share and frozen non-targets on 80 GB GPUs; the
# run's own preflight plans the same):
#   megatron-logra memory --model "$HF_PATH/config.json" --tp 8 --gpus 8 --micro-batch 2 --seq-len 4096 \
#     --rank 128 --recompute full --engine-fraction 0.3 --gpu-memory 81559MiB --freeze-native --compare
set -euo pipefail
: "${HF_PATH:?set HF_PATH to a local Hugging Face checkpoint directory}"
GPUS="${GPUS:-8}"
RUN_DIR="${RUN_DIR:-runs/27b}"
source "$(dirname "$0")/gpu_impl.bash"
gpu_impl_args 1
exec torchrun --standalone --nproc-per-node "$GPUS" -m megatron_logra.cli train 27b \
  --model.hf_path "$HF_PATH" train.run_dir="$RUN_DIR" ${EXTRA[@]+"${EXTRA[@]}"} "$@"
