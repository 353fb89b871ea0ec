"""A checkpoint save starts no helper process: megatron-core's torch_dist writer reports its write results
through an in-process queue (``checkpoint.dist_writer._in_process_write_results``) instead of the queue of a
spawned ``multiprocessing`` Manager, and the checkpoint it writes loads back bitwise."""

from __future__ import annotations

import multiprocessing
import queue
import warnings

import torch

from megatron_logra.checkpoint import load_checkpoint, save_checkpoint
from megatron_logra.models.gpt import ModelConfig, build_gpt

MODEL = ModelConfig(num_layers=1, hidden_size=32, ffn_hidden_size=64, num_attention_heads=4, vocab_size=64,
                    seq_length=16)


def _model(groups, seed: int):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return build_gpt(MODEL, groups, seed=seed)


def test_a_save_reports_through_an_in_process_queue_and_round_trips(groups, tmp_path):
    from megatron.core.dist_checkpointing.strategies import filesystem_async

    before = {p.pid for p in multiprocessing.active_children()}
    saved = _model(groups, seed=5)
    path = save_checkpoint(tmp_path / "run", 1, saved, None, groups)
    assert isinstance(filesystem_async._results_queue, queue.Queue)
    assert filesystem_async._results_queue.empty()  # the save read back what its workers reported
    # the writer's forked workers are joined; no Manager (or any other helper) outlives the save
    assert {p.pid for p in multiprocessing.active_children()} <= before

    loaded = _model(groups, seed=6)
    load_checkpoint(path, loaded, None, groups)
    want = {k: v for k, v in saved.state_dict().items() if not k.endswith("_extra_state")}
    got = loaded.state_dict()
    assert any(not torch.equal(v, _model(groups, seed=6).state_dict()[k]) for k, v in want.items())
    for key, value in want.items():
        assert torch.equal(got[key], value), key
