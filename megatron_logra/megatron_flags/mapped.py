"""The Megatron-LM flags that set (or check) config fields: what each one maps to here.

Plain tables, importing nothing of this project, so that :mod:`megatron_logra.config` can read them while it
loads. The flags whose field depends on the rest of the config (:data:`CONTEXT_FLAGS`) are resolved by
:mod:`megatron_logra.megatron_flags.resolve` after every other override.
"""

from __future__ import annotations

from typing import Any, Optional

from megatron_logra.megatron_flags.slime import (CLIP_FLAGS, SLIME_ALIASES, SLIME_CHECK_SWITCHES,
                                                 SLIME_SAMPLING_FLAGS, SLIME_SWITCHES, SLIME_VALUE_MAPS)

__all__ = ["MEGATRON_ALIASES", "JOB_ALIASES", "OPTIMIZER_ALIASES", "SCHEDULE_RATIO_FLAGS", "STEP_FRACTION_FLAGS",
           "CHECK_FLAGS", "SWITCH_DEFAULTS", "CHECK_SWITCHES", "LOAD_FLAGS", "MEGATRON_FLAGS", "VALUE_MAPS",
           "CONTEXT_FLAGS"]

MEGATRON_ALIASES: dict[str, str] = {
    "tensor-model-parallel-size": "parallel.tp",
    "pipeline-model-parallel-size": "parallel.pp",
    "distributed-backend": "parallel.backend",
    "distributed-timeout-minutes": "parallel.timeout_minutes",
    "seq-length": "model.seq_length",
    "num-layers": "model.num_layers",
    "hidden-size": "model.hidden_size",
    "ffn-hidden-size": "model.ffn_hidden_size",
    "num-attention-heads": "model.num_attention_heads",
    "kv-channels": "model.kv_channels",
    "num-query-groups": "model.num_query_groups",
    "init-method-std": "model.init_std",
    "hidden-dropout": "model.hidden_dropout",
    "attention-dropout": "model.attention_dropout",
    "position-embedding-type": "model.position_embedding_type",
    "rotary-base": "model.rotary_base",
    "rope-scaling-factor": "model.rope_scaling_factor",
    "normalization": "model.normalization",
    "norm-epsilon": "model.layernorm_epsilon",
    "recompute-granularity": "model.recompute",
    "make-vocab-size-divisible-by": "model.make_vocab_size_divisible_by",
    "transformer-impl": "model.transformer_impl",
    "fp8-format": "model.fp8",
    "fp8-recipe": "model.fp8_recipe",
    "lr-warmup-iters": "optimizer.schedule.warmup_steps",
    "lr-decay-iters": "optimizer.schedule.decay_steps",
    "lr-decay-style": "optimizer.schedule.decay_style",
    "seed": "train.seed",
    "log-interval": "train.log_interval",
    "save-interval": "train.save_interval",
    "exit-duration-in-mins": "train.exit_duration_minutes",
    "save": "train.run_dir",
    "optimizer": "optimizer.name",
    "profile-step-start": "profile.step_start",
    "profile-step-end": "profile.step_end",
    "profile-ranks": "profile.ranks",
    "wandb-project": "train.wandb_project",
    "wandb-entity": "train.wandb_entity",
    "wandb-exp-name": "train.wandb_exp_name",
    "wandb-save-dir": "train.wandb_save_dir",
    "vocab-size": "model.vocab_size",
    # slime's rollout flags (RL job; one optimizer step per rollout, as slime's --num-steps-per-rollout 1)
    "num-rollout": "rl.steps",
    "rollout-batch-size": "rl.prompts_per_step",
    "n-samples-per-prompt": "rl.group_size",
    "rollout-max-response-len": "rl.rollout.max_new_tokens",
    "rollout-max-prompt-len": "task.max_prompt_tokens",
    "rollout-temperature": "rl.rollout.temperature",
    "rollout-top-p": "rl.rollout.top_p",
    "n-samples-per-eval-prompt": "rl.rollout.eval_samples",
    "eval-temperature": "rl.rollout.eval_temperature",
    "input-key": "task.jsonl_prompt_key",
    "label-key": "task.jsonl_answer_key",
    "rm-url": "task.reward",
    "kl-loss-coef": "rl.loss.kl_coef",
    "initial-loss-scale": "optimizer.loss_scale.initial",
    "min-loss-scale": "optimizer.loss_scale.min_scale",
    "loss-scale-window": "optimizer.loss_scale.window",
    "hysteresis": "optimizer.loss_scale.hysteresis",
    **SLIME_ALIASES,
}
"""Megatron-LM flags (without ``--``) -> the dotted field they set, whatever the job; the flags of
:data:`JOB_ALIASES` are resolved against the configured job by
:func:`~megatron_logra.megatron_flags.resolve_alias`. slime's rollout flags set the RL job's fields of the same
meaning (an RL step is one rollout of ``rl.prompts_per_step`` prompts × ``rl.group_size`` samples and one optimizer
step): ``--num-rollout`` ``rl.steps``, ``--rollout-batch-size`` ``rl.prompts_per_step`` (prompts per step over
all DP ranks), ``--n-samples-per-prompt`` ``rl.group_size``, ``--rollout-max-response-len``
``rl.rollout.max_new_tokens``, ``--rollout-max-prompt-len`` ``task.max_prompt_tokens`` (longer training prompts are
skipped), ``--rollout-temperature`` / ``--rollout-top-p`` the sampling, and
``--n-samples-per-eval-prompt`` / ``--eval-temperature`` the held-out evaluation's, ``--input-key`` /
``--label-key`` the keys of a ``jsonl:`` file's prompt and answer, ``--rm-url`` a reward server
(``task.reward``), ``--kl-loss-coef`` the weight of the KL penalty, ``rl.loss.kl_coef`` (on when > 0, with or
without slime's ``--use-kl-loss``: :mod:`~megatron_logra.megatron_flags.kl_loss`); with ``job=lm`` they are refused as every
``rl.*`` and ``task.*`` field is."""

JOB_ALIASES: dict[str, dict[str, Optional[str]]] = {
    "train-iters": {"lm": "train.steps", "rl": "rl.steps"},
    "micro-batch-size": {"lm": "train.micro_batch_size", "rl": "rl.micro_batch_size"},
    "global-batch-size": {"lm": "train.global_batch_size", "rl": None},
    "eval-interval": {"lm": "train.eval_interval", "rl": "rl.eval_interval"},
}
"""Megatron-LM flags whose field depends on ``job``: the lm job's loop reads ``train.*``, the RL job
``rl.*`` (None: no RL field; :func:`~megatron_logra.megatron_flags.resolve_alias` accepts ``--global-batch-size``
there only as a check that it equals ``rl.prompts_per_step × rl.group_size``, the sequences each RL step trains,
as slime's ``--global-batch-size`` with one step per rollout, and refuses any other value)."""

OPTIMIZER_ALIASES: tuple[str, ...] = ("lr", "weight-decay", "clip-grad", "adam-beta1", "adam-beta2", "adam-eps")
"""Megatron-LM optimizer flags, resolved against ``optimizer.name`` / ``logra.recipe`` /
``native.freeze`` (:func:`~megatron_logra.megatron_flags.resolve_alias`):

* ``optimizer.name=adam`` (dense AdamW reads ``optimizer.native.*``): ``--lr``, ``--weight-decay``,
  ``--adam-beta1/2``, ``--adam-eps`` set ``optimizer.native.*``; ``--clip-grad`` ``optimizer.logra.clip_grad``.
* LoGRA, ``logra.recipe=optimizer``: ``--lr``, ``--weight-decay``, ``--clip-grad`` set ``optimizer.logra.*``
  (the target layers; ``native.lr`` etc. stay for the other parameters); ``--adam-*`` set the AdamW of the
  non-target parameters, ``optimizer.native.*``, refused when ``native.freeze=true`` freezes them.
* LoGRA, ``logra.recipe=paper``: ``--lr``, ``--weight-decay`` and ``--clip-grad`` are refused (its step is
  ``logra.update_ratio`` scaled by the KL controller's α, without weight decay on targets or clipping)."""

SCHEDULE_RATIO_FLAGS: dict[str, str] = {"lr-warmup-init": "optimizer.schedule.warmup_init_lr",
                                         "min-lr": "optimizer.schedule.min_lr"}
"""Megatron-LM's absolute schedule lrs -> the ``optimizer.schedule`` field they set
(:func:`~megatron_logra.megatron_flags.schedule_ratio`), against the peak lr that ``--lr`` sets for the configured
optimizer (the first of :meth:`~megatron_logra.optim.config.OptimizerConfig.scheduled_lrs`: ``optimizer.logra.lr``
for LoGRA's optimizer recipe, ``optimizer.native.lr`` for dense AdamW and for the paper recipe, whose schedule
reaches the non-target AdamW only). Each is stored as given (:data:`~megatron_logra.optim.schedule.ABSOLUTE_LRS`):
``--lr-warmup-init`` in ``warmup_init_lr``, that peak lr's exact lr at the first step of the warmup; ``--min-lr`` in
``min_lr``, the floor it decays to exactly; every other scheduled lr starts and ends at the same fractions of its
own peak. Each flag clears the ratio field its lr replaces (``warmup_init_ratio`` / ``min_lr_ratio``) unless that
field is given too (both are then refused). Resolved after every other override, so the order of ``--lr`` /
``--min-lr`` on the line does not matter; a peak lr of 0, a value above the peak or a configuration where no lr
follows a schedule is refused."""

STEP_FRACTION_FLAGS: dict[str, str] = {"lr-warmup-fraction": "optimizer.schedule.warmup_steps"}
"""Megatron-LM flags giving a number of optimizer steps as a fraction of the schedule's decay length -> the
field they set (:func:`~megatron_logra.megatron_flags.step_fraction`): ``--lr-warmup-fraction F`` is
``optimizer.schedule.warmup_steps = F × L``, L being ``optimizer.schedule.decay_steps`` (``--lr-decay-iters``) or,
when null, the job's steps (``train.steps`` / ``rl.steps``, ``--train-iters``), as Megatron-LM computes it.
Resolved after every other override; refused where ``F × L`` is no whole number of steps (Megatron-LM would
warm up over a fractional step count, which ``warmup_steps`` cannot hold), naming the nearest
``--lr-warmup-iters``."""

CHECK_FLAGS: tuple[str, ...] = ("max-position-embeddings",)
"""Megatron-LM flags without a field of their own, accepted as a check
(:func:`~megatron_logra.megatron_flags.check_flag`):
``--max-position-embeddings N`` needs ``N >= model.seq_length`` (positions run up to ``model.seq_length``;
RoPE has no position table) and, with learned absolute positions (a table of ``model.seq_length`` rows),
``N == model.seq_length``. It never changes ``model.seq_length`` (``--seq-length``)."""

SWITCH_DEFAULTS: dict[str, tuple[str, Any]] = {"use-rope-scaling": ("model.rope_scaling_factor", 8.0)}
"""Megatron-LM switches that turn on a feature whose value another flag may give, in either order:
``--use-rope-scaling`` sets ``model.rope_scaling_factor`` to Megatron-LM's default factor 8 unless
``--rope-scaling-factor`` (or the field) gives one."""

CHECK_SWITCHES: tuple[str, ...] = ("no-position-embedding", "use-kl-loss", *SLIME_CHECK_SWITCHES)
"""Megatron-LM switches accepted as a check of the final config
(:func:`~megatron_logra.megatron_flags.check_switch`):
``--no-position-embedding`` (no learned position table) holds with ``model.position_embedding_type=rope``, the
default here, and is refused with ``learned_absolute``, which is such a table. slime's ``--use-kl-loss`` is accepted
(with a note) where ``rl.loss.kl_coef`` is above 0 or given, the penalty being on when ``rl.loss.kl_coef > 0``, and
refused alone, naming ``rl.loss.kl_coef`` (:func:`~megatron_logra.megatron_flags.kl_loss.check_use_kl_loss`)."""

VALUE_MAPS: dict[str, str] = {"kl-loss-type": "rl.loss.kl_estimator", **SLIME_VALUE_MAPS}
"""Value flags whose values are spelt otherwise here -> the dotted field they set, by
:func:`~megatron_logra.megatron_flags.map_value`: slime's ``--kl-loss-type`` ``k2`` / ``k3`` / ``low_var_kl``
set ``rl.loss.kl_estimator`` (the same estimators); ``k1`` is refused naming ``k2`` (:func:`~megatron_logra.megatron_flags.kl_loss.kl_loss_type`);
the others are :data:`~megatron_logra.megatron_flags.slime.SLIME_VALUE_MAPS`."""

LOAD_FLAGS: dict[str, tuple[tuple[str, Optional[str]], ...]] = {
    "load": (("train.run_dir", None), ("train.resume", "true")),
    "loss-scale": (("optimizer.loss_scale.mode", "static"), ("optimizer.loss_scale.initial", None)),
}
"""Megatron-LM value flags that set several fields (None: the flag's value): ``--load DIR`` continues the run
in DIR, ``train.run_dir=DIR train.resume=true`` (from DIR's latest checkpoint; from step 0 when DIR holds none,
as Megatron-LM's ``--load`` does). This trainer saves into the directory it resumes from, so a ``--save``
naming another directory is refused (one field given twice). ``--loss-scale S`` scales the loss by S always,
``optimizer.loss_scale.mode=static optimizer.loss_scale.initial=S`` (with ``--initial-loss-scale`` at another
value it is refused: one field given twice)."""

MEGATRON_FLAGS: dict[str, tuple[str, str]] = {
    "exit-signal-handler": ("train.exit_signal_handler", "true"),
    "bf16": ("model.params_dtype", "bfloat16"),
    "fp16": ("model.params_dtype", "float16"),
    "swiglu": ("model.swiglu", "true"),
    "untie-embeddings-and-output-weights": ("model.untie_embeddings_and_output_weights", "true"),
    "add-qkv-bias": ("model.add_qkv_bias", "true"),
    "add-bias-linear": ("model.add_bias_linear", "true"),
    "disable-bias-linear": ("model.add_bias_linear", "false"),
    "qk-layernorm": ("model.qk_layernorm", "true"),
    "sequence-parallel": ("model.sequence_parallel", "true"),
    "use-rotary-position-embeddings": ("model.position_embedding_type", "rope"),
    "resume": ("train.resume", "true"),
    "profile": ("profile.enabled", "true"),
    "use-pytorch-profiler": ("profile.tool", "torch"),
    "pytorch-profiler-collect-shapes": ("profile.record_shapes", "true"),
    "pytorch-profiler-collect-callstack": ("profile.with_stack", "true"),
    "use-rope-scaling": ("use-rope-scaling", "true"),  # SWITCH_DEFAULTS
    "no-position-embedding": ("no-position-embedding", "true"),  # CHECK_SWITCHES
    "apply-chat-template": ("rl.chat_template", "true"),  # slime
    "use-kl-loss": ("use-kl-loss", "true"),  # slime; CHECK_SWITCHES
    **SLIME_SWITCHES,
}
"""Megatron-LM switches (no value) -> the (dotted field, value) they set."""

CONTEXT_FLAGS = (frozenset(JOB_ALIASES) | frozenset(OPTIMIZER_ALIASES) | frozenset(CHECK_FLAGS)
                 | frozenset(SWITCH_DEFAULTS) | frozenset(SCHEDULE_RATIO_FLAGS) | frozenset(CHECK_SWITCHES)
                 | frozenset(STEP_FRACTION_FLAGS) | frozenset(CLIP_FLAGS) | frozenset(SLIME_SAMPLING_FLAGS))
"""Flags set (or checked) after the other overrides, against the config they leave."""
