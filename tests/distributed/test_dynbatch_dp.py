"""Dynamic micro-batches under data parallelism (2 gloo ranks, CPU megatron GPT, LoGRA): the ranks' batches split
into different numbers of micro-batches (rank 0's short completions fit one, rank 1's long ones need several), and
the step still runs on both and reduces to the same gradient sketches as fixed micro-batches, identical on both
ranks. Nothing in a step's forward/backward waits on a peer per micro-batch, so the counts may differ.

This file is also the worker: ``python -m torch.distributed.run --nproc-per-node 2
tests/distributed/test_dynbatch_dp.py OUT_DIR``.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.distributed, pytest.mark.filterwarnings("ignore::DeprecationWarning")]

LENGTHS = [[2, 3, 1, 4, 2, 3, 0, 5], [40, 38, 3, 36, 2, 41, 6, 39]]
"""Completion lengths of each rank's eight sequences."""


def worker(result_dir: str) -> None:
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/: the support package
    import torch

    from support.dynbatch import largest_sketch_difference, skewed_batch, step_parts
    from support.run_fixtures import rl_components

    with rl_components(Path(result_dir) / "run", ["rl.prompts_per_step=4", "rl.group_size=4", "rl.micro_batch_size=4",
                                                  "task.num_eval=0", "parallel.timeout_minutes=2"]) as (comps, _):
        rank, world = comps.groups.dp_rank, comps.groups.dp_size
        assert world == 2
        batch = skewed_batch(comps, LENGTHS[rank], seed=rank)
        fixed, dyn = step_parts(comps, batch, 0), step_parts(comps, batch, 128)
        flat = torch.cat([s.reshape(-1) for _, s in sorted(dyn["sketches"].items())])
        others = [torch.empty_like(flat) for _ in range(world)]
        torch.distributed.all_gather(others, flat)
        out = {"micro_fixed": fixed["micro_batches"], "micro_dynamic": dyn["micro_batches"],
               "positions_fixed": fixed["positions"], "positions_dynamic": dyn["positions"],
               "difference": largest_sketch_difference(fixed["sketches"], dyn["sketches"]),
               "same_on_ranks": all(torch.equal(o, others[0]) for o in others),
               "global_tokens": [fixed["result"].global_tokens, dyn["result"].global_tokens],
               "local_tokens": int(batch.loss_mask.sum())}
    with open(os.path.join(result_dir, f"rank{rank}.json"), "w") as f:
        json.dump(out, f)


def test_ranks_with_different_micro_batch_counts_reduce_to_the_fixed_layouts_sketches(launcher, tmp_path):
    launcher.launch(2, [str(Path(__file__).resolve()), str(tmp_path)], timeout=240, log=tmp_path / "launch.log")
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    assert ranks[0]["micro_dynamic"] == 1 and ranks[1]["micro_dynamic"] > 1
    assert ranks[0]["micro_fixed"] == ranks[1]["micro_fixed"] == 2
    total = sum(r["local_tokens"] for r in ranks)
    for r in ranks:
        assert r["global_tokens"] == [total, total]
        assert r["same_on_ranks"]
        assert r["difference"] < 1e-4, r
    assert ranks[1]["positions_dynamic"] < ranks[1]["positions_fixed"]  # rank 1's short rows are not padded to 48


if __name__ == "__main__":
    worker(sys.argv[1])
