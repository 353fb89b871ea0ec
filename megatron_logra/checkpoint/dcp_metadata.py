"""Reading the pickled parts of a ``torch_dist`` checkpoint without running code from it.

torch.distributed.checkpoint (DCP) stores a checkpoint's index, ``dist/.metadata``, as a pickle
and reads it with a plain ``pickle.load``; it also stores byte objects (megatron-core's
``ShardedObject``\\ s, e.g. each layer's ``_extra_state``) as ``torch.save`` payloads inside the
``.distcp`` files and reads them back with ``torch.load(weights_only=False)``. Either would run
arbitrary code from a crafted checkpoint (a shared run directory, a downloaded export) on
``--resume``, ``eval`` or ``convert``; the CRC-32s in ``meta.json`` do not help, since whoever
hands out a checkpoint can recompute them.

:func:`read_dcp_metadata` unpickles ``.metadata`` with an unpickler that resolves only the
globals a DCP index holds (:data:`ALLOWED_GLOBALS`: the ``torch.distributed.checkpoint``
metadata and plan dataclasses, ``torch.Size``, torch dtypes and layouts, builtin containers) and
refuses anything else with a :class:`CheckpointError` naming the file and the global.
:func:`check_dcp_dir` does that and then loads every stored byte object with
``torch.load(weights_only=True)`` (tensors, numbers, strings and containers only) and unpickles the
FP8 metadata a TransformerEngine layer keeps in its ``_extra_state`` (a pickle inside a uint8 tensor,
which TransformerEngine itself would unpickle unrestricted on load) with an allow-list of its own
(:func:`check_extra_state`, in :mod:`megatron_logra.checkpoint.fp8_extra_state`). Every reader
of trainer checkpoints calls it before handing the directory to DCP or megatron-core
(:func:`megatron_logra.checkpoint.integrity.read_meta` does, for every checkpoint with a
``dist/`` directory).
"""

from __future__ import annotations

import io
import logging
import pickle
from pathlib import Path
from typing import Any, Union

from megatron_logra.checkpoint.fp8_extra_state import EXTRA_STATE_GLOBALS, RECIPE_GLOBALS, TRUST_ENV, check_extra_state
from megatron_logra.checkpoint.integrity import CheckpointError

logger = logging.getLogger(__name__)

__all__ = ["ALLOWED_GLOBALS", "EXTRA_STATE_GLOBALS", "read_dcp_metadata", "check_dcp_dir", "check_extra_state",
           "METADATA_FILE", "RECIPE_GLOBALS", "TRUST_ENV"]  # the FP8 extra-state names live in fp8_extra_state

METADATA_FILE = ".metadata"
"""DCP's index file in a ``torch_dist`` directory (``torch.distributed.checkpoint.filesystem._metadata_fn``)."""

ALLOWED_GLOBALS: dict[str, frozenset[str]] = {
    "torch.distributed.checkpoint.metadata": frozenset({
        "Metadata", "MetadataIndex", "StorageMeta", "TensorProperties", "TensorStorageMetadata",
        "BytesStorageMetadata", "ChunkStorageMetadata", "_MEM_FORMAT_ENCODING"}),
    "torch.distributed.checkpoint.planner": frozenset({
        "SavePlan", "WriteItem", "WriteItemType", "TensorWriteData", "BytesIOWriteData"}),
    "torch.distributed.checkpoint.filesystem": frozenset({"_StorageInfo"}),
    "torch.serialization": frozenset({"_get_layout"}),  # torch.layout pickles as _get_layout("torch.strided")
    "torch": frozenset({"Size"}),  # and every torch dtype (torch.float32, ...): see _allowed
    "builtins": frozenset({"set", "frozenset", "list", "dict", "tuple", "bytearray", "complex", "slice"}),
    "collections": frozenset({"OrderedDict"}),
}
"""``module: names`` the unpickler of ``.metadata`` resolves (dataclasses and enums that only store
fields, constructors of plain values); everything else is refused. The set was read off real
checkpoints (``pickletools``) and the DCP classes that can occur in a save plan."""


def _allowed(module: str, name: str) -> bool:
    if name in ALLOWED_GLOBALS.get(module, ()):
        return True
    if module == "torch":
        import torch

        return isinstance(getattr(torch, name, None), torch.dtype)
    return False


class _MetadataUnpickler(pickle.Unpickler):
    """``pickle.Unpickler`` that resolves only :data:`ALLOWED_GLOBALS` (and torch dtypes)."""

    def __init__(self, fh, source: Path) -> None:
        super().__init__(fh)
        self._source = source

    def find_class(self, module: str, name: str) -> Any:
        if not _allowed(module, name):
            raise CheckpointError(
                f"{self._source} references the Python global {module}.{name}, which a torch.distributed.checkpoint "
                "index never holds (only its metadata classes, torch.Size, dtypes and builtin containers); refusing "
                "to load it, since unpickling it could run code: the checkpoint was not written by this trainer "
                "(crafted or from another program)")
        return super().find_class(module, name)


def read_dcp_metadata(dist_dir: Union[str, Path]) -> Any:
    """The ``torch.distributed.checkpoint.metadata.Metadata`` of the ``torch_dist`` directory
    ``dist_dir``, read from ``dist_dir/.metadata`` with the restricted unpickler, with
    ``storage_meta`` set as DCP's ``FileSystemReader.read_metadata`` sets it (usable in its
    place, e.g. returned by a ``FileSystemReader`` subclass's ``read_metadata``).
    :class:`CheckpointError` naming the file when it is missing, truncated or corrupt, references
    any other global, or is not a DCP ``Metadata``."""
    from torch.distributed.checkpoint.metadata import Metadata, StorageMeta

    path = Path(dist_dir) / METADATA_FILE
    try:
        with open(path, "rb") as fh:
            metadata = _MetadataUnpickler(fh, path).load()
    except CheckpointError:
        raise
    except OSError as exc:
        raise CheckpointError(f"{path} is unreadable: {type(exc).__name__}: {exc}") from exc
    except Exception as exc:  # noqa: BLE001 - UnpicklingError, EOFError, and whatever a malformed stream raises
        raise CheckpointError(f"{path} is not a readable torch.distributed.checkpoint index (truncated or "
                              f"corrupt?): {type(exc).__name__}: {exc}") from exc
    if not isinstance(metadata, Metadata) or not isinstance(metadata.state_dict_metadata, dict) or not (
            metadata.storage_data is None or isinstance(metadata.storage_data, dict)):
        raise CheckpointError(f"{path} holds a {type(metadata).__name__}, not a torch.distributed.checkpoint "
                              "Metadata with its state_dict_metadata and storage_data mappings")
    if getattr(metadata, "storage_meta", None) is None:
        metadata.storage_meta = StorageMeta()
    metadata.storage_meta.load_id = None
    return metadata


def _byte_items(dist_dir: Path, metadata: Any) -> dict[str, list[tuple[int, int, str]]]:
    """``{relative file: [(offset, length, key)]}`` of the byte objects ``metadata`` indexes, sorted by
    offset; :class:`CheckpointError` for an entry that points outside ``dist_dir`` or is transformed."""
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata

    items: dict[str, list[tuple[int, int, str]]] = {}
    root = dist_dir.resolve()
    for index, info in (metadata.storage_data or {}).items():
        key = getattr(index, "fqn", None)
        if not isinstance(metadata.state_dict_metadata.get(key), BytesStorageMetadata):
            continue
        rel, offset, length = (getattr(info, a, None) for a in ("relative_path", "offset", "length"))
        where = f"{dist_dir / METADATA_FILE}: byte object {key!r}"
        if not (isinstance(rel, str) and isinstance(offset, int) and isinstance(length, int)
                and offset >= 0 and length >= 0):
            raise CheckpointError(f"{where} has no valid location ({info!r})")
        if (root / rel).resolve().parent != root:
            raise CheckpointError(f"{where} points outside the checkpoint ({rel!r})")
        if getattr(info, "transform_descriptors", None):
            raise CheckpointError(f"{where} is stored with transforms {info.transform_descriptors!r}, which this "
                                  "trainer never writes")
        items.setdefault(rel, []).append((offset, length, key))
    return {rel: sorted(entries) for rel, entries in items.items()}


_TORCH_ADVICE = ("Re-running `torch.load`", "Please use `torch.serialization", "Check the documentation of torch.load",
                 "Please file an issue", "Weights only load failed.")
"""Where the advice in torch's own ``weights_only`` messages starts: its suggestions to load with
``weights_only=False`` or to allow-list the global would defeat the check, so they are never passed on."""


def _load_failure(exc: BaseException) -> str:
    """``Type: reason`` of a refused ``torch.load(weights_only=True)``, on one line and without torch's
    advice (:data:`_TORCH_ADVICE`). torch wraps the unpickler's error in an ``UnpicklingError`` whose text
    leads with that advice; the unpickler's own error is its ``__context__``."""
    import pickle as _pickle

    inner = exc
    if (isinstance(exc, _pickle.UnpicklingError) and str(exc).startswith("Weights only load failed")
            and isinstance(exc.__context__, Exception)):
        inner = exc.__context__
    text = " ".join(str(inner).split())
    for advice in _TORCH_ADVICE:
        text = text.split(advice)[0].strip()
    return f"torch.load weights_only=True: {type(inner).__name__}" + (f": {text[:300]}" if text else "")


def check_dcp_dir(dist_dir: Union[str, Path]) -> None:
    """Check that loading the ``torch_dist`` directory ``dist_dir`` runs no code from it: its
    ``.metadata`` unpickles with only the allowed globals (:func:`read_dcp_metadata`), and every
    byte object it indexes loads with ``torch.load(weights_only=True)``. :class:`CheckpointError`
    naming the file (and the object) otherwise. Reads the index and the byte objects only (small:
    megatron-core stores a few per layer), never the tensors."""
    import torch

    dist_dir = Path(dist_dir)
    metadata = read_dcp_metadata(dist_dir)
    for rel, entries in _byte_items(dist_dir, metadata).items():
        path = dist_dir / rel
        try:
            with open(path, "rb") as fh:
                for offset, length, key in entries:
                    fh.seek(offset)
                    data = fh.read(length)
                    if len(data) != length:
                        raise CheckpointError(f"{path}: byte object {key!r} ends past the end of the file "
                                              "(truncated or corrupt)")
                    try:
                        obj = torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
                    except Exception as exc:  # noqa: BLE001 - UnpicklingError for a refused global; others if corrupt
                        raise CheckpointError(
                            f"{path}: byte object {key!r} does not load as plain data ({_load_failure(exc)}); "
                            "refusing to load it, since unpickling it could run code: crafted, corrupt or not "
                            "written by this trainer") from exc
                    if "_extra_state" in str(key):
                        check_extra_state(obj, f"{path}: byte object {key!r}")
        except OSError as exc:
            raise CheckpointError(f"{path} is unreadable: {type(exc).__name__}: {exc}") from exc
