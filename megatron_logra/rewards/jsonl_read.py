"""Reading a problem file's rows: the lines of a JSONL file as JSON objects, or the rows of a Parquet file, each with
its 1-based line (row) number. Every refusal is a ``ValueError`` naming ``PATH:LINE``: bytes that are not UTF-8, a
line that is no valid JSON (a key repeated within one object, an integer JSON cannot turn into a Python number, an
object nested too deeply for the parser included). Line numbers count line breaks as the reader does: ``\\n``,
``\\r\\n`` and a lone ``\\r`` each end a line. What one row becomes is :mod:`megatron_logra.rewards.jsonl_rows`; the
file format as a whole is described in :mod:`megatron_logra.rewards.jsonl`."""

from __future__ import annotations

import codecs
import io
import json
import re
from pathlib import Path
from typing import Any, Iterator

__all__ = ["json_lines", "parquet_rows", "read_utf8"]

_LINE_BREAK = re.compile(rb"\r\n|\r|\n")


def json_lines(path: Path) -> Iterator[tuple[int, Any]]:
    """``(line number, JSON value)`` of each non-blank line; ``ValueError`` naming ``PATH:LINE`` for a line that is
    no valid JSON, a key repeated within one object, an integer past Python's digit limit for int-string conversion
    or nesting too deep for the parser."""
    for line_no, raw in enumerate(io.StringIO(read_utf8(path), newline=None), start=1):
        if not raw.strip():
            continue
        try:
            value = json.loads(raw, object_pairs_hook=_unique_keys)
        except json.JSONDecodeError as exc:
            raise ValueError(f"{path}:{line_no}: invalid JSON ({exc.msg} at column {exc.colno})") from exc
        except _DuplicateKey as exc:
            raise ValueError(f"{path}:{line_no}: key {exc.args[0]!r} appears twice in one object (JSON keeps only the "
                             f"last, silently); keep one of the two") from None
        except RecursionError:
            raise ValueError(f"{path}:{line_no}: invalid JSON (arrays or objects nested too deeply to read); "
                             f"flatten the row") from None
        except ValueError as exc:  # an integer of more digits than int-string conversion allows (4300)
            raise ValueError(f"{path}:{line_no}: unreadable JSON ({exc}); give such a number as a string") from None
        yield line_no, value


def parquet_rows(path: Path) -> Iterator[tuple[int, Any]]:
    """``(row number from 1, row as a dict)`` of a Parquet file (nested structs as dicts, lists as lists), read with
    pyarrow; ``ValueError`` naming the file when pyarrow is missing or cannot read it."""
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise ValueError(f"{path}: reading a parquet: dataset needs pyarrow (pip install pyarrow), or convert the file "
                         f"to JSON lines and give it as jsonl:PATH") from None
    try:
        rows = pq.read_table(path).to_pylist()
    except Exception as exc:  # pyarrow raises ArrowInvalid, OSError, ... for a file that is not Parquet
        raise ValueError(f"{path}: not a readable Parquet file ({type(exc).__name__}: {exc})") from None
    yield from enumerate(rows, start=1)


class _DuplicateKey(Exception):
    """A key repeated within one JSON object (``args[0]`` is the key)."""


def _unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """``json`` object hook: the object as a dict, raising :class:`_DuplicateKey` for a repeated key."""
    obj: dict[str, Any] = {}
    for key, value in pairs:
        if key in obj:
            raise _DuplicateKey(key)
        obj[key] = value
    return obj


def read_utf8(path: Path) -> str:
    """The file's text (a leading UTF-8 byte-order mark dropped); bytes that are not UTF-8 raise
    ValueError naming ``PATH:LINE`` (counted as :func:`json_lines` counts them) and the byte's column."""
    data = path.read_bytes()
    if data.startswith(codecs.BOM_UTF8):
        data = data[len(codecs.BOM_UTF8) :]
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        breaks = list(_LINE_BREAK.finditer(data, 0, exc.start))
        line_start = breaks[-1].end() if breaks else 0
        raise ValueError(f"{path}:{len(breaks) + 1}: not UTF-8 ({exc.reason}, byte 0x{data[exc.start]:02x} at byte "
                         f"column {exc.start - line_start + 1}); re-save the file as UTF-8") from None
