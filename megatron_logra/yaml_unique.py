"""YAML loading that refuses duplicate mapping keys (stdlib + PyYAML).

PyYAML's ``safe_load`` keeps the last of two equal keys of one mapping, so a recipe file with a second
``train:`` block silently loses every field of the first. :func:`safe_load_unique` parses like
``yaml.safe_load`` but raises a ``ValueError`` naming the key, its path and both lines instead. Keys merged
in with ``<<:`` may be overridden by the mapping's own keys, as YAML specifies.
"""

from __future__ import annotations

from typing import Any

import yaml

__all__ = ["DuplicateKeyError", "safe_load_unique"]


class DuplicateKeyError(ValueError):
    """A mapping of a YAML document has the same key twice."""


class _UniqueKeyLoader(yaml.SafeLoader):
    """``SafeLoader`` whose mappings refuse a repeated key (:class:`DuplicateKeyError`)."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict:
        if isinstance(node, yaml.MappingNode):
            seen: dict[Any, int] = {}
            for key_node, _ in node.value:
                if key_node.tag == "tag:yaml.org,2002:merge":
                    continue
                key = self.construct_object(key_node, deep=True)
                line = key_node.start_mark.line + 1
                try:
                    first = seen.get(key)
                    seen.setdefault(key, line)
                except TypeError:  # an unhashable key: the base constructor reports it
                    continue
                if first is not None:
                    raise DuplicateKeyError(
                        f"key {key!r} appears twice in one mapping (lines {first} and {line}); YAML would keep only "
                        f"the last, dropping the first's value: merge them into one")
        return super().construct_mapping(node, deep=deep)


_UniqueKeyLoader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _UniqueKeyLoader.construct_mapping)


def safe_load_unique(text: str) -> Any:
    """``yaml.safe_load(text)``, except that a mapping with a repeated key raises :class:`DuplicateKeyError`
    (a ``ValueError``) naming the key and the lines of both; YAML syntax errors raise ``yaml.YAMLError``."""
    return yaml.load(text, Loader=_UniqueKeyLoader)  # noqa: S506 - a SafeLoader subclass
