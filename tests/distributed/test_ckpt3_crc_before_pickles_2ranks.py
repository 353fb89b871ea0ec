"""On 2 ranks (gloo), a byte object damaged at the same size is named by its CRC-32 on every rank.

Each rank hashes a share of the files; the rank whose share is clean must not read the damaged pickle
and report it as possibly crafted before the other rank's CRC-32 verdict is known: ``read_meta`` gathers
every rank's size and CRC-32 results first and reads the pickles only when all matched. One torchrun
launch of ``ckpt3_crc_worker.py``.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

pytestmark = pytest.mark.distributed

WORKER = Path(__file__).resolve().parent / "ckpt3_crc_worker.py"
NPROC = 2


def test_every_rank_names_the_crc32_of_a_damaged_byte_object(launcher, tmp_path):
    launcher.launch(NPROC, [str(WORKER), str(tmp_path)], timeout=180, log=tmp_path / "launch.log")
    records = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(NPROC)]
    flipped = records[0]["flipped"]
    assert any(flipped not in rec["share"] for rec in records), "every rank hashed the damaged file"
    for what in ("read_meta", "load"):
        messages = set()
        for r, rec in enumerate(records):
            assert rec[what] is not None, f"rank {r}: {what} accepted a damaged byte object in {flipped}"
            kind, message = rec[what]
            assert kind == "CheckpointError" and f"{flipped} has CRC-32" in message, (r, what, message)
            assert "(corrupt at the same size)" in message and "could run code" not in message, (r, what, message)
            messages.add(message)
        assert len(messages) == 1, f"{what}: ranks raised different errors: {messages}"
