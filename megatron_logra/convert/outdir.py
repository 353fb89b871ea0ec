"""Output directories of the converters: checked apart from the inputs, built aside, renamed into place.

:func:`_prepare_out` refuses an ``--out`` that is an input, lies inside one or holds one (with or
without ``force``: ``force`` deletes ``--out``), a non-empty ``--out`` without ``force``, one holding
files a conversion does not write and, for ``hf-to-mcore``, anything but an earlier ``hf-to-mcore`` output
(a Hugging Face checkpoint there is never replaced by megatron-core files); only then is the sibling
``.NAME.partial`` build directory (re)created. :func:`_finalize` swaps it onto ``--out`` by renames only, so that a complete output exists
at every instant, even if the process is killed mid-swap: the previous output is renamed aside to the
sibling ``.NAME.old``, the build directory onto ``--out``, then ``.NAME.old`` is deleted; every file and directory
of the build directory is synced to storage before the renames, and the parent directory after them. The next
conversion to the same ``--out`` finishes an interrupted swap first (:func:`_recover_aside`): killed
between the two renames, ``.NAME.old`` is the only complete copy and is renamed back onto ``--out`` (the
interrupted replacement never reported success, so the previous output stays); killed after them, the
superseded ``.NAME.old`` is deleted once the checks pass. A conversion that fails otherwise removes the
build directory and leaves ``--out`` as it was; :func:`write_error_message` is the one-line report of a
failed write (a full disk). :func:`template_weight_map` reads a template's shard assignment, whose file
names must be plain ``*.safetensors`` names, so that the export writes inside its own directory only.
"""

from __future__ import annotations

import errno
import json
import logging
import os
import shutil
from pathlib import Path
from typing import Optional

from megatron_logra.convert.hf_checkpoint import HF_EXTRA_FILES, check_shard_name
from megatron_logra.models.presets import read_json_object

logger = logging.getLogger(__name__)

__all__ = ["EXPORT_MARK", "template_weight_map", "write_error_message"]

WRITE_ERRNOS = frozenset(getattr(errno, name) for name in ("ENOSPC", "EFBIG", "EDQUOT", "EROFS") if hasattr(errno, name))
"""``OSError`` numbers that only a write raises: a full disk or quota, a file over the size limit, a read-only
file system."""


def _build_dir(out: Path) -> Path:
    """The sibling directory ``.NAME.partial`` in which the output of ``out`` (resolved) is built."""
    return out.parent / f".{out.name}.partial"


def _aside_dir(out: Path) -> Path:
    """The sibling directory ``.NAME.old`` that holds the previous output of ``out`` (resolved) during the swap."""
    return out.parent / f".{out.name}.old"


def _fsync_path(path: Path, *, directory: bool = False) -> None:
    """:func:`megatron_logra.checkpoint.durable.fsync_path` (imported on first use: converting needs nothing
    else of the checkpoint package)."""
    from megatron_logra.checkpoint.durable import fsync_path

    fsync_path(path, directory=directory)


def _fsync_dir(path: Path) -> None:
    """Make the renames inside directory ``path`` durable (best effort: not every file system allows it)."""
    try:
        _fsync_path(path, directory=True)
    except OSError:
        pass


def _sync_tree(root: Path) -> None:
    """Flush every file below ``root`` (weights, ``meta.json``, ``config.json``, the index, tokenizer and
    generation-config files) and then every directory, deepest first, ``root`` last, to storage
    (:func:`~megatron_logra.checkpoint.durable.fsync_path`; an error syncing a file raises): after a power loss
    a directory renamed into place afterwards holds complete files, never empty or partial ones."""
    dirs = [root]
    for path in sorted(root.rglob("*")):
        if path.is_symlink():
            continue
        if path.is_dir():
            dirs.append(path)
        elif path.is_file():
            _fsync_path(path)
    for d in sorted(dirs, key=lambda p: len(p.parts), reverse=True):
        _fsync_path(d, directory=True)


def _recover_aside(out: Path) -> Optional[Path]:
    """Finish a swap of :func:`_finalize` that was killed: with ``.NAME.old`` but no ``out``, it was killed
    between its two renames and ``.NAME.old`` is the only complete output: renamed back onto ``out`` (logged).
    With both, it was killed after the new output was in place: returns the superseded ``.NAME.old`` for
    :func:`_prepare_out` to delete once its checks pass. ``None`` when there is nothing to delete."""
    old = _aside_dir(out)
    if not old.is_dir():
        return None
    if not out.exists() and not out.is_symlink():
        os.replace(old, out)
        _fsync_dir(out.parent)
        logger.warning("restored the previous output %s from %s: a replacement of it was interrupted", out, old.name)
        return None
    return old


def write_error_message(exc: OSError, out: Path) -> Optional[str]:
    """One line for an ``OSError`` raised while writing the output ``out`` of a conversion (an errno of
    :data:`WRITE_ERRNOS`, or any errno with a ``filename`` inside ``out`` or its build directory), naming
    ``out``, the OS error and the file; ``None`` for any other ``OSError`` (reading an input). The converters
    have removed the build directory by then, and ``out`` is as it was."""
    out = Path(out).resolve()
    tmp = _build_dir(out)
    where = None
    if exc.filename is not None:
        path = Path(os.fsdecode(exc.filename)).resolve()
        for root in (tmp, out):
            if path == root or root in path.parents:
                where = str(path.relative_to(root)) if path != root else root.name
    if exc.errno not in WRITE_ERRNOS and where is None:
        return None
    reason = f"[Errno {exc.errno}] {exc.strerror}" if exc.strerror else str(exc)
    return (f"writing --out {out} failed: {reason}{f' ({where})' if where else ''}; the partial output was removed "
            "and --out is as it was: free space on that file system or choose another --out")


def _conversion_output(path: Path) -> bool:
    """Whether ``path`` is something a conversion writes (weights, index, configs, tokenizer files, and the
    ``hf/`` folder of config and tokenizer files an HF -> megatron-core conversion keeps)."""
    name = path.name
    if path.is_dir():
        return name == "hf" and all(_conversion_output(p) for p in path.iterdir())
    return path.is_file() and (name.endswith((".safetensors", ".safetensors.index.json"))
                               or name in ("config.json", "generation_config.json", "meta.json", *HF_EXTRA_FILES))


def _check_out_apart(out: Path, tmp: Path, inputs: tuple[Optional[Path], ...]) -> None:
    """``ValueError`` naming the input when ``out`` (resolved) or its ``tmp`` build directory is an input, lies
    inside one, or contains one: ``--force`` deletes ``out`` and the build directory is removed, so they must
    be disjoint from every input whatever the flags."""
    for src in inputs:
        if src is None:
            continue
        src = src.resolve()
        old = _aside_dir(out)
        for what, path in (("--out", out), (f"the build directory of --out ({tmp.name})", tmp),
                           (f"the directory that holds the replaced --out during the swap ({old.name})", old)):
            if src == path:
                raise ValueError(f"{what} {path} is also an input directory: choose an --out apart from the inputs")
            if path in src.parents:
                raise ValueError(f"{what} {path} contains the input {src}: choose an --out that holds no input")
            if src in path.parents:
                raise ValueError(f"{what} {path} is inside the input {src}: choose an --out outside the inputs")


def _earlier_mcore_output(out: Path) -> bool:
    """Whether ``out`` holds the ``meta.json`` of an earlier ``convert hf-to-mcore`` output."""
    from megatron_logra.convert.mcore_checkpoint import MCORE_FORMAT

    try:
        meta = json.loads((out / "meta.json").read_text())
    except (OSError, ValueError):
        return False
    return isinstance(meta, dict) and meta.get("format") == MCORE_FORMAT


EXPORT_MARK = ("converted_by", "megatron-logra mcore-to-hf")
"""The ``__metadata__`` entry every safetensors file of a ``convert mcore-to-hf`` output carries: what tells an
earlier export, which ``--force`` may replace, from any other Hugging Face checkpoint."""


def _unmarked_weights(out: Path) -> Optional[str]:
    """``None`` when ``out`` holds safetensors files and each carries :data:`EXPORT_MARK`; else the name of one
    that does not (or ``"no *.safetensors"``)."""
    from megatron_logra.convert.st_header import read_header

    files = sorted(out.glob("*.safetensors"))
    if not files:
        return "no *.safetensors"
    key, value = EXPORT_MARK
    for path in files:
        try:
            _, metadata, _ = read_header(path)
        except (OSError, ValueError):
            return path.name
        if metadata.get(key) != value:
            return path.name
    return None


def _prepare_out(out: Path, force: bool, inputs: tuple[Optional[Path], ...], *, mcore: bool = False,
                 export: bool = False) -> Path:
    """The empty build directory (sibling ``.NAME.partial``) of ``out``, after every check: ``out`` apart from
    the ``inputs`` (:func:`_check_out_apart`), and, when not empty, replaceable (``force``, only conversion
    files in it; for an ``hf-to-mcore`` output, ``mcore``, only an earlier ``hf-to-mcore`` output: a Hugging
    Face checkpoint there is not replaced by megatron-core files; for an ``mcore-to-hf`` output, ``export``,
    only an earlier export, whose weight files carry :data:`EXPORT_MARK`: a Hugging Face checkpoint of another
    origin, e.g. the model a run started from, is not replaced). Nothing is deleted or written before the
    checks pass, except that the previous output of a swap killed between its renames is first renamed back
    onto ``out`` (:func:`_recover_aside`)."""
    out = out.resolve()
    tmp = _build_dir(out)
    _check_out_apart(out, tmp, inputs)
    stale = _recover_aside(out)
    if out.exists():
        if not out.is_dir():
            raise ValueError(f"--out {out} exists and is not a directory")
        if any(out.iterdir()):
            if not force:
                raise ValueError(f"--out {out} exists and is not empty (pass --force to replace a previous conversion)")
            if not ((out / "meta.json").is_file() or (out / "config.json").is_file()):
                raise ValueError(f"--out {out} is not empty and holds no meta.json or config.json: refusing to "
                                 "replace a directory that does not look like a checkpoint")
            if mcore and not _earlier_mcore_output(out):
                held = sorted(p.name + ("/" if p.is_dir() else "") for p in out.iterdir())
                what = " (a Hugging Face checkpoint?)" if (out / "config.json").is_file() else ""
                raise ValueError(f"--out {out} is not an earlier `convert hf-to-mcore` output (no meta.json of one; it "
                                 f"holds {held[:5]}{what}): --force replaces only such an output and would delete "
                                 "these files; choose another --out")
            unmarked = _unmarked_weights(out) if export else None
            if unmarked is not None:
                raise ValueError(f"--out {out} is not an earlier `convert mcore-to-hf` output ({unmarked} does not carry "
                                 f"its {EXPORT_MARK[0]!r} mark; a Hugging Face checkpoint of another origin?): --force "
                                 "replaces only such an output and would delete it; choose another --out (an export of "
                                 "a release before the mark: delete it yourself first)")
            foreign = sorted(p.name + ("/" if p.is_dir() else "") for p in out.iterdir() if not _conversion_output(p))
            if foreign:
                raise ValueError(f"--out {out} also holds {foreign[:5]}, which a conversion does not write: "
                                 "--force would delete them; move them or choose another --out")
    if stale is not None:
        shutil.rmtree(stale)  # the output an earlier --force replaced, left by a kill before its deletion
    if tmp.exists():
        shutil.rmtree(tmp)  # a previous interrupted conversion to the same destination
    tmp.mkdir(parents=True)
    return tmp


def _finalize(tmp: Path, out: Path) -> None:
    """Swap the finished build directory ``tmp`` onto ``out``: sync every file and directory of ``tmp`` to
    storage (:func:`_sync_tree`), rename the previous ``out`` aside to ``.NAME.old``, rename ``tmp`` onto ``out``,
    sync the parent directory, delete ``.NAME.old``. Only renames in one directory, so a complete output exists
    at every instant, also after a power loss: a kill between the renames leaves ``.NAME.old``, which the next
    conversion to ``out`` restores (:func:`_recover_aside`); an exception there renames it back at once. The
    final deletion is best effort (what it leaves, the next conversion deletes)."""
    out = out.resolve()
    old = _aside_dir(out)
    _sync_tree(tmp)
    if out.exists():
        if old.exists():  # _prepare_out deleted any earlier one; something recreated it since
            shutil.rmtree(old)
        os.replace(out, old)
        try:
            os.replace(tmp, out)
        except BaseException:
            os.replace(old, out)
            raise
        _fsync_path(out.parent, directory=True)
        shutil.rmtree(old, ignore_errors=True)
        if old.exists():
            logger.warning("could not delete the replaced output %s: the next conversion to %s deletes it", old, out)
    else:
        os.replace(tmp, out)
        _fsync_path(out.parent, directory=True)


def template_weight_map(index_path: Path) -> dict[str, str]:
    """The ``weight_map`` of a template's index, every shard a plain ``*.safetensors`` file name
    (:func:`check_shard_name`): the export writes these names inside its own directory only."""
    weight_map = read_json_object(index_path).get("weight_map")
    if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
        raise ValueError(f"{index_path}: no weight_map object of tensor name -> shard file")
    for fname in sorted(set(weight_map.values())):
        check_shard_name(fname, index_path)
        if not fname.endswith(".safetensors"):
            raise ValueError(f"{index_path}: shard file name {fname!r} does not end in .safetensors")
    return weight_map


def _write_json(path: Path, data: dict) -> None:
    path.write_text(json.dumps(data, indent=2, sort_keys=False) + "\n")
