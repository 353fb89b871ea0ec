"""Command-line overrides of a :class:`~megatron_logra.config.run.RunConfig`: :func:`apply_overrides`
(dotted fields and Megatron-LM flags, including the flag alias tables), then the cross-field checks of
:mod:`megatron_logra.config.checks` and ``model.hf_path``'s architecture
(:func:`~megatron_logra.config.checks.resolve_hf_model`). Values are parsed by the fields' annotated types
with the rules of :mod:`megatron_logra.config.codec` (shared with its
:func:`~megatron_logra.config.codec.from_dict`); recipe files set their fields the same way
(:mod:`megatron_logra.config.recipe_files`).

Overrides take any of these forms::

    optimizer.logra.rank=64      --optimizer.logra.rank 64      --logra.rank=64
    --tensor-model-parallel-size 2   --micro-batch-size 4   --bf16

``logra.``, ``native.`` and ``schedule.`` are short for ``optimizer.logra.``, ``optimizer.native.`` and
``optimizer.schedule.``.
Every value is parsed by the field's annotated type and the whole config is re-validated.

The Megatron-LM (and slime) flags and what each one does here are the tables of
:mod:`megatron_logra.megatron_flags`: a flag with a field of its own sets it; one whose setting is already in effect
here (``--use-distributed-optimizer``, the ``--no-*-fusion`` switches, ...) is accepted with a logged warning
saying why; one this trainer cannot honour (``--data-path``, ``--finetune``, ...) is refused, naming what to use;
any other ``--name`` that is no config field is refused, naming the closest flags and fields. Every refused word
of a line is reported in one error. ``--load DIR`` is ``train.run_dir=DIR train.resume=true``.

One field set on the command line to different values under two spellings (``--tensor-model-parallel-size 2
parallel.tp=1``, ``logra.rank=8 optimizer.logra.rank=4``, ``--train-iters 5 rl.steps=7``) is refused, naming both;
the same value twice is fine, and the same key repeated (overrides appended to a command line) takes its last value.
With LoGRA, ``optimizer.logra.rank`` above the input width of a target layer is refused here, before anything is
built.

A few Megatron-LM flags set the field that the configured job reads
(:func:`~megatron_logra.megatron_flags.resolve_alias`, after every other override, so ``job=...`` anywhere on the
line counts): ``--train-iters``, ``--micro-batch-size`` and ``--eval-interval`` set ``train.*`` for ``job=lm`` and
``rl.steps``, ``rl.micro_batch_size``, ``rl.eval_interval`` for ``job=rl``; ``--global-batch-size`` is
``train.global_batch_size`` (lm); for RL, whose step trains ``rl.prompts_per_step × rl.group_size`` sequences,
it is only checked against that product (slime's launch lines give it) and refused at any other value. The
optimizer flags (``--lr``, ``--weight-decay``, ``--clip-grad``, ``--adam-beta1/2``, ``--adam-eps``) follow
``optimizer.name`` and ``logra.recipe`` (:data:`~megatron_logra.megatron_flags.OPTIMIZER_ALIASES`); one the
configured optimizer would not read is refused. ``--lr-warmup-init`` and ``--min-lr`` (absolute lrs) set
``optimizer.schedule.warmup_init_lr`` / ``optimizer.schedule.min_lr`` as given
(:data:`~megatron_logra.megatron_flags.SCHEDULE_RATIO_FLAGS`), resolved after every other override.
``--lr-warmup-fraction F`` sets ``optimizer.schedule.warmup_steps`` to ``F`` × the decay length
(``optimizer.schedule.decay_steps``, else the job's steps), as Megatron-LM does, refused where that is no whole
number of steps (:data:`~megatron_logra.megatron_flags.STEP_FRACTION_FLAGS`).
``--max-position-embeddings`` only checks ``model.seq_length`` (:data:`~megatron_logra.megatron_flags.CHECK_FLAGS`).
slime's ``--dynamic-sampling-filter-path`` and ``--over-sampling-batch-size`` are resolved last, against
``rl.dynamic_sampling_rounds`` (:mod:`~megatron_logra.megatron_flags.dynamic_sampling`).
A field the configured job never reads, given at a value other than its default (``train.steps`` with job=rl,
``rl.*`` / ``task.*`` / ``kl.*`` ... with job=lm), is refused, naming the job's own field
(:data:`~megatron_logra.config.checks._LM_ONLY`, :data:`~megatron_logra.config.checks._RL_ONLY`).

``task.datasets`` set without ``task.dataset_kwargs`` drops the kwargs of datasets it no longer lists
(:func:`_drop_unselected_dataset_kwargs`).
"""

from __future__ import annotations

import logging
from typing import Any, Mapping, Optional, Sequence

from megatron_logra.config.args import Collector, Item, _parse_overrides, raise_errors
from megatron_logra.config.checks import (_check_logra_rank, _check_other_job_unused, _check_paper_unused,
                                          _warn_log_interval_unread, resolve_hf_model)
from megatron_logra.config.field_setter import FieldSetter
from megatron_logra.config.run import RunConfig
from megatron_logra.megatron_flags import (CHECK_FLAGS, CHECK_SWITCHES, CONTEXT_FLAGS, LOAD_FLAGS, MEGATRON_ALIASES,
                                           SCHEDULE_RATIO_FLAGS, STEP_FRACTION_FLAGS, SWITCH_DEFAULTS, VALUE_MAPS,
                                           check_flag, check_switch, map_value, note_kl_loss_coef, resolve_alias,
                                           schedule_ratio, step_fraction)
from megatron_logra.megatron_flags.dynamic_sampling import resolve_sampling, sampling_order
from megatron_logra.megatron_flags.slime import CLIP_FLAGS, SLIME_SAMPLING_FLAGS
from megatron_logra.megatron_flags.slime_resolve import check_estimator, resolve_clip, slime_eval_sampling
from megatron_logra.optim.schedule import ABSOLUTE_LRS

logger = logging.getLogger(__name__)

__all__ = ["apply_overrides"]


def _apply_items(cfg: RunConfig, items: Sequence[Item],
                 errors: Optional[list[ValueError]] = None) -> tuple[RunConfig, set[str]]:
    """Set ``(key, value, spelling)`` items in order (a key may be a Megatron-LM flag name), then the flags whose
    field depends on the rest of the config (:func:`resolve_alias`) against the config they leave. One field set
    to different values under two spellings is a ``ValueError`` naming both (:class:`~megatron_logra.config.field_setter.FieldSetter`).
    ``errors``: where given, each item's ``ValueError`` is appended to it and the others are still applied.
    Returns the config and the dotted fields set."""
    deferred: list[Item] = []
    ratios: list[Item] = []  # after the peak lr (--lr, itself deferred) is known
    sampling: list[Item] = []  # slime's dynamic sampling: after every field it reads (rl.*, job) is set
    setter = FieldSetter(cfg)
    collect = Collector(errors)
    # a flag of VALUE_MAPS sets a field chosen by its value (--advantage-estimator gspo: rl.loss.kind): given twice,
    # only its last value is applied, as a repeated key takes its last value, so no earlier value's field remains
    last = {key: i for i, (key, _, _) in enumerate(items) if key in VALUE_MAPS}
    for index, (key, raw, spelling) in enumerate(items):
        if key in VALUE_MAPS and last[key] != index:
            continue
        with collect:
            if key in SCHEDULE_RATIO_FLAGS or key in STEP_FRACTION_FLAGS:
                ratios.append((key, raw, spelling))
            elif key in SLIME_SAMPLING_FLAGS:
                sampling.append((key, raw, spelling))
            elif key in CONTEXT_FLAGS:
                deferred.append((key, raw, spelling))
            elif key in LOAD_FLAGS:
                for field, fixed in LOAD_FLAGS[key]:
                    setter.put(field, raw if fixed is None else fixed, spelling)
            elif key in VALUE_MAPS:
                setter.put(*map_value(key, raw), spelling, key)
            else:
                setter.put(MEGATRON_ALIASES.get(key, key), raw, spelling)
    for flag, raw, spelling in deferred:
        with collect:
            _apply_deferred(cfg, setter, flag, raw, spelling)
    for flag, raw, spelling in ratios:
        with collect:
            if flag in STEP_FRACTION_FLAGS:  # after --train-iters (deferred) is known
                setter.put(*step_fraction(cfg, flag, raw), spelling, flag)
                continue
            target, value = schedule_ratio(cfg, flag, raw)
            setter.put(target, value, spelling, flag)
            ratio = ABSOLUTE_LRS[target.rpartition(".")[2]]
            if f"optimizer.schedule.{ratio}" not in setter.set_by:
                # the flag replaces the ratio of the config it overrides (a recipe file's, or a resumed run's saved
                # before the absolute field existed, where the flag was kept as that ratio); given here too, both
                # are refused
                setattr(cfg.optimizer.schedule, ratio, 0.0)
    for flag, raw, spelling in sorted(sampling, key=lambda item: sampling_order(item[0])):  # the filter first
        with collect:
            resolve_sampling(cfg, setter, flag, raw, spelling)
    given = set(setter.set_by)
    note_kl_loss_coef(cfg, [key for key, _, _ in items])
    with collect:
        check_estimator(cfg, items)
    with collect:
        for field, value, spelling in slime_eval_sampling(cfg, items, setter.set_by):
            setter.put(field, value, spelling, "n-samples-per-eval-prompt")
    _drop_unselected_dataset_kwargs(cfg, given)
    return cfg, given


def _apply_deferred(cfg: RunConfig, setter: FieldSetter, flag: str, raw: Any, spelling: str) -> None:
    """Apply one flag of :data:`CONTEXT_FLAGS` against the config the other overrides left."""
    if flag in CHECK_FLAGS:
        check_flag(cfg, flag, raw)
    elif flag in CHECK_SWITCHES:
        check_switch(cfg, flag, set(setter.set_by))
    elif flag in SWITCH_DEFAULTS:
        target, value = SWITCH_DEFAULTS[flag]
        if target not in setter.set_by:
            setter.put(target, value, spelling)
    elif flag in CLIP_FLAGS:
        kind = resolve_clip(cfg, flag, setter.set_by)
        setter.put(CLIP_FLAGS[flag], raw, spelling, flag)
        if kind is not None:
            setter.put("rl.loss.kind", kind, spelling, flag)
    else:
        target = resolve_alias(cfg, flag, raw)
        if target is not None:  # None: a check only (--global-batch-size of the RL job)
            setter.put(target, raw, spelling, flag)


def _drop_unselected_dataset_kwargs(cfg: RunConfig, given: set[str]) -> None:
    """``task.datasets`` set (``given``) without ``task.dataset_kwargs``: the kwargs already in ``cfg`` (a named
    recipe's, a base recipe file's, a resumed run's) belong to the datasets it listed, so those of datasets no
    longer listed are dropped (logged) instead of refused, e.g. ``megatron-logra train tiny task.datasets=gcd``.
    ``task.dataset_kwargs`` given as well is kept as given: one for a dataset not listed is still refused."""
    if "task.datasets" not in given or "task.dataset_kwargs" in given:
        return
    kwargs, datasets = cfg.task.dataset_kwargs, cfg.task.datasets
    if not isinstance(kwargs, dict) or not kwargs:
        return
    if isinstance(datasets, str):
        datasets = datasets.split(",")
    listed = {d.strip() for d in datasets if isinstance(d, str)}
    dropped = sorted(name for name in kwargs if name not in listed)
    if dropped:
        logger.info("task.datasets=%s: dropping task.dataset_kwargs for %s (no longer listed)",
                    list(datasets), ", ".join(dropped))
        cfg.task.dataset_kwargs = {k: v for k, v in kwargs.items() if k in listed}


def apply_overrides(cfg: RunConfig, overrides: Sequence[str]) -> RunConfig:
    """Apply dotted overrides and Megatron-LM flags (see module docstring), then validate. ``cfg`` is taken
    as the user's own (a run's saved config): its ``tokenizer.path`` stays, with ``model.hf_path`` too."""
    return _apply_overrides(cfg, overrides, {})


def _apply_overrides(cfg: RunConfig, overrides: Sequence[str], given: Mapping[str, str], *,
                     from_recipe: bool = False, pending: Sequence = ()) -> RunConfig:
    """:func:`apply_overrides`, where ``given`` (dotted field -> where it was set) names the fields a recipe
    file set, which :func:`resolve_hf_model` checks with those of the overrides; ``from_recipe``: the other
    fields are a named recipe's (see :func:`resolve_hf_model`); ``pending``: the recipe files' context flags,
    resolved again against the overrides' config (:func:`~megatron_logra.config.recipe_context.resolve_pending`)."""
    errors: list[ValueError] = []
    items = _parse_overrides(overrides, errors)
    cfg, mine = _apply_items(cfg, items, errors)
    raise_errors(errors)
    if pending:
        from megatron_logra.config.recipe_context import resolve_pending

        resolve_pending(cfg, pending, items, mine)
    given = {**given, **{key: "" for key in mine}}
    _check_paper_unused(cfg, given)
    _check_other_job_unused(cfg, given)
    _warn_log_interval_unread(cfg, given)
    if "train.eval_sequences" in given and cfg.train.eval_batches is not None:
        where = " (in the resumed run's config)" if "train.eval_batches" not in given else ""
        raise ValueError(f"train.eval_sequences={cfg.train.eval_sequences} is given, but the deprecated "
                         f"train.eval_batches={cfg.train.eval_batches}{where} replaces it; give train.eval_batches=null "
                         f"as well to evaluate train.eval_sequences sequences")
    cfg = resolve_hf_model(cfg.validate(), given, from_recipe=from_recipe)
    _check_logra_rank(cfg, given)
    return cfg
