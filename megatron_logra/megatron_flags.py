"""The Megatron-LM flags that :mod:`megatron_logra.config.overrides` accepts, and what each one does here.

Every flag is in exactly one table (without its ``--``):

* :data:`MEGATRON_ALIASES`: a value flag that sets one dotted field, whatever the rest of the config;
* :data:`JOB_ALIASES`, :data:`OPTIMIZER_ALIASES`, :data:`SCHEDULE_RATIO_FLAGS`, :data:`CHECK_FLAGS`: value flags
  resolved against the rest of the config after every other override (:func:`resolve_alias`);
* :data:`LOAD_FLAGS`: ``--load DIR``, which sets two fields;
* :data:`MEGATRON_FLAGS`: switches (no value) that set a field (or, for :data:`SWITCH_DEFAULTS` and
  :data:`CHECK_SWITCHES`, are resolved later);
* :data:`IGNORED_SWITCHES`, :data:`IGNORED_VALUE_FLAGS`: flags whose setting is already in effect here or has
  no counterpart that would change the run: accepted, with a logged warning saying why;
* :data:`NEUTRAL_FLAGS`: flags accepted (and ignored) at the one value that matches this trainer, refused at
  any other;
* :data:`REFUSED_SWITCHES`, :data:`REFUSED_VALUE_FLAGS`: well-known flags this trainer cannot honour, refused
  with what to use instead.

Any other ``--name`` that is not a dotted config field is refused by :func:`unknown_flag_error`, naming the
closest flags and fields (:func:`suggestions`); it never takes the next argument as its value.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import typing
from typing import TYPE_CHECKING, Any, Optional

if TYPE_CHECKING:
    from megatron_logra.config.run import RunConfig

# the functions import megatron_logra.config's modules when called: that package imports this module (its
# overrides read these tables) while it loads

__all__ = ["MEGATRON_ALIASES", "JOB_ALIASES", "OPTIMIZER_ALIASES", "SCHEDULE_RATIO_FLAGS", "CHECK_FLAGS",
           "SWITCH_DEFAULTS", "CHECK_SWITCHES", "MEGATRON_FLAGS", "LOAD_FLAGS", "IGNORED_SWITCHES",
           "IGNORED_VALUE_FLAGS", "NEUTRAL_FLAGS", "REFUSED_SWITCHES", "REFUSED_VALUE_FLAGS", "CONTEXT_FLAGS",
           "resolve_alias", "schedule_ratio", "check_flag", "check_switch", "neutral_flag", "known_flags",
           "suggestions", "unknown_flag_error"]

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
}
"""Megatron-LM flags (without ``--``) -> the dotted field they set, whatever the job; the flags of
:data:`JOB_ALIASES` are resolved against the configured job by :func:`resolve_alias`."""

JOB_ALIASES: dict[str, dict[str, Optional[str]]] = {
    "train-iters": {"lm": "train.steps", "rl": "rl.steps"},
    "micro-batch-size": {"lm": "train.micro_batch_size", "rl": "rl.micro_batch_size"},
    "global-batch-size": {"lm": "train.global_batch_size", "rl": None},
    "eval-interval": {"lm": "train.eval_interval", "rl": "rl.eval_interval"},
}
"""Megatron-LM flags whose field depends on ``job``: the lm job's loop reads ``train.*``, the RL job
``rl.*`` (None: no RL field; the flag is refused)."""

OPTIMIZER_ALIASES: tuple[str, ...] = ("lr", "weight-decay", "clip-grad", "adam-beta1", "adam-beta2", "adam-eps")
"""Megatron-LM optimizer flags, resolved against ``optimizer.name`` / ``logra.recipe`` /
``native.freeze`` (:func:`resolve_alias`):

* ``optimizer.name=adam`` (dense AdamW reads ``optimizer.native.*``): ``--lr``, ``--weight-decay``,
  ``--adam-beta1/2``, ``--adam-eps`` set ``optimizer.native.*``; ``--clip-grad`` ``optimizer.logra.clip_grad``.
* LoGRA, ``logra.recipe=optimizer``: ``--lr``, ``--weight-decay``, ``--clip-grad`` set ``optimizer.logra.*``
  (the target layers; ``native.lr`` etc. stay for the other parameters); ``--adam-*`` set the AdamW of the
  non-target parameters, ``optimizer.native.*``, refused when ``native.freeze=true`` freezes them.
* LoGRA, ``logra.recipe=paper``: ``--lr``, ``--weight-decay`` and ``--clip-grad`` are refused (its step is
  ``logra.update_ratio`` scaled by the KL controller's α, without weight decay on targets or clipping)."""

SCHEDULE_RATIO_FLAGS: dict[str, str] = {"lr-warmup-init": "optimizer.schedule.warmup_init_lr",
                                         "min-lr": "optimizer.schedule.min_lr"}
"""Megatron-LM's absolute schedule lrs -> the ``optimizer.schedule`` field they set (:func:`schedule_ratio`),
against the peak lr that ``--lr`` sets for the configured optimizer (the first of
:meth:`~megatron_logra.optim.config.OptimizerConfig.scheduled_lrs`: ``optimizer.logra.lr`` for LoGRA's optimizer
recipe, ``optimizer.native.lr`` for dense AdamW and for the paper recipe, whose schedule reaches the non-target
AdamW only). Each is stored as given (:data:`~megatron_logra.optim.schedule.ABSOLUTE_LRS`): ``--lr-warmup-init``
in ``warmup_init_lr``, that peak lr's exact lr at the first step of the warmup; ``--min-lr`` in ``min_lr``, the
floor it decays to exactly; every other scheduled lr starts and ends at the same fractions of its own peak. Each
flag clears the ratio field its lr replaces (``warmup_init_ratio`` / ``min_lr_ratio``) unless that field is given
too (both are then refused). Resolved after every other override, so the order of ``--lr`` / ``--min-lr`` on the
line does not matter; a peak lr of 0, a value above the peak or a configuration where no lr follows a schedule
is refused."""

CHECK_FLAGS: tuple[str, ...] = ("max-position-embeddings",)
"""Megatron-LM flags without a field of their own, accepted as a check (:func:`check_flag`):
``--max-position-embeddings N`` needs ``N >= model.seq_length`` (positions run up to ``model.seq_length``;
RoPE has no position table) and, with learned absolute positions (a table of ``model.seq_length`` rows),
``N == model.seq_length``. It never changes ``model.seq_length`` (``--seq-length``)."""

SWITCH_DEFAULTS: dict[str, tuple[str, Any]] = {"use-rope-scaling": ("model.rope_scaling_factor", 8.0)}
"""Megatron-LM switches that turn on a feature whose value another flag may give, in either order:
``--use-rope-scaling`` sets ``model.rope_scaling_factor`` to Megatron-LM's default factor 8 unless
``--rope-scaling-factor`` (or the field) gives one."""

CHECK_SWITCHES: tuple[str, ...] = ("no-position-embedding",)
"""Megatron-LM switches accepted as a check of the final config (:func:`check_switch`):
``--no-position-embedding`` (no learned position table) holds with ``model.position_embedding_type=rope``, the
default here, and is refused with ``learned_absolute``, which is such a table."""

LOAD_FLAGS: dict[str, tuple[tuple[str, Optional[str]], ...]] = {
    "load": (("train.run_dir", None), ("train.resume", "true")),
}
"""Megatron-LM value flags that set several fields (None: the flag's value): ``--load DIR`` continues the run
in DIR, ``train.run_dir=DIR train.resume=true`` (from DIR's latest checkpoint; from step 0 when DIR holds none,
as Megatron-LM's ``--load`` does). This trainer saves into the directory it resumes from, so a ``--save``
naming another directory is refused (one field given twice)."""

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
}
"""Megatron-LM switches (no value) -> the (dotted field, value) they set."""

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
    "no-masked-softmax-fusion": _FUSIONS_OFF,
    "no-bias-gelu-fusion": _FUSIONS_OFF,
    "no-bias-swiglu-fusion": _FUSIONS_OFF,
    "no-bias-dropout-fusion": _FUSIONS_OFF,
    "no-rope-fusion": _FUSIONS_OFF,
    "no-gradient-accumulation-fusion": _FUSIONS_OFF,
    "no-persist-layer-norm": _FUSIONS_OFF,
}
"""Megatron-LM switches accepted and ignored, each with why (logged as a warning)."""

IGNORED_VALUE_FLAGS: dict[str, str] = {
    "num-workers": "the training data are generated in the training process (there are no DataLoader workers)",
    "tensorboard-dir": "TensorBoard events go to RUN/tensorboard, RUN being train.run_dir (--save)",
}
"""Megatron-LM value flags accepted (with their value) and ignored, each with why (logged as a warning)."""

NEUTRAL_FLAGS: dict[str, tuple[type, Any, str]] = {
    "context-parallel-size": (int, 1, "context parallelism is not supported (the layout is TP × PP × DP)"),
    "expert-model-parallel-size": (int, 1, "mixture-of-experts models are not supported (dense GPT only)"),
    "recompute-method": (str, "uniform", "full recompute (--recompute-granularity full) is uniform here"),
    "recompute-num-layers": (int, 1, "full recompute (--recompute-granularity full) recomputes one layer at a time"),
    "rotary-percent": (float, 1.0, "RoPE rotates every channel of a head here"),
    "ckpt-format": (str, "torch_dist", "checkpoints are megatron-core torch_dist checkpoints"),
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
    "lr-warmup-fraction": "give the warmup in steps: --lr-warmup-iters N (optimizer.schedule.warmup_steps)",
    "num-experts": "mixture-of-experts models are not supported (dense GPT only)",
    "num-layers-per-virtual-pipeline-stage": "interleaved (virtual) pipeline schedules are not supported",
    "virtual-pipeline-model-parallel-size": "interleaved (virtual) pipeline schedules are not supported",
}
"""Megatron-LM value flags this trainer cannot honour: refused, with what to use instead."""

CONTEXT_FLAGS = (frozenset(JOB_ALIASES) | frozenset(OPTIMIZER_ALIASES) | frozenset(CHECK_FLAGS)
                 | frozenset(SWITCH_DEFAULTS) | frozenset(SCHEDULE_RATIO_FLAGS) | frozenset(CHECK_SWITCHES))
"""Flags set (or checked) after the other overrides, against the config they leave."""


def known_flags() -> list[str]:
    """Every Megatron-LM flag name (without ``--``) of the tables above, sorted."""
    names: set[str] = set()
    for table in (MEGATRON_ALIASES, JOB_ALIASES, OPTIMIZER_ALIASES, SCHEDULE_RATIO_FLAGS, CHECK_FLAGS,
                  LOAD_FLAGS, MEGATRON_FLAGS, IGNORED_SWITCHES, IGNORED_VALUE_FLAGS, NEUTRAL_FLAGS,
                  REFUSED_SWITCHES, REFUSED_VALUE_FLAGS):
        names.update(table)
    return sorted(names)


def _dotted_fields(cls: Any = None, prefix: str = "") -> list[str]:
    """Every dotted leaf field of the config dataclass ``cls`` (default: the run config)."""
    from megatron_logra.config.codec import _section_type
    from megatron_logra.config.run import RunConfig

    cls = RunConfig if cls is None else cls
    out: list[str] = []
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        section = _section_type(hints[f.name])
        if section is not None:
            out.extend(_dotted_fields(section, f"{prefix}{f.name}."))
        else:
            out.append(f"{prefix}{f.name}")
    return out


def suggestions(name: str, limit: int = 3) -> list[str]:
    """The known spellings closest to ``name`` (a flag name without ``--``, or a dotted key): ``--FLAG`` for a
    Megatron-LM flag, the dotted field otherwise; best first, at most ``limit``, empty when nothing is close."""
    under = name.replace("-", "_")
    scored: list[tuple[float, str]] = []
    for flag in known_flags():
        scored.append((difflib.SequenceMatcher(None, name, flag).ratio(), f"--{flag}"))
    for field in _dotted_fields():
        leaf = field.rsplit(".", 1)[-1]
        ratio = max(difflib.SequenceMatcher(None, under, field).ratio(),
                    difflib.SequenceMatcher(None, under, leaf).ratio())
        scored.append((ratio, field))
    scored.sort(key=lambda s: -s[0])
    return [spelling for ratio, spelling in scored if ratio >= 0.7][:limit]


def unknown_flag_error(flag: str) -> ValueError:
    """The error for ``--flag`` that no table knows and that is no dotted field: names it and the closest
    flags and fields."""
    close = suggestions(flag)
    hint = f"did you mean {' or '.join(close)}? " if close else ""
    return ValueError(f"unknown option --{flag}: it is neither a Megatron-LM flag this trainer accepts nor a config "
                      f"field; {hint}`megatron-logra train --help` lists the flags, `megatron-logra config RECIPE` "
                      f"every field (give a field as a.b=VALUE or --a.b VALUE)")


def neutral_flag(flag: str, raw: Any) -> None:
    """``--flag raw`` of :data:`NEUTRAL_FLAGS`: returns when ``raw`` is the value this trainer runs at, else a
    ``ValueError`` saying why no other value is possible."""
    from megatron_logra.config.codec import _coerce

    ftype, neutral, why = NEUTRAL_FLAGS[flag]
    value = _coerce(raw, ftype, f"--{flag}")
    if value != neutral:
        raise ValueError(f"--{flag}={value}: {why}; drop --{flag} (only {neutral} is accepted)")


def resolve_alias(cfg: RunConfig, flag: str) -> str:
    """The dotted field that the context-dependent Megatron-LM flag ``flag`` (without ``--``) sets in
    ``cfg``; a ``ValueError`` naming the field to use instead when the flag would have no effect."""
    if flag in JOB_ALIASES:
        target = JOB_ALIASES[flag].get(cfg.job)
        if target is None:
            rl = cfg.rl
            raise ValueError(
                f"--{flag} has no field in the RL job (job=rl): each RL step trains rl.prompts_per_step × "
                f"rl.group_size = {rl.prompts_per_step} × {rl.group_size} = {rl.prompts_per_step * rl.group_size} "
                f"sequences (in micro-batches of rl.micro_batch_size); set rl.prompts_per_step (and rl.group_size) "
                f"instead")
        return target
    if flag in OPTIMIZER_ALIASES:
        return _optimizer_alias(cfg, flag)
    raise ValueError(f"--{flag} is not a context-dependent flag")


_NATIVE_FIELDS = {"lr": "lr", "weight-decay": "weight_decay", "adam-beta1": "beta1", "adam-beta2": "beta2",
                  "adam-eps": "eps"}


def _optimizer_alias(cfg: RunConfig, flag: str) -> str:
    """See :data:`OPTIMIZER_ALIASES`."""
    opt = cfg.optimizer
    if opt.name == "adam":  # dense AdamW (optim/dense.py): native.* for every parameter, logra.clip_grad
        return "optimizer.logra.clip_grad" if flag == "clip-grad" else f"optimizer.native.{_NATIVE_FIELDS[flag]}"
    if flag in ("lr", "weight-decay", "clip-grad"):
        field = {"lr": "lr", "weight-decay": "weight_decay", "clip-grad": "clip_grad"}[flag]
        if opt.logra.recipe == "paper":
            why, instead = {
                "lr": ("its step is logra.update_ratio scaled by the KL controller's α",
                       "set logra.update_ratio (and native.lr for non-target parameters) or use logra.recipe=optimizer"),
                "weight-decay": ("it applies no weight decay to the target layers",
                                 "set native.weight_decay for non-target parameters or use logra.recipe=optimizer"),
                "clip-grad": ("it does not clip: the KL controller's α bounds each step",
                              "use logra.recipe=optimizer to clip"),
            }[flag]
            raise ValueError(f"--{flag} would set optimizer.logra.{field}, which logra.recipe=paper does not use "
                             f"({why}); {instead}")
        return f"optimizer.logra.{field}"
    field = _NATIVE_FIELDS[flag]
    if opt.native.freeze:
        instead = {"beta1": "LoGRA's RowAdam has no first moment",
                   "beta2": "LoGRA's RowAdam decay is optimizer.logra.beta2",
                   "eps": "LoGRA's RowAdam epsilon is optimizer.logra.eps"}[field]
        raise ValueError(f"--{flag} would set optimizer.native.{field}, the AdamW of the non-target parameters, "
                         f"which optimizer.native.freeze=true freezes: it has no effect; {instead} (or set "
                         f"native.freeze=false)")
    return f"optimizer.native.{field}"


def schedule_ratio(cfg: RunConfig, flag: str, raw: Any) -> tuple[str, float]:
    """``(field, value)`` for the absolute-lr flag ``flag`` of :data:`SCHEDULE_RATIO_FLAGS`, checked against
    ``cfg``'s peak lr: the lr itself (stored as given, so the schedule reaches exactly it); ``ValueError``
    naming the flag and the fields where it cannot be used."""
    from megatron_logra.config.codec import _coerce

    target = SCHEDULE_RATIO_FLAGS[flag]
    value = _coerce(raw, float, f"--{flag}")
    if not (math.isfinite(value) and value >= 0):
        raise ValueError(f"--{flag}={value} must be a finite lr >= 0")
    lrs = cfg.optimizer.scheduled_lrs()
    if not lrs:
        raise ValueError(f"--{flag} sets {target}, but no lr follows a schedule here (optimizer.logra.recipe=paper "
                         f"has no lr for the targets and optimizer.native.freeze=true trains nothing else); drop it")
    peak_field, peak = next(iter(lrs.items()))
    if peak == 0:
        raise ValueError(f"--{flag}={value} is an absolute lr of the schedule of the peak lr {peak_field}, which "
                         f"is 0 here; set --lr / {peak_field} > 0 or give {target} directly")
    if value > peak:
        raise ValueError(f"--{flag}={value} exceeds the peak lr {peak_field}={peak} (--lr): a schedule runs from "
                         f"and down to fractions of the peak; lower --{flag} or raise --lr")
    return target, value


def check_flag(cfg: RunConfig, flag: str, raw: Any) -> None:
    """See :data:`CHECK_FLAGS`."""
    from megatron_logra.config.codec import _coerce

    value = _coerce(raw, int, f"--{flag}")
    seq, kind = cfg.model.seq_length, cfg.model.position_embedding_type
    if value < seq:
        raise ValueError(f"--{flag}={value} is below model.seq_length={seq}: positions run up to model.seq_length "
                         f"(there is no separate position limit); set --seq-length / model.seq_length to at most "
                         f"{value} or raise --{flag}")
    if kind == "learned_absolute" and value != seq:
        raise ValueError(f"--{flag}={value}: model.position_embedding_type=learned_absolute has a table of "
                         f"model.seq_length={seq} positions; set --seq-length {value} to size it (or drop --{flag})")


def check_switch(cfg: RunConfig, flag: str) -> None:
    """See :data:`CHECK_SWITCHES`."""
    kind = cfg.model.position_embedding_type
    if kind != "rope":
        raise ValueError(f"--{flag} asks for no learned position table, but model.position_embedding_type={kind} is "
                         f"one; give --position-embedding-type rope (or drop --{flag})")
