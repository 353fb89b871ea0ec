"""The words of a command line's overrides -> :data:`Item` s (key, raw value, spelling), as
:mod:`megatron_logra.config.overrides` applies them: ``key=value``, ``--key=value``, ``--key value`` and the
Megatron-LM switches and flags of :mod:`megatron_logra.megatron_flags` (ignored ones logged, refused and
unknown ones a ``ValueError``)."""

from __future__ import annotations

import logging
import re
import typing
from typing import Any, Optional, Sequence

from megatron_logra.config.dotted import _canonical, _field_type
from megatron_logra.megatron_flags import (CONTEXT_FLAGS, IGNORED_SWITCHES, IGNORED_VALUE_FLAGS, LOAD_FLAGS,
                                           MEGATRON_ALIASES, MEGATRON_FLAGS, NEUTRAL_FLAGS, REFUSED_SWITCHES,
                                           REFUSED_VALUE_FLAGS, VALUE_MAPS, neutral_flag, unknown_flag_error)
from megatron_logra.megatron_flags.launch_scripts import moe_line_error
from megatron_logra.megatron_flags.slime import SLIME_ALIASES, SLIME_REFUSED_SWITCHES, SLIME_REFUSED_VALUE_FLAGS
from megatron_logra.megatron_flags.slime_resolve import sglang_flag_error

logger = logging.getLogger(__name__)

__all__ = ["Item", "Collector", "raise_errors"]


Item = tuple[str, Any, str]
"""One override: (key: a dotted field, shortcut or Megatron-LM flag name; raw value; how the user spelled it)."""


def _parse_overrides(overrides: Sequence[str], errors: Optional[list[ValueError]] = None) -> list[Item]:
    """Command-line overrides -> :data:`Item` s. ``key=value`` and ``--key=value`` are taken as they are; ``--key``
    alone is a switch of :data:`~megatron_logra.megatron_flags.MEGATRON_FLAGS`, an ignored or refused Megatron-LM
    flag (:mod:`megatron_logra.megatron_flags`), or a flag or field that takes the next argument as its value
    (never one starting with ``--``). An unknown ``--name`` is a ``ValueError`` naming the closest flags and
    fields; it never takes the next argument. Ignored flags log a warning saying why.

    ``errors``: where given, each refused word is appended to it and parsing goes on, so that a pasted launch line
    hears of every flag it must change at once (:func:`raise_errors`); the arguments that follow a refused flag up
    to the next ``--flag`` or ``key=value`` are taken as its values. A line with ``--num-experts`` or a ``--moe-*``
    flag (a mixture-of-experts model's) is refused as a whole, by one ``ValueError`` (:func:`moe_line_error`)."""
    moe = moe_line_error(overrides)
    if moe is not None:
        raise moe
    items: list[Item] = []
    i = 0
    while i < len(overrides):
        start = i
        try:
            i = _parse_one(overrides, i, items)
        except ValueError as exc:
            if errors is None:
                raise
            errors.append(exc)
            i = start + 1
            if overrides[start].startswith("--") and "=" not in overrides[start]:
                while i < len(overrides) and not overrides[i].startswith("--") and not _ASSIGNMENT.match(overrides[i]):
                    i += 1
    return items


_ASSIGNMENT = re.compile(r"^[A-Za-z_][\w.-]*=")
"""A ``key=value`` override (a dotted field set), as opposed to a flag's value."""


def raise_errors(errors: Sequence[ValueError]) -> None:
    """Raise the refusals :func:`_parse_overrides` and the config's ``_apply_items`` collected: one as it is,
    several as one ``ValueError`` listing each."""
    if len(errors) == 1:
        raise errors[0]
    if errors:
        listed = "\n".join(f"  * {exc}" for exc in errors)
        raise ValueError(f"{len(errors)} of the command line's options cannot be used; change each of them:\n{listed}")


class Collector:
    """``with collector:`` appends a ``ValueError`` raised in the block to ``errors`` (None: lets it propagate)."""

    def __init__(self, errors: Optional[list[ValueError]]) -> None:
        self.errors = errors

    def __enter__(self) -> None:
        return None

    def __exit__(self, kind: Any, exc: Any, tb: Any) -> bool:
        if self.errors is not None and isinstance(exc, ValueError):
            self.errors.append(exc)
            return True
        return False


def _parse_one(overrides: Sequence[str], i: int, items: list[Item]) -> int:
    """Parse the override at ``overrides[i]`` (and its value) into ``items``; returns the index after it."""
    item = overrides[i]
    i += 1
    if not item.startswith("--"):
        if "=" not in item:
            after = _after_flag_value(items, overrides, i - 1)
            raise ValueError(f"cannot parse override {item!r}: use key=value or --key value{after}")
        key, raw = item.split("=", 1)
        items.append((key, raw, item))
        return i
    name, has_value, raw = item[2:].partition("=")
    if name in MEGATRON_FLAGS or name in IGNORED_SWITCHES or name in REFUSED_SWITCHES:
        if name in REFUSED_SWITCHES:
            raise ValueError(f"{item.split('=')[0]} is {_whose(name)} flag this trainer cannot honour: "
                             f"{REFUSED_SWITCHES[name]}")
        if has_value:
            field = MEGATRON_FLAGS.get(name, ("",))[0]
            also = f", or set the field: {field}=VALUE" if "." in field else ""
            raise ValueError(f"--{name} is a switch and takes no value: give --{name} alone{also}")
        if name in IGNORED_SWITCHES:
            logger.warning("--%s is accepted and ignored: %s", name, IGNORED_SWITCHES[name])
        else:
            items.append((*MEGATRON_FLAGS[name], item))
        return i
    if name in REFUSED_VALUE_FLAGS:
        raise ValueError(f"--{name} is {_whose(name)} flag this trainer cannot honour: {REFUSED_VALUE_FLAGS[name]}")
    if not _takes_value(name):
        raise sglang_flag_error(name) or unknown_flag_error(name)
    if not has_value:
        if i >= len(overrides) or overrides[i].startswith("--"):
            got = f" (the next argument is the option {overrides[i]})" if i < len(overrides) else ""
            raise ValueError(f"option {item} needs a value{got}: give {item} VALUE or {item}=VALUE")
        raw = overrides[i]
        i += 1
        if _takes_several(name):  # slime's nargs="+" flags: each following word is one more value, verbatim
            words = [raw]
            while i < len(overrides) and not overrides[i].startswith("--") and not _ASSIGNMENT.match(overrides[i]):
                if _names_recipe(overrides[i]):
                    raise ValueError(f"{item} takes every word up to the next --flag or key=value, and "
                                     f"{overrides[i]!r} after {item} {' '.join(words)} is a recipe: give the recipe "
                                     f"first (megatron-logra train {overrides[i]} {item} {' '.join(words)} ...), or "
                                     f"{item}={overrides[i]} for a value that is a recipe's name")
                words.append(overrides[i])
                i += 1
            _check_int_words(name, words)
            raw = words
    spelling = item if has_value else f"{item} {' '.join(raw) if isinstance(raw, list) else raw}"
    if name in IGNORED_VALUE_FLAGS:
        logger.warning("%s is accepted and ignored: %s", spelling, IGNORED_VALUE_FLAGS[name])
    elif name in NEUTRAL_FLAGS:
        neutral_flag(name, raw)
    else:
        items.append((name, raw, spelling))
    return i


def _takes_several(name: str) -> bool:
    """Whether ``--name`` is a slime flag of a list field (``--rollout-stop-token-ids 151645 151643``,
    ``--rollout-stop '</answer>'``), which takes every word up to the next ``--flag`` or ``key=value`` as one value
    each, as slime's ``nargs="+"`` does (a later word naming a recipe is refused: the recipe goes first); its
    ``--name=V`` form is one value, parsed as the field's
    (comma-separated). Megatron-LM's list flags take one comma-separated value (:func:`_after_flag_value`)."""
    return name in SLIME_ALIASES and typing.get_origin(_field_type(SLIME_ALIASES[name])) in (list, tuple)


def _check_int_words(name: str, words: list[str]) -> None:
    """Refuse a comma-joined word of a slime flag of integers (``--rollout-stop-token-ids 5,6``), which slime's
    ``nargs="+"`` reads as one value too (and refuses), naming both spellings that give the list."""
    args = typing.get_args(_field_type(SLIME_ALIASES[name]))
    joined = next((word for word in words if "," in word), None)
    if not args or args[0] is not int or joined is None:
        return
    spaced = " ".join(part.strip() for word in words for part in word.split(",") if part.strip())
    listed = ",".join(spaced.split())
    raise ValueError(f"--{name} {' '.join(words)}: {joined!r} is not an integer: --{name} takes one id per word, "
                     f"as slime's does: give --{name} {spaced} (or --{name}={listed})")


def _names_recipe(word: str) -> bool:
    """Whether ``word`` names a recipe: a named recipe, or an existing ``.yaml`` / ``.yml`` file."""
    from pathlib import Path

    from megatron_logra.config.recipes import RECIPES

    return word in RECIPES or (word.lower().endswith((".yaml", ".yml")) and Path(word).is_file())


def _whose(name: str) -> str:
    """"a slime" for slime's own refused flags, else "a Megatron-LM"."""
    return "a slime" if name in SLIME_REFUSED_SWITCHES or name in SLIME_REFUSED_VALUE_FLAGS else "a Megatron-LM"


def _after_flag_value(items: list[Item], overrides: Sequence[str], index: int) -> str:
    """A hint for a stray argument at ``overrides[index]`` that follows ``--flag VALUE`` of a list field: a flag
    takes one value here (Megatron-LM's list flags, e.g. ``--profile-ranks 0 1``, take one comma-separated
    value)."""
    if not items or index < 2 or not overrides[index - 2].startswith("--") or "=" in overrides[index - 2]:
        return ""
    flag, value = overrides[index - 2], overrides[index - 1]
    if items[-1][2] != f"{flag} {value}":
        return ""
    name = flag[2:]
    if typing.get_origin(_field_type(_canonical(MEGATRON_ALIASES.get(name, name)))) not in (list, tuple):
        return ""
    return (f" ({overrides[index]!r} follows {flag} {value}, and a flag takes one value: for a list, separate "
            f"the values with commas, {flag} {value},{overrides[index]})")


def _takes_value(name: str) -> bool:
    """Whether ``--name`` is a value flag (:mod:`megatron_logra.megatron_flags`) or a dotted config field."""
    if (name in MEGATRON_ALIASES or name in CONTEXT_FLAGS or name in LOAD_FLAGS or name in IGNORED_VALUE_FLAGS
            or name in NEUTRAL_FLAGS or name in VALUE_MAPS):
        return True
    return _field_type(_canonical(name)) is not None
