#!/usr/bin/env bash
# LoGRA on the tiny GPT with tensor parallelism 2 (gloo on CPU, NCCL on GPUs).
#   bash examples/train_tiny_tp2.sh [extra overrides...]
# Env: NPROC (processes, default 2). DP = NPROC / (TP x PP).
set -euo pipefail
NPROC="${NPROC:-2}"
exec torchrun --nproc-per-node "$NPROC" -m megatron_logra.cli train lm-tiny \
  --tensor-model-parallel-size 2 train.run_dir=runs/tiny-tp2 "$@"
