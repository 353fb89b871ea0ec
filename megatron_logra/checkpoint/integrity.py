"""Integrity checks of checkpoint files: the CRC-32 of every file (hashed by all ranks together, each a
share), and the checked reading of ``meta.json``. The durable writes (fsync discipline) are
:mod:`megatron_logra.checkpoint.durable`, re-exported here.

See :mod:`megatron_logra.checkpoint` for the on-disk format and the guarantees these serve.
"""

from __future__ import annotations

import heapq
import json
import logging
import zlib
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Mapping, NamedTuple, Optional, Sequence, Union

import torch.distributed as dist

from megatron_logra.checkpoint.durable import atomic_write_text, fsync_path, sync_own_files, write_synced
from megatron_logra.parallel import all_gather_bytes, group_rank, group_size, world_group

logger = logging.getLogger(__name__)

__all__ = ["CheckpointError", "FORMAT_VERSION", "read_meta", "read_meta_json", "checksum_shares", "file_crc32",
           "file_records", "meta_crc32", "removed_while_read", "fsync_path", "write_synced", "atomic_write_text", "sync_own_files"]

FORMAT_VERSION = 2
_CRC_CHUNK = 16 << 20
"""Bytes read per ``zlib.crc32`` call: one buffer of this size per hashing thread."""
_CRC_THREADS = 4
"""Hashing threads per rank."""


class CheckpointError(ValueError):
    """A checkpoint is missing, incomplete, corrupt or incompatible with this run (bad input: the
    command line reports it as an error, without a traceback)."""


def meta_crc32(meta: Mapping[str, Any]) -> str:
    """CRC-32 of meta.json's content without its ``meta_crc32`` field, over a canonical JSON form
    (what a JSON round trip preserves: string keys, sorted, no whitespace)."""
    body = json.loads(json.dumps({k: v for k, v in meta.items() if k != "meta_crc32"}))
    return f"{zlib.crc32(json.dumps(body, sort_keys=True, separators=(',', ':')).encode()):08x}"


def checksum_shares(sizes: Mapping[str, int], world_size: int) -> list[list[str]]:
    """Split the files ``{name: bytes}`` into ``world_size`` disjoint shares (index = rank) of
    similar total size: largest first, each to the least loaded rank (ties: lower rank; equal
    sizes: by name). Deterministic, so every rank computes the same split from the same sizes;
    every name is in exactly one share, and each share is sorted by name."""
    if world_size < 1:
        raise ValueError(f"world_size={world_size} must be >= 1")
    shares: list[list[str]] = [[] for _ in range(world_size)]
    load = [(0, r) for r in range(world_size)]
    for name in sorted(sizes, key=lambda n: (-sizes[n], n)):
        total, r = heapq.heappop(load)
        shares[r].append(name)
        heapq.heappush(load, (total + sizes[name], r))
    return [sorted(share) for share in shares]


def file_crc32(path: Union[str, Path]) -> tuple[int, str]:
    """``(bytes read, CRC-32 as 8 lowercase hex digits)`` of a file, read in 16 MiB chunks into one
    reused buffer (memory stays flat; ``zlib.crc32`` releases the GIL, so threads overlap)."""
    crc, total = 0, 0
    view = memoryview(bytearray(_CRC_CHUNK))
    with open(path, "rb", buffering=0) as fh:
        while True:
            got = fh.readinto(view)
            if not got:
                break
            crc = zlib.crc32(view[:got], crc)
            total += got
    return total, f"{crc:08x}"


def _hash_files(root: Path, names: Sequence[str]) -> dict[str, dict]:
    """``{name: {"bytes": n, "crc32": hex}}`` of files under ``root`` (``{"error": message}`` for
    one that cannot be read), hashed on up to ``_CRC_THREADS`` threads."""
    def one(name: str) -> dict:
        try:
            n, crc = file_crc32(root / name)
        except OSError as exc:
            return {"error": f"{type(exc).__name__}: {exc}"}
        return {"bytes": n, "crc32": crc}

    if not names:
        return {}
    with ThreadPoolExecutor(max_workers=min(_CRC_THREADS, len(names)), thread_name_prefix="ckpt-crc32") as pool:
        return dict(zip(names, pool.map(one, names)))


def file_records(root: Path, sizes: dict[str, int], checksums: bool) -> dict[str, dict]:
    """meta.json's ``files`` (collective over the world group when ``checksums``): each rank
    hashes its :func:`checksum_shares` share of the files it sees, the results are gathered; a
    file that no rank hashed at the size rank 0 sees (a rank that could not read it, or listed
    other files) is hashed by rank 0 itself. ``{}`` on the other ranks."""
    if not checksums:
        return {rel: {"bytes": n} for rel, n in sizes.items()}
    group = world_group()
    share = checksum_shares(sizes, group_size(group))[group_rank(group)]
    hashed: dict[str, dict] = {}
    for payload in all_gather_bytes(json.dumps(_hash_files(root, share)).encode(), group):
        hashed.update(json.loads(payload))
    if group_rank(group) != 0:
        return {}
    records = {}
    for rel, n in sizes.items():
        got = hashed.get(rel, {})
        if got.get("bytes") != n or "crc32" not in got:
            n, crc = file_crc32(root / rel)
            got = {"bytes": n, "crc32": crc}
        records[rel] = {"bytes": got["bytes"], "crc32": got["crc32"]}
    return records


def removed_while_read(path: Path) -> str:
    """The message for checkpoint ``path`` vanishing while it was read: a job still training prunes its
    checkpoints beyond ``train.keep_last`` (or another job removed it)."""
    return (f"{path} was removed while it was being read (a job still training this run deletes checkpoints "
            f"older than its train.keep_last newest); read it again: {path.parent / 'latest'} names the newest")


class _Recorded(NamedTuple):
    bytes: int
    crc32: Optional[str]


def _is_count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _is_crc(value: Any) -> bool:
    return isinstance(value, str) and len(value) == 8 and all(c in "0123456789abcdef" for c in value)


def _parse_meta(path: Path) -> tuple[dict, dict[str, _Recorded]]:
    """meta.json of ``path`` (format version checked) and its ``files``: sizes and CRC-32s (None
    where not recorded: plain-int sizes of older checkpoints, or saved without checksums)."""
    meta_path = path / "meta.json"
    if not meta_path.exists():
        raise CheckpointError(f"{path} is not a megatron_logra checkpoint (no meta.json)")
    try:
        meta = json.loads(meta_path.read_text())
    except ValueError as exc:  # JSONDecodeError, and UnicodeDecodeError for bytes that are not UTF-8
        raise CheckpointError(f"{meta_path} is corrupt: {exc}") from exc
    if not isinstance(meta, dict) or meta.get("format_version") != FORMAT_VERSION:
        got = meta.get("format_version") if isinstance(meta, dict) else None
        raise CheckpointError(f"{path} has format version {got}, expected {FORMAT_VERSION}")
    if "meta_crc32" in meta and meta["meta_crc32"] != meta_crc32(meta):  # absent in older checkpoints
        raise CheckpointError(f"{meta_path} is corrupt: its content does not match the CRC-32 it was written with "
                              f"(meta_crc32 {meta['meta_crc32']!r}, content {meta_crc32(meta)}): edited or damaged")
    files = meta.get("files", {})
    if not isinstance(files, dict):
        raise CheckpointError(f"{meta_path} is corrupt: 'files' is a {type(files).__name__}, not a mapping")
    recorded = {}
    for rel, entry in files.items():
        if _is_count(entry):  # sizes only (older checkpoints)
            recorded[rel] = _Recorded(entry, None)
        elif isinstance(entry, dict) and _is_count(entry.get("bytes")) and (
                "crc32" not in entry or _is_crc(entry["crc32"])):
            recorded[rel] = _Recorded(entry["bytes"], entry.get("crc32"))
        else:
            raise CheckpointError(f"{meta_path} is corrupt: files[{rel!r}] = {json.dumps(entry)[:80]} is neither a "
                                  'size nor {"bytes": size, "crc32": 8 hex digits}')
    return meta, recorded


def read_meta_json(path: Union[str, Path]) -> dict:
    """``meta.json`` of checkpoint ``path``, parsed and checked by itself only: present, JSON, this format
    version, its own CRC-32 (``meta_crc32``, where recorded) and a well-formed ``files`` mapping. No other
    file is opened (cheap; callable before any process group exists): :func:`read_meta` checks the files
    before they are loaded. :class:`CheckpointError` naming meta.json otherwise."""
    return _parse_meta(Path(path))[0]


def _size_problems(path: Path, recorded: Mapping[str, _Recorded]) -> list[str]:
    problems = []
    for rel, want in recorded.items():
        f = path / rel
        if not f.exists():
            problems.append(f"{rel} is missing")
        elif f.stat().st_size != want.bytes:
            problems.append(f"{rel} has {f.stat().st_size} bytes, {want.bytes} were written (truncated or corrupt)")
    return problems


def _crc_problems(path: Path, recorded: Mapping[str, _Recorded]) -> list[str]:
    problems = []
    for rel, got in _hash_files(path, sorted(recorded)).items():
        want = recorded[rel]
        if "error" in got:
            problems.append(f"{rel} is unreadable: {got['error']}")
        elif got["bytes"] != want.bytes:
            problems.append(f"{rel} has {got['bytes']} bytes, {want.bytes} were written (truncated or corrupt)")
        elif got["crc32"] != want.crc32:
            problems.append(f"{rel} has CRC-32 {got['crc32']}, {want.crc32} was written (corrupt at the same size)")
    return problems


def read_meta(
    path: Union[str, Path],
    *,
    checksums: bool = True,
    group: Optional[dist.ProcessGroup] = None,
) -> dict:
    """``meta.json`` of checkpoint ``path``, checked: format version, every recorded file present
    with its recorded size, then (``checksums``) every recorded CRC-32, then that the pickles of its
    ``dist/`` directory (DCP's ``.metadata`` index and the stored byte objects) hold plain data only
    (:func:`megatron_logra.checkpoint.dcp_metadata.check_dcp_dir`: loading the checkpoint runs no
    code from it, whatever its CRC-32s say). A missing, truncated, corrupt or crafted file is named
    in the :class:`CheckpointError`; the pickles are read only when every size and CRC-32 matched,
    so a file damaged at the same size is reported by its CRC-32. Checkpoints without CRC-32s (older
    ones, or saved with ``checksums=False``) and ``checksums=False`` get the size check only. A checkpoint
    whose meta.json disappears while it is checked (pruned by the job still training the run) is reported
    as such (:func:`removed_while_read`), not as a damaged file.

    ``group=None``: this process checks every file (tools: convert, eval). With a process group,
    every member must call it (collective): the CRC-32 work is split among the members
    (:func:`checksum_shares`) and the problems found by each are gathered before any member reads the
    pickles, so that every member raises the same CheckpointError, or none does."""
    path = Path(path)
    existed = (path / "meta.json").exists()
    world, rank = group_size(group), group_rank(group)
    meta: dict = {}
    problems: list[str] = []

    def failure(fn) -> Optional[str]:
        try:
            fn()
        except CheckpointError as exc:
            return str(exc)
        except OSError as exc:  # e.g. an unreadable directory: reported like the other problems, on every rank
            return f"{path}: {type(exc).__name__}: {exc}"
        return None

    def sizes_and_crcs() -> None:
        nonlocal meta, problems
        meta, recorded = _parse_meta(path)
        problems = _size_problems(path, recorded)
        with_crc = {rel: r for rel, r in recorded.items() if r.crc32 is not None}
        if checksums and not problems and with_crc:
            share = checksum_shares({rel: r.bytes for rel, r in with_crc.items()}, world)[rank]
            problems = _crc_problems(path, {rel: with_crc[rel] for rel in share})
        elif checksums and not with_crc and recorded and rank == 0:
            logger.info("%s records no CRC-32s (older checkpoint or saved without checksums): sizes checked only", path)

    def pickles() -> None:
        from megatron_logra.checkpoint.dcp_metadata import check_dcp_dir

        if (path / "dist").is_dir():
            check_dcp_dir(path / "dist")  # its pickles hold plain data only: loading it runs no code

    error = failure(sizes_and_crcs)
    if world > 1:  # every member's size and CRC-32 verdict first: a damaged file is named as such
        reports = [json.loads(p) for p in all_gather_bytes(json.dumps([error, problems]).encode(), group)]
        error = next((e for e, _ in reports if e), None)
        problems = [p for _, ps in reports for p in ps]
    if error is None and not problems:
        error = failure(pickles)
        if world > 1:
            error = next((e for e in (json.loads(p) for p in all_gather_bytes(json.dumps(error).encode(), group))
                          if e), None)
    if (error is not None or problems) and existed and not (path / "meta.json").exists():
        raise CheckpointError(removed_while_read(path))  # pruned by the job still training it, mid-read
    if error is not None:
        raise CheckpointError(error)
    if problems:
        problems = sorted(set(problems))
        raise CheckpointError(f"{path}: " + "; ".join(problems[:4]) + (" ..." if len(problems) > 4 else ""))
    return meta
