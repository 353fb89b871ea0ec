"""Checkpoint CRC-32s on 2 ranks (gloo): the hashing is split, and every rank refuses a corrupt file.

One torchrun launch of ``checksums_worker.py``: save, verify (each rank reads only its share of the
files), flip one byte of a file that only the last rank checks, load. Every rank must raise the same
``CheckpointError`` naming that file — rank 0 included, which never read it — and leave its model
untouched. Then a save whose RNG file cannot be written on the last rank only: every rank must
raise the same ``CheckpointError`` naming that rank (before, rank 0 waited for it in a barrier) and
``latest`` must keep naming the first checkpoint.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

pytestmark = pytest.mark.distributed

WORKER = Path(__file__).resolve().parent / "checksums_worker.py"
NPROC = 2


def test_crc32_work_is_split_and_every_rank_refuses(launcher, tmp_path):
    launcher.launch(NPROC, [str(WORKER), str(tmp_path)], timeout=180, log=tmp_path / "launch.log")
    records = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(NPROC)]

    shares = [set(r["share"]) for r in records]
    assert all(shares), f"a rank hashed nothing: {shares}"
    assert not shares[0] & shares[1], f"shares overlap: {shares[0] & shares[1]}"
    meta = json.loads((tmp_path / "run" / "checkpoints" / "step_00000001" / "meta.json").read_text())
    assert shares[0] | shares[1] == set(meta["files"])
    assert all(set(e) == {"bytes", "crc32"} for e in meta["files"].values())
    for r, rec in enumerate(records):
        if rec["read_bytes"] is not None:  # Linux: bytes read by the verification of the untouched checkpoint
            assert rec["share_bytes"] <= rec["read_bytes"] < rec["share_bytes"] + (256 << 10), (
                f"rank {r} read {rec['read_bytes']} bytes verifying a share of {rec['share_bytes']} "
                f"(of {rec['total_bytes']})")

    flipped = records[0]["flipped"]
    assert flipped in shares[-1] and flipped not in shares[0]
    messages = set()
    for r, rec in enumerate(records):
        assert rec["error"] is not None, f"rank {r} loaded a checkpoint with a flipped byte in {flipped}"
        kind, message = rec["error"]
        assert kind == "CheckpointError" and f"{flipped} has CRC-32" in message, (r, rec["error"])
        assert not rec["changed"], f"rank {r}: the model was modified by a refused load"
        messages.add(message)
    assert len(messages) == 1, f"ranks raised different errors: {messages}"

    saves = {tuple(rec["save_error"] or ()) for rec in records}
    assert len(saves) == 1, f"ranks raised different save errors: {saves}"
    kind, message = saves.pop()
    assert kind == "CheckpointError" and f"rank {NPROC - 1} (OSError: [Errno 28] No space left" in message, message
    assert "rank 0 (" not in message and "writing the RNG states" in message, message
    assert all(rec["latest"] == "step_00000001" for rec in records)

