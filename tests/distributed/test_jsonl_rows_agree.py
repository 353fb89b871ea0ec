"""The rows of a JSONL dataset kept at load are the same on every rank, on a real gloo world of 2 processes.

A row whose gold answer math-verify cannot parse is dropped. math-verify gives up on a parse after
``task.math_timeout_s`` and then reports nothing parsed, so a parse near that limit could fail on a loaded rank
and succeed on another, and the ranks would index different lists of problems. Here one rank's math-verify is
made slow (past the limit) on one answer, through its real timeout path: rank 0 of the group decides for every
rank, so both ranks keep the rows rank 0 kept, and the other rank does not parse at all.
"""

from __future__ import annotations

import json
import os
import time

import pytest
import torch.distributed as dist

from support.gloo import spawn_group

pytestmark = pytest.mark.distributed

ROWS = [("What is 6 * 7?", "42"), ("What is 1 / 2?", "\\frac{1}{2}"), ("Expand (x)(x) + 1.", "x^2+1"),
        ("What is 7 / 2?", "3.5")]
SLOW = "\\frac{1}{2}"


def _worker(rank: int, world: int, out: str, path: str, slow_rank: int) -> None:
    import math_verify.parser as mv_parser

    from megatron_logra.rewards import TaskConfig, build_task
    from megatron_logra.rewards import math as rmath

    rmath._parse_gold.cache_clear()
    real = mv_parser.extract_target_from_pred
    calls = []

    def extract(pred, *args, **kwargs):
        calls.append(pred)
        if rank == slow_rank and SLOW in pred:
            time.sleep(30)  # past task.math_timeout_s: math-verify's alarm interrupts it and reports no parse
        return real(pred, *args, **kwargs)

    mv_parser.extract_target_from_pred = extract
    try:
        task = build_task(TaskConfig(datasets=[f"jsonl:{path}"], num_eval=0, eval_modulus=1000, math_timeout_s=1),
                          dist.group.WORLD)
    finally:
        mv_parser.extract_target_from_pred = real
    with open(os.path.join(out, f"rank{rank}.json"), "w") as fh:
        json.dump({"answers": [p.answer for p in task.sources[0].problems], "parsed": len(calls)}, fh)


@pytest.mark.parametrize("slow_rank", [1, 0])
def test_every_rank_keeps_the_rows_rank0_kept(tmp_path, slow_rank):
    path = tmp_path / "data.jsonl"
    path.write_text("".join(json.dumps({"prompt": q, "answer": a}) + "\n" for q, a in ROWS))
    spawn_group(_worker, 2, tmp_path, str(tmp_path), str(path), slow_rank)
    got = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    everything = [a for _, a in ROWS]
    # rank 0's parse decides: a slow parse on rank 1 drops nothing; one on rank 0 drops that row on both ranks
    expected = everything if slow_rank == 1 else [a for a in everything if a != SLOW]
    assert got[0]["answers"] == got[1]["answers"] == expected
    assert got[0]["parsed"] > 0 and got[1]["parsed"] == 0  # only rank 0 runs math-verify
