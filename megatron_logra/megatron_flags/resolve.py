"""Resolving the context-dependent Megatron-LM flags against the config the other overrides leave, and the
checks of the flags accepted only as a check or at one value.

Each function raises a ``ValueError`` that names the flag and what to give instead, so a pasted launch line
fails before the run starts rather than training with a flag that has no effect.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any, Collection, Optional

from megatron_logra.megatron_flags.kl_loss import check_use_kl_loss, kl_loss_type
from megatron_logra.megatron_flags.slime import SLIME_VALUE_MAPS
from megatron_logra.megatron_flags.slime_resolve import check_dynamic_batch, check_use_wandb, slime_value
from megatron_logra.megatron_flags.mapped import (JOB_ALIASES, OPTIMIZER_ALIASES, SCHEDULE_RATIO_FLAGS,
                                                  STEP_FRACTION_FLAGS, VALUE_MAPS)
from megatron_logra.megatron_flags.unmapped import NEUTRAL_FLAGS

if TYPE_CHECKING:
    from megatron_logra.config.run import RunConfig

# the functions import megatron_logra.config's modules when called: that package imports this package (its
# overrides read the tables) while it loads

__all__ = ["resolve_alias", "schedule_ratio", "step_fraction", "check_flag", "check_switch", "neutral_flag",
           "map_value"]


def neutral_flag(flag: str, raw: Any) -> None:
    """``--flag raw`` of :data:`~megatron_logra.megatron_flags.NEUTRAL_FLAGS`: returns when ``raw`` is the value
    this trainer runs at, else a ``ValueError`` saying why no other value is possible."""
    from megatron_logra.config.codec import _coerce

    ftype, neutral, why = NEUTRAL_FLAGS[flag]
    value = _coerce(raw, ftype, f"--{flag}")
    if value != neutral:
        raise ValueError(f"--{flag}={value}: {why}; drop --{flag} (only {neutral} is accepted)")


def resolve_alias(cfg: RunConfig, flag: str, raw: Any = None) -> Optional[str]:
    """The dotted field that the context-dependent Megatron-LM flag ``flag`` (without ``--``) sets in
    ``cfg``; None when the flag has no field here and its value ``raw`` only checks ``cfg``
    (``--global-batch-size`` of the RL job); a ``ValueError`` naming the field to use instead when the flag would
    have no effect."""
    if flag in JOB_ALIASES:
        target = JOB_ALIASES[flag].get(cfg.job)
        if target is None:
            _check_rl_sequences_per_step(cfg, flag, raw)
            return None
        return target
    if flag in OPTIMIZER_ALIASES:
        return _optimizer_alias(cfg, flag)
    raise ValueError(f"--{flag} is not a context-dependent flag")


def _check_rl_sequences_per_step(cfg: RunConfig, flag: str, raw: Any) -> None:
    """``--global-batch-size N`` (a Megatron-LM / slime launch line) with job=rl: each RL step is one rollout
    and one optimizer step over its ``rl.prompts_per_step × rl.group_size`` sequences, so N is accepted when it
    is that product (slime's ``--global-batch-size`` with one step per rollout) and refused otherwise."""
    from megatron_logra.config.codec import _coerce

    rl = cfg.rl
    per_step = rl.prompts_per_step * rl.group_size
    how = (f"rl.prompts_per_step × rl.group_size = {rl.prompts_per_step} × {rl.group_size} = {per_step} sequences "
           f"(in micro-batches of rl.micro_batch_size)")
    if raw is None:
        raise ValueError(f"--{flag} has no field in the RL job (job=rl): each RL step trains {how}; set "
                         f"rl.prompts_per_step (and rl.group_size) instead")
    value = _coerce(raw, int, f"--{flag}")
    if value != per_step:
        raise ValueError(
            f"--{flag} {value}: each RL step (job=rl) is one rollout and one optimizer step, training {how}; "
            f"several optimizer steps per rollout (slime's --global-batch-size below --rollout-batch-size × "
            f"--n-samples-per-prompt) are not supported. Set rl.prompts_per_step (--rollout-batch-size) and "
            f"rl.group_size (--n-samples-per-prompt) whose product is {value}, or drop --{flag}")


_NATIVE_FIELDS = {"lr": "lr", "weight-decay": "weight_decay", "adam-beta1": "beta1", "adam-beta2": "beta2",
                  "adam-eps": "eps"}


def _optimizer_alias(cfg: RunConfig, flag: str) -> str:
    """See :data:`~megatron_logra.megatron_flags.OPTIMIZER_ALIASES`."""
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
    """``(field, value)`` for the absolute-lr flag ``flag`` of
    :data:`~megatron_logra.megatron_flags.SCHEDULE_RATIO_FLAGS`, checked against ``cfg``'s peak lr: the lr itself
    (stored as given, so the schedule reaches exactly it); ``ValueError`` naming the flag and the fields where it
    cannot be used."""
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


def step_fraction(cfg: RunConfig, flag: str, raw: Any) -> tuple[str, int]:
    """``(field, steps)`` for the flag ``flag`` of :data:`~megatron_logra.megatron_flags.STEP_FRACTION_FLAGS`:
    the fraction ``raw`` of the schedule's decay length in ``cfg``; ``ValueError`` naming the flag and
    ``--lr-warmup-iters`` when that is no whole number of steps."""
    from megatron_logra.config.codec import _coerce

    target = STEP_FRACTION_FLAGS[flag]
    fraction = _coerce(raw, float, f"--{flag}")
    if not (math.isfinite(fraction) and 0 <= fraction <= 1):
        raise ValueError(f"--{flag}={fraction} must be a fraction in [0, 1] of the schedule's decay length")
    decay = cfg.optimizer.schedule.decay_steps
    if decay is not None:
        length, named = decay, f"optimizer.schedule.decay_steps={decay} (--lr-decay-iters)"
    else:
        field = "rl.steps" if cfg.job == "rl" else "train.steps"
        length = cfg.rl.steps if cfg.job == "rl" else cfg.train.steps
        named = f"{field}={length} (--train-iters; optimizer.schedule.decay_steps is null)"
    steps = fraction * length
    whole = round(steps)
    if abs(steps - whole) > 1e-9 * max(1.0, steps):
        low, high = math.floor(steps), math.ceil(steps)
        raise ValueError(f"--{flag}={fraction} of {named} is {steps:g} steps, not a whole number: {target} counts "
                         f"optimizer steps; give --lr-warmup-iters {low} or {high} instead (or a fraction that "
                         f"makes whole steps)")
    return target, int(whole)


def check_flag(cfg: RunConfig, flag: str, raw: Any) -> None:
    """See :data:`~megatron_logra.megatron_flags.CHECK_FLAGS`."""
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


def map_value(flag: str, raw: Any) -> tuple[str, str]:
    """``(field, value)`` that the flag ``flag`` of :data:`~megatron_logra.megatron_flags.VALUE_MAPS` sets for
    its value ``raw``; a ``ValueError`` naming the nearest accepted value where this trainer has none of that
    meaning."""
    if flag in SLIME_VALUE_MAPS:
        return slime_value(flag, raw)
    if flag != "kl-loss-type":
        raise ValueError(f"--{flag} is not a flag of VALUE_MAPS")
    return VALUE_MAPS[flag], kl_loss_type(raw)


def check_switch(cfg: RunConfig, flag: str, given: Collection[str] = ()) -> None:
    """See :data:`~megatron_logra.megatron_flags.CHECK_SWITCHES`; ``given``: the dotted fields the command line
    set."""
    if flag == "use-kl-loss":
        check_use_kl_loss(cfg, given)
        return
    if flag == "use-wandb":
        check_use_wandb(cfg)
        return
    if flag == "use-dynamic-batch-size":
        check_dynamic_batch(cfg)
        return
    kind = cfg.model.position_embedding_type
    if kind != "rope":
        raise ValueError(f"--{flag} asks for no learned position table, but model.position_embedding_type={kind} is "
                         f"one; give --position-embedding-type rope (or drop --{flag})")

