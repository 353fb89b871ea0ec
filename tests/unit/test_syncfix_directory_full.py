"""``sync.transport=directory`` on a bf16 model with fp32 masters: a master re-anchor refits the trainer's
own engine outside the delta chain and writes the refit's full weights next to the anchor, so a separate
engine that follows the files is refused at the anchor, reloads that file and rejoins the chain with weights
bitwise equal to the trainer's. A resumed run keeps its files up to the resume version."""

from __future__ import annotations

import copy

import pytest
import torch

from test_rl_e2e import alternating_score, built_components


@pytest.fixture(scope="module", autouse=True)
def _one_thread(one_thread):
    """Every test of this module runs single-threaded (conftest.one_thread)."""


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    run = tmp_path_factory.mktemp("directory_full") / "run"
    with built_components(run, "sft.steps=2", "model.params_dtype=bfloat16", "logra.masters=fp32",
                          "sync.transport=directory", "sync.max_master_drift=1e-9",
                          "sync.check_interval=1") as (comps, state):
        comps.task.score = alternating_score()
        yield comps, state, run / "deltas" / "rank0"


def _trainer_hf(comps):
    from megatron_logra.models.hf import megatron_to_hf
    from megatron_logra.rl.weights import gather_full_model

    return megatron_to_hf(gather_full_model(comps.model, comps.groups), comps.cfg.model, tp=1)


def test_a_separate_engine_reloads_a_master_reanchor_and_rejoins_bitwise(built):
    from megatron_logra.rl.loop import rl_update
    from megatron_logra.sync import DirectoryTransport, ModuleEngine, SyncError

    comps, state, directory = built
    assert next(comps.model.parameters()).dtype == torch.bfloat16 and comps.optimizer.masters
    separate = ModuleEngine(copy.deepcopy(comps.engine.model), version=state.weight_version)
    consumer = DirectoryTransport(directory)
    start = state.weight_version
    rec = rl_update(comps, state)
    assert rec["sync_mode"] == "delta+anchor"  # the masters were copied back: a refit outside the chain
    assert consumer.consume(separate) == [start + 1]  # the delta; the re-anchor at that version is not in it
    comps.sync.cfg.max_master_drift = 0.0  # from here on plain deltas
    try:
        rec = rl_update(comps, state)
    finally:
        comps.sync.cfg.max_master_drift = 1e-9
    assert rec["sync_mode"] == "delta"
    with pytest.raises(SyncError, match=rf"differ from the trainer's anchor.*full_{start + 1:08d}\.safetensors with "
                                        r"DirectoryTransport\.load_full\(engine\)") as exc:
        consumer.consume(separate)
    assert exc.value.kind == "anchor"
    assert consumer.load_full(separate)["version"] == start + 1
    assert consumer.consume(separate) == [start + 2]
    assert separate.weight_version == comps.engine.weight_version == state.weight_version
    weights = separate.weights()
    for name, tensor in _trainer_hf(comps).items():
        assert torch.equal(weights[name], tensor.to(weights[name].dtype)), name


def test_a_resumed_trainer_keeps_the_files_up_to_its_version(built):
    """A consumer behind the resume point still follows the deltas up to it, then verifies the resumed
    trainer's anchor there by fingerprint and goes on with the new chain; what lies above the resume
    version (an abandoned run's files) is deleted."""
    from megatron_logra.rl.loop import rl_update
    from megatron_logra.rl.policy_sync import PolicySync
    from megatron_logra.rollout import build_engine
    from megatron_logra.sync import DirectoryTransport, ModuleEngine
    from megatron_logra.sync.synthetic import DenseShape, random_delta

    comps, state, directory = built
    comps.sync.cfg.max_master_drift = 0.0
    try:
        base = state.weight_version
        comps.sync.full(base)  # a refit (drift repair) anchors the chain at base
        behind = ModuleEngine(copy.deepcopy(comps.engine.model), version=base)
        for _ in range(2):
            assert rl_update(comps, state)["sync_mode"] == "delta"
        abandoned = random_delta(DenseShape(hidden=32, layers=1, heads=4, kv_heads=2, ffn=48, vocab=40), 8,
                                 base_version=base + 2, new_version=base + 3)
        DirectoryTransport(directory).publish(abandoned)  # an earlier run's file past the checkpoint
        # the job resumes from its checkpoint at base + 2: a fresh engine, a new PolicySync and its start refit
        comps.engine = build_engine(comps.cfg, comps.model, comps.groups)
        comps.sync = PolicySync(comps.sync.cfg, model=comps.model, model_cfg=comps.cfg.model,
                                optimizer=comps.optimizer, engine=comps.engine, groups=comps.groups,
                                run_dir=directory.parent.parent)
        comps.sync.full(base + 2)
        transport = DirectoryTransport(directory)
        assert [v for v in transport.versions() if v > base] == [base + 1, base + 2]
        assert rl_update(comps, state)["sync_mode"] == "delta"
        # behind the resume point: the kept deltas, the resumed anchor (verified by fingerprint), the new delta
        assert DirectoryTransport(directory).consume(behind) == [base + 1, base + 2, base + 3]
        weights = behind.weights()
        for name, tensor in _trainer_hf(comps).items():
            assert torch.equal(weights[name], tensor.to(weights[name].dtype)), name
    finally:
        comps.sync.cfg.max_master_drift = 1e-9
