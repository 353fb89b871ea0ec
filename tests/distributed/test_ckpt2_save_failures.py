"""A checkpoint save that fails on one rank inside megatron-core's sharded save is the same
``CheckpointError`` on every rank (2 gloo ranks).

This file is also the worker (``python test_ckpt2_save_failures.py OUT`` on each rank). The failures
are real write errors: the failing rank lowers its file-size limit (``RLIMIT_FSIZE``, ``SIGXFSZ``
ignored, so a write past it fails with EFBIG as on a full disk) for one save only (TP=2, so that each
rank writes tensor shards of its own):

1. step 1 saves normally;
2. step 2: rank 0 cannot write ``common.pt`` (megatron-core writes it on rank 0 alone, outside any
   collective; before, rank 0 raised its own error and rank 1 died in the next collective);
3. step 3: rank 1 cannot write its tensor shard (torch.distributed.checkpoint raised its
   ``CheckpointException``, a ``BaseException``, not the promised ``CheckpointError``);
4. step 4 saves normally;
5. step 5: rank 0 cannot write ``dist/.metadata`` (an injected ENOSPC in the DCP writer's ``finish``,
   which only the coordinator runs, just before megatron-core broadcasts whether the save failed: the
   other rank waited in that broadcast while rank 0 went on to the next collective);
6. step 6 saves normally.

Each rank records the error of every save and what ``checkpoints/`` holds after it.
"""

from __future__ import annotations

import json
import resource
import signal
import sys
import warnings
from pathlib import Path

import pytest

pytestmark = pytest.mark.distributed

NPROC = 2
_LIMIT = 1024
"""Bytes a failing rank may write per file: below common.pt (~1.3 kB) and every tensor shard."""


def test_a_rank_failing_inside_the_sharded_save_is_one_error_everywhere(launcher, tmp_path):
    launcher.launch(NPROC, [__file__, str(tmp_path)], timeout=240, log=tmp_path / "launch.log")
    records = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(NPROC)]
    for step, failing in ((2, 0), (3, 1)):
        errors = {tuple(rec["saves"][str(step)]["error"] or ()) for rec in records}
        assert len(errors) == 1, f"step {step}: the ranks raised different errors: {errors}"
        kind, message = errors.pop()
        assert kind == "CheckpointError", (step, kind, message)
        assert f"saving checkpoint step {step} failed on rank {failing} (" in message, message
        assert f"rank {1 - failing} (" not in message, message
        assert "still names the last complete checkpoint" in message
        for rec in records:
            after = rec["saves"][str(step)]
            assert after["latest"] == "step_00000001", after
            assert not any(name.endswith(".tmp") for name in after["entries"]), after  # the unfinished save is gone
    assert "(common.pt)" in records[0]["saves"]["2"]["error"][1]
    assert "writing the sharded tensors" in records[0]["saves"]["3"]["error"][1]
    for rec in records:
        assert rec["saves"]["4"] == {"error": None, "latest": "step_00000004",
                                     "entries": ["latest", "step_00000001", "step_00000004"]}
    errors = {tuple(rec["saves"]["5"]["error"] or ()) for rec in records}
    assert len(errors) == 1, f"step 5: the ranks raised different errors: {errors}"
    kind, message = errors.pop()
    assert kind == "CheckpointError" and "saving checkpoint step 5 failed on rank 0 (" in message, message
    assert "No space left on device" in message and "rank 1 (" not in message, message
    for rec in records:
        assert rec["saves"]["5"]["latest"] == "step_00000004", rec["saves"]["5"]
        assert not any(name.endswith(".tmp") for name in rec["saves"]["5"]["entries"])
        assert rec["saves"]["6"]["error"] is None and rec["saves"]["6"]["latest"] == "step_00000006"
    from megatron_logra.checkpoint import read_meta

    read_meta(tmp_path / "run" / "checkpoints" / "step_00000004")
    read_meta(tmp_path / "run" / "checkpoints" / "step_00000006")


def _run(out: Path) -> None:
    import torch.distributed as dist

    from megatron_logra.checkpoint import CheckpointError, save_checkpoint
    from megatron_logra.models.gpt import ModelConfig, build_gpt
    from megatron_logra.parallel import ParallelConfig, initialize_parallel

    groups = initialize_parallel(ParallelConfig(tp=NPROC, backend="gloo"))  # every rank writes tensor shards
    rank = dist.get_rank()
    cfg = ModelConfig(num_layers=2, hidden_size=64, ffn_hidden_size=128, num_attention_heads=4, vocab_size=64,
                      seq_length=16)
    model = build_gpt(cfg, groups, seed=3)
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    limits = resource.getrlimit(resource.RLIMIT_FSIZE)
    saves = {}
    from megatron.core.dist_checkpointing.strategies.filesystem_async import FileSystemWriterAsync

    real_finish = FileSystemWriterAsync.finish

    def full_disk(self, *args, **kwargs):
        raise OSError(28, "No space left on device", str(Path(self.checkpoint_dir) / ".metadata"))

    for step, failing in ((1, None), (2, 0), (3, 1), (4, None), (5, 0), (6, None)):
        if rank == failing and step != 5:
            resource.setrlimit(resource.RLIMIT_FSIZE, (_LIMIT, limits[1]))
        if rank == failing and step == 5:
            FileSystemWriterAsync.finish = full_disk
        error = None
        try:
            save_checkpoint(out / "run", step, model, None, groups, keep_last=3)
        except CheckpointError as exc:
            error = [type(exc).__name__, str(exc)]
        except BaseException as exc:  # noqa: BLE001 - what the test must not see, recorded as such
            error = [type(exc).__name__, str(exc)]
        finally:
            resource.setrlimit(resource.RLIMIT_FSIZE, limits)
            FileSystemWriterAsync.finish = real_finish
        dist.barrier()
        root = out / "run" / "checkpoints"
        saves[step] = {"error": error, "latest": (root / "latest").read_text().strip(),
                       "entries": sorted(p.name for p in root.iterdir())}
        dist.barrier()
    (out / f"rank{rank}.json").write_text(json.dumps({"saves": saves}))
    dist.barrier()


def main() -> int:
    from rank_main import rank_main

    warnings.filterwarnings("ignore")
    return rank_main(lambda: _run(Path(sys.argv[1])))


if __name__ == "__main__":
    sys.exit(main())
