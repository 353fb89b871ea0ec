"""slime's flags accepted without effect here: each with why (logged as a warning when given).

They are merged into :data:`~megatron_logra.megatron_flags.IGNORED_SWITCHES` /
:data:`~megatron_logra.megatron_flags.IGNORED_VALUE_FLAGS` (through :mod:`~megatron_logra.megatron_flags.slime`),
so a pasted slime launch line keeps them. A flag lands here only where it changes nothing this trainer trains:
placement and Ray's transport of rollouts (the trainer and its in-process engine share the GPUs), logging, debug
dumps and profiling, speed or memory only, a setting already in effect here, or a flag slime reads only together
with a feature this trainer refuses (``--opsm-delta`` without ``--use-opsm``: given with it, that switch is
refused). Plain tables, importing nothing of this project.
"""

from __future__ import annotations

__all__ = ["SLIME_IGNORED_SWITCHES", "SLIME_IGNORED_VALUE_FLAGS", "ONE_STEP", "COLOCATED"]

ONE_STEP = ("each RL step is one rollout and one optimizer step over its rl.prompts_per_step × rl.group_size "
            "sequences")
COLOCATED = ("the in-process SGLang engine runs on the trainer's own GPUs (rl.rollout.mem_fraction_static of each, "
             "--sglang-mem-fraction-static; `megatron-logra memory --engine-fraction` plans the rest)")
_GPUS = "the trainer's GPUs are torchrun's (--nnodes × --nproc-per-node), and " + COLOCATED
_SPEED = ("every DP rank trains rl.prompts_per_step / DP whole groups of the step; there is no token balancing "
          "across DP ranks, which changes speed only")
_QUEUE = ("rollouts are generated in the training process and handed to the trainer in memory; slime's Ray / "
          "straw rollout transport and its storage do not exist here")
_HEALTH = ("the in-process engine is part of the training process (a failed engine fails the run, which --resume "
           "RUN_DIR continues); there are no engine health checks or recovery to tune")
_SYNC = ("the engine receives each step's weights as sync.* says (sync.mode delta: LoGRA's factors, full: a dense "
         "refit; in process, or files in sync.directory with sync.transport=directory); slime's weight-sync "
         "transport settings have no counterpart")
_LOG = ("every step's record goes to RUN/metrics.jsonl (and TensorBoard, W&B with --wandb-project); "
        "rl.log_samples=N writes the first N rollouts of each step and evaluation to RUN/samples.jsonl")
_DUMP = "rollout and train data dumps are not written: " + _LOG
_MEMORY = ("memory snapshots are not recorded: profile.enabled=true profile.profile_memory=true records memory in "
           "the torch profiler's trace, and `megatron-logra memory` plans a layout's memory")
_CI = "slime's CI checks have no counterpart (the tests of this trainer are its own)"
_BUFFER = "read by slime's external rollout buffer only (--rollout-buffer-url, refused): " + _QUEUE
_MOE = "read for mixture-of-experts models only, which are not supported (dense GPT only)"
_NO_CRITIC = ("read by slime's ppo and reinforce_plus_plus estimators only (a value critic, discounted returns), "
              "which this trainer does not have; GRPO's advantages are the group-normalised sequence rewards")


def _only_with(flag: str) -> str:
    return f"slime reads it only with {flag}, which this trainer refuses (given with it, {flag} is reported)"


SLIME_IGNORED_SWITCHES: dict[str, str] = {
    "rollout-shuffle": "the prompt stream draws its prompts at random already (seeded by task.seed, --rollout-seed)",
    "colocate": "this is already in effect: " + COLOCATED,
    "offload": ("the trainer keeps its weights on the GPU while the engine generates (LoGRA's optimizer state is a "
                "few percent of dense Adam's); " + COLOCATED),
    "offload-train": "the trainer keeps its weights on the GPU while the engine generates; " + COLOCATED,
    "offload-rollout": "the engine keeps its weights on the GPU while the trainer steps; " + COLOCATED,
    "no-offload-train": "this is already in effect: the trainer keeps its weights on the GPU while the engine generates",
    "no-offload-rollout": "this is already in effect: the engine keeps its weights on the GPU while the trainer steps",
    "balance-data": _SPEED,
    "balance-by-flops": _SPEED + " (micro-batches: rl.max_tokens_per_micro_batch, --max-tokens-per-gpu)",
    "calculate-per-token-loss": ("this is already in effect: the loss is summed over the completion tokens and "
                                 "divided by the step's token count over every DP rank"),
    "use-rollout-logprobs": ("this is already in effect: the importance weight (rl.loss.kind=tis) and the PPO "
                             "ratio (rl.loss.kind=ppo) are taken against the rollout engine's log-probs"),
    "keep-old-actor": ONE_STEP + ", so no old actor is kept: the rollout engine's log-probs are π_old",
    "rollout-global-dataset": "the prompt stream is one dataset for the whole run already (task.datasets)",
    "log-passrate": ("this is already in effect: every step's record holds pass_at_group, slime's pass@n of the step's groups (n = rl.group_size, "
                     "--n-samples-per-prompt): the share of its prompts with a correct sample; accuracy is the "
                     "share of correct samples"),
    "rollout-skip-special-tokens": ("this is already in effect: the completion text a reward sees is decoded "
                                    "without special tokens (the token ids trained on keep them)"),
    "skip-eval-before-train": ("the held-out evaluation before the first step (the baseline of eval_accuracy) is "
                               "always run; it changes no weight"),
    "recompute-loss-function": ("memory only: the logits are turned into log-probs in chunks of "
                                "rl.loss.logprob_chunk_tokens tokens (--log-probs-chunk-size)"),
    "allgather-cp": "context parallelism is not supported (--context-parallel-size 1), so there is no CP exchange",
    "update-weight-disk-keep-files": _SYNC,
    "buffer-sort-by-staleness": ("there is no buffer of older rollouts: " + ONE_STEP
                                 + ", each step's rollouts generated by the current policy"),
    "mask-offpolicy-in-partial-rollout": _only_with("--partial-rollout"),
    "rollout-queue-online-gc": _QUEUE,
    "use-fault-tolerance": _HEALTH,
    "async-save": "only speed differs: a checkpoint holds the same state either way",
    "record-memory-history": _MEMORY,
    "check-weight-update-equal": ("this is already in effect: sync.check_interval compares the trainer's and the "
                                  "engine's weight fingerprints (every weight version by default)"),
    "use-distributed-post": "the reward server (--rm-url) is called from every DP rank for its own completions",
    "use-tensorboard": "this is already in effect: TensorBoard events go to RUN/tensorboard (tensorboard installed)",
    "disable-wandb-random-suffix": ("this is already in effect: the W&B run's name is train.wandb_exp_name "
                                    "(--wandb-exp-name) or the run directory's name, without a suffix"),
    "wandb-always-use-train-step": ONE_STEP + ", so the rollout and train step counts are the same",
    "use-rollout-entropy": ("this is already in effect: the entropy is computed with the log-probs, and every step's "
                            "record holds entropy (the policy's mean token entropy over the loss tokens)"),
    "get-mismatch-metrics": ("this is already in effect: every step's record holds mismatch, the estimated log-prob "
                             "gap between the rollout engine and the trainer"),
    "log-multi-turn": "rollouts are single-turn here; there are no turns to log",
    "log-correct-samples": _LOG,
    "ci-test": _CI,
    "ci-disable-kl-checker": _CI,
}
"""slime switches accepted and ignored, each with why (logged as a warning)."""

SLIME_IGNORED_VALUE_FLAGS: dict[str, str] = {
    "actor-num-nodes": _GPUS,
    "actor-num-gpus-per-node": _GPUS,
    "num-gpus-per-node": _GPUS,
    "rollout-num-gpus": _GPUS,
    "log-probs-max-tokens-per-gpu": ("the log-probs are computed in the training micro-batches (rl.micro_batch_size "
                                     "sequences, or rl.max_tokens_per_micro_batch positions: --max-tokens-per-gpu), "
                                     "their logits turned into log-probs in chunks of "
                                     "rl.loss.logprob_chunk_tokens tokens"),
    "model-name": "the Hugging Face names of the weights follow model.hf_path's config.json",
    "qwen-gdn-backend": "it chooses the kernels of Qwen linear-attention (gated delta net) layers, which the models "
                        "here do not have",
    "update-weight-mode": _SYNC,
    "update-weight-transport": _SYNC,
    "update-weight-disk-dir": _SYNC,
    "update-weight-delta-encoding": _SYNC,
    "update-weight-delta-checksum": _SYNC,
    "update-weight-local-checkpoint-dir": _SYNC,
    "update-weight-buffer-size": _SYNC,
    "custom-rollout-log-function-path": "custom logging functions are not called: " + _LOG,
    "custom-eval-rollout-log-function-path": "custom logging functions are not called: " + _LOG,
    "rollout-data-transport": _QUEUE,
    "rollout-data-dir": _QUEUE,
    "rollout-storage-profile": _QUEUE,
    "rollout-storage-declaration": _QUEUE,
    "rollout-queue-run-id": _QUEUE,
    "rollout-queue-lease-seconds": _QUEUE,
    "rollout-queue-segment-mib": _QUEUE,
    "rollout-io-concurrency": _QUEUE,
    "rollout-session-id": _HEALTH,
    "rollout-health-check-interval": _HEALTH,
    "rollout-health-check-timeout": _HEALTH,
    "rollout-health-check-first-wait": _HEALTH,
    "rollout-cleanup-timeout": _HEALTH,
    "score-centering-top-k": _only_with("--use-score-centering"),
    "value-clip": _NO_CRITIC,
    "gamma": _NO_CRITIC,
    "lambd": _NO_CRITIC,
    "routing-replay-prefetch-microbatches": _MOE,
    "mtp-loss-scaling-factor": "multi-token prediction (MTP) layers are not supported",
    "opsm-delta": _only_with("--use-opsm"),
    "opd-kl-coef": _only_with("--use-opd"),
    "opd-teacher-ckpt-step": _only_with("--use-opd"),
    "log-reward-category": _LOG,
    "tb-project-name": "TensorBoard events go to RUN/tensorboard, RUN being train.run_dir (--save)",
    "tb-experiment-name": "TensorBoard events go to RUN/tensorboard, RUN being train.run_dir (--save)",
    "save-debug-rollout-data": _DUMP,
    "save-debug-train-data": _DUMP,
    "dump-details": _DUMP,
    "load-debug-rollout-data-subsample": _only_with("--load-debug-rollout-data"),
    "memory-snapshot-dir": _MEMORY,
    "memory-snapshot-num-steps": _MEMORY,
    "memory-recorder": _MEMORY,
    "fetch-trajectory-retry-times": _BUFFER,
    "min-batch-collection-ratio": _BUFFER,
    "rollout-task-type": _BUFFER,
    "loss-mask-type": "the loss mask is each completion's generated tokens (the prompt is masked out)",
    "data-pad-size-multiplier": "padding only: it sets how slime pads its packed batches, which changes no loss",
    "ci-train-rollout-logprob-abs-diff-threshold": _CI,
    "ci-save-grad-norm": _CI,
    "ci-load-grad-norm": _CI,
}
"""slime value flags accepted (with their value) and ignored, each with why (logged as a warning)."""
