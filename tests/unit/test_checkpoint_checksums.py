"""CRC-32s of checkpoint files: a file corrupted at the same size is refused, naming it.

One tiny checkpoint (weights only, single-process gloo world) is saved per module; each test damages
a copy of it: a flipped byte in the middle of a ``dist/*.distcp`` shard or of the RNG file keeps the
size (so the size check alone misses it) and must raise ``CheckpointError`` naming the file, before
the model is modified. Older meta.json files (``files`` values are plain sizes) still load, and with
checksums off a flipped byte passes while a size change is still refused.
"""

from __future__ import annotations

import json
import os
import shutil
import warnings
import zlib
from pathlib import Path

import pytest
import torch

from megatron_logra.checkpoint import CheckpointError, load_checkpoint, read_meta, save_checkpoint
from megatron_logra.checkpoint.integrity import checksum_shares, file_crc32
from megatron_logra.config import TrainConfig, parse_args_to_config
from megatron_logra.models.gpt import ModelConfig, build_gpt

MODEL = ModelConfig(num_layers=2, hidden_size=32, ffn_hidden_size=64, num_attention_heads=4, vocab_size=64,
                    seq_length=16)


@pytest.fixture(scope="module", autouse=True)
def _one_thread(one_thread):
    """Every test of this module runs single-threaded (conftest.one_thread)."""


def _model(groups, seed: int):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return build_gpt(MODEL, groups, seed=seed)


def _weights(model) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items() if not k.endswith("_extra_state")}


@pytest.fixture(scope="module")
def saved(groups, tmp_path_factory):
    """``{True: checkpoint with CRC-32s, False: saved with checksums=False}`` and the saved weights."""
    model = _model(groups, seed=3)
    base = tmp_path_factory.mktemp("ckpt")
    paths = {flag: save_checkpoint(base / f"run_{flag}", 1, model, None, groups, checksums=flag)
             for flag in (True, False)}
    return paths, _weights(model)


@pytest.fixture
def ckpt(saved, tmp_path) -> Path:
    """A fresh copy of the checkpoint saved with CRC-32s."""
    return Path(shutil.copytree(saved[0][True], tmp_path / "step"))


def _largest_shard(path: Path) -> Path:
    return max((path / "dist").glob("*.distcp"), key=lambda f: f.stat().st_size)


def _flip_middle_byte(f: Path) -> None:
    data = bytearray(f.read_bytes())
    data[len(data) // 2] ^= 0xFF
    f.write_bytes(bytes(data))
    assert f.stat().st_size == len(data)


def _assert_untouched(model, weights: dict[str, torch.Tensor]) -> None:
    for k, v in _weights(model).items():
        assert torch.equal(v, weights[k]), f"{k} was modified by a refused load"


def test_meta_records_size_and_crc32_of_every_file(ckpt):
    files = json.loads((ckpt / "meta.json").read_text())["files"]
    on_disk = sorted(str(p.relative_to(ckpt)) for p in ckpt.rglob("*") if p.is_file() and p.name != "meta.json")
    assert sorted(files) == on_disk
    assert any(rel.endswith(".distcp") for rel in files) and "rng_rank0.safetensors" in files
    for rel, entry in files.items():
        data = (ckpt / rel).read_bytes()
        assert entry == {"bytes": len(data), "crc32": f"{zlib.crc32(data):08x}"}, rel


def test_untouched_checkpoint_loads(ckpt, saved, groups):
    model = _model(groups, seed=9)
    assert read_meta(ckpt)["step"] == 1
    assert load_checkpoint(ckpt, model, None, groups)["step"] == 1
    for k, v in _weights(model).items():
        assert torch.equal(v, saved[1][k]), k


@pytest.mark.parametrize("target", ["shard", "rng"])
def test_flipped_byte_at_same_size_is_named(ckpt, groups, target):
    f = _largest_shard(ckpt) if target == "shard" else ckpt / "rng_rank0.safetensors"
    rel = str(f.relative_to(ckpt))
    _flip_middle_byte(f)
    with pytest.raises(CheckpointError, match=rf"{ckpt}: {rel} has CRC-32 [0-9a-f]{{8}}, [0-9a-f]{{8}} was written "
                                              r"\(corrupt at the same size\)"):
        read_meta(ckpt)
    model = _model(groups, seed=9)
    before = _weights(model)
    with pytest.raises(CheckpointError, match=rel):
        load_checkpoint(ckpt, model, None, groups)
    _assert_untouched(model, before)


def test_every_corrupt_file_is_named(ckpt):
    shard, rng = _largest_shard(ckpt), ckpt / "rng_rank0.safetensors"
    _flip_middle_byte(shard)
    _flip_middle_byte(rng)
    with pytest.raises(CheckpointError) as info:
        read_meta(ckpt)
    assert shard.name in str(info.value) and rng.name in str(info.value)


def test_size_is_checked_before_crc(ckpt):
    shard = _largest_shard(ckpt)
    shard.write_bytes(shard.read_bytes()[:-1])
    with pytest.raises(CheckpointError, match=rf"{shard.name} has \d+ bytes, \d+ were written \(truncated"):
        read_meta(ckpt)


def test_old_meta_with_plain_sizes_loads(ckpt, saved, groups):
    meta_path = ckpt / "meta.json"
    meta = json.loads(meta_path.read_text())
    meta["files"] = {rel: entry["bytes"] for rel, entry in meta["files"].items()}
    del meta["meta_crc32"]  # older checkpoints carry no CRC-32 of their own
    meta_path.write_text(json.dumps(meta))
    model = _model(groups, seed=9)
    assert load_checkpoint(ckpt, model, None, groups)["step"] == 1
    for k, v in _weights(model).items():
        assert torch.equal(v, saved[1][k]), k
    rng = ckpt / "rng_rank0.safetensors"
    _flip_middle_byte(rng)  # no CRC recorded: not detectable, sizes only
    read_meta(ckpt)
    rng.write_bytes(rng.read_bytes() + b"\0")
    with pytest.raises(CheckpointError, match="rng_rank0.safetensors has .* bytes"):
        read_meta(ckpt)


def test_checksums_off(saved, ckpt, tmp_path):
    off = Path(shutil.copytree(saved[0][False], tmp_path / "off"))
    files = json.loads((off / "meta.json").read_text())["files"]
    assert files and all(set(entry) == {"bytes"} for entry in files.values())
    for path in (off, ckpt):  # saved without CRC-32s / CRC-32s recorded but not verified
        shard = _largest_shard(path)
        _flip_middle_byte(shard)
        read_meta(path) if path is off else read_meta(path, checksums=False)
        shard.write_bytes(shard.read_bytes()[:-10])
        with pytest.raises(CheckpointError, match=f"{shard.name} has .* bytes.*truncated"):
            read_meta(path, checksums=False)


@pytest.mark.parametrize("entry", ['"12"', '{"bytes": 3, "crc32": "xyz"}', '{"crc32": "00000000"}', "-1", "true"])
def test_malformed_file_entry_is_refused(ckpt, entry):
    meta_path = ckpt / "meta.json"
    meta = json.loads(meta_path.read_text())
    meta["files"]["rng_rank0.safetensors"] = json.loads(entry)
    meta_path.write_text(json.dumps(meta))
    with pytest.raises(CheckpointError, match="does not match the CRC-32 it was written with"):
        read_meta(ckpt)  # the edit breaks meta.json's own CRC-32 first
    del meta["meta_crc32"]  # as an older checkpoint, the entry itself is refused
    meta_path.write_text(json.dumps(meta))
    with pytest.raises(CheckpointError, match=r"meta.json is corrupt: files\['rng_rank0.safetensors'\]"):
        read_meta(ckpt)


def test_checksum_shares_are_disjoint_complete_and_balanced():
    sizes = {f"f{i:02d}": s for i, s in enumerate([100, 90, 80, 70, 60, 50, 40, 30, 20, 10, 10, 0])}
    for world in (1, 2, 3, 5):
        shares = checksum_shares(sizes, world)
        assert len(shares) == world and all(s == sorted(s) for s in shares)
        flat = [n for s in shares for n in s]
        assert sorted(flat) == sorted(sizes) and len(flat) == len(set(flat))
        loads = [sum(sizes[n] for n in s) for s in shares]
        assert max(loads) - min(loads) <= max(sizes.values()), (world, loads)
        assert all(shares), f"world {world}: an idle rank while {len(sizes)} files are hashed"
        assert checksum_shares(dict(reversed(sizes.items())), world) == shares  # same split on every rank
    assert checksum_shares({"big": 10**9, "a": 1, "b": 1}, 2) == [["big"], ["a", "b"]]
    assert checksum_shares({}, 3) == [[], [], []]
    assert checksum_shares({"only": 5}, 2) == [["only"], []]
    with pytest.raises(ValueError, match="world_size=0"):
        checksum_shares(sizes, 0)


def test_file_crc32_streams_over_chunks(tmp_path):
    data = os.urandom((16 << 20) * 2 + 12345)  # three 16 MiB reads
    f = tmp_path / "blob"
    f.write_bytes(data)
    assert file_crc32(f) == (len(data), f"{zlib.crc32(data):08x}")
    (tmp_path / "empty").write_bytes(b"")
    assert file_crc32(tmp_path / "empty") == (0, "00000000")


def test_config_field():
    assert TrainConfig().checkpoint_checksums is True
    assert parse_args_to_config("lm-tiny", ["train.checkpoint_checksums=false"]).train.checkpoint_checksums is False
    with pytest.raises(ValueError, match="train.checkpoint_checksums"):
        TrainConfig(checkpoint_checksums="yes")
    with pytest.raises(ValueError, match="train.checkpoint_checksums"):
        parse_args_to_config("lm-tiny", ["train.checkpoint_checksums=maybe"])


def test_a_save_that_fails_on_rank_0_is_a_checkpoint_error_and_keeps_latest(saved, groups, tmp_path):
    """Rank 0 finishes a save alone (meta.json, rename, ``latest``); its failure is shared with every
    rank as a ``CheckpointError`` (the other ranks would otherwise wait for it forever) and ``latest``
    keeps naming the last complete checkpoint."""
    model = _model(groups, seed=3)
    run = tmp_path / "run"
    first = save_checkpoint(run, 1, model, None, groups)
    (run / "checkpoints" / "latest.tmp").mkdir()  # the atomic write of `latest` cannot create its temp file
    with pytest.raises(CheckpointError, match=r"saving checkpoint step 2 failed on rank 0 \(IsADirectoryError"):
        save_checkpoint(run, 2, model, None, groups)
    assert (run / "checkpoints" / "latest").read_text().strip() == first.name
    read_meta(first)  # still complete and verified
    (run / "checkpoints" / "latest.tmp").rmdir()
    assert save_checkpoint(run, 3, model, None, groups).name == "step_00000003"


def test_a_meta_json_that_is_not_utf8_is_a_checkpoint_error(ckpt):
    meta = ckpt / "meta.json"
    meta.write_bytes(b"\xff" + meta.read_bytes())
    with pytest.raises(CheckpointError, match="meta.json is corrupt"):
        read_meta(ckpt)


def test_rng_saved_with_cuda_resumes_on_a_cpu(ckpt, groups, caplog):
    """A checkpoint written on a GPU holds a CUDA generator state and CUDA tracker states (16 bytes:
    seed and offset), which do not load into host generators: only the host RNG is restored."""
    from safetensors.torch import load_file, save_file

    rng_file = ckpt / "rng_rank0.safetensors"
    rng = load_file(str(rng_file))
    assert any(k.startswith("tracker.") for k in rng) and "cuda" not in rng
    gpu_rng = {"torch": rng["torch"], "cuda": torch.arange(16, dtype=torch.uint8)}
    gpu_rng.update({k: torch.arange(16, dtype=torch.uint8) for k in rng if k.startswith("tracker.")})
    save_file(gpu_rng, str(rng_file))
    meta = json.loads((ckpt / "meta.json").read_text())
    size, crc = file_crc32(rng_file)
    meta["files"][rng_file.name] = {"bytes": size, "crc32": crc}
    del meta["meta_crc32"]  # rewritten by hand: without its own CRC-32, as an older meta.json
    (ckpt / "meta.json").write_text(json.dumps(meta))
    from megatron.core import tensor_parallel

    tracker_before = {k: v.clone() for k, v in tensor_parallel.get_cuda_rng_tracker().get_states().items()}
    torch.manual_seed(1234)
    model = _model(groups, seed=4)
    with caplog.at_level("WARNING"):
        assert load_checkpoint(ckpt, model, None, groups)["step"] == 1
    assert torch.equal(torch.get_rng_state(), rng["torch"])
    tracker_after = tensor_parallel.get_cuda_rng_tracker().get_states()
    assert all(torch.equal(tracker_after[k], v) for k, v in tracker_before.items())
    assert "saved with CUDA and is resumed without it" in caplog.text
