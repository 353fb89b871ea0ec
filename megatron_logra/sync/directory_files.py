"""The files of a delta directory: names and patterns of every kind, the anchor marker's schema, atomic writes.

A delta directory (:class:`~megatron_logra.sync.transport.DirectoryTransport`) holds deltas
``delta_{new_version:08d}.safetensors``, anchor markers ``anchor_{version:08d}.json`` and full-weights
files ``full_{version:08d}.safetensors``, each written through a temporary file ``.<name>.<pid>.<hex>.tmp``
renamed (or linked) into place, so a reader never sees a partial file and a writer's leftovers are
recognisable. The names and patterns live here, in one place, so the producer's ``clear`` / ``prune`` and
the consumer's listing agree on what belongs to a chain; and so does the marker's schema, which the
producer checks before writing and the consumer before trusting a marker.

Imports only the standard library besides the sync package.
"""

from __future__ import annotations

import os
import re
import uuid
from pathlib import Path
from typing import Any

from megatron_logra.sync.full_weights import full_filename

__all__ = ["delta_filename", "anchor_filename", "full_filename"]

# a version as the producer spells it, ``{:08d}``: eight digits, or more without a leading zero, so that a stray
# ``delta_000000007.safetensors`` is not taken for version 7 (whose file is ``delta_00000007.safetensors``)
_VERSION = r"(\d{8}|[1-9]\d{8,})"
_FILE_RE = re.compile(rf"^delta_{_VERSION}\.safetensors$")
_TMP_RE = re.compile(r"^\.delta_\d{8,}\.safetensors\..+\.tmp$")
_ANCHOR_RE = re.compile(rf"^anchor_{_VERSION}\.json$")
_ANCHOR_TMP_RE = re.compile(r"^\.anchor_\d{8,}\.json\..+\.tmp$")
_FULL_RE = re.compile(rf"^full_{_VERSION}\.safetensors$")
_FULL_TMP_RE = re.compile(r"^\.full_\d{8,}\.safetensors\..+\.tmp$")
_ANCHOR_KEYS = {"version", "epoch", "fingerprint"}
_ANCHOR_OPTIONAL = {"full"}
_FULL_KEYS = {"file", "sha256"}
_SIBLING_RE = re.compile(r"^[A-Za-z0-9_.-]+$")
_RANK_DIR_RE = re.compile(r"^rank\d+$")


def delta_filename(new_version: int) -> str:
    return f"delta_{new_version:08d}.safetensors"


def anchor_filename(version: int) -> str:
    return f"anchor_{version:08d}.json"


def _valid_marker(marker: Any) -> bool:
    if not isinstance(marker, dict) or not _ANCHOR_KEYS <= set(marker) <= _ANCHOR_KEYS | _ANCHOR_OPTIONAL:
        return False
    version, epoch, fp = marker["version"], marker["epoch"], marker["fingerprint"]
    if isinstance(version, bool) or not isinstance(version, int) or version < 0:
        return False
    if not isinstance(epoch, str) or not epoch:
        return False
    full = marker.get("full")
    if full is not None and not (isinstance(full, dict) and set(full) == _FULL_KEYS
                                 and _full_file_ok(full["file"], version) and _is_sha256(full["sha256"])):
        return False
    return fp is None or (isinstance(fp, dict)
                          and all(isinstance(k, str) and isinstance(v, str) for k, v in fp.items()))


def _full_file_ok(file: Any, version: int) -> bool:
    """A marker's ``full`` file: ``full_<version>.safetensors`` in its own directory, or in a sibling directory
    (``../<name>/full_<version>.safetensors``: another trainer rank's chain that wrote the file for all)."""
    if not isinstance(file, str):
        return False
    if file == full_filename(version):
        return True
    parts = file.split("/")
    return (len(parts) == 3 and parts[0] == ".." and _SIBLING_RE.match(parts[1]) is not None
            and parts[1] not in (".", "..") and parts[2] == full_filename(version))


def _is_sha256(value: Any) -> bool:
    return isinstance(value, str) and len(value) == 64 and all(c in "0123456789abcdef" for c in value)


def _write_atomically(final: Path, data: bytes) -> None:
    tmp = final.parent / f".{final.name}.{os.getpid()}.{uuid.uuid4().hex}.tmp"
    try:
        with open(tmp, "wb") as fh:
            fh.write(data)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, final)
    finally:
        if tmp.exists():
            tmp.unlink()
