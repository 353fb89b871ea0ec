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

The flags accepted without effect are the tables of :mod:`~megatron_logra.megatron_flags.slime_ignored`, those run
at one value only or refused :mod:`~megatron_logra.megatron_flags.slime_refused`; both are re-exported here. Plain
tables, importing only those two modules; :mod:`~megatron_logra.megatron_flags.slime_resolve` resolves the flags
that depend on the config or on their value.
"""

from __future__ import annotations

from megatron_logra.megatron_flags.slime_ignored import SLIME_IGNORED_SWITCHES, SLIME_IGNORED_VALUE_FLAGS
from megatron_logra.megatron_flags.slime_refused import (SLIME_NEUTRAL_FLAGS, SLIME_REFUSED_SWITCHES,
                                                         SLIME_REFUSED_VALUE_FLAGS)

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
    "eval-max-prompt-len": "task.eval_max_prompt_tokens",
    "wandb-dir": "train.wandb_save_dir",
}
"""slime value flags -> the dotted field they set: ``--rollout-seed`` the seed of the prompt stream (``task.seed``;
the held-out set keeps ``task.eval_seed``), ``--tis-clip`` / ``--tis-clip-low`` the importance weight's cap and
floor, ``--entropy-coef`` the entropy bonus, ``--eval-top-p`` / ``--eval-max-response-len`` the held-out sampling's nucleus mass and completion
length, ``--sglang-mem-fraction-static`` the share of each GPU the in-process SGLang
engine reserves, ``--rollout-num-gpus-per-engine`` that engine's tensor-parallel size, ``--wandb-group`` /
``--wandb-team`` the W&B run's group and team, ``--max-tokens-per-gpu`` the positions of a dynamic
micro-batch (slime reads it with ``--use-dynamic-batch-size``; here it turns dynamic micro-batches on by itself,
since they give the same update as fixed ones), ``--eval-max-prompt-len`` the longest held-out prompt (longer ones
are dropped from the held-out set, as ``--rollout-max-prompt-len`` drops training prompts), ``--wandb-dir`` the
directory W&B writes its local files under."""

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
                                    "custom-rm-path": "task.reward", "attention-backend": "model.transformer_impl",
                                    "log-probs-chunk-size": "rl.loss.logprob_chunk_tokens"}
"""Value flags whose values are spelt otherwise here -> the field they set, by :func:`~megatron_logra.megatron_flags.slime_resolve.slime_value`:
``--advantage-estimator grpo`` (``gspo``: ``rl.loss.kind=gspo``, GSPO's loss on GRPO's advantages;
``reinforce_plus_plus_baseline``: ``rl.advantage.scale_by_std=false``, the group mean only, whitened by
``--normalize-advantages``, which :func:`~megatron_logra.megatron_flags.slime_resolve.check_estimator` requires);
``--rm-type`` math / deepscaler / dapo score with math-verify
(``task.reward=math_verify``); ``--custom-rm-path a.b.fn`` runs slime's own reward function,
``task.reward=slime:a.b.fn``; Megatron-LM's ``--attention-backend`` flash / fused is TransformerEngine's attention
(``model.transformer_impl=transformer_engine``), unfused / local megatron-core's (``local``), auto ``auto``; ``--log-probs-chunk-size N`` the tokens per chunk in which
logits become log-probs (``rl.loss.logprob_chunk_tokens=N``; slime's -1, no chunks, is 0 here)."""
