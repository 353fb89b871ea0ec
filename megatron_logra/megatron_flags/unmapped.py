"""The Megatron-LM flags with no field here: accepted and ignored (with why), accepted only at this trainer's
one value, or refused (with what to use instead).

Plain tables (with :mod:`~megatron_logra.megatron_flags.launch_scripts`' flags of slime's launch scripts), importing
nothing of this project; :func:`~megatron_logra.megatron_flags.neutral_flag` checks
a value of :data:`NEUTRAL_FLAGS`.
"""

from __future__ import annotations

from typing import Any

from megatron_logra.megatron_flags.launch_scripts import (SCRIPT_IGNORED_SWITCHES, SCRIPT_IGNORED_VALUE_FLAGS,
                                                          SCRIPT_NEUTRAL_FLAGS, SCRIPT_REFUSED_SWITCHES,
                                                          SCRIPT_REFUSED_VALUE_FLAGS)
from megatron_logra.megatron_flags.slime import (SLIME_IGNORED_SWITCHES, SLIME_IGNORED_VALUE_FLAGS, SLIME_NEUTRAL_FLAGS,
                                                 SLIME_REFUSED_SWITCHES, SLIME_REFUSED_VALUE_FLAGS)

__all__ = ["IGNORED_SWITCHES", "IGNORED_VALUE_FLAGS", "NEUTRAL_FLAGS", "REFUSED_SWITCHES", "REFUSED_VALUE_FLAGS"]

_FUSIONS_OFF = "megatron-core's fused kernels are always off here (models/gpt.py), so this is already in effect"

IGNORED_SWITCHES: dict[str, str] = {
    "use-mcore-models": "the model is always megatron-core's GPTModel",
    "use-distributed-optimizer": (
        "this trainer keeps the optimizer states whole on every DP rank (it has no sharded optimizer; "
        "`megatron-logra memory --distributed-optimizer` plans Megatron-LM's for comparison)"),
    "group-query-attention": (
        "grouped-query attention follows model.num_query_groups (--num-query-groups N); without it attention "
        "stays multi-head"),
    "use-flash-attn": ("attention is TransformerEngine's fused attention with model.transformer_impl="
                       "transformer_engine, else megatron-core's unfused attention"),
    "use-cpu-initialization": "weights are always initialised on the CPU here (the same at every TP / PP layout)",
    "accumulate-allreduce-grads-in-fp32": (
        "low-precision parameters already accumulate and all-reduce their gradients in fp32 here"),
    "overlap-grad-reduce": "gradients are all-reduced once after the backward pass here (no DDP buckets to overlap)",
    "overlap-param-gather": "this trainer has no sharded optimizer whose parameters would be gathered",
    "log-throughput": "every step's metrics record holds tokens_per_second",
    "attention-softmax-in-fp32": "megatron-core's attention computes its softmax in fp32 here (the default of "
                                 "its TransformerConfig, which models/gpt.py keeps)",
    "no-masked-softmax-fusion": _FUSIONS_OFF,
    "no-bias-gelu-fusion": _FUSIONS_OFF,
    "no-bias-swiglu-fusion": _FUSIONS_OFF,
    "no-bias-dropout-fusion": _FUSIONS_OFF,
    "no-rope-fusion": _FUSIONS_OFF,
    "no-gradient-accumulation-fusion": _FUSIONS_OFF,
    "no-persist-layer-norm": _FUSIONS_OFF,
    **SLIME_IGNORED_SWITCHES,
    **SCRIPT_IGNORED_SWITCHES,
}
"""Megatron-LM switches accepted and ignored, each with why (logged as a warning)."""

IGNORED_VALUE_FLAGS: dict[str, str] = {
    "num-workers": "the training data are generated in the training process (there are no DataLoader workers)",
    "tensorboard-dir": "TensorBoard events go to RUN/tensorboard, RUN being train.run_dir (--save)",
    **SLIME_IGNORED_VALUE_FLAGS,
    **SCRIPT_IGNORED_VALUE_FLAGS,
}
"""Megatron-LM value flags accepted (with their value) and ignored, each with why (logged as a warning)."""

NEUTRAL_FLAGS: dict[str, tuple[type, Any, str]] = {
    "context-parallel-size": (int, 1, "context parallelism is not supported (the layout is TP × PP × DP)"),
    "expert-model-parallel-size": (int, 1, "mixture-of-experts models are not supported (dense GPT only)"),
    "recompute-method": (str, "uniform", "full recompute (--recompute-granularity full) is uniform here"),
    "recompute-num-layers": (int, 1, "full recompute (--recompute-granularity full) recomputes one layer at a time"),
    "rotary-percent": (float, 1.0, "RoPE rotates every channel of a head here"),
    "ckpt-format": (str, "torch_dist", "checkpoints are megatron-core torch_dist checkpoints"),
    "num-steps-per-rollout": (int, 1, "each RL step is one rollout and one optimizer step over its "
                                      "rl.prompts_per_step × rl.group_size sequences"),
    **SLIME_NEUTRAL_FLAGS,
    **SCRIPT_NEUTRAL_FLAGS,
}
"""Megatron-LM value flags accepted (and ignored) at the one value that matches this trainer:
``(type, value, why other values are refused)``."""

REFUSED_SWITCHES: dict[str, str] = {
    "recompute-activations": ("selective recompute is not supported; use --recompute-granularity full "
                              "(model.recompute=full)"),
    "finetune": "to start from a Hugging Face checkpoint give model.hf_path=DIR (job=rl)",
    "no-load-optim": ("a resumed run restores every optimizer state; start a new run (another train.run_dir) to "
                      "start the optimizer afresh"),
    "no-load-rng": "a resumed run restores the RNG states; start a new run (another train.run_dir) instead",
    "use-checkpoint-args": "--resume RUN_DIR already takes the run's saved config (RUN_DIR/config.yaml)",
    **SLIME_REFUSED_SWITCHES,
    **SCRIPT_REFUSED_SWITCHES,
}
"""Megatron-LM switches this trainer cannot honour: refused, with what to do instead."""

_DATA = ("the training data are the job's task: task.datasets (job=rl: reasoning-gym names or jsonl:PATH) or the "
         "synthetic data.* task (job=lm)")
_TOKENIZER = "the tokenizer is tokenizer.path, or model.hf_path's own (job=rl)"

REFUSED_VALUE_FLAGS: dict[str, str] = {
    "data-path": _DATA,
    "train-data-path": _DATA,
    "valid-data-path": _DATA,
    "split": _DATA,
    "tokenizer-type": _TOKENIZER,
    "tokenizer-model": _TOKENIZER,
    "vocab-file": _TOKENIZER,
    "merge-file": _TOKENIZER,
    "eval-iters": "the held-out set is train.eval_sequences sequences (job=lm) or task.num_eval problems (job=rl)",
    "train-samples": ("give the run's length in optimizer steps: --train-iters N (job=lm: train.steps, N = samples / "
                      "--global-batch-size; job=rl: rl.steps, each step training rl.prompts_per_step × "
                      "rl.group_size sequences)"),
    "lr-warmup-samples": "give the warmup in optimizer steps: --lr-warmup-iters N (optimizer.schedule.warmup_steps)",
    "lr-decay-samples": "give the decay in optimizer steps: --lr-decay-iters N (optimizer.schedule.decay_steps)",
    "exit-interval": ("to stop after step N and continue later, give --train-iters N with --lr-decay-iters TOTAL "
                      "(optimizer.schedule.decay_steps keeps the schedule of the whole run), then --resume RUN_DIR "
                      "--train-iters TOTAL; a time limit is --exit-duration-in-mins (train.exit_duration_minutes)"),
    "num-experts": "mixture-of-experts models are not supported (dense GPT only)",
    "num-layers-per-virtual-pipeline-stage": "interleaved (virtual) pipeline schedules are not supported",
    "virtual-pipeline-model-parallel-size": "interleaved (virtual) pipeline schedules are not supported",
    **SLIME_REFUSED_VALUE_FLAGS,
    **SCRIPT_REFUSED_VALUE_FLAGS,
}
"""Megatron-LM value flags this trainer cannot honour: refused, with what to use instead."""
