"""Checkpoints on real clusters: pruning never deletes what ``latest`` names, unfinished saves are
cleaned up, everything published is synced to storage first, an edited meta.json is refused, and a
resumed AdamW keeps the learning rate the resumed run configures.

Single-process gloo world, tiny weights-only checkpoints (the layout of every save is the same).
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest
import torch

from megatron_logra.checkpoint import CheckpointError, latest_checkpoint, load_checkpoint, read_meta, save_checkpoint
from megatron_logra.optim import build_optimizer
from megatron_logra.optim.config import LograConfig, OptimizerConfig
from megatron_logra.optim.native import NativeAdamW
from megatron_logra.parallel import ParallelGroups
from test_checkpoint_checksums import _model


@pytest.fixture(scope="module", autouse=True)
def _one_thread(one_thread):
    """Every test of this module runs single-threaded (conftest.one_thread)."""


@pytest.fixture(scope="module")
def model(groups):
    return _model(groups, seed=3)


def _steps(run: Path) -> list[str]:
    return sorted(p.name for p in (run / "checkpoints").iterdir() if p.name.startswith("step_"))


def test_pruning_keeps_the_newest_up_to_the_step_saved(model, groups, tmp_path):
    run = tmp_path / "run"
    for step in (1, 2, 3):
        save_checkpoint(run, step, model, None, groups, keep_last=2)
    assert _steps(run) == ["step_00000002", "step_00000003"]
    assert latest_checkpoint(run).name == "step_00000003"


def test_pruning_never_deletes_the_checkpoint_latest_names(model, groups, tmp_path, caplog):
    """``latest`` rolled back by hand to step 1 while step 3 stays on disk (or a job killed between
    the rename and the ``latest`` update): the next save (step 2) must survive its own pruning."""
    run = tmp_path / "run"
    save_checkpoint(run, 1, model, None, groups, keep_last=1)
    save_checkpoint(run, 3, model, None, groups, keep_last=5)
    (run / "checkpoints" / "latest").write_text("step_00000001")
    with caplog.at_level(logging.WARNING, logger="megatron_logra.checkpoint.catalog"):
        save_checkpoint(run, 2, model, None, groups, keep_last=1)
    assert latest_checkpoint(run).name == "step_00000002"
    read_meta(run / "checkpoints" / "step_00000002")
    assert _steps(run) == ["step_00000002", "step_00000003"]  # step 1 pruned; the later step 3 kept, said so
    assert "step_00000003" in caplog.text and "kept" in caplog.text


def test_unfinished_saves_of_any_step_are_removed(model, groups, tmp_path):
    run = tmp_path / "run"
    stale = run / "checkpoints" / "step_00000005.tmp" / "dist"
    stale.mkdir(parents=True)
    (stale / "__0_0.distcp").write_bytes(b"\0" * 1000)
    save_checkpoint(run, 6, model, None, groups)
    assert not list((run / "checkpoints").glob("*.tmp"))
    assert _steps(run) == ["step_00000006"]


def test_files_are_synced_before_latest_names_them(model, groups, tmp_path, monkeypatch):
    from support.fsync_log import record_fsyncs

    synced = record_fsyncs(monkeypatch)
    run = (tmp_path / "run").resolve()
    save_checkpoint(run, 1, model, None, groups)
    tmp = str(run / "checkpoints" / "step_00000001.tmp")
    root = str(run / "checkpoints")
    for wanted in (f"{tmp}/rng_rank0.safetensors", f"{tmp}/dist/.metadata", f"{tmp}/meta.json", tmp,
                   f"{root}/latest.tmp"):
        assert wanted in synced, f"{wanted} was never synced: {synced}"
    shards = [p for p in synced if p.endswith(".distcp")]
    assert shards and all(p.startswith(f"{tmp}/dist/") for p in shards)
    # meta.json before the rename that publishes the folder; the folder's parent after it and after `latest`
    assert synced.index(f"{tmp}/meta.json") < synced.index(f"{root}/latest.tmp")
    assert synced[-1] == root


def test_an_edited_meta_json_is_refused_and_nothing_is_loaded(model, groups, tmp_path):
    run = tmp_path / "run"
    ckpt = save_checkpoint(run, 2, model, None, groups)
    meta_path = ckpt / "meta.json"
    meta = json.loads(meta_path.read_text())
    meta["step"] = 7  # valid JSON, plausible value: only meta.json's own CRC-32 can tell
    meta_path.write_text(json.dumps(meta, indent=1))
    fresh = _model(groups, seed=11)
    before = {k: v.clone() for k, v in fresh.state_dict().items() if isinstance(v, torch.Tensor)}
    with pytest.raises(CheckpointError, match=r"meta.json is corrupt: its content does not match the CRC-32"):
        load_checkpoint(ckpt, fresh, None, groups)
    assert all(torch.equal(v, before[k]) for k, v in fresh.state_dict().items() if k in before)


def test_resumed_adamw_keeps_the_configured_learning_rate(caplog):
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(4, 3))]
    first = NativeAdamW(params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0, groups=ParallelGroups())
    params[0].grad = torch.randn(4, 3)
    first.step()
    scalars, slots = first.sharded_state()
    assert scalars["lr"] == 1e-3
    resumed = NativeAdamW(params, lr=5e-4, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0, groups=ParallelGroups())
    with caplog.at_level(logging.WARNING, logger="megatron_logra.optim.native"):
        resumed.load_sharded_state(scalars, slots)
    assert resumed.inner.param_groups[0]["lr"] == 5e-4
    assert "0.0005" in caplog.text and "0.001" in caplog.text
    same = NativeAdamW(params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0, groups=ParallelGroups())
    caplog.clear()
    same.load_sharded_state(scalars, slots)
    assert same.inner.param_groups[0]["lr"] == 1e-3 and "resuming AdamW" not in caplog.text


def test_resuming_with_or_without_fp32_masters_against_the_checkpoint_is_refused_by_name():
    from megatron_logra.checkpoint.compat import check_compatible

    saved = {"kind": "logra", "rank": 8, "seed": 1, "distribution": "rademacher", "masters": "none",
             "native": {"step": 3, "lr": 1e-3}}
    here = dict(saved, masters="fp32")
    config = {"model": {"params_dtype": "float32"}, "optimizer": {"logra": {"masters": "fp32"}}}
    with pytest.raises(CheckpointError) as info:
        check_compatible(saved, here, "ckpt", config=config)
    assert "holds no fp32 master weights (masters='none'), this run has (masters='fp32')" in str(info.value)
    assert "model.params_dtype and optimizer.logra.masters decide it" in str(info.value)
    assert "(model.params_dtype='float32', optimizer.logra.masters='fp32')" in str(info.value)
    check_compatible(saved, dict(saved), "ckpt")
    older = {k: v for k, v in saved.items() if k != "masters"}  # recorded only since this check exists
    check_compatible(older, here, "ckpt")
    with pytest.raises(CheckpointError, match=r"saved with optimizer\.logra\.rank=8, this run has 16; .*"
                                              r"set optimizer\.logra\.rank=8 \(or drop the override\) to resume it, "
                                              r"or start a new run directory"):
        check_compatible(older, dict(here, rank=16), "ckpt")


@pytest.mark.parametrize("key, saved_value, here_value, shown", [
    ("rank", 32, 16, "optimizer.logra.rank=32, this run has 16"),
    ("seed", 1, 2, "optimizer.logra.seed=1, this run has 2"),
    ("distribution", "rademacher", "gaussian", "optimizer.logra.distribution=rademacher, this run has gaussian"),
    ("algorithm", "sgd", "row_adam", "optimizer.logra.algorithm=sgd, this run has row_adam"),
    ("refresh", False, True, "optimizer.logra.refresh=false, this run has true"),
    ("kind", "adam", "logra", "optimizer.name=adam, this run has logra"),
])
def test_resume_mismatches_name_the_config_field_in_either_job(key, saved_value, here_value, shown):
    """The LM job saves the optimizer scalars at the top level, the RL job under ``optimizer``: both name the
    config field (not the scalar's path) and say how to resume or start over."""
    from megatron_logra.checkpoint.compat import check_compatible

    saved = {"kind": "logra", "rank": 8, "seed": 1, "distribution": "rademacher", "algorithm": "row_adam",
             "refresh": True, "masters": "none", key: saved_value}
    here = dict(saved, **{key: here_value})
    for wrap in (lambda d: d, lambda d: {"optimizer": d, "kl": {}, "rl": {}}):
        with pytest.raises(CheckpointError) as info:
            check_compatible(wrap(saved), wrap(here), "ckpt")
        message = str(info.value)
        assert f"saved with {shown};" in message and "optimizer.optimizer" not in message, message
        assert "or start a new run directory" in message, message


@pytest.mark.parametrize("field, saved_value, here_value", [("algorithm", "sgd", "row_adam"), ("refresh", False, True)])
def test_resuming_with_another_logra_algorithm_or_refresh_is_refused(groups, tmp_path, field, saved_value, here_value):
    """``optimizer.logra.algorithm`` / ``refresh`` are recorded in the checkpoint and a change is refused before
    anything is loaded; a checkpoint saved before they were recorded still loads."""
    run = tmp_path / "run"
    model = _model(groups, seed=3)
    saving = build_optimizer(model, OptimizerConfig(logra=LograConfig(rank=4, **{field: saved_value})), groups)
    ckpt = save_checkpoint(run, 1, model, saving, groups)
    state = json.loads((ckpt / "meta.json").read_text())["state"]
    assert state[field] == saved_value
    fresh = _model(groups, seed=11)
    before = {k: v.clone() for k, v in fresh.state_dict().items() if isinstance(v, torch.Tensor)}
    resumed = build_optimizer(fresh, OptimizerConfig(logra=LograConfig(rank=4, **{field: here_value})), groups)
    with pytest.raises(CheckpointError, match=rf"saved with optimizer\.logra\.{field}={str(saved_value).lower()}, "
                                              rf"this run has {str(here_value).lower()}"):
        load_checkpoint(ckpt, fresh, resumed, groups)
    assert all(torch.equal(v, before[k]) for k, v in fresh.state_dict().items() if k in before)

    meta = json.loads((ckpt / "meta.json").read_text())  # as written before algorithm / refresh were recorded
    for key in ("algorithm", "refresh"):
        del meta["state"][key]
    from megatron_logra.checkpoint.integrity import meta_crc32

    meta["meta_crc32"] = meta_crc32(meta)
    (ckpt / "meta.json").write_text(json.dumps(meta, indent=1))
    load_checkpoint(ckpt, fresh, resumed, groups)
    assert resumed.num_steps == 0


@pytest.mark.parametrize("name", ["logra", "adam"])
def test_resuming_from_a_weights_only_checkpoint_says_so_and_changes_nothing(model, groups, tmp_path, name):
    run = tmp_path / "run"
    ckpt = save_checkpoint(run, 1, model, None, groups)
    files = {p: p.read_bytes() for p in sorted(run.rglob("*")) if p.is_file()}
    fresh = _model(groups, seed=11)
    optimizer = build_optimizer(fresh, OptimizerConfig(name=name, logra=LograConfig(rank=4)), groups)
    before = {k: v.clone() for k, v in fresh.state_dict().items() if isinstance(v, torch.Tensor)}
    with pytest.raises(CheckpointError, match=r"holds weights only \(no optimizer state\) and cannot be resumed"):
        load_checkpoint(ckpt, fresh, optimizer, groups)
    assert all(torch.equal(v, before[k]) for k, v in fresh.state_dict().items() if k in before)
    assert {p: p.read_bytes() for p in sorted(run.rglob("*")) if p.is_file()} == files
