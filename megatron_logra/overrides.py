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

The Megatron-LM flags and what each one does here are the tables of :mod:`megatron_logra.megatron_flags`
(re-exported here): a flag with a field of its own sets it; well-known switches whose setting is already in
effect here (``--use-distributed-optimizer``, ``--use-mcore-models``, ``--group-query-attention``, the
``--no-*-fusion`` switches, ...) are accepted and ignored with a logged warning saying why; flags this trainer
cannot honour (``--data-path``, ``--tokenizer-type``, ``--finetune``, ...) are refused, naming what to use; any
other ``--name`` that is no config field is refused, naming the closest flags and fields, and never takes the
next argument as its value. ``--load DIR`` is ``train.run_dir=DIR train.resume=true``.

One field set on the command line to different values under two spellings (``--tensor-model-parallel-size 2
parallel.tp=1``, ``logra.rank=8 optimizer.logra.rank=4``, ``--train-iters 5 rl.steps=7``) is refused, naming
both; the same value twice is fine, and the same key repeated (overrides appended to a command line) takes its
last value. With LoGRA, ``optimizer.logra.rank`` above
the input width of a target layer is refused here, before anything is built.

A few Megatron-LM flags set the field that the configured job reads (:func:`resolve_alias`, after
every other override, so ``job=...`` anywhere on the line counts): ``--train-iters``,
``--micro-batch-size`` and ``--eval-interval`` set ``train.*`` for ``job=lm`` and ``rl.steps``,
``rl.micro_batch_size``, ``rl.eval_interval`` for ``job=rl``; ``--global-batch-size`` is
``train.global_batch_size`` (lm) and refused for RL, whose step trains ``rl.prompts_per_step ×
rl.group_size`` sequences. The optimizer flags (``--lr``, ``--weight-decay``, ``--clip-grad``,
``--adam-beta1/2``, ``--adam-eps``) follow ``optimizer.name`` and ``logra.recipe``
(:data:`OPTIMIZER_ALIASES`); one the configured optimizer would not read is refused.
``--lr-warmup-init`` and ``--min-lr`` (absolute lrs) set ``optimizer.schedule.warmup_init_lr`` /
``optimizer.schedule.min_lr`` as given (:data:`SCHEDULE_RATIO_FLAGS`), resolved after every other override.
``--max-position-embeddings`` only checks ``model.seq_length`` (:data:`CHECK_FLAGS`). A field the configured job
never reads, given at a value other than its default (``train.steps`` with job=rl, ``rl.*`` / ``task.*`` / ``kl.*``
... with job=lm), is refused, naming the job's own field (:data:`_LM_ONLY`, :data:`_RL_ONLY`).

``task.datasets`` set without ``task.dataset_kwargs`` drops the kwargs (of the recipe, a base recipe file or the
resumed run) of datasets it no longer lists: ``megatron-logra train tiny task.datasets=gcd`` needs no
``task.dataset_kwargs={}`` for the recipe's chain_sum kwargs.
"""

from __future__ import annotations

import dataclasses
import difflib
import logging
import math
import typing
from pathlib import Path
from typing import Any, Mapping, Optional, Sequence, Union

import yaml

from megatron_logra.config import RECIPES, RunConfig, _coerce, _is_section, _section_type, _short
from megatron_logra.megatron_flags import (CHECK_FLAGS, CHECK_SWITCHES, CONTEXT_FLAGS, IGNORED_SWITCHES,
                                           IGNORED_VALUE_FLAGS, JOB_ALIASES, LOAD_FLAGS, MEGATRON_ALIASES,
                                           MEGATRON_FLAGS, NEUTRAL_FLAGS, OPTIMIZER_ALIASES, REFUSED_SWITCHES,
                                           REFUSED_VALUE_FLAGS, SCHEDULE_RATIO_FLAGS, SWITCH_DEFAULTS, check_flag,
                                           check_switch, neutral_flag, resolve_alias, schedule_ratio,
                                           unknown_flag_error)
from megatron_logra.optim.config import LograConfig
from megatron_logra.optim.schedule import ABSOLUTE_LRS
from megatron_logra.yaml_unique import safe_load_unique

logger = logging.getLogger(__name__)

__all__ = ["load_recipe", "apply_overrides", "parse_args_to_config", "MEGATRON_ALIASES", "JOB_ALIASES",
           "OPTIMIZER_ALIASES", "SCHEDULE_RATIO_FLAGS", "CHECK_FLAGS", "MEGATRON_FLAGS", "resolve_alias",
           "resolve_hf_model"]

_CONTEXT_FLAGS = CONTEXT_FLAGS
"""Flags set by :func:`resolve_alias` (or checked), after the other overrides."""


# ---------------------------------------------------------------------------- recipe files
def load_recipe(name_or_path: str) -> RunConfig:
    """A named recipe or a YAML file (a partial RunConfig dict, applied over the defaults).

    A file may name its base with ``recipe: NAME_OR_FILE`` (a relative ``.yaml`` / ``.yml`` path is relative to
    the file's own directory; a blank ``recipe:`` is refused, a file without the key starts from the
    defaults); its other keys are dotted sections/fields
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
        close = difflib.get_close_matches(name_or_path, sorted(RECIPES), n=1)
        hint = f"did you mean {close[0]}? " if close else ""
        raise ValueError(f"unknown recipe {name_or_path!r}: {hint}choose one of {sorted(RECIPES)} or a .yaml file")
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
    if "recipe" in data and (data["recipe"] is None or (isinstance(data["recipe"], str) and not data["recipe"].strip())):
        # a blank base would silently fall back to the built-in defaults (an RL config)
        raise ValueError(f"recipe file {path}: 'recipe:' is empty: name a base recipe ({', '.join(sorted(RECIPES))}) "
                         f"or a .yaml file, or remove the key to start from the built-in defaults")
    base = data.pop("recipe", None)
    if base is not None and not isinstance(base, str):
        raise ValueError(f"recipe file {path}: recipe={_short(base)} must be a recipe name "
                         f"({', '.join(sorted(RECIPES))}) or a .yaml file")
    if base and base not in RECIPES and not Path(base).is_absolute() and Path(base).suffix.lower() in (".yaml", ".yml"):
        base = str(path.parent / base)  # a file names its base relative to itself, not to the working directory
    dashed = [str(k) for k in data if str(k).startswith("-")]
    if dashed:  # a flag pasted from a command line; its key is the name without the dashes
        raise ValueError(f"recipe file {path}: key {dashed[0]!r} starts with '-': a recipe's keys are fields or "
                         f"Megatron-LM flag names without the dashes ({dashed[0].lstrip('-')!r})")
    try:
        cfg, given = _load_recipe(base, (*_including, resolved)) if base else (RunConfig(), {})
        items = [(key, value, key) for key, value in _flatten(data)]
        _check_spelled_twice(items)
        cfg, mine = _apply_items(cfg, items)
        return cfg.validate(), {**given, **{key: f"recipe file {path}" for key in mine}}
    except ValueError as exc:
        raise ValueError(f"recipe file {path}: {exc}") from None


def _check_spelled_twice(items: Sequence[tuple[str, Any, str]]) -> None:
    """One field set twice in one recipe file under two spellings (``train: {steps: 5}`` and ``train.steps: 6``,
    ``logra:`` and ``optimizer: {logra: ...}``, a Megatron-LM flag name and its field) is refused: only the last
    would count, as with a repeated YAML key."""
    seen: dict[str, str] = {}
    for key, _, _ in items:
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
    tab = "; indent with spaces: YAML allows no tabs" if "'\\t'" in problem else ""
    return f"line {mark.line + 1}, column {mark.column + 1}: {problem}" + (f" ({context})" if context else "") + tab


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
            close = difflib.get_close_matches(part, sorted(names), n=1)
            hint = f" (did you mean {'.'.join([*parts[:i], close[0]])}?)" if close else ""
            raise ValueError(f"unknown config key {key!r}: {where} has no field {part!r}{hint}; known: "
                             f"{sorted(names)}")
        if i == len(parts) - 1:
            ftype = typing.get_type_hints(type(obj))[part]
            setattr(obj, part, _coerce(raw, ftype, key))
        else:
            obj = getattr(obj, part)


def _canonical(key: str) -> str:
    """The dotted field ``key`` names, as :func:`set_dotted` spells it (shortcuts expanded, ``-`` -> ``_``)."""
    return _expand(key).replace("-", "_")


Item = tuple[str, Any, str]
"""One override: (key: a dotted field, shortcut or Megatron-LM flag name; raw value; how the user spelled it)."""


def _get_dotted(cfg: Any, field: str) -> Any:
    """The value of the canonical dotted ``field`` of ``cfg``."""
    obj = cfg
    for part in field.split("."):
        obj = getattr(obj, part)
    return obj


def _same_value(a: Any, b: Any) -> bool:
    """Whether two parsed field values are the same setting (NaN equals NaN)."""
    if isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b):
        return True
    return a == b


def _spelled(spelling: str, value: Any) -> str:
    """``spelling`` with the parsed ``value`` it gave, unless the spelling shows it (``--bf16 (bfloat16)``)."""
    shown = value if isinstance(value, str) else _short(value)
    return spelling if str(shown) in spelling else f"{spelling} ({shown})"


def _spelling_key(spelling: str) -> str:
    """The key part of an override's spelling: ``--seq-length 64`` and ``seq-length=64`` -> ``seq-length``."""
    return spelling.split(" ", 1)[0].split("=", 1)[0].removeprefix("--")


class _FieldSetter:
    """Sets dotted fields of a config, remembering which spelling set each one. One field set twice to different
    values under two spellings (``--tensor-model-parallel-size 2 parallel.tp=1``, ``logra.rank=8
    optimizer.logra.rank=4``, ``--bf16 model.params_dtype=float32``, ``--save A --load B``) is a ``ValueError``
    naming both; the same value twice is fine. The same key repeated (``rl.steps=5 ... rl.steps=7``, as when
    overrides are appended to a command line) sets the field to its last value."""

    def __init__(self, cfg: RunConfig) -> None:
        self.cfg = cfg
        self.set_by: dict[str, tuple[str, Any]] = {}  # canonical field -> (spelling, parsed value)

    def put(self, key: str, raw: Any, spelling: str, flag: Optional[str] = None) -> None:
        """Set ``key`` (a dotted field or shortcut) from ``raw``, as ``spelling`` gave it; ``flag``: the
        context-dependent Megatron-LM flag (without ``--``) that resolved to ``key``, named in the error."""
        field = _canonical(key)
        before = self.set_by.get(field)
        set_dotted(self.cfg, key, raw)
        value = _get_dotted(self.cfg, field)
        if before is None or _spelling_key(before[0]) == _spelling_key(spelling):
            self.set_by[field] = (spelling, value)
            return
        first, old = before
        if _same_value(old, value):
            return
        pair = f"as {_spelled(first, old)} and as {_spelled(spelling, value)}"
        hint = ""
        if field == "train.run_dir" and "load" in (_spelling_key(first), _spelling_key(spelling)):
            hint = (" (this trainer saves into the run directory it resumes from: --load DIR alone, or --resume DIR, "
                    "continues the run in DIR)")
        if flag is not None:
            raise ValueError(f"--{flag} sets {field} here, which is also given with another value, {pair}: give "
                             f"only one of them (or the same value){hint}")
        raise ValueError(f"{field} is set twice with different values, {pair}: both spell the same field; give it "
                         f"once{hint}")


def _apply_items(cfg: RunConfig, items: Sequence[Item]) -> tuple[RunConfig, set[str]]:
    """Set ``(key, value, spelling)`` items in order (a key may be a Megatron-LM flag name), then the flags whose
    field depends on the rest of the config (:func:`resolve_alias`) against the config they leave. One field set
    to different values under two spellings is a ``ValueError`` naming both (:class:`_FieldSetter`).
    Returns the config and the dotted fields set."""
    deferred: list[Item] = []
    ratios: list[Item] = []  # after the peak lr (--lr, itself deferred) is known
    setter = _FieldSetter(cfg)
    for key, raw, spelling in items:
        if key in SCHEDULE_RATIO_FLAGS:
            ratios.append((key, raw, spelling))
        elif key in _CONTEXT_FLAGS:
            deferred.append((key, raw, spelling))
        elif key in LOAD_FLAGS:
            for field, fixed in LOAD_FLAGS[key]:
                setter.put(field, raw if fixed is None else fixed, spelling)
        else:
            setter.put(MEGATRON_ALIASES.get(key, key), raw, spelling)
    for flag, raw, spelling in deferred:
        if flag in CHECK_FLAGS:
            check_flag(cfg, flag, raw)
        elif flag in CHECK_SWITCHES:
            check_switch(cfg, flag)
        elif flag in SWITCH_DEFAULTS:
            target, value = SWITCH_DEFAULTS[flag]
            if target not in setter.set_by:
                setter.put(target, value, spelling)
        else:
            setter.put(resolve_alias(cfg, flag), raw, spelling, flag)
    for flag, raw, spelling in ratios:
        target, value = schedule_ratio(cfg, flag, raw)
        setter.put(target, value, spelling, flag)
        ratio = ABSOLUTE_LRS[target.rpartition(".")[2]]
        if f"optimizer.schedule.{ratio}" not in setter.set_by:
            # the flag replaces the ratio of the config it overrides (a recipe file's, or a resumed run's saved
            # before the absolute field existed, where the flag was kept as that ratio); given here too, both
            # are refused
            setattr(cfg.optimizer.schedule, ratio, 0.0)
    given = set(setter.set_by)
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


def _parse_overrides(overrides: Sequence[str]) -> list[Item]:
    """Command-line overrides -> :data:`Item` s. ``key=value`` and ``--key=value`` are taken as they are; ``--key``
    alone is a switch of :data:`~megatron_logra.megatron_flags.MEGATRON_FLAGS`, an ignored or refused Megatron-LM
    flag (:mod:`megatron_logra.megatron_flags`), or a flag or field that takes the next argument as its value
    (never one starting with ``--``). An unknown ``--name`` is a ``ValueError`` naming the closest flags and
    fields; it never takes the next argument. Ignored flags log a warning saying why."""
    items: list[Item] = []
    i = 0
    while i < len(overrides):
        item = overrides[i]
        i += 1
        if not item.startswith("--"):
            if "=" not in item:
                raise ValueError(f"cannot parse override {item!r}: use key=value or --key value")
            key, raw = item.split("=", 1)
            items.append((key, raw, item))
            continue
        name, has_value, raw = item[2:].partition("=")
        if name in MEGATRON_FLAGS or name in IGNORED_SWITCHES or name in REFUSED_SWITCHES:
            if name in REFUSED_SWITCHES:
                raise ValueError(f"{item.split('=')[0]} is a Megatron-LM flag this trainer cannot honour: "
                                 f"{REFUSED_SWITCHES[name]}")
            if has_value:
                field = MEGATRON_FLAGS.get(name, ("",))[0]
                also = f", or set the field: {field}=VALUE" if "." in field else ""
                raise ValueError(f"--{name} is a switch and takes no value: give --{name} alone{also}")
            if name in IGNORED_SWITCHES:
                logger.warning("--%s is accepted and ignored: %s", name, IGNORED_SWITCHES[name])
            else:
                items.append((*MEGATRON_FLAGS[name], item))
            continue
        if name in REFUSED_VALUE_FLAGS:
            raise ValueError(f"--{name} is a Megatron-LM flag this trainer cannot honour: {REFUSED_VALUE_FLAGS[name]}")
        if not _takes_value(name):
            raise unknown_flag_error(name)
        if not has_value:
            if i >= len(overrides) or overrides[i].startswith("--"):
                got = f" (the next argument is the option {overrides[i]})" if i < len(overrides) else ""
                raise ValueError(f"option {item} needs a value{got}: give {item} VALUE or {item}=VALUE")
            raw = overrides[i]
            i += 1
        spelling = item if has_value else f"{item} {raw}"
        if name in IGNORED_VALUE_FLAGS:
            logger.warning("%s is accepted and ignored: %s", spelling, IGNORED_VALUE_FLAGS[name])
        elif name in NEUTRAL_FLAGS:
            neutral_flag(name, raw)
        else:
            items.append((name, raw, spelling))
    return items


def _takes_value(name: str) -> bool:
    """Whether ``--name`` is a value flag (:mod:`megatron_logra.megatron_flags`) or a dotted config field."""
    if (name in MEGATRON_ALIASES or name in _CONTEXT_FLAGS or name in LOAD_FLAGS or name in IGNORED_VALUE_FLAGS
            or name in NEUTRAL_FLAGS):
        return True
    return _field_type(_canonical(name)) is not None


def apply_overrides(cfg: RunConfig, overrides: Sequence[str]) -> RunConfig:
    """Apply dotted overrides and Megatron-LM flags (see module docstring), then validate. ``cfg`` is taken
    as the user's own (a run's saved config): its ``tokenizer.path`` stays, with ``model.hf_path`` too."""
    return _apply_overrides(cfg, overrides, {})


def _apply_overrides(cfg: RunConfig, overrides: Sequence[str], given: Mapping[str, str], *,
                     from_recipe: bool = False) -> RunConfig:
    """:func:`apply_overrides`, where ``given`` (dotted field -> where it was set) names the fields a recipe
    file set, which :func:`resolve_hf_model` checks with those of the overrides; ``from_recipe``: the other
    fields are a named recipe's (see :func:`resolve_hf_model`)."""
    items = _parse_overrides(overrides)
    cfg, mine = _apply_items(cfg, items)
    given = {**given, **{key: "" for key in mine}}
    _check_paper_unused(cfg, given)
    _check_other_job_unused(cfg, given)
    if "train.eval_sequences" in given and cfg.train.eval_batches is not None:
        where = " (in the resumed run's config)" if "train.eval_batches" not in given else ""
        raise ValueError(f"train.eval_sequences={cfg.train.eval_sequences} is given, but the deprecated "
                         f"train.eval_batches={cfg.train.eval_batches}{where} replaces it; give train.eval_batches=null "
                         f"as well to evaluate train.eval_sequences sequences")
    cfg = resolve_hf_model(cfg.validate(), given, from_recipe=from_recipe)
    _check_logra_rank(cfg, given)
    return cfg


_RANK_INPUTS = frozenset({"optimizer.name", "optimizer.logra.rank", "optimizer.logra.targets", "model.hidden_size",
                          "model.ffn_hidden_size", "model.num_attention_heads", "model.kv_channels"})
"""The fields that decide whether ``optimizer.logra.rank`` fits the targets (:func:`_check_logra_rank`)."""


def _check_logra_rank(cfg: RunConfig, given: Mapping[str, str]) -> None:
    """With LoGRA (``optimizer.name=logra``) and one of :data:`_RANK_INPUTS` among ``given`` (set by an override
    or a recipe file), ``optimizer.logra.rank`` above the input width of a target layer is a ``ValueError`` naming
    the field, the target and the model field that sizes it, before anything is built. Otherwise (a named
    recipe's rank against a ``model.hf_path`` checkpoint's shapes, a target named by an exact leaf module name
    other than ``output_layer``) the sketches refuse it, naming ``optimizer.logra.rank``, when installed."""
    from megatron_logra.sketch.naming import TARGET_ALIASES

    if cfg.optimizer.name != "logra" or not _RANK_INPUTS & set(given):
        return
    m = cfg.model
    widths = {"linear_qkv": (m.hidden_size, "model.hidden_size"),
              "linear_proj": (m.num_attention_heads * m.head_dim, "model.num_attention_heads × the head dim"),
              "linear_fc1": (m.hidden_size, "model.hidden_size"),
              "linear_fc2": (m.ffn_hidden_size, "model.ffn_hidden_size"),
              "output_layer": (m.hidden_size, "model.hidden_size")}
    rank = cfg.optimizer.logra.rank
    checked = [(*widths[kind], target) for target in cfg.optimizer.logra.targets
               if (kind := TARGET_ALIASES.get(target, target)) in widths]
    if checked and rank > min(checked)[0]:
        width, what, target = min(checked)
        raise ValueError(f"optimizer.logra.rank={rank} exceeds the input width {width} ({what}) of the LoGRA target "
                         f"{target}: the sketch rank is at most the input width of every target; set "
                         f"optimizer.logra.rank <= {width} (logra.rank={width})")


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
