"""A :class:`~megatron_logra.config.RunConfig` from a recipe name or YAML file and command-line overrides:
:func:`load_recipe` (named recipes and recipe files), :func:`apply_overrides` (dotted fields and
Megatron-LM flags, including the flag alias tables), :func:`resolve_hf_model` (``model.hf_path``'s
architecture) and :func:`parse_args_to_config` (all of them, as the CLI calls it). Values are parsed by
the fields' annotated types with the rules of :mod:`megatron_logra.config` (shared with its
:func:`~megatron_logra.config.from_dict`).

Overrides take any of these forms::

    optimizer.logra.rank=64      --optimizer.logra.rank 64      --logra.rank=64
    --tensor-model-parallel-size 2   --micro-batch-size 4   --bf16

``logra.``, ``native.`` and ``schedule.`` are short for ``optimizer.logra.``, ``optimizer.native.`` and
``optimizer.schedule.``.
Every value is parsed by the field's annotated type and the whole config is re-validated.

A few Megatron-LM flags set the field that the configured job reads (:func:`resolve_alias`, after
every other override, so ``job=...`` anywhere on the line counts): ``--train-iters``,
``--micro-batch-size`` and ``--eval-interval`` set ``train.*`` for ``job=lm`` and ``rl.steps``,
``rl.micro_batch_size``, ``rl.eval_interval`` for ``job=rl``; ``--global-batch-size`` is
``train.global_batch_size`` (lm) and refused for RL, whose step trains ``rl.prompts_per_step ×
rl.group_size`` sequences. The optimizer flags (``--lr``, ``--weight-decay``, ``--clip-grad``,
``--adam-beta1/2``, ``--adam-eps``) follow ``optimizer.name`` and ``logra.recipe``
(:data:`OPTIMIZER_ALIASES`); one the configured optimizer would not read is refused.
``--lr-warmup-init`` and ``--min-lr`` (absolute lrs) become ratios of ``optimizer.schedule``
(:data:`SCHEDULE_RATIO_FLAGS`), resolved after every other override.
``--max-position-embeddings`` only checks ``model.seq_length`` (:data:`CHECK_FLAGS`). A field the configured job
never reads, given at a value other than its default (``train.steps`` with job=rl, ``rl.*`` / ``task.*`` / ``kl.*``
... with job=lm), is refused, naming the job's own field (:data:`_LM_ONLY`, :data:`_RL_ONLY`).

``task.datasets`` set without ``task.dataset_kwargs`` drops the kwargs (of the recipe, a base recipe file or the
resumed run) of datasets it no longer lists: ``megatron-logra train tiny task.datasets=gcd`` needs no
``task.dataset_kwargs={}`` for the recipe's chain_sum kwargs.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import typing
from pathlib import Path
from typing import Any, Mapping, Optional, Sequence, Union

import yaml

from megatron_logra.config import RECIPES, RunConfig, _coerce, _is_section, _section_type, _short
from megatron_logra.optim.config import LograConfig
from megatron_logra.yaml_unique import safe_load_unique

logger = logging.getLogger(__name__)

__all__ = ["load_recipe", "apply_overrides", "parse_args_to_config", "MEGATRON_ALIASES", "JOB_ALIASES",
           "OPTIMIZER_ALIASES", "SCHEDULE_RATIO_FLAGS", "CHECK_FLAGS", "resolve_alias", "resolve_hf_model"]


# ---------------------------------------------------------------------------- recipe files
def load_recipe(name_or_path: str) -> RunConfig:
    """A named recipe or a YAML file (a partial RunConfig dict, applied over the defaults).

    A file may name its base with ``recipe: NAME_OR_FILE`` (a relative file path is relative to the file's
    own directory); its other keys are dotted sections/fields
    (``train: {steps: 3}``) parsed by the fields' types. A key given twice in one mapping is refused, and so
    is, with ``model.hf_path``, an architecture field set by a file that the checkpoint would replace
    (:func:`resolve_hf_model`). Every problem is a ``ValueError`` naming the file. With ``model.hf_path``, a
    ``tokenizer.path`` that no file of the chain sets (a named recipe's) yields to the checkpoint's tokenizer.
    """
    cfg, given = _load_recipe(name_or_path)
    return resolve_hf_model(cfg, given, from_recipe=True)


def _load_recipe(name_or_path: str, _including: tuple = ()) -> tuple[RunConfig, dict[str, str]]:
    """:func:`load_recipe` without ``model.hf_path``'s resolution: the config and the dotted fields the
    recipe files of the chain set, each mapped to ``"recipe file PATH"`` (empty for a named recipe)."""
    if not isinstance(name_or_path, str):
        raise ValueError(f"recipe={_short(name_or_path)}: give a recipe name ({', '.join(sorted(RECIPES))}) "
                         "or a .yaml file")
    if name_or_path in RECIPES:
        return RECIPES[name_or_path](), {}
    path = Path(name_or_path)
    if path.suffix.lower() not in (".yaml", ".yml"):
        raise ValueError(f"unknown recipe {name_or_path!r}: choose one of {sorted(RECIPES)} or a .yaml file")
    if not path.exists():
        raise ValueError(f"recipe file {path} does not exist (check the path; named recipes: {sorted(RECIPES)})")
    if not path.is_file():
        raise ValueError(f"recipe file {path} is not a file")
    resolved = path.resolve()
    if resolved in _including:
        chain = " -> ".join(str(p) for p in (*_including, resolved))
        raise ValueError(f"recipe file {path} includes itself through 'recipe:' ({chain}); break the cycle")
    try:
        text = path.read_text()
    except (OSError, UnicodeDecodeError) as exc:
        raise ValueError(f"cannot read recipe file {path}: {exc}") from None
    try:
        data = safe_load_unique(text)
    except ValueError as exc:  # a repeated key (DuplicateKeyError)
        raise ValueError(f"recipe file {path}: {exc}") from None
    except yaml.YAMLError as exc:
        raise ValueError(f"recipe file {path} is not valid YAML: {_yaml_problem(exc)}") from None
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ValueError(
            f"recipe file {path}: the top level must be a mapping of config sections and fields "
            f"(e.g. 'recipe: tiny' / 'train:' / 'rl:'), got a {type(data).__name__} {_short(data)}"
        )
    data = dict(data)
    base = data.pop("recipe", None)
    if base is not None and not isinstance(base, str):
        raise ValueError(f"recipe file {path}: recipe={_short(base)} must be a recipe name "
                         f"({', '.join(sorted(RECIPES))}) or a .yaml file")
    if base and base not in RECIPES and not Path(base).is_absolute():
        base = str(path.parent / base)  # a file names its base relative to itself, not to the working directory
    try:
        cfg, given = _load_recipe(base, (*_including, resolved)) if base else (RunConfig(), {})
        items = _flatten(data)
        _check_spelled_twice(items)
        cfg, mine = _apply_items(cfg, items)
        return cfg.validate(), {**given, **{key: f"recipe file {path}" for key in mine}}
    except ValueError as exc:
        raise ValueError(f"recipe file {path}: {exc}") from None


def _check_spelled_twice(items: Sequence[tuple[str, Any]]) -> None:
    """One field set twice in one recipe file under two spellings (``train: {steps: 5}`` and ``train.steps: 6``,
    ``logra:`` and ``optimizer: {logra: ...}``, a Megatron-LM flag name and its field) is refused: only the last
    would count, as with a repeated YAML key."""
    seen: dict[str, str] = {}
    for key, _ in items:
        if key in _CONTEXT_FLAGS:  # checked against the field they resolve to by _apply_items
            continue
        field = _canonical(MEGATRON_ALIASES.get(key, key))
        if field in seen:
            raise ValueError(f"{field} is set twice (as {seen[field]!r} and as {key!r}; a nested section and a dotted "
                             f"key, a shortcut or a flag name spell the same field): only the last would count; "
                             f"set it once")
        seen[field] = key


def _yaml_problem(exc: Exception) -> str:
    mark = getattr(exc, "problem_mark", None)
    problem = getattr(exc, "problem", None)
    if mark is None or not problem:
        return " ".join(str(exc).split())
    context = getattr(exc, "context", None)
    return f"line {mark.line + 1}, column {mark.column + 1}: {problem}" + (f" ({context})" if context else "")


def _flatten(data: dict, prefix: str = "") -> list[tuple[str, Any]]:
    """Nested YAML sections -> (dotted key, value); a mapping given to a dict-typed field stays whole."""
    out = []
    for k, v in data.items():
        key = f"{prefix}{k}"
        ftype = _field_type(key)
        if isinstance(v, dict) and not _is_mapping_type(ftype) and (v or _is_section(ftype)):
            out.extend(_flatten(v, f"{key}."))  # an empty section ("rl: {}") changes nothing
        else:
            out.append((key, v))
    return out


def _field_type(key: str) -> Any:
    """The annotated type of dotted ``key`` in :class:`RunConfig` (shortcuts and aliases applied), or None."""
    key = _expand(MEGATRON_ALIASES.get(key, key))
    cls: Any = RunConfig
    ftype: Any = None
    for part in key.split("."):
        if not _is_section(cls):
            return None
        hints = typing.get_type_hints(_section_type(cls))
        if part not in hints:
            return None
        ftype = cls = hints[part]
    return ftype


def _is_mapping_type(ftype: Any) -> bool:
    if typing.get_origin(ftype) is typing.Union:
        return any(_is_mapping_type(a) for a in typing.get_args(ftype))
    return ftype is dict or typing.get_origin(ftype) is dict


# ---------------------------------------------------------------------------- overrides
MEGATRON_ALIASES: dict[str, str] = {
    "tensor-model-parallel-size": "parallel.tp",
    "pipeline-model-parallel-size": "parallel.pp",
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

SCHEDULE_RATIO_FLAGS: dict[str, str] = {"lr-warmup-init": "optimizer.schedule.warmup_init_ratio",
                                         "min-lr": "optimizer.schedule.min_lr_ratio"}
"""Megatron-LM's absolute schedule lrs -> the ``optimizer.schedule`` ratio they set (:func:`_schedule_ratio`):
the value divided by the peak lr that ``--lr`` sets for the configured optimizer (the first of
:meth:`~megatron_logra.optim.config.OptimizerConfig.scheduled_lrs`: ``optimizer.logra.lr`` for LoGRA's optimizer
recipe, ``optimizer.native.lr`` for dense AdamW and for the paper recipe, whose schedule reaches the non-target
AdamW only). The same ratio then applies to every scheduled lr. Resolved after every other override, so the
order of ``--lr`` / ``--min-lr`` on the line does not matter; a peak lr of 0, a value above the peak or a
configuration where no lr follows a schedule is refused."""

CHECK_FLAGS: tuple[str, ...] = ("max-position-embeddings",)
"""Megatron-LM flags without a field of their own, accepted as a check (:func:`_check_flag`):
``--max-position-embeddings N`` needs ``N >= model.seq_length`` (positions run up to ``model.seq_length``;
RoPE has no position table) and, with learned absolute positions (a table of ``model.seq_length`` rows),
``N == model.seq_length``. It never changes ``model.seq_length`` (``--seq-length``)."""

SWITCH_DEFAULTS: dict[str, tuple[str, Any]] = {"use-rope-scaling": ("model.rope_scaling_factor", 8.0)}
"""Megatron-LM switches that turn on a feature whose value another flag may give, in either order:
``--use-rope-scaling`` sets ``model.rope_scaling_factor`` to Megatron-LM's default factor 8 unless
``--rope-scaling-factor`` (or the field) gives one."""

_CONTEXT_FLAGS = (frozenset(JOB_ALIASES) | frozenset(OPTIMIZER_ALIASES) | frozenset(CHECK_FLAGS)
                  | frozenset(SWITCH_DEFAULTS) | frozenset(SCHEDULE_RATIO_FLAGS))
"""Flags set by :func:`resolve_alias`, after the other overrides."""

# Megatron-LM boolean flags (no value) -> (dotted key, value)
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
    "resume": ("train.resume", "true"),
    "use-rope-scaling": ("use-rope-scaling", "true"),  # SWITCH_DEFAULTS
}

_SHORTCUTS = {"logra.": "optimizer.logra.", "native.": "optimizer.native.", "schedule.": "optimizer.schedule."}


def _expand(key: str) -> str:
    for short, full in _SHORTCUTS.items():
        if key.startswith(short):
            return full + key[len(short):]
        if key == short[:-1]:  # the section itself ("logra" -> "optimizer.logra")
            return full[:-1]
    return key


def set_dotted(cfg: Any, key: str, raw: Any) -> None:
    """Set ``cfg.<key>`` from ``raw`` (a command-line string, or a YAML value), parsed by the field's type."""
    key = _expand(key)
    parts = key.replace("-", "_").split(".")
    key = ".".join(parts)
    obj = cfg
    for i, part in enumerate(parts):
        if not dataclasses.is_dataclass(obj):
            raise ValueError(f"unknown config key {key!r}: {'.'.join(parts[:i])} is not a section")
        names = {f.name for f in dataclasses.fields(obj)}
        if part not in names:
            where = ".".join(parts[:i]) or "the run config"
            raise ValueError(f"unknown config key {key!r}: {where} has no field {part!r}; known: {sorted(names)}")
        if i == len(parts) - 1:
            ftype = typing.get_type_hints(type(obj))[part]
            setattr(obj, part, _coerce(raw, ftype, key))
        else:
            obj = getattr(obj, part)


def _canonical(key: str) -> str:
    """The dotted field ``key`` names, as :func:`set_dotted` spells it (shortcuts expanded, ``-`` -> ``_``)."""
    return _expand(key).replace("-", "_")


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


def _schedule_ratio(cfg: RunConfig, flag: str, raw: Any) -> tuple[str, float]:
    """``(field, ratio)`` for the absolute-lr flag ``flag`` of :data:`SCHEDULE_RATIO_FLAGS` against ``cfg``'s
    peak lr; ``ValueError`` naming the flag and the fields where it cannot be converted."""
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
        raise ValueError(f"--{flag}={value} is an absolute lr, converted to {target} as a fraction of the peak lr "
                         f"{peak_field}, which is 0 here; set --lr / {peak_field} > 0 or give {target} directly")
    if value > peak:
        raise ValueError(f"--{flag}={value} exceeds the peak lr {peak_field}={peak} (--lr): a schedule runs from "
                         f"and down to fractions of the peak; lower --{flag} or raise --lr")
    return target, value / peak


def _check_flag(cfg: RunConfig, flag: str, raw: Any) -> None:
    """See :data:`CHECK_FLAGS`."""
    value = _coerce(raw, int, f"--{flag}")
    seq, kind = cfg.model.seq_length, cfg.model.position_embedding_type
    if value < seq:
        raise ValueError(f"--{flag}={value} is below model.seq_length={seq}: positions run up to model.seq_length "
                         f"(there is no separate position limit); set --seq-length / model.seq_length to at most "
                         f"{value} or raise --{flag}")
    if kind == "learned_absolute" and value != seq:
        raise ValueError(f"--{flag}={value}: model.position_embedding_type=learned_absolute has a table of "
                         f"model.seq_length={seq} positions; set --seq-length {value} to size it (or drop --{flag})")


def _apply_items(cfg: RunConfig, items: Sequence[tuple[str, Any]]) -> tuple[RunConfig, set[str]]:
    """Set ``(key, value)`` pairs in order (a key may be a Megatron-LM flag name), then the flags whose
    field depends on the rest of the config (:func:`resolve_alias`) against the config they leave.
    Returns the config and the dotted fields set."""
    deferred: list[tuple[str, Any]] = []
    ratios: list[tuple[str, Any]] = []  # after the peak lr (--lr, itself deferred) is known
    given: set[str] = set()
    for key, raw in items:
        if key in SCHEDULE_RATIO_FLAGS:
            ratios.append((key, raw))
            continue
        if key in _CONTEXT_FLAGS:
            deferred.append((key, raw))
            continue
        key = MEGATRON_ALIASES.get(key, key)
        set_dotted(cfg, key, raw)
        given.add(_canonical(key))
    for flag, raw in deferred:
        if flag in CHECK_FLAGS:
            _check_flag(cfg, flag, raw)
            continue
        if flag in SWITCH_DEFAULTS:
            target, value = SWITCH_DEFAULTS[flag]
            if target not in given:
                set_dotted(cfg, target, value)
                given.add(target)
            continue
        target = resolve_alias(cfg, flag)
        if target in given:
            raise ValueError(f"--{flag} sets {target} here, which is also given: give only one of them")
        set_dotted(cfg, target, raw)
        given.add(target)
    for flag, raw in ratios:
        target, ratio = _schedule_ratio(cfg, flag, raw)
        if target in given:
            raise ValueError(f"--{flag} sets {target} here, which is also given: give only one of them")
        set_dotted(cfg, target, ratio)
        given.add(target)
    _drop_unselected_dataset_kwargs(cfg, given)
    return cfg, given


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
                     from_recipe: bool = False) -> RunConfig:
    """:func:`apply_overrides`, where ``given`` (dotted field -> where it was set) names the fields a recipe
    file set, which :func:`resolve_hf_model` checks with those of the overrides; ``from_recipe``: the other
    fields are a named recipe's (see :func:`resolve_hf_model`)."""
    items: list[tuple[str, Any]] = []
    pending = list(overrides)
    i = 0
    while i < len(pending):
        item = pending[i]
        i += 1
        if item.startswith("--"):
            body = item[2:]
            if "=" in body:
                key, raw = body.split("=", 1)
            elif body in MEGATRON_FLAGS:
                items.append(MEGATRON_FLAGS[body])
                continue
            else:
                if i >= len(pending):
                    raise ValueError(f"option {item} needs a value")
                key, raw = body, pending[i]
                i += 1
        elif "=" in item:
            key, raw = item.split("=", 1)
        else:
            raise ValueError(f"cannot parse override {item!r}: use key=value or --key value")
        items.append((key, raw))
    cfg, mine = _apply_items(cfg, items)
    given = {**given, **{key: "" for key in mine}}
    _check_paper_unused(cfg, given)
    _check_other_job_unused(cfg, given)
    if "train.eval_sequences" in given and cfg.train.eval_batches is not None:
        where = " (in the resumed run's config)" if "train.eval_batches" not in given else ""
        raise ValueError(f"train.eval_sequences={cfg.train.eval_sequences} is given, but the deprecated "
                         f"train.eval_batches={cfg.train.eval_batches}{where} replaces it; give train.eval_batches=null "
                         f"as well to evaluate train.eval_sequences sequences")
    return resolve_hf_model(cfg.validate(), given, from_recipe=from_recipe)


_PAPER_UNUSED: dict[str, tuple[str, str]] = {
    "lr": ("its step is optimizer.logra.update_ratio scaled by the KL controller's α",
           " (optimizer.logra.update_ratio sizes the targets' step, optimizer.native.lr the other parameters')"),
    "weight_decay": ("it applies no weight decay to the target layers",
                     " (optimizer.native.weight_decay decays the non-target parameters)"),
    "clip_grad": ("it does not clip: the KL controller's α bounds each step", ""),
}
"""Fields of ``optimizer.logra`` that ``recipe=paper`` does not read: (why, what to do instead)."""


def _check_paper_unused(cfg: RunConfig, given: Mapping[str, str]) -> None:
    """With ``optimizer.logra.recipe=paper`` (LoGRA), an ``optimizer.logra.lr`` / ``weight_decay`` /
    ``clip_grad`` the user gave (``given``: an override or a recipe file's field) at a value other than the
    field's default would be silently ignored: refused, naming it, as the ``--lr`` / ``--weight-decay`` /
    ``--clip-grad`` flags are. Values of a named recipe or a resumed run's saved config are not "given"."""
    opt = cfg.optimizer
    if opt.name != "logra" or opt.logra.recipe != "paper":
        return
    defaults = LograConfig()
    for name, (why, hint) in _PAPER_UNUSED.items():
        key = f"optimizer.logra.{name}"
        value = getattr(opt.logra, name)
        if key in given and value != getattr(defaults, name):
            where = f" in {given[key]}" if given[key] else ""
            raise ValueError(f"{key}={value} is set{where}, but optimizer.logra.recipe=paper does not use it ({why}); "
                             f"remove {key}{hint}, or use optimizer.logra.recipe=optimizer")


_LM_ONLY: dict[str, str] = {
    "train.steps": "the RL job runs rl.steps",
    "train.micro_batch_size": "the RL job's micro-batch is rl.micro_batch_size",
    "train.global_batch_size": "each RL step trains rl.prompts_per_step × rl.group_size sequences",
    "train.eval_interval": "the RL job evaluates every rl.eval_interval steps",
    "train.eval_sequences": "the RL job evaluates task.num_eval held-out problems",
    "train.eval_batches": "the RL job evaluates task.num_eval held-out problems",
    "data.": "the RL job's problems are task.*",
}
"""Fields (``data.``: the section) only the lm job reads, with what the RL job reads instead."""

_RL_ONLY: dict[str, str] = {
    "rl.steps": "the lm job runs train.steps",
    "rl.micro_batch_size": "the lm job's micro-batch is train.micro_batch_size",
    "rl.eval_interval": "the lm job evaluates every train.eval_interval steps",
    "rl.": "the lm job's loop is train.*",
    "task.": "the lm job's synthetic task is data.*",
    "sft.": "the lm job has no warm start",
    "kl.": "the lm job has no KL step control",
    "sync.": "the lm job has no rollout engine to sync",
    "tokenizer.": "the lm job's synthetic task has no tokenizer",
}
"""Fields (a key ending in ``.``: the section) only the RL job reads, with what the lm job reads instead."""


def _check_other_job_unused(cfg: RunConfig, given: Mapping[str, str]) -> None:
    """A field the user gave (``given``: an override or a recipe file's field) at a value other than the
    field's default that the configured job never reads (the lm job's ``train.steps`` etc. with job=rl, the RL
    sections with job=lm) would be silently ignored: refused, naming the field and the job's own. Values of a
    named recipe or a resumed run's saved config are not "given"."""
    unused = _LM_ONLY if cfg.job == "rl" else _RL_ONLY
    sections = {f.name: f for f in dataclasses.fields(RunConfig)}
    for key in sorted(given):
        why = unused.get(key) or next((w for k, w in unused.items() if k.endswith(".") and key.startswith(k)), None)
        if why is None:
            continue
        first, *rest = key.split(".")
        value, default = getattr(cfg, first), sections[first].default_factory()  # the section's defaults
        for part in rest:
            value, default = getattr(value, part), getattr(default, part)
        if value == default:
            continue
        where = f" in {given[key]}" if given[key] else ""
        raise ValueError(f"{key}={_short(value)} is set{where}, but the {cfg.job} job does not read it ({key} is the "
                         f"{'lm' if cfg.job == 'rl' else 'RL'} job's; {why}); remove {key}")


def resolve_hf_model(cfg: RunConfig, given: Union[Sequence[str], Mapping[str, str]] = (), *,
                     from_recipe: bool = False) -> RunConfig:
    """With ``model.hf_path`` (job=rl), the checkpoint's architecture replaces the config's, as the RL job
    does when it starts (``convert.model_config_from_hf``; the run's own choices, such as ``seq_length`` and
    the dtype, stay): a missing or unreadable checkpoint is a ``ValueError`` naming ``model.hf_path``, and so is
    an architecture field among ``given`` (fields set by the overrides or a recipe file; a mapping names where
    each was set, e.g. ``"recipe file x.yaml"``, ``""`` for the command line) that the checkpoint would replace.

    The checkpoint brings its tokenizer too: with ``from_recipe`` (the fields not in ``given`` are a named
    recipe's, as for ``megatron-logra train RECIPE``), a ``tokenizer.path`` not in ``given`` (the ``tiny``
    recipe's own word tokenizer) is cleared, so the RL job loads the tokenizer of ``model.hf_path``; one the
    user gave (an override or a recipe file's field) stays. Without ``from_recipe`` (a resumed run's saved
    config) ``tokenizer.path`` is left as it is."""
    if cfg.job != "rl" or not cfg.model.hf_path:
        return cfg
    if from_recipe and cfg.tokenizer.path and "tokenizer.path" not in given:
        cfg.tokenizer.path = ""
    from megatron_logra.convert.spec import ARCH_FIELDS, model_config_from_hf

    where = given if isinstance(given, Mapping) else dict.fromkeys(given, "")
    mine = cfg.model
    cfg.model = model_config_from_hf(mine.hf_path, base=mine)
    replaced = []
    for k in ARCH_FIELDS:
        source = where.get(f"model.{k}")
        if source is not None and getattr(mine, k) != getattr(cfg.model, k):
            replaced.append(f"model.{k}={getattr(mine, k)!r} ({f'set in {source}; ' if source else ''}the checkpoint "
                            f"has {getattr(cfg.model, k)!r})")
    if replaced:
        raise ValueError(f"{'; '.join(replaced)}: the architecture comes from model.hf_path={mine.hf_path!r}; drop "
                         f"the override (or the recipe file's field) or start from another checkpoint")
    cfg.check_parallel_split()  # RunConfig's own check waits for the checkpoint's sizes
    return cfg.validate()


def parse_args_to_config(recipe: Optional[str], overrides: Sequence[str]) -> RunConfig:
    """Recipe (default ``tiny``) plus overrides; with ``model.hf_path``, an architecture field set by a recipe
    file or an override that the checkpoint would replace is refused, and the checkpoint's tokenizer replaces
    a named recipe's ``tokenizer.path`` unless the user gave one (:func:`resolve_hf_model`)."""
    cfg, given = _load_recipe(recipe or "tiny")
    return _apply_overrides(cfg, overrides, given, from_recipe=True)
