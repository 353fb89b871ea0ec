#!/usr/bin/env bash
# LoGRA RL of Qwen2.5-7B over several nodes (recipe qwen2.5-7b: TP 4 inside a node, DP across the
# rest, full recompute, rank 128, paper recipe with predicted-KL step control).
#
# Run the same command on every node, changing only NODE_RANK:
#   NNODES=2 NODE_RANK=0 MASTER_ADDR=10.0.0.1 MASTER_PORT=29500 HF_PATH=/ckpt/Qwen2.5-7B-Instruct \
#     bash examples/train_7b_multinode.sh [extra overrides...]
# Under Slurm, one task per node (torchrun starts the GPUs' processes) from an sbatch script:
#   #SBATCH --nodes=2 --ntasks-per-node=1 --gpus-per-node=8 --exclusive
#   HF_PATH=/ckpt/Qwen2.5-7B-Instruct srun bash examples/train_7b_multinode.sh [extra overrides...]
# (srun bash, not sbatch on this file: sbatch runs a copy from its spool directory, without gpu_impl.bash)
#
# Env:
#   NNODES         number of nodes (required; under Slurm default SLURM_NNODES)
#   NODE_RANK      this node's index, 0 .. NNODES-1 (required; under Slurm default SLURM_NODEID)
#   MASTER_ADDR    address of node 0, reachable from every node (required; under Slurm default the
#                  job's first host, from scontrol show hostnames)
#   MASTER_PORT    a free TCP port on node 0 (default 29500)
#   GPUS_PER_NODE  processes per node (default 8); world = NNODES x GPUS_PER_NODE, DP = world / TP
#   HF_PATH        local Hugging Face checkpoint on every node (same path); required
#   RUN_DIR        run directory, on storage every node can write (default runs/qwen2_5-7b)
#   IMPL / FP8     as in examples/train_27b_8gpu.sh (FP8 alone selects IMPL=transformer_engine)
#   DATA / EVAL_DATA  task.datasets / task.eval_datasets, as in examples/train_27b_8gpu.sh (same paths on every node)
set -euo pipefail
if [[ -n "${SLURM_JOB_ID:-}" ]]; then
  NNODES="${NNODES:-${SLURM_NNODES:-}}" NODE_RANK="${NODE_RANK:-${SLURM_NODEID:-}}"
  if [[ -z "${MASTER_ADDR:-}" && -n "${SLURM_JOB_NODELIST:-}" ]]; then
    MASTER_ADDR="$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)"
  fi
fi
: "${NNODES:?set NNODES}" "${NODE_RANK:?set NODE_RANK}" "${MASTER_ADDR:?set MASTER_ADDR}"
: "${HF_PATH:?set HF_PATH to a local Hugging Face checkpoint directory}"
MASTER_PORT="${MASTER_PORT:-29500}"
GPUS_PER_NODE="${GPUS_PER_NODE:-8}"
RUN_DIR="${RUN_DIR:-runs/qwen2_5-7b}"
source "$(dirname "$0")/gpu_impl.bash"
gpu_impl_args 1
exec torchrun --nnodes "$NNODES" --node-rank "$NODE_RANK" --master-addr "$MASTER_ADDR" \
  --master-port "$MASTER_PORT" --nproc-per-node "$GPUS_PER_NODE" -m megatron_logra.cli train qwen2.5-7b \
  --model.hf_path "$HF_PATH" train.run_dir="$RUN_DIR" ${EXTRA[@]+"${EXTRA[@]}"} "$@"
