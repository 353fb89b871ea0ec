"""Read back what W&B wrote for an offline run (``WANDB_MODE=offline``): the records of its ``run-ID.wandb``
transaction log, parsed here independently of the trainer with W&B's own protobuf messages.

The file is a 7-byte header (``:W&B``, a 2-byte magic, a version byte) followed by LevelDB log blocks of
32 KiB: each chunk is a 7-byte header (CRC-32C, little-endian length, type: 1 full, 2 first, 3 middle, 4 last)
and its bytes; a record is one full chunk or first + middles + last, and holds one ``wandb_internal_pb2.Record``."""

from __future__ import annotations

import json
import struct
from pathlib import Path
from typing import Any

_HEADER = 7
_BLOCK = 32768


def _chunks(data: bytes) -> list[bytes]:
    records, pending, pos = [], b"", _HEADER
    while pos + 7 <= len(data):
        left = _BLOCK - pos % _BLOCK
        if left < 7:  # the block's tail is padding
            pos += left
            continue
        _, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        if length == 0 and kind == 0:
            break
        chunk = data[pos + 7:pos + 7 + length]
        pos += 7 + length
        if kind == 1:
            records.append(chunk)
        elif kind == 2:
            pending = chunk
        elif kind == 3:
            pending += chunk
        elif kind == 4:
            records.append(pending + chunk)
    return records


def offline_runs(save_dir: Path) -> list[Path]:
    """The offline run directories W&B wrote under ``save_dir/wandb``, oldest first."""
    return sorted((Path(save_dir) / "wandb").glob("offline-run-*"))


def read_offline_run(run_dir: Path) -> dict[str, Any]:
    """``{"id", "project", "name", "group", "history": [dict per log call], "summary": dict, "config": dict, "exit_code"}``
    of one offline run directory (values decoded from W&B's JSON; ``exit_code`` None while the run is not
    finished)."""
    from wandb.proto import wandb_internal_pb2 as pb

    (path,) = Path(run_dir).glob("run-*.wandb")
    out: dict[str, Any] = {"history": [], "summary": {}, "config": {}, "exit_code": None}
    for raw in _chunks(path.read_bytes()):
        record = pb.Record()
        record.ParseFromString(raw)
        kind = record.WhichOneof("record_type")
        if kind == "run":
            out.update(id=record.run.run_id, project=record.run.project, name=record.run.display_name,
                       group=record.run.run_group)
            out["config"].update({u.key: json.loads(u.value_json) for u in record.run.config.update})
        elif kind == "config":
            out["config"].update({u.key: json.loads(u.value_json) for u in record.config.update})
        elif kind == "history":
            out["history"].append({(i.key or "/".join(i.nested_key)): json.loads(i.value_json)
                                   for i in record.history.item})
        elif kind == "exit":
            out["exit_code"] = record.exit.exit_code
        elif kind == "summary":
            out["summary"].update({(u.key or "/".join(u.nested_key)): json.loads(u.value_json)
                                   for u in record.summary.update})
    return out
