"""A :class:`~megatron_logra.config.run.RunConfig` from a recipe name or YAML recipe file
(:func:`load_recipe`; a file may name its base recipe or file with ``recipe:``), and from a recipe plus the
command line's overrides (:func:`parse_args_to_config`, as the CLI calls it; the overrides are
:mod:`megatron_logra.config.overrides`)."""

from __future__ import annotations

import dataclasses
import difflib
import logging
from pathlib import Path
from typing import Any, Optional, Sequence

import yaml

from megatron_logra.config.checks import resolve_hf_model
from megatron_logra.config.codec import _is_section, _short
from megatron_logra.config.dotted import _canonical, _field_type, _is_mapping_type
from megatron_logra.config.overrides import _apply_items, _apply_overrides
from megatron_logra.config.recipe_context import Pending, pending_items, resolve_pending
from megatron_logra.config.recipes import RECIPES
from megatron_logra.config.run import RunConfig
from megatron_logra.megatron_flags import CONTEXT_FLAGS, MEGATRON_ALIASES
from megatron_logra.yaml_unique import safe_load_unique

__all__ = ["load_recipe", "parse_args_to_config"]

logger = logging.getLogger(__name__)


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
    cfg, given, _ = _load_recipe(name_or_path)
    return resolve_hf_model(cfg, given, from_recipe=True)


def _load_recipe(name_or_path: str, _including: tuple = ()) -> tuple[RunConfig, dict[str, str], list[Pending]]:
    """:func:`load_recipe` without ``model.hf_path``'s resolution: the config, the dotted fields the
    recipe files of the chain set, each mapped to ``"recipe file PATH"`` (empty for a named recipe), and the
    files' context flags that the command line's config resolves again (:mod:`~megatron_logra.config.recipe_context`)."""
    if not isinstance(name_or_path, str):
        raise ValueError(f"recipe={_short(name_or_path)}: give a recipe name ({', '.join(sorted(RECIPES))}) "
                         "or a .yaml file")
    if name_or_path in RECIPES:
        return RECIPES[name_or_path](), {}, []
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
    if "recipe" not in data:
        unset = [f.name for f in dataclasses.fields(RunConfig) if f.name not in data]
        if unset:  # not a whole config (`megatron-logra config RECIPE > FILE` writes every section)
            logger.warning("recipe file %s names no base recipe: its fields apply over the built-in defaults "
                           "(which no job runs as they are), not over the tiny recipe that `train` uses without "
                           "a recipe; add 'recipe: tiny' (RL) or 'recipe: lm-tiny' (lm) to start from one "
                           "(it leaves unset: %s)", path, ", ".join(unset))
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
        cfg, given, pending = _load_recipe(base, (*_including, resolved)) if base else (RunConfig(), {}, [])
        items = [(key, value, key) for key, value in _flatten(data)]
        _check_spelled_twice(items)
        cfg, mine = _apply_items(cfg, items)
        pending = resolve_pending(cfg, pending, items, mine) + pending_items(items, f"recipe file {path}")
        return cfg.validate(), {**given, **{key: f"recipe file {path}" for key in mine}}, pending
    except ValueError as exc:
        raise ValueError(f"recipe file {path}: {exc}") from None


def _check_spelled_twice(items: Sequence[tuple[str, Any, str]]) -> None:
    """One field set twice in one recipe file under two spellings (``train: {steps: 5}`` and ``train.steps: 6``,
    ``logra:`` and ``optimizer: {logra: ...}``, a Megatron-LM flag name and its field) is refused: only the last
    would count, as with a repeated YAML key."""
    seen: dict[str, str] = {}
    for key, _, _ in items:
        if key in CONTEXT_FLAGS:  # checked against the field they resolve to by _apply_items
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


def parse_args_to_config(recipe: Optional[str], overrides: Sequence[str]) -> RunConfig:
    """Recipe (default ``tiny``) plus overrides; with ``model.hf_path``, an architecture field set by a recipe
    file or an override that the checkpoint would replace is refused, and the checkpoint's tokenizer replaces
    a named recipe's ``tokenizer.path`` unless the user gave one (:func:`resolve_hf_model`)."""
    cfg, given, pending = _load_recipe(recipe or "tiny")
    return _apply_overrides(cfg, overrides, given, from_recipe=True, pending=pending)
