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


def run_script(script: str, args: list[str], monkeypatch, capsys) -> tuple[int, str, str]:
    """``python ROOT/script args...`` run as ``__main__`` in this process (``runpy``; the checkout as working
    directory, its own ``sys.argv`` and ``sys.path``): ``(exit status, stdout, stderr)``. An exception that
    escapes the script is raised here, as the traceback a user would see; no interpreter start-up is paid."""
    import runpy
    import sys
    import warnings

    monkeypatch.chdir(ROOT)
    monkeypatch.setattr(sys, "argv", [str(ROOT / script), *args])
    monkeypatch.setattr(sys, "path", list(sys.path))  # scripts put the repository first
    capsys.readouterr()
    code = 0
    with warnings.catch_warnings():
        try:
            runpy.run_path(str(ROOT / script), run_name="__main__")
        except SystemExit as exc:
            code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    out = capsys.readouterr()
    return code, out.out, out.err


def exit_code(main, argv) -> int:
    """``main(argv)``'s return value, or the status of the ``SystemExit`` it raised (argparse's error path)."""
    try:
        return main(argv)
    except SystemExit as exc:
        return exc.code
