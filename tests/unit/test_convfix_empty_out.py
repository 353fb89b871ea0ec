"""An empty ``--out`` (``--out "$OUT"`` with ``OUT`` unset) is refused: it used to stand for the working
directory, so ``mcore-to-hf --mcore M --out "" --force`` run inside a Hugging Face checkpoint directory replaced
that checkpoint with the export. ``--hf`` and ``--mcore`` are refused empty too; nothing is written."""

from __future__ import annotations

import pytest

from megatron_logra.convert import convert_hf_to_mcore
from megatron_logra.convert.cli import main
from support.convert_fixtures import tiny_llama_checkpoint


@pytest.fixture(scope="module", autouse=True)
def _one_thread(one_thread):
    """Every test of this module runs single-threaded (conftest.one_thread)."""


def _save(path, seed: int):
    return tiny_llama_checkpoint(path.parent, name=path.name, seed=seed)


@pytest.mark.parametrize("direction", ["hf-to-mcore", "mcore-to-hf"])
def test_an_empty_out_is_refused_and_the_working_directory_kept(direction, tmp_path, monkeypatch, capsys):
    source = _save(tmp_path / "a", 0)
    convert_hf_to_mcore(source, tmp_path / "mc")
    here = _save(tmp_path / "b", 1)  # the directory the command runs in: another model's checkpoint
    before = {p.name: p.read_bytes() for p in here.iterdir()}
    monkeypatch.chdir(here)
    src = ["--hf", str(source)] if direction == "hf-to-mcore" else ["--mcore", str(tmp_path / "mc")]
    capsys.readouterr()
    with pytest.raises(SystemExit) as exit_info:
        main([direction, *src, "--out", "", "--force"])
    assert exit_info.value.code == 2
    assert "--out is empty: give a directory" in capsys.readouterr().err
    assert {p.name: p.read_bytes() for p in here.iterdir()} == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a", "b", "mc"]


@pytest.mark.parametrize("argv", [["hf-to-mcore", "--hf", " ", "--out", "x"], ["mcore-to-hf", "--mcore", "", "--out", "x"]])
def test_an_empty_input_is_refused(argv, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    assert exit_info.value.code == 2
    assert "is empty: give a directory" in capsys.readouterr().err
    assert not (tmp_path / "x").exists()
