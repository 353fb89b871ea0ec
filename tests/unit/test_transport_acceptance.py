"""``sync.transport=directory`` as a separate consumer process meets it: the trainer resumes from an earlier
checkpoint, a run directory is deleted and recreated (``train.overwrite=true``), the consumer is pointed at
``sync.directory`` instead of a rank's directory, the producer prunes a delta the consumer is about to read,
a second trainer is pointed at the same directory, and the directory cannot be written. Real files, real
engines (:class:`ModuleEngine`), a real second process for the producer lock and a real ``PolicySync``."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from megatron_logra.sync import DirectoryTransport, ModuleEngine, SyncError
from megatron_logra.sync.apply import apply_delta_
from megatron_logra.sync.fingerprint import fingerprint
from megatron_logra.sync.synthetic import random_delta
from megatron_logra.sync.transport import delta_filename
from test_sync_transport import SHAPE, _hf_state as _state, _HFModule as _HF

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(autouse=True)
def _one_thread(one_thread):
    yield


def _delta(base, seed=0):
    return random_delta(SHAPE, 8, base_version=base, new_version=base + 1, update_index=base, seed=3,
                        generator_seed=1000 * seed + base, scale=0.02)


class _Trainer:
    """A producer as PolicySync drives one: a refit (full weights + anchor) where its chain (re)starts, then
    one published delta per update; ``weights`` are its compute weights."""

    def __init__(self, directory, weights, version, seed=0):
        self.t = DirectoryTransport(directory)
        self.weights, self.version, self.seed = {k: v.clone() for k, v in weights.items()}, version, seed
        self.t.clear(above_version=version)
        self.refit()

    def refit(self):
        full = self.t.write_full(self.version, self.weights)
        self.t.write_anchor(self.version, fingerprint(self.weights, salt=self.version), full=full)

    def step(self):
        d = _delta(self.version, self.seed)
        apply_delta_(self.weights, d, self.version)
        self.t.publish(d)
        self.version += 1


def _assert_equal(engine, weights):
    for name, t in engine.weights().items():
        assert torch.equal(t, weights[name]), name


def test_a_consumer_learns_of_a_trainer_resume_before_the_new_chain_passes_it(tmp_path):
    """A trainer killed at version 5 resumes from its checkpoint at 3: its files above 3 go and its refit at 3
    writes a new anchor. A consumer at 5 holds the abandoned trajectory's weights; it is refused at once (it
    used to see nothing new and keep serving them until the new chain passed version 5), reloads version 3 and
    follows the new chain bitwise."""
    first = _Trainer(tmp_path, _state(), 0)
    at = {0: {k: v.clone() for k, v in first.weights.items()}}
    for _ in range(5):
        first.step()
        at[first.version] = {k: v.clone() for k, v in first.weights.items()}
    consumer, engine = DirectoryTransport(tmp_path), ModuleEngine(_HF(_state(seed=7)))
    with pytest.raises(SyncError) as exc:  # random weights at version 0: not the anchor's
        consumer.consume(engine)
    assert exc.value.kind == "anchor"
    consumer.load_full(engine)
    assert consumer.consume(engine) == [1, 2, 3, 4, 5]
    assert consumer.consume(engine) == []

    resumed = _Trainer(tmp_path, at[3], 3, seed=1)  # another trajectory from the checkpoint at 3
    with pytest.raises(SyncError, match=r"anchored at version 3 .*which this engine \(at version 5\) passed "
                                         r"without verifying.*full_00000003\.safetensors") as exc:
        consumer.consume(engine)
    assert exc.value.kind == "anchor" and engine.weight_version == 5
    _assert_equal(engine, at[5])  # refused: unchanged
    assert consumer.load_full(engine)["version"] == 3
    for _ in range(3):
        resumed.step()
    assert consumer.consume(engine) == [4, 5, 6]
    _assert_equal(engine, resumed.weights)
    assert consumer.consume(engine) == []  # verified: nothing to say


def test_a_deleted_and_recreated_directory_is_a_sync_error_and_the_consumer_rejoins(tmp_path):
    """``train.overwrite=true`` deletes the run directory under a following consumer: a ``SyncError`` it can log
    and retry (it used to be a bare FileNotFoundError that kills a consumer loop catching SyncError), and the
    new run's anchor then asks it to reload."""
    directory = tmp_path / "run" / "deltas" / "rank0"
    old = _Trainer(directory, _state(), 0)
    for _ in range(4):
        old.step()
    consumer, engine = DirectoryTransport(directory), ModuleEngine(_HF(_state()))
    consumer.load_full(engine)
    assert consumer.consume(engine) == [1, 2, 3, 4]
    shutil.rmtree(tmp_path / "run")
    for call in (lambda: consumer.consume(engine), lambda: consumer.load_full(engine), consumer.versions):
        with pytest.raises(SyncError, match=r"delta directory .*rank0 does not exist .*train\.overwrite=true") as exc:
            call()
        assert exc.value.kind == "unreadable"
    assert engine.weight_version == 4
    new = _Trainer(directory, _state(seed=5), 0, seed=2)
    new.step()
    with pytest.raises(SyncError, match="anchored at version 0") as exc:
        consumer.consume(engine)
    assert exc.value.kind == "anchor"
    assert consumer.load_full(engine)["version"] == 0
    assert consumer.consume(engine) == [1]
    _assert_equal(engine, new.weights)


def test_a_consumer_pointed_at_the_sync_directory_root_is_told_the_rank_directory(tmp_path):
    for rank in (0, 1):
        trainer = _Trainer(tmp_path / f"rank{rank}", _state(), 0)
        trainer.step()
    root = DirectoryTransport(tmp_path)
    engine = ModuleEngine(_HF(_state()))
    for call in (lambda: root.consume(engine), lambda: root.load_full(engine), lambda: root.poll(0)):
        with pytest.raises(SyncError, match=r"holds the trainer ranks' delta directories \(rank0, rank1\), not a "
                                            rf"chain: point the consumer at .*{re.escape(str(tmp_path / 'rank0'))}") as exc:
            call()
        assert exc.value.kind == "config"
    assert engine.weight_version == 0
    assert DirectoryTransport(tmp_path / "rank0").load_full(engine)["version"] == 0


class _PrunedWhileReading(DirectoryTransport):
    """A consumer whose producer prunes the chain between its listing and its read of ``version`` (the producer's
    own, real ``prune``, run at that moment)."""

    def __init__(self, directory, producer, version, below):
        super().__init__(directory)
        self.producer, self.version, self.below = producer, version, below

    def read(self, version):
        if version == self.version:
            self.producer.prune(self.below)
        return super().read(version)


def test_a_delta_pruned_while_the_consumer_reads_the_chain_is_a_gap(tmp_path):
    trainer = _Trainer(tmp_path, _state(), 0)
    for _ in range(4):
        trainer.step()
        if trainer.version == 2:
            trainer.refit()  # an anchor at 2 with its full weights: what a far-behind consumer reloads
    engine = ModuleEngine(_HF(_state()))  # the trainer's weights at version 0 (verified by fingerprint)
    before = {k: v.clone() for k, v in engine.weights().items()}
    consumer = _PrunedWhileReading(tmp_path, trainer.t, version=1, below=3)
    with pytest.raises(SyncError, match=rf"{delta_filename(1)} was removed from .* while this consumer \(at version "
                                        r"0\) read the chain.*full_00000002\.safetensors") as exc:
        consumer.consume(engine)
    assert exc.value.kind == "gap" and engine.weight_version == 0
    _assert_equal(engine, before)
    consumer.load_full(engine)
    assert consumer.consume(engine) == [3, 4]
    _assert_equal(engine, trainer.weights)

    # pruned after some deltas were applied: the prefix stays applied, the next call names the gap
    trainer.step()
    trainer.step()
    engine = ModuleEngine(_HF(_state()))
    DirectoryTransport(tmp_path).load_full(engine, 2)
    consumer = _PrunedWhileReading(tmp_path, trainer.t, version=4, below=6)
    assert consumer.consume(engine) == [3]
    with pytest.raises(SyncError) as exc:
        consumer.consume(engine)
    assert exc.value.kind == "gap"


_HOLDER = textwrap.dedent("""
    import sys
    from megatron_logra.sync import DirectoryTransport
    DirectoryTransport(sys.argv[1]).claim()
    print("claimed", flush=True)
    sys.stdin.read()  # hold the lock until the test closes our stdin
""")


def _holder(directory):
    proc = subprocess.Popen([sys.executable, "-c", _HOLDER, str(directory)], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True, cwd=REPO,
                            env={**os.environ, "PYTHONPATH": str(REPO)})
    assert proc.stdout.readline().strip() == "claimed"
    return proc


def test_a_second_producer_process_is_refused_and_a_dead_ones_lock_is_released(tmp_path):
    proc = _holder(tmp_path)
    try:
        with pytest.raises(SyncError, match=r"another process is already writing deltas into .*two trainers must not "
                                            r"share a delta directory; give this run its own sync.directory") as exc:
            DirectoryTransport(tmp_path).claim()
        assert exc.value.kind == "config"
        DirectoryTransport(tmp_path / "other").claim()  # another directory is free
    finally:
        proc.stdin.close()
        proc.wait(timeout=60)
    DirectoryTransport(tmp_path).claim()  # the kernel released the dead producer's lock
    DirectoryTransport(tmp_path).claim()  # and a process may claim its own directory again (a resume in-process)


# --------------------------------------------------------------------------- the trainer (PolicySync)


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    from test_rl_e2e import alternating_score, built_components

    run = tmp_path_factory.mktemp("acceptance") / "run"
    with built_components(run, "sft.steps=1", "sync.transport=directory", "sync.keep_deltas=0") as (comps, state):
        comps.task.score = alternating_score()
        yield comps, state, run / "deltas" / "rank0"


def test_a_second_trainer_on_the_same_delta_directory_is_refused_at_start(built, tmp_path):
    """Two runs with one ``sync.directory`` used to interleave their chains (each run's publishes failing as
    ``exists`` and refitting, its anchors and prunes deleting the other's files) with warnings only."""
    from megatron_logra.rl.policy_sync import PolicySync
    from megatron_logra.sync.config import SyncConfig

    comps, _, _ = built
    shared = tmp_path / "shared"
    proc = _holder(shared / "rank0")  # the other run's trainer
    try:
        with pytest.raises(SyncError, match="another process is already writing deltas into") as exc:
            PolicySync(SyncConfig(transport="directory", directory=str(shared)), model=comps.model,
                       model_cfg=comps.cfg.model, optimizer=comps.optimizer, engine=comps.engine, groups=comps.groups,
                       run_dir=tmp_path)
        assert exc.value.kind == "config"
    finally:
        proc.stdin.close()
        proc.wait(timeout=60)


@pytest.mark.parametrize("anchor_interval,keep_deltas,warns", [(0, 8, True), (16, 8, True), (8, 8, False),
                                                                 (0, 0, False)])
def test_a_chain_a_late_consumer_cannot_rejoin_is_announced(built, tmp_path, caplog, anchor_interval, keep_deltas,
                                                            warns):
    """With pruning (``sync.keep_deltas``) but no anchor refit within the deltas kept, a consumer that falls
    further behind can only wait for a drift repair: the trainer says so at start, naming the setting that
    keeps a reloadable anchor in reach."""
    from megatron_logra.rl.policy_sync import PolicySync
    from megatron_logra.sync.config import SyncConfig

    comps, _, _ = built
    cfg = SyncConfig(transport="directory", directory=str(tmp_path / "d"), anchor_interval=anchor_interval,
                     keep_deltas=keep_deltas)
    with caplog.at_level("WARNING", logger="megatron_logra.rl.policy_sync"):
        PolicySync(cfg, model=comps.model, model_cfg=comps.cfg.model, optimizer=comps.optimizer, engine=comps.engine,
                   groups=comps.groups, run_dir=tmp_path)
    said = [r.getMessage() for r in caplog.records if "cannot reload and rejoin" in r.getMessage()]
    assert len(said) == warns
    if warns:
        assert f"set sync.anchor_interval={keep_deltas} (<= sync.keep_deltas)" in said[0]


def test_an_unwritable_delta_directory_stops_the_run_with_a_clear_error(built):
    """A delta or anchor marker that cannot be written (here: the directory replaced by a file; a full disk or a
    read-only filesystem alike) is ``SyncError("unwritable")`` naming the file, the directory and the way out,
    not a bare OSError traceback; the directory restored, a refit rewrites the chain and a consumer follows."""
    from megatron_logra.rl.loop import rl_update

    comps, state, directory = built
    assert rl_update(comps, state)["sync_mode"] == "delta"
    saved = directory.with_name("saved")
    directory.rename(saved)
    directory.write_text("not a directory")
    try:
        with pytest.raises(SyncError, match=rf"writing the delta {state.weight_version}->{state.weight_version + 1} "
                                            rf"into {re.escape(str(directory))} failed \(NotADirectoryError.*--resume RUN_DIR") as exc:
            rl_update(comps, state)
        assert exc.value.kind == "unwritable"
        version = state.weight_version  # the trainer's weights; its engine is one version behind
        with pytest.raises(SyncError, match=rf"writing the anchor marker of the refit at version {version} into "
                                            rf"{re.escape(str(directory))} failed") as exc:
            comps.sync.full(version)
        assert exc.value.kind == "unwritable"
    finally:
        directory.unlink()
        saved.rename(directory)
    comps.sync.full(state.weight_version)  # what a resume does: a refit, then the chain goes on
    assert rl_update(comps, state)["sync_mode"] == "delta"
    follower = ModuleEngine(_HF({n: p.detach().clone() for n, p in comps.engine.model.named_parameters()}))
    consumer = DirectoryTransport(directory)
    consumer.load_full(follower, comps.engine.weight_version - 1)
    assert consumer.consume(follower) == [comps.engine.weight_version]
    for name, p in comps.engine.model.named_parameters():
        assert torch.equal(follower.weights()[name], p.detach()), name


def test_a_full_weights_writer_whose_directory_vanished_returns_none_without_raising(tmp_path):
    """The writer taps the refit's stream and must never raise; its cleanup raised NotADirectoryError when the
    directory had been replaced by a file meanwhile."""
    directory = tmp_path / "rank0"
    writer = DirectoryTransport(directory).full_writer(0, [(n, list(t.shape)) for n, t in _state().items()],
                                                       torch.float32)
    shutil.rmtree(directory)
    directory.write_text("not a directory")
    for name, t in _state().items():
        writer.add(name, t)
    assert writer.finish() is None
    writer.abort()  # idempotent


def test_follow_reloads_once_per_anchor_and_a_late_consumer_waits_for_the_next_refit(tmp_path, caplog):
    """A consumer started after the deltas following the newest anchor were pruned: ``follow`` reloads that
    anchor once, then raises the ``gap`` (naming the next refit as the way out) without re-reading the file at
    every poll; the trainer's next refit gets it on the chain, bitwise."""
    trainer = _Trainer(tmp_path, _state(), 0)
    for _ in range(6):
        trainer.step()
    trainer.t.prune(4)
    consumer, engine = DirectoryTransport(tmp_path), ModuleEngine(_HF(_state(seed=9)))
    caplog.set_level("INFO", logger="megatron_logra.sync.anchor_full")
    for _ in range(3):
        with pytest.raises(SyncError, match=r"reload at the producer's next full refit") as exc:
            consumer.follow(engine)
        assert exc.value.kind == "gap"
    assert sum("engine reloaded the full weights" in r.message for r in caplog.records) == 1
    assert engine.weight_version == 0
    trainer.refit()  # e.g. sync.anchor_interval
    assert consumer.follow(engine) == [] and engine.weight_version == 6
    trainer.step()
    assert consumer.follow(engine) == [7]
    _assert_equal(engine, trainer.weights)
    corrupt = tmp_path / delta_filename(8)
    trainer.step()
    data = bytearray(corrupt.read_bytes())
    data[-1] ^= 1
    corrupt.write_bytes(bytes(data))
    with pytest.raises(SyncError) as exc:  # not an anchor or gap: raised, nothing reloaded, engine unchanged
        consumer.follow(engine)
    assert exc.value.kind == "checksum" and engine.weight_version == 7
    assert sum("engine reloaded the full weights" in r.message for r in caplog.records) == 2
