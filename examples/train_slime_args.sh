#!/usr/bin/env bash
# A slime launch script's arguments, kept as its bash arrays, on this trainer: LoGRA RL of Qwen2.5-1.5B with
# slime's GRPO settings (the arrays of slime's scripts/run-qwen3-4B.sh, sized for the qwen2.5-1.5b recipe's
# 4096-token sequences). Each slime flag is applied, accepted with a logged reason, or refused naming what to use
# (docs/usage.md, "slime launch lines"); what differs from slime's own script is marked below.
#
#   HF_PATH=/ckpt/Qwen2.5-1.5B-Instruct DATA=/data/dapo-math-17k.jsonl EVAL_DATA=/data/aime-2024.jsonl \
#     bash examples/train_slime_args.sh [extra overrides...]
#
# Env: HF_PATH, DATA (a JSONL of prompt / label rows) required; EVAL_DATA (held-out benchmark, optional);
#      GPUS (default 1), RUN_DIR (default runs/slime-args).
set -euo pipefail
: "${HF_PATH:?set HF_PATH to a local Hugging Face checkpoint directory}"
: "${DATA:?set DATA to a JSONL file of prompt / label rows}"
GPUS="${GPUS:-1}"
RUN_DIR="${RUN_DIR:-runs/slime-args}"

# slime's --hf-checkpoint / --ref-load / --load: the Hugging Face checkpoint gives the architecture, tokenizer,
# initial and reference weights at once (model.hf_path); --save is the run directory, resumed with --load RUN_DIR
CKPT_ARGS=(--model.hf_path "$HF_PATH" --save "$RUN_DIR" --save-interval 20)

# slime's --prompt-data PATH is task.datasets=jsonl:PATH
ROLLOUT_ARGS=(
  task.datasets="jsonl:$DATA"
  --input-key prompt --label-key label --apply-chat-template --rollout-shuffle --rm-type deepscaler
  --num-rollout 3000 --rollout-batch-size 32 --n-samples-per-prompt 8
  --rollout-max-response-len 3072 --rollout-temperature 0.8
  --global-batch-size 256 --balance-data
)

# slime's --eval-prompt-data NAME PATH is task.eval_datasets=jsonl:PATH
EVAL_ARGS=(
  --eval-interval 20 --n-samples-per-eval-prompt 16 --eval-temperature 0.8
  --eval-max-response-len 3584 --eval-top-p 0.7
)
if [[ -n "${EVAL_DATA:-}" ]]; then EVAL_ARGS+=(task.eval_datasets="jsonl:$EVAL_DATA"); fi

PERF_ARGS=(
  --tensor-model-parallel-size 1 --pipeline-model-parallel-size 1 --context-parallel-size 1
  --expert-model-parallel-size 1 --expert-tensor-parallel-size 1
  --recompute-granularity full --recompute-method uniform --recompute-num-layers 1
  --use-dynamic-batch-size --max-tokens-per-gpu 9216
)

GRPO_ARGS=(
  --advantage-estimator grpo --use-kl-loss --kl-loss-coef 0.00 --kl-loss-type low_var_kl
  --entropy-coef 0.00 --eps-clip 0.2 --eps-clip-high 0.28
)

# slime's OPTIMIZER_ARGS (--optimizer adam --lr 1e-6 ...) are dense Adam's: this recipe trains with LoGRA, its
# steps sized by the predicted-KL controller (optimizer.logra.update_ratio, kl.*); --optimizer adam would run dense
# AdamW (with native.freeze=false kl.mode=none)

SGLANG_ARGS=(--rollout-num-gpus-per-engine 1 --sglang-mem-fraction-static 0.3)

MISC_ARGS=(--attention-dropout 0.0 --hidden-dropout 0.0 --accumulate-allreduce-grads-in-fp32 --attention-softmax-in-fp32)

CLUSTER_ARGS=(--actor-num-nodes 1 --actor-num-gpus-per-node "$GPUS" --colocate)

exec torchrun --standalone --nproc-per-node "$GPUS" -m megatron_logra.cli train qwen2.5-1.5b \
  "${CKPT_ARGS[@]}" "${ROLLOUT_ARGS[@]}" "${EVAL_ARGS[@]}" "${PERF_ARGS[@]}" "${GRPO_ARGS[@]}" "${SGLANG_ARGS[@]}" \
  "${MISC_ARGS[@]}" "${CLUSTER_ARGS[@]}" "$@"
