"""One full-weights file for several trainer ranks (``sync.full_weights=first_rank``): rank 0's chain holds
the file, the other ranks' anchor markers name it by a path relative to their own directory
(``../rank0/full_<version>.safetensors``), and an engine following any rank's directory reloads it from there.

Real files, real ``ModuleEngine``s."""

from __future__ import annotations

import json
import os

import pytest

from megatron_logra.sync import DirectoryTransport, ModuleEngine, SyncError
from megatron_logra.sync.fingerprint import fingerprint
from megatron_logra.sync.transport import full_filename
from test_sync_transport import _hf_state, _HFModule
from test_syncfix_directory_anchor import _delta


@pytest.fixture(autouse=True)
def _one_thread(one_thread):
    yield


def _ranks(root, weights, version):
    """Two ranks' chains at a refit at ``version``: rank 0 writes the file, rank 1's marker names it."""
    rank0, rank1 = DirectoryTransport(root / "rank0"), DirectoryTransport(root / "rank1")
    full = rank0.write_full(version, weights)
    fp = fingerprint(weights, salt=version)
    rank0.write_anchor(version, fp, full=full)
    shared = {"file": f"../rank0/{full['file']}", "sha256": full["sha256"]}
    rank1.write_anchor(version, fp, full=shared)
    return rank0, rank1, shared


def test_a_rank_without_its_own_file_reloads_the_first_ranks(tmp_path):
    weights = _hf_state(seed=1)
    rank0, rank1, shared = _ranks(tmp_path, weights, 0)
    assert rank0.full_files() == [0] and rank1.full_files() == []
    assert json.loads((rank1.dir / "anchor_00000000.json").read_text())["full"] == shared
    for v in range(2):  # both chains publish the same deltas
        rank0.publish(_delta(v, 1))
        rank1.publish(_delta(v, 1))
    behind = DirectoryTransport(tmp_path / "rank1")
    engine = ModuleEngine(_HFModule(_hf_state(seed=2)), version=1)
    with pytest.raises(SyncError, match=rf"passed without verifying.* from {tmp_path / 'rank0' / full_filename(0)} "
                                        r"with DirectoryTransport\.load_full") as exc:
        behind.consume(engine)
    assert exc.value.kind == "anchor"
    assert behind.load_full(engine)["version"] == 0 and engine.weight_version == 0
    assert behind.consume(engine) == [1, 2]


def test_a_marker_naming_another_ranks_file_deletes_the_files_of_its_own_directory(tmp_path):
    weights = _hf_state(seed=1)
    own = DirectoryTransport(tmp_path / "rank1")
    own.write_anchor(0, None, full=own.write_full(0, weights))  # e.g. an earlier run with full_weights=all
    assert own.full_files() == [0]
    _ranks(tmp_path, weights, 3)
    assert own.full_files() == []


@pytest.mark.parametrize("file", ["/abs/full_00000003.safetensors", "../../x/full_00000003.safetensors",
                                  "../rank0/full_00000002.safetensors", "../rank0/sub/full_00000003.safetensors",
                                  "rank0/full_00000003.safetensors", "../../full_00000003.safetensors",
                                  "../rank0/../full_00000003.safetensors"])
def test_a_marker_names_only_its_own_or_a_sibling_directorys_file_of_its_version(tmp_path, file):
    transport = DirectoryTransport(tmp_path / "rank1")
    with pytest.raises(SyncError, match="full weights") as exc:
        transport.write_anchor(3, None, full={"file": file, "sha256": "0" * 64})
    assert exc.value.kind == "config"
    marker = {"version": 3, "epoch": "e", "fingerprint": None, "full": {"file": file, "sha256": "0" * 64}}
    (transport.dir / "anchor_00000003.json").write_text(json.dumps(marker))
    with pytest.raises(SyncError, match="is not an anchor marker") as exc:
        transport.anchors()
    assert exc.value.kind == "anchor"
    os.remove(transport.dir / "anchor_00000003.json")
    assert transport.anchors() == []


def test_sync_full_weights_is_validated_by_name():
    from megatron_logra.sync.config import SyncConfig

    assert SyncConfig().full_weights == "first_rank"
    assert SyncConfig(full_weights="none").full_weights == "none"
    with pytest.raises(ValueError, match=r"sync\.full_weights='rank0' is unknown; choose one of \('first_rank', "
                                         r"'all', 'none'\)"):
        SyncConfig(full_weights="rank0")
