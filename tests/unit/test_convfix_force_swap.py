"""``--force`` replaces a previous output by renames only, so a complete output survives a kill at any point of
the swap, and the next conversion to the same --out finishes the interrupted swap correctly.

The kill is real: the conversion runs in a child process that ends itself with ``os._exit`` (no exception
handler, no cleanup) at a chosen step of the swap."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from megatron_logra.convert import convert_hf_to_mcore, convert_mcore_to_hf
from megatron_logra.convert import outdir
from support import forked
from support.convert_fixtures import snapshot, tiny_llama_checkpoint


@pytest.fixture(scope="module", autouse=True)
def _one_thread(one_thread):
    """Every test of this module runs single-threaded (conftest.one_thread)."""


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory) -> Path:
    return tiny_llama_checkpoint(tmp_path_factory.mktemp("src"))


def _siblings(out: Path) -> list[str]:
    return sorted(p.name for p in out.parent.iterdir())


def _killed_during_force(hf: Path, out: Path, tp: int, kill_at: str) -> None:
    """Run ``convert_hf_to_mcore(hf, out, tp=tp, force=True)`` in a child killed (``os._exit(9)``) just before
    ``kill_at``: ``"rename-in"`` (the build directory's rename onto ``out``) or ``"delete-old"`` (the deletion
    of the replaced output)."""
    child = f"""
import os, shutil, sys
from pathlib import Path
from megatron_logra.convert import convert_hf_to_mcore
tmp = str(Path({str(out)!r}).resolve().parent / ".{out.name}.partial")
real_replace, real_rmtree = os.replace, shutil.rmtree
def replace(src, dst, *a, **k):
    if {kill_at!r} == "rename-in" and os.fspath(src) == tmp:
        os._exit(9)
    return real_replace(src, dst, *a, **k)
def rmtree(path, *a, **k):
    if {kill_at!r} == "delete-old" and os.fspath(path).endswith(".old"):
        os._exit(9)
    return real_rmtree(path, *a, **k)
os.replace, shutil.rmtree = replace, rmtree
convert_hf_to_mcore({str(hf)!r}, {str(out)!r}, tp={tp}, force=True)
sys.exit(0)
"""
    proc = forked.python(["-c", child], timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"})  # forked warm
    assert proc.returncode == 9, proc.stderr


def _exports_the_original(mc: Path, hf: Path, tmp_path: Path) -> None:
    """``mc`` is a complete conversion: it exports back to the original HF tensors, bit for bit."""
    back = tmp_path / "back"
    convert_mcore_to_hf(mc, back, force=True)
    original, exported = load_file(str(hf / "model.safetensors")), load_file(str(back / "model.safetensors"))
    assert set(exported) == set(original)
    for name, tensor in exported.items():
        assert torch.equal(tensor, original[name]), name


def test_killed_between_the_renames_the_previous_output_survives_and_is_restored(hf_dir, tmp_path):
    out = tmp_path / "mc"
    convert_hf_to_mcore(hf_dir, out, tp=1)
    previous = snapshot(out)

    _killed_during_force(hf_dir, out, tp=2, kill_at="rename-in")
    # a complete copy exists: the previous output, renamed aside intact
    assert not out.exists()
    assert snapshot(tmp_path / ".mc.old") == previous

    # the next run without --force restores it and refuses to replace it
    with pytest.raises(ValueError, match="pass --force"):
        convert_hf_to_mcore(hf_dir, out, tp=2)
    assert snapshot(out) == previous and _siblings(out) == [".mc.partial", "mc"]
    _exports_the_original(out, hf_dir, tmp_path)

    # with --force it is replaced, and nothing of the interrupted swap is left
    meta = convert_hf_to_mcore(hf_dir, out, tp=2, force=True)
    assert meta["tp"] == 2 and json.loads((out / "meta.json").read_text())["tp"] == 2
    assert _siblings(out) == ["back", "mc"]
    _exports_the_original(out, hf_dir, tmp_path)


def test_killed_after_the_renames_the_new_output_is_kept(hf_dir, tmp_path):
    out = tmp_path / "mc"
    convert_hf_to_mcore(hf_dir, out, tp=1)
    _killed_during_force(hf_dir, out, tp=2, kill_at="delete-old")
    assert json.loads((out / "meta.json").read_text())["tp"] == 2 and (tmp_path / ".mc.old").is_dir()
    _exports_the_original(out, hf_dir, tmp_path)

    # a refused run deletes nothing; the next conversion deletes the superseded copy
    with pytest.raises(ValueError, match="pass --force"):
        convert_hf_to_mcore(hf_dir, out, tp=1)
    assert (tmp_path / ".mc.old").is_dir()
    assert convert_hf_to_mcore(hf_dir, out, tp=1, force=True)["tp"] == 1
    assert _siblings(out) == ["back", "mc"]
    _exports_the_original(out, hf_dir, tmp_path)


def test_an_exception_at_the_rename_in_puts_the_previous_output_back(hf_dir, tmp_path, monkeypatch):
    out = tmp_path / "mc"
    convert_hf_to_mcore(hf_dir, out, tp=1)
    previous = snapshot(out)
    real_replace = os.replace

    def replace(src, dst):
        if Path(src).name == ".mc.partial":
            raise OSError(18, "Invalid cross-device link", str(src))
        return real_replace(src, dst)

    monkeypatch.setattr(outdir.os, "replace", replace)
    with pytest.raises(OSError, match="cross-device"):
        convert_hf_to_mcore(hf_dir, out, tp=2, force=True)
    assert snapshot(out) == previous and _siblings(out) == ["mc"]
