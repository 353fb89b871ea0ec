"""slime's own flags (its launch scripts' rollout, GRPO, evaluation, SGLang, W&B and cluster arguments): what each
one does here.

A slime launch line (``ROLLOUT_ARGS``, ``GRPO_ARGS``, ``SGLANG_ARGS``, ... of its ``scripts/run-*.sh``) pasted after
``megatron-logra train RECIPE`` is applied flag by flag as Megatron-LM's flags are: these tables are merged into
those of :mod:`~megatron_logra.megatron_flags.mapped` and :mod:`~megatron_logra.megatron_flags.unmapped`, so every
flag is in exactly one table. The loss flags follow from each RL step being one rollout and one optimizer step
(slime's ``--num-steps-per-rollout 1``): slime's PPO ratio ``π_θ / π_old`` is 1 at that step, so

* without ``--use-tis`` slime's loss is PPO-clip, which ``--eps-clip`` / ``--eps-clip-high`` select here too
  (``rl.loss.kind=ppo``, its ratio taken against the rollout engine's log-probs, whose weights this trainer keeps
  bitwise equal to its own);
* with ``--use-tis`` it is the policy gradient weighted by the rollout's importance weight truncated at
  ``--tis-clip`` (default 2, as here), this trainer's ``rl.loss.kind=tis``; the clip range is then stored but
  never acts (:func:`~megatron_logra.megatron_flags.slime_resolve.resolve_clip`).

Plain tables, importing nothing of this project; :mod:`~megatron_logra.megatron_flags.slime_resolve` resolves the
flags that depend on the config or on their value.
"""

from __future__ import annotations

from typing import Any

__all__ = ["SLIME_ALIASES", "SLIME_SWITCHES", "SLIME_CHECK_SWITCHES", "SLIME_VALUE_MAPS", "SLIME_IGNORED_SWITCHES",
           "SLIME_IGNORED_VALUE_FLAGS", "SLIME_NEUTRAL_FLAGS", "SLIME_REFUSED_SWITCHES", "SLIME_REFUSED_VALUE_FLAGS",
           "CLIP_FLAGS", "SLIME_SAMPLING_FLAGS", "NONZERO_STD_FILTER", "FILTER_ROUNDS"]

SLIME_ALIASES: dict[str, str] = {
    "rollout-seed": "task.seed",
    "tis-clip": "rl.loss.tis_cap",
    "tis-clip-low": "rl.loss.tis_floor",
    "entropy-coef": "rl.loss.entropy_coef",
    "eval-top-p": "rl.rollout.eval_top_p",
    "eval-max-response-len": "rl.rollout.eval_max_new_tokens",
    "sglang-mem-fraction-static": "rl.rollout.mem_fraction_static",
    "rollout-num-gpus-per-engine": "rl.rollout.sglang_tp",
    "wandb-group": "train.wandb_group",
    "wandb-team": "train.wandb_entity",
    "max-tokens-per-gpu": "rl.max_tokens_per_micro_batch",
    "rollout-stop-token-ids": "rl.rollout.stop_token_ids",  # nargs: --rollout-stop-token-ids 151645 151643
    "rollout-stop": "rl.rollout.stop",  # nargs: --rollout-stop '</answer>' 'Question:', each word one string
}
"""slime value flags -> the dotted field they set: ``--rollout-seed`` the seed of the prompt stream (``task.seed``;
the held-out set keeps ``task.eval_seed``), ``--tis-clip`` / ``--tis-clip-low`` the importance weight's cap and
floor, ``--entropy-coef`` the entropy bonus, ``--eval-top-p`` / ``--eval-max-response-len`` the held-out sampling's nucleus mass and completion
length, ``--sglang-mem-fraction-static`` the share of each GPU the in-process SGLang
engine reserves, ``--rollout-num-gpus-per-engine`` that engine's tensor-parallel size, ``--wandb-group`` /
``--wandb-team`` the W&B run's group and team, ``--max-tokens-per-gpu`` the positions of a dynamic
micro-batch (slime reads it with ``--use-dynamic-batch-size``; here it turns dynamic micro-batches on by itself,
since they give the same update as fixed ones)."""

SLIME_SWITCHES: dict[str, tuple[str, str]] = {
    "use-tis": ("rl.loss.kind", "tis"),
    "disable-grpo-std-normalization": ("rl.advantage.scale_by_std", "false"),
    "disable-rewards-normalization": ("rl.advantage.baseline", "none"),
    "normalize-advantages": ("rl.advantage.normalize", "true"),
    "group-rm": ("task.reward_group", "true"),
    "use-wandb": ("use-wandb", "true"),  # SLIME_CHECK_SWITCHES
    "use-dynamic-batch-size": ("use-dynamic-batch-size", "true"),  # SLIME_CHECK_SWITCHES
}
"""slime switches -> the (dotted field, value) they set: ``--use-tis`` the truncated-importance-sampling loss,
``--disable-grpo-std-normalization`` GRPO advantages not divided by the group's std (Dr. GRPO),
``--disable-rewards-normalization`` no group normalisation at all: the raw rewards are the advantages,
``--normalize-advantages`` the advantages whitened over the step's loss tokens of every DP rank, ``--group-rm`` the
slime reward function (``--custom-rm-path``) called once per prompt with the list of its samples."""

SLIME_CHECK_SWITCHES: tuple[str, ...] = ("use-wandb", "use-dynamic-batch-size")
"""slime switches accepted as a check of the final config: ``--use-wandb`` needs ``train.wandb_project``
(:func:`~megatron_logra.megatron_flags.slime_resolve.check_use_wandb`), ``--use-dynamic-batch-size`` needs
``rl.max_tokens_per_micro_batch`` (``--max-tokens-per-gpu``;
:func:`~megatron_logra.megatron_flags.slime_resolve.check_dynamic_batch`)."""

CLIP_FLAGS: dict[str, str] = {"eps-clip": "rl.loss.clip_low", "eps-clip-high": "rl.loss.clip_high",
                              "eps-clip-c": "rl.loss.clip_c"}
"""slime's PPO clip range and dual clip -> their fields; resolved after the other overrides by :func:`~megatron_logra.megatron_flags.slime_resolve.resolve_clip`, which also
chooses ``rl.loss.kind``."""

SLIME_SAMPLING_FLAGS: tuple[str, ...] = ("dynamic-sampling-filter-path", "over-sampling-batch-size")
"""slime's dynamic sampling, resolved after every other override (the filter first) by
:func:`~megatron_logra.megatron_flags.dynamic_sampling.resolve_sampling`: ``--dynamic-sampling-filter-path`` naming
slime's :data:`NONZERO_STD_FILTER` (any module path) turns on ``rl.dynamic_sampling_rounds`` (:data:`FILTER_ROUNDS`
unless the line or recipe sets it), any other filter is refused; ``--over-sampling-batch-size N`` is accepted with
dynamic sampling on (each extra round draws ``rl.prompts_per_step`` fresh prompts), and without it only at slime's
default, ``N`` = ``rl.prompts_per_step`` (``--rollout-batch-size``)."""

NONZERO_STD_FILTER = "check_reward_nonzero_std"
"""The name of slime's dynamic sampling filter that keeps a group whose rewards are not all equal: the groups
``rl.dynamic_sampling_rounds`` keeps here."""

FILTER_ROUNDS = 4
"""``rl.dynamic_sampling_rounds`` that ``--dynamic-sampling-filter-path ...check_reward_nonzero_std`` sets where
the line and recipe leave it 0: slime draws prompts until the batch is full, without a bound; here at most 4 extra
rounds (5 × the step's prompts generated) bound a step's cost, the groups still uniform after them trained at
advantage 0."""

SLIME_VALUE_MAPS: dict[str, str] = {"advantage-estimator": "rl.advantage.estimator", "rm-type": "task.reward",
                                    "custom-rm-path": "task.reward", "attention-backend": "model.transformer_impl"}
"""Value flags whose values are spelt otherwise here -> the field they set, by :func:`~megatron_logra.megatron_flags.slime_resolve.slime_value`:
``--advantage-estimator grpo`` (``gspo``: ``rl.loss.kind=gspo``, GSPO's loss on GRPO's advantages;
``reinforce_plus_plus_baseline``: ``rl.advantage.scale_by_std=false``, the group mean only, whitened by
``--normalize-advantages``, which :func:`~megatron_logra.megatron_flags.slime_resolve.check_estimator` requires);
``--rm-type`` math / deepscaler / dapo score with math-verify
(``task.reward=math_verify``); ``--custom-rm-path a.b.fn`` runs slime's own reward function,
``task.reward=slime:a.b.fn``; Megatron-LM's ``--attention-backend`` flash / fused is TransformerEngine's attention
(``model.transformer_impl=transformer_engine``), unfused / local megatron-core's (``local``), auto ``auto``."""

_ONE_STEP = ("each RL step is one rollout and one optimizer step over its rl.prompts_per_step × rl.group_size "
             "sequences")
_COLOCATED = ("the in-process SGLang engine runs on the trainer's own GPUs (rl.rollout.mem_fraction_static of each, "
              "--sglang-mem-fraction-static; `megatron-logra memory --engine-fraction` plans the rest)")
_GPUS = ("the trainer's GPUs are torchrun's (--nnodes × --nproc-per-node), and " + _COLOCATED)

SLIME_IGNORED_SWITCHES: dict[str, str] = {
    "rollout-shuffle": "the prompt stream draws its prompts at random already (seeded by task.seed, --rollout-seed)",
    "colocate": "this is already in effect: " + _COLOCATED,
    "offload": ("the trainer keeps its weights on the GPU while the engine generates (LoGRA's optimizer state is a "
                "few percent of dense Adam's); " + _COLOCATED),
    "offload-train": "the trainer keeps its weights on the GPU while the engine generates; " + _COLOCATED,
    "offload-rollout": "the engine keeps its weights on the GPU while the trainer steps; " + _COLOCATED,
    "no-offload-train": "this is already in effect: the trainer keeps its weights on the GPU while the engine generates",
    "no-offload-rollout": "this is already in effect: the engine keeps its weights on the GPU while the trainer steps",
    "balance-data": ("every DP rank trains rl.prompts_per_step / DP whole groups of the step; there is no "
                     "token balancing across DP ranks, which changes speed only"),
    "calculate-per-token-loss": ("this is already in effect: the loss is summed over the completion tokens and "
                                 "divided by the step's token count over every DP rank"),
    "use-rollout-logprobs": ("this is already in effect: the importance weight (rl.loss.kind=tis) and the PPO "
                             "ratio (rl.loss.kind=ppo) are taken against the rollout engine's log-probs"),
    "keep-old-actor": _ONE_STEP + ", so no old actor is kept: the rollout engine's log-probs are π_old",
    "rollout-global-dataset": "the prompt stream is one dataset for the whole run already (task.datasets)",
    "log-passrate": ("this is already in effect: every step's record holds pass_at_group, slime's pass@n of the step's groups (n = rl.group_size, "
                     "--n-samples-per-prompt): the share of its prompts with a correct sample; accuracy is the "
                     "share of correct samples"),
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
}
"""slime value flags accepted (with their value) and ignored, each with why (logged as a warning)."""

SLIME_NEUTRAL_FLAGS: dict[str, tuple[type, Any, str]] = {
    "train-backend": (str, "megatron", "the trainer is megatron-core's (there is no FSDP backend)"),
    "expert-tensor-parallel-size": (int, 1, "mixture-of-experts models are not supported (dense GPT only)"),
    "kl-coef": (float, 0.0, "a KL penalty in the reward is not supported: the KL to the initial policy is a loss "
                            "term, rl.loss.kl_coef=C (slime's --use-kl-loss --kl-loss-coef C), with "
                            "rl.loss.kl_estimator k3 or k2"),
    "update-weights-interval": (int, 1, "the rollout engine's weights are synced with the trainer's after every RL "
                                        "step (sync.*), so each step's rollouts come from the current policy; "
                                        "rollouts of a policy several steps old are not supported"),
}
"""slime value flags accepted (and ignored) at the one value that matches this trainer."""

SLIME_REFUSED_SWITCHES: dict[str, str] = {
    "partial-rollout": ("every rollout of a step completes within the step (responses stop at "
                        "rl.rollout.max_new_tokens, --rollout-max-response-len); none is carried to the next step"),
    "use-opsm": "off-policy sequence masking is not supported: " + _ONE_STEP,
    "use-routing-replay": "mixture-of-experts models are not supported (dense GPT only)",
}
"""slime switches this trainer cannot honour: refused, with what to use instead."""

SLIME_REFUSED_VALUE_FLAGS: dict[str, str] = {
    "rollout-function-path": ("rollouts come from the configured engine (rl.rollout.engine: embedded or sglang); "
                              "a custom rollout function is not supported"),
    "custom-generate-function-path": ("rollouts come from the configured engine (rl.rollout.engine); a custom "
                                      "generate function is not supported"),
    "custom-tis-function-path": ("the importance weight is min(π_θ / μ, rl.loss.tis_cap) (--tis-clip); a custom "
                                 "weighting is not supported"),
    "wandb-key": ("W&B reads its key from WANDB_API_KEY (or `wandb login`); a key given on the command line would "
                  "be written to config.yaml and the launch logs"),
    "wandb-host": "W&B reads its server from WANDB_BASE_URL (or `wandb login --host URL`)",
    "hf-checkpoint": ("give model.hf_path=DIR (job=rl): the run reads the Hugging Face checkpoint's architecture, "
                      "tokenizer and initial weights from it (slime's --hf-checkpoint only seeds SGLang and the "
                      "tokenizer, its weights coming from --ref-load / --load)"),
    "ref-load": ("the initial and reference policy is model.hf_path's weights (a Hugging Face directory; "
                 "`megatron-logra convert mcore-to-hf` writes one from a torch_dist checkpoint); "
                 "to continue a run of this trainer give --load RUN_DIR"),
    "prompt-data": ("the RL job's prompts are task.datasets: jsonl:PATH for a file of prompt / answer rows (several, "
                    "comma-separated, mixed by task.weights) or reasoning-gym names"),
    "eval-prompt-data": ("held-out benchmarks are task.eval_datasets=jsonl:PATH[,jsonl:PATH2] (slime's NAME PATH "
                         "pairs without the names: each file is reported as eval_accuracy/jsonl:FILE), up to "
                         "task.num_eval rows of each"),
    "loss-type": ("the RL job's loss is rl.loss.kind (tis, ppo or gspo, --use-tis / --eps-clip / "
                  "--advantage-estimator gspo) with the KL penalty "
                  "rl.loss.kl_coef; the LM job's is the language-model loss (job=lm)"),
}
"""slime value flags this trainer cannot honour: refused, with what to use instead."""
