"""A byte object damaged at the same size on several ranks, for ``test_ckpt3_crc_before_pickles_2ranks.py``.

``python -m torch.distributed.run --nproc-per-node N ckpt3_crc_worker.py OUT`` (gloo, DP=N): saves a tiny
weights-only checkpoint to ``OUT/run``; global rank 0 flips one byte inside its first byte object (a layer's
``_extra_state``: same size, and ``torch.load(weights_only=True)`` refuses the result); then every rank calls
``read_meta`` over the world group and ``load_checkpoint``. Each rank writes ``OUT/rank{r}.json``:
``{"share": [...], "flipped": rel, "read_meta": [type, message] | null, "load": [type, message] | null}``.
"""

from __future__ import annotations

import json
import sys
import warnings
from pathlib import Path

warnings.filterwarnings("ignore")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/: the support package


def run(out: Path) -> None:
    import torch.distributed as dist

    from megatron_logra.checkpoint import CheckpointError, load_checkpoint, read_meta
    from megatron_logra.checkpoint.integrity import checksum_shares
    from megatron_logra.models.gpt import build_gpt
    from support.ckpt_corruption import save_tiny_checkpoint

    groups, cfg, _, ckpt, sizes = save_tiny_checkpoint(out / "run")
    rank, world = dist.get_rank(), dist.get_world_size()
    from support.ckpt_corruption import flip_inside_a_byte_object

    flipped = [flip_inside_a_byte_object(ckpt)[0] if rank == 0 else None]
    dist.broadcast_object_list(flipped, src=0)

    record: dict = {"share": checksum_shares(sizes, world)[rank], "flipped": flipped[0]}
    for what, fn in (("read_meta", lambda: read_meta(ckpt, group=dist.group.WORLD)),
                     ("load", lambda: load_checkpoint(ckpt, build_gpt(cfg, groups, seed=11), None, groups))):
        record[what] = None
        try:
            fn()
        except CheckpointError as exc:
            record[what] = [type(exc).__name__, str(exc)]
    (out / f"rank{rank}.json").write_text(json.dumps(record))
    dist.barrier()


def main() -> int:
    from rank_main import rank_main

    return rank_main(lambda: run(Path(sys.argv[1])))


if __name__ == "__main__":
    sys.exit(main())
