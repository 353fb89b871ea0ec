"""Checkpoint CRC-32s on several ranks, for ``test_checkpoint_checksums_2ranks.py``.

``python -m torch.distributed.run --nproc-per-node N checksums_worker.py OUT`` (gloo, DP=N):

1. saves a tiny weights-only checkpoint to ``OUT/run`` (CRC-32s hashed by all ranks);
2. ``read_meta`` over the world group on the untouched checkpoint, measuring the bytes this rank
   read (``rchar`` of ``/proc/self/io``, ``null`` where missing): each rank hashes only its share;
3. global rank 0 flips the middle byte of one file of the *last* rank's share (same size), then
   every rank calls ``load_checkpoint`` and records the error it raised;
4. saves step 2 with the last rank's RNG file write failing (a full disk or quota on its node):
   every rank records the error it raised, and what ``latest`` names afterwards.

Each rank writes ``OUT/rank{r}.json``: ``{"share": [...], "share_bytes": n, "total_bytes": n,
"read_bytes": n | null, "flipped": rel, "error": [type, message] | null, "changed": bool,
"save_error": [type, message] | null, "latest": name}``.
"""

from __future__ import annotations

import json
import sys
import warnings
from pathlib import Path

warnings.filterwarnings("ignore")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/: the support package


def _rchar() -> int | None:
    try:
        with open("/proc/self/io") as fh:
            return next(int(line.split()[1]) for line in fh if line.startswith("rchar:"))
    except (OSError, StopIteration, ValueError):
        return None


def run(out: Path) -> None:
    import torch
    import torch.distributed as dist

    from megatron_logra.checkpoint import CheckpointError, load_checkpoint, read_meta, save_checkpoint
    from megatron_logra.checkpoint.integrity import checksum_shares
    from megatron_logra.models.gpt import build_gpt
    from support.ckpt_corruption import save_tiny_checkpoint

    groups, cfg, model, ckpt, sizes = save_tiny_checkpoint(out / "run")
    rank, world = dist.get_rank(), dist.get_world_size()

    shares = checksum_shares(sizes, world)
    before = _rchar()
    read_meta(ckpt, group=dist.group.WORLD)
    after = _rchar()
    flipped = sorted(shares[-1], key=lambda rel: -sizes[rel])[0]
    dist.barrier()
    if rank == 0:
        f = ckpt / flipped
        data = bytearray(f.read_bytes())
        data[len(data) // 2] ^= 0xFF
        f.write_bytes(bytes(data))
    dist.barrier()

    fresh = build_gpt(cfg, groups, seed=11)
    weights = {k: v.clone() for k, v in fresh.state_dict().items() if isinstance(v, torch.Tensor)}
    error = None
    try:
        load_checkpoint(ckpt, fresh, None, groups)
    except CheckpointError as exc:
        error = [type(exc).__name__, str(exc)]
    changed = any(not torch.equal(v, weights[k]) for k, v in fresh.state_dict().items() if k in weights)

    from megatron_logra.checkpoint import save as save_module

    if rank == world - 1:
        def full_disk(*args, **kwargs):
            raise OSError(28, "No space left on device")

        save_module.save_safetensors = full_disk
    save_error = None
    try:
        save_checkpoint(out / "run", 2, model, None, groups)
    except CheckpointError as exc:
        save_error = [type(exc).__name__, str(exc)]
    latest = (out / "run" / "checkpoints" / "latest").read_text().strip()
    record = {"share": shares[rank], "share_bytes": sum(sizes[r] for r in shares[rank]),
              "total_bytes": sum(sizes.values()), "read_bytes": None if before is None else after - before,
              "flipped": flipped, "error": error, "changed": changed,
              "save_error": save_error, "latest": latest}
    (out / f"rank{rank}.json").write_text(json.dumps(record))
    dist.barrier()


def main() -> int:
    from rank_main import rank_main

    return rank_main(lambda: run(Path(sys.argv[1])))


if __name__ == "__main__":
    sys.exit(main())
