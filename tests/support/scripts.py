"""Import a script of the checkout (``benchmarks/``: scripts, not a package) as a module."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import ModuleType

ROOT = Path(__file__).resolve().parents[2]
"""The checkout's root directory."""


def load_script(path: str, name: str) -> ModuleType:
    """``ROOT/path`` (e.g. ``"benchmarks/rl_parity.py"``) executed as a new module ``name``, a fresh copy on every
    call. It is not entered in ``sys.modules``: a script whose dataclasses look their module up there needs a
    loader that registers it (``tests/unit/tool_modules.py`` does, for ``tools/``)."""
    spec = importlib.util.spec_from_file_location(name, ROOT / path)
    assert spec is not None and spec.loader is not None, ROOT / path
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
