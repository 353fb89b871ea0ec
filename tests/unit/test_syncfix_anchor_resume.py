"""``sync.anchor_interval`` and ``sync.check_interval`` are keyed by the weight version, so a resumed run
(a fresh ``PolicySync`` at a restored version, as ``rl.components.build_components`` makes on ``--resume``)
anchors and checks at the same updates as an uninterrupted one."""

from __future__ import annotations

import warnings

import pytest
import torch

from test_rl_e2e import _assert_engine_equals_trainer, alternating_score, small_cfg


@pytest.fixture(scope="module", autouse=True)
def _one_thread(one_thread):
    """Every test of this module runs single-threaded (conftest.one_thread)."""


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    from megatron_logra.parallel import destroy_parallel
    from megatron_logra.rl.components import build_components

    cfg = small_cfg(tmp_path_factory.mktemp("anchor_resume") / "run", "sft.steps=2")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        comps, state, _ = build_components(cfg)
    yield comps, state
    destroy_parallel()


def _resumed_update(comps, state, after_refit=None, **sync):
    """One RL update right after a resume at the state's weight version (a new ``PolicySync``, as on resume);
    ``after_refit()`` runs between the resume's refit and the update."""
    from megatron_logra.rl.policy_sync import PolicySync
    from megatron_logra.sync.config import SyncConfig

    comps.sync = PolicySync(SyncConfig(**sync), model=comps.model, model_cfg=comps.cfg.model,
                            optimizer=comps.optimizer, engine=comps.engine, groups=comps.groups, run_dir=None)
    comps.sync.full(state.weight_version)  # what build_components does after loading the checkpoint
    if after_refit is not None:
        after_refit()
    return _scored_update(comps, state)


def _scored_update(comps, state):
    """One RL update with a reward that alternates 1, 0, ... (every group has an advantage)."""
    from megatron_logra.rl.loop import rl_update

    real_score = comps.task.score
    comps.task.score = alternating_score()
    try:
        return rl_update(comps, state)
    finally:
        comps.task.score = real_score


def test_a_resumed_run_anchors_at_the_versions_an_uninterrupted_one_does(built):
    comps, state = built
    state.weight_version = 1  # resumed after update 1: update 2 is an anchor of anchor_interval=2
    rec = _resumed_update(comps, state, anchor_interval=2, check_interval=0)
    assert not rec["skipped"] and state.weight_version == 2
    assert rec["sync_mode"] == "delta+anchor"
    rec = _resumed_update(comps, state, anchor_interval=2, check_interval=0)  # update 3, resumed again
    assert rec["sync_mode"] == "delta"
    _assert_engine_equals_trainer(comps)
    assert comps.engine.weight_version == state.weight_version == 3


def test_a_resumed_run_checks_for_drift_at_the_versions_an_uninterrupted_one_does(built):
    comps, state = built
    state.weight_version = 5  # the next update is version 6, a multiple of check_interval=3

    @torch.no_grad()
    def corrupt():  # silent engine-side corruption of one weight after the resume refit
        comps.engine.model.model.layers[0].mlp.down_proj.weight[0, 0] += 1e-3

    rec = _resumed_update(comps, state, after_refit=corrupt, anchor_interval=0, check_interval=3)
    assert state.weight_version == 6
    assert rec["sync_drift"] == 1 and rec["sync_mode"] == "delta+anchor"
    _assert_engine_equals_trainer(comps)
    # version 7: no check, so the corruption stays (the check interval's contract)
    rec = _resumed_update(comps, state, after_refit=corrupt, anchor_interval=0, check_interval=3)
    assert rec["sync_drift"] == 0 and rec["sync_mode"] == "delta"


def test_directory_anchors_let_a_separate_engine_follow_and_refuse_a_resumed_chain(built, tmp_path):
    """``sync.transport=directory``: a separate engine holding the trainer's weights follows the files
    through an ``anchor_interval`` refit (real trainer and engine fingerprints agree), and refuses the
    chain of a trainer resumed at an earlier version instead of applying it."""
    import copy

    from megatron_logra.models.hf import megatron_to_hf
    from megatron_logra.rl.policy_sync import PolicySync
    from megatron_logra.rl.weights import gather_full_model
    from megatron_logra.rollout import build_engine
    from megatron_logra.sync import DirectoryTransport, ModuleEngine, SyncError
    from megatron_logra.sync.config import SyncConfig

    comps, state = built
    cfg = SyncConfig(transport="directory", directory=str(tmp_path / "deltas"), anchor_interval=2, check_interval=0)

    def start():
        comps.sync = PolicySync(cfg, model=comps.model, model_cfg=comps.cfg.model, optimizer=comps.optimizer,
                                engine=comps.engine, groups=comps.groups, run_dir=tmp_path)
        comps.sync.full(state.weight_version)

    def update():
        return _scored_update(comps, state)

    state.weight_version = 10
    start()
    separate = ModuleEngine(copy.deepcopy(comps.engine.model), version=10)
    consumer = DirectoryTransport(tmp_path / "deltas" / "rank0")
    modes = [update()["sync_mode"] for _ in range(3)]
    assert modes == ["delta", "delta+anchor", "delta"]  # the in-process engine was never refused
    assert consumer.consume(separate) == [11, 12, 13]  # anchors at 10 and 12 verified by fingerprint
    trainer = megatron_to_hf(gather_full_model(comps.model, comps.groups), comps.cfg.model, tp=1)
    weights = separate.weights()
    for name, tensor in trainer.items():
        assert torch.equal(weights[name], tensor.to(weights[name].dtype)), name

    # the trainer resumes from its checkpoint of version 12 and publishes another 12->13 and 13->14: the
    # separate engine, already at 13, would skip the new 13 and apply 14 to the other trajectory's 13
    state.weight_version = 12
    comps.engine = build_engine(comps.cfg, comps.model, comps.groups)  # a resumed job builds a fresh engine
    start()
    assert [update()["sync_mode"] for _ in range(2)] == ["delta", "delta+anchor"]
    with pytest.raises(SyncError, match=r"anchored at version 12 .* passed without verifying") as exc:
        consumer.consume(separate)
    assert exc.value.kind == "anchor" and separate.weight_version == 13


def test_the_drift_check_samples_the_rows_of_each_weight_version(built):
    """An engine that salts its fingerprint with its weight version (``ModuleEngine`` does; here the
    embedded engine's weights fingerprinted that way) is compared with the trainer's rows of that version:
    clean updates show no drift, and a divergence in a row the unsalted sample never covers is caught."""
    from megatron_logra.sync.fingerprint import fingerprint, sample_rows

    comps, state = built
    engine = comps.engine
    name = "model.layers.0.mlp.down_proj.weight"
    weight = dict(engine.model.named_parameters())[name]
    engine.fingerprint = lambda: fingerprint({n: p.data for n, p in engine.model.named_parameters()},
                                             salt=engine.weight_version)
    try:
        state.weight_version = 20
        rec = _resumed_update(comps, state, anchor_interval=0, check_interval=1)
        assert (rec["sync_drift"], rec["sync_mode"]) == (0, "delta")  # same rows on both sides: no false alarm
        n = weight.shape[0]
        row = next(r for r in sample_rows(name, n, salt=22) if r not in sample_rows(name, n))

        @torch.no_grad()
        def corrupt():  # a row the fixed, unsalted sample never compares; version 22's sample does
            weight[row, 0] += 1e-2

        rec = _resumed_update(comps, state, after_refit=corrupt, anchor_interval=0, check_interval=1)
        assert state.weight_version == 22
        assert (rec["sync_drift"], rec["sync_mode"]) == (1, "delta+anchor")
        _assert_engine_equals_trainer(comps)
    finally:
        del engine.fingerprint
