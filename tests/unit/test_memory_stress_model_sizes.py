"""``tools/memory_stress.py --model M`` takes the model's sizes and dtype from the preset or config.json: a size
flag given with it (``--layers 2``) used to be ignored silently, planning and building the whole preset; it is
refused, naming the flags. Without ``--model`` the sizes keep their defaults."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

TOOL = Path(__file__).resolve().parents[2] / "tools" / "memory_stress.py"


def _tool():
    spec = importlib.util.spec_from_file_location("memory_stress_sizes", TOOL)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("flags", [["--layers", "2"], ["--hidden", "64", "--vocab", "1000"], ["--dtype", "float32"]])
def test_size_flags_with_a_model_are_refused_naming_them(tmp_path, capsys, flags):
    tool = _tool()
    with pytest.raises(SystemExit) as exc:
        tool.main(["--model", "qwen2.5-1.5b", *flags, "--dry-run", "--out", str(tmp_path / "o")])
    assert exc.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    named = [f for f in flags if f.startswith("--")]
    assert "--model qwen2.5-1.5b takes its sizes" in err and all(f in err for f in named), err
    assert not (tmp_path / "o").exists()


def test_without_a_model_the_sizes_keep_their_defaults(tmp_path):
    tool = _tool()
    args = tool.build_parser().parse_args(["--dry-run", "--out", str(tmp_path)])
    cfg = tool.model_config(args)
    assert (cfg.num_layers, cfg.hidden_size, cfg.vocab_size, cfg.params_dtype) == (2, 256, 32000, "bfloat16")
    args = tool.build_parser().parse_args(["--dry-run", "--hidden", "128", "--dtype", "float32", "--out", str(tmp_path)])
    cfg = tool.model_config(args)
    assert (cfg.hidden_size, cfg.params_dtype, cfg.num_attention_heads) == (128, "float32", 2)


def test_a_model_alone_plans_the_preset(tmp_path, capsys):
    tool = _tool()
    assert tool.main(["--model", "qwen2.5-1.5b", "--dry-run", "--out", str(tmp_path / "o")]) == 0
    assert (tmp_path / "o" / "memory_stress.csv").is_file()
