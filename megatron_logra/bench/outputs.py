"""Whether a report can be written where a benchmark will write it, checked before the run so that a long run
is refused at once instead of failing at its end. Standard library only: the benchmark scripts' parent
processes check their ``--out`` without importing torch."""

from __future__ import annotations

import argparse
import errno
import os
import tempfile
from pathlib import Path
from typing import Optional, Union

__all__ = ["why_unwritable", "refuse_unwritable"]


def why_unwritable(path: Union[str, Path], *, directory: bool = False) -> Optional[str]:
    """Why a report could not be written at ``path`` (a file, or with ``directory`` a directory to write
    into), or None when it can. Checked before a long run, so that it is refused at once rather than
    failing at its end: the file being a directory (or the directory a file), an existing file this process
    cannot write, or the nearest existing ancestor not a directory or not one where this process can create
    a file. The last is probed by creating and removing a temporary file there (``os.access`` says yes to
    root on read-only mounts and ``/proc``); nothing else is created, missing directories included."""
    path = Path(path)
    if directory:
        if path.exists() and not path.is_dir():
            return f"{path} is not a directory"
        target = path
    else:
        if path.is_dir():
            return f"{path} is a directory; give a file path"
        if path.exists() and not os.access(path, os.W_OK):
            return f"{path} exists and is not writable"
        target = path.parent
    ancestor = target.absolute()
    while not ancestor.exists():
        ancestor = ancestor.parent
    if not ancestor.is_dir():
        return f"{ancestor} is not a directory, so {path} cannot be written"
    try:
        with tempfile.TemporaryFile(dir=ancestor):
            pass
    except OSError as exc:  # ENOENT: a pseudo file system such as /proc, where no file can be created
        why = f" ({exc.strerror})" if exc.strerror and exc.errno != errno.ENOENT else ""
        return f"{ancestor} is not a writable directory{why}, so {path} cannot be written"
    return None


def refuse_unwritable(parser: argparse.ArgumentParser, flag: str, *paths: Union[str, Path]) -> None:
    """Refuse, before anything runs, report ``paths`` that could not be written at the end
    (:func:`why_unwritable`): a usage error (``parser.error``, exit status 2) naming ``flag``, the option that
    chose them."""
    for path in paths:
        problem = why_unwritable(path)
        if problem:
            parser.error(f"argument {flag}: {problem}")
