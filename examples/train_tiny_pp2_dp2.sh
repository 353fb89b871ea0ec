#!/usr/bin/env bash
# LoGRA on the tiny GPT with pipeline parallelism 2 and data parallelism 2 (4 processes).
#   bash examples/train_tiny_pp2_dp2.sh [extra overrides...]
set -euo pipefail
exec torchrun --nproc-per-node 4 -m megatron_logra.cli train lm-tiny \
  --pipeline-model-parallel-size 2 train.run_dir=runs/tiny-pp2-dp2 "$@"
