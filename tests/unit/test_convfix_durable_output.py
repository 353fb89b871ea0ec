"""Both conversions flush every file they write into the output directory (weights, ``meta.json``,
``config.json``, the safetensors index, generation-config and tokenizer files, the ``hf/`` folder) and every
directory of it to storage before the build directory is renamed onto ``--out``, and the parent directory after
the rename, so that a power loss cannot bring the output back with empty small files. A power loss cannot be
simulated here: the test records the path of every real ``os.fsync`` (the build directory's paths exist only
before the rename) and checks each file of the finished output against it."""

from __future__ import annotations

from pathlib import Path

import pytest

from megatron_logra.convert import convert_hf_to_mcore, convert_mcore_to_hf
from support.convert_fixtures import tiny_llama_checkpoint


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory) -> Path:
    return tiny_llama_checkpoint(tmp_path_factory.mktemp("src"), tokenizer_stub=True)


@pytest.fixture
def synced(monkeypatch) -> list[str]:
    """The path of every descriptor ``os.fsync`` flushes, in order."""
    from support.fsync_log import record_fsyncs

    return record_fsyncs(monkeypatch)


def _check_synced_before_rename(out: Path, synced: list[str]) -> None:
    out = out.resolve()
    build = out.parent / f".{out.name}.partial"
    files = [p.relative_to(out) for p in sorted(out.rglob("*")) if p.is_file()]
    dirs = [Path(".")] + [p.relative_to(out) for p in sorted(out.rglob("*")) if p.is_dir()]
    assert files
    missing = [str(rel) for rel in files if str(build / rel) not in synced]
    assert not missing, f"never synced before the rename: {missing}; synced: {synced}"
    unsynced_dirs = [str(rel) for rel in dirs if str((build / rel).resolve()) not in synced]
    assert not unsynced_dirs, f"directories never synced before the rename: {unsynced_dirs}"
    last_build = max(i for i, p in enumerate(synced) if p == str(build) or p.startswith(f"{build}/"))
    assert str(out.parent) in synced[last_build + 1:], "the parent directory was not synced after the rename"


def test_hf_to_mcore_syncs_every_file_before_the_rename(hf_dir, tmp_path, synced):
    out = tmp_path / "mc"
    convert_hf_to_mcore(hf_dir, out, tp=2)
    names = {str(p.relative_to(out)) for p in out.rglob("*") if p.is_file()}
    assert {"meta.json", "hf/config.json", "hf/tokenizer.json", "hf/generation_config.json"} <= names
    _check_synced_before_rename(out, synced)

    synced.clear()  # --force: the swap with a previous output
    convert_hf_to_mcore(hf_dir, out, tp=1, force=True)
    _check_synced_before_rename(out, synced)


def test_mcore_to_hf_syncs_every_file_before_the_rename(hf_dir, tmp_path, synced):
    mc = tmp_path / "mc"
    convert_hf_to_mcore(hf_dir, mc)
    out = tmp_path / "hf_out"
    synced.clear()
    convert_mcore_to_hf(mc, out, max_shard_size="20KB")  # several shards: an index too
    names = {p.name for p in out.iterdir()}
    assert {"config.json", "model.safetensors.index.json", "tokenizer.json", "generation_config.json"} <= names
    assert len([n for n in names if n.endswith(".safetensors")]) > 1
    _check_synced_before_rename(out, synced)

    synced.clear()
    convert_mcore_to_hf(mc, out, force=True)
    assert (out / "model.safetensors").is_file()
    _check_synced_before_rename(out, synced)
