"""The SGLang loader's all-or-nothing apply across an engine's TP ranks, over a real gloo group of 2.

Each rank holds ``SGLangLlama``'s TP-2 shards; the ranks agree (all-reduce MIN over the group the
loader takes as SGLang's TP CPU group) after staging and after the commit. When one rank cannot
*prepare* a delta (an allocation failure injected into its preparation, after validation passed),
neither rank may write: both keep their weights and their version, and the next delta applies
normally. The weights after a good delta are the TP-2 shards of the trainer's HF-layout apply.
"""

from __future__ import annotations

import json
import os

import pytest
import torch
import torch.distributed as dist

import megatron_logra.sync.apply as apply_mod
from megatron_logra.sync import sglang_loader
from megatron_logra.sync.sglang_loader import (FINGERPRINT_PARAM, STATE_PARAM, delta_as_named_tensors, read_state,
                                               sync_loader)
from support.gloo import spawn_group
from support.sglang_stand_ins import SGLangLlama, delta_chain, hf_state, reference


def _params(model) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.named_parameters() if n not in (STATE_PARAM, FINGERPRINT_PARAM)}


def _same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def _worker(rank: int, world: int, tmp: str) -> None:
    sglang_loader._tp_cpu_group = lambda: dist.group.WORLD  # SGLang's get_tp_group().cpu_group
    hf = hf_state(2)
    d1, d2 = delta_chain(2)
    model = SGLangLlama(hf, tp=world, rank=rank)
    out = {}
    sync_loader(model, delta_as_named_tensors(d1))
    out["first"] = read_state(model)
    after_first = _params(model)

    real_prepare = apply_mod.prepare
    if rank == 1:
        def out_of_memory(*args, **kw):
            raise torch.OutOfMemoryError("injected: no room for the workspaces")

        apply_mod.prepare = out_of_memory
    sync_loader(model, delta_as_named_tensors(d2))
    apply_mod.prepare = real_prepare
    out["failed"] = read_state(model)
    out["untouched"] = _same(_params(model), after_first)

    sync_loader(model, delta_as_named_tensors(d2))
    out["retried"] = read_state(model)
    out["equals_trainer"] = _same(_params(model), _params(SGLangLlama(reference(hf, [d1, d2]), tp=world, rank=rank)))
    with open(os.path.join(tmp, f"rank{rank}.json"), "w") as fh:
        json.dump(out, fh)


@pytest.mark.distributed
def test_a_preparation_failure_on_one_tp_rank_leaves_every_rank_unwritten(tmp_path):
    spawn_group(_worker, 2, tmp_path, str(tmp_path))
    results = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    for rank, got in enumerate(results):
        assert got["first"]["ok"] and got["first"]["version"] == 1
        failed = got["failed"]
        assert not failed["ok"] and failed["version"] == 1, f"rank {rank}: {failed}"  # not -1: nobody committed
        assert got["untouched"], f"rank {rank} wrote weights of a delta another rank could not prepare"
        assert got["retried"]["ok"] and got["retried"]["version"] == 2
        assert got["equals_trainer"], f"rank {rank}: weights differ from the trainer's apply"
    assert results[1]["failed"]["error_kind"] == "apply" and "OutOfMemoryError" in results[1]["failed"]["error"]
    assert "another TP rank" in results[0]["failed"]["error"]
