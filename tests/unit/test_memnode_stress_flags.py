"""``tools/memory_stress.py`` errors name the flags the user typed, with a fix the script can take.

The shared checks behind it (``ModelConfig``, the planner's layout check) speak in config fields, as ``megatron-logra
train`` users need them: ``--hidden 63 --heads 4`` used to end with ``model.hidden_size=63 must be divisible by
model.num_attention_heads=4, or set model.kv_channels`` although the script has no flag for kv_channels. Each case
here runs the script's ``main``, checks its one ``error:`` line names the flags (and marks the values the script
filled in as defaults), holds no config field name, and then runs the fix the line proposes, which must plan.
"""

from __future__ import annotations

import argparse
import csv
import importlib.util
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
TOOL = ROOT / "tools" / "memory_stress.py"
FIELDS = ("model.", "hidden_size", "num_attention_heads", "num_query_groups", "ffn_hidden_size", "kv_channels",
          "tp=", "rank=", "model=", "choose tp ")


@pytest.fixture(scope="module")
def tool():
    spec = importlib.util.spec_from_file_location("memory_stress_memnode", TOOL)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _error(tool, capsys, argv: list[str], out: Path) -> str:
    with pytest.raises(SystemExit) as exc:
        tool.main([*argv, "--dry-run", "--out", str(out)])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err, err
    line = err.strip().splitlines()[-1]
    assert line.startswith("memory_stress.py: error: "), line
    text = line.replace("--tp=", "").replace("--rank=", "").replace("--model ", "")
    assert not [f for f in FIELDS if f in text], line  # no config field name is left
    assert not out.exists()  # refused before anything is written
    return line.removeprefix("memory_stress.py: error: ")


CASES = {
    "hidden-not-divisible-by-heads": (
        ["--hidden", "63", "--heads", "4"],
        ["--hidden=63 is not divisible by --heads=4", "--heads=3 or --heads=7", "--hidden=64"],
        [["--hidden", "63", "--heads", "7", "--rank", "63", "--optimizers", "logra"]]),
    "default-hidden-and-odd-heads": (
        ["--heads", "5"], ["--hidden=256 (the default) is not divisible by --heads=5", "--heads=4 or --heads=8"],
        [["--heads", "8", "--optimizers", "logra"]]),
    "query-groups-not-dividing-heads": (
        ["--query-groups", "3", "--heads", "4"],
        ["--query-groups=3 must divide --heads=4: choose --query-groups in [1, 2, 4]", "--heads a multiple of 3"],
        [["--query-groups", "3", "--heads", "12", "--hidden", "384", "--optimizers", "logra"]]),
    "query-groups-over-default-heads": (
        ["--query-groups", "8"], ["--query-groups=8 must divide --heads=4 (the default, --hidden // 64)"],
        [["--query-groups", "4"]]),
    "tp-against-a-preset": (
        ["--tp", "3", "--model", "27b"],
        ["--tp=3 must divide the 32 attention heads of --model 27b: choose --tp in [1, 2, 4, 8, 16]"],
        [["--tp", "4", "--model", "27b"]]),
    "tp-against-query-groups-of-a-preset": (
        ["--tp", "4", "--model", "qwen2.5-1.5b"],
        ["--tp=4 must divide the 2 query groups (KV heads) of --model qwen2.5-1.5b: choose --tp in [1, 2]"],
        [["--tp", "2", "--model", "qwen2.5-1.5b"]]),
    "tp-against-default-heads": (
        ["--tp", "3"], ["--tp=3 must divide --heads=4 (the default, --hidden // 64): choose --tp in [1, 2, 4]"],
        [["--tp", "3", "--heads", "6", "--ffn", "768", "--hidden", "384", "--optimizers", "logra"]]),
    "tp-against-the-mlp-width": (
        ["--tp", "2", "--hidden", "64", "--heads", "4", "--ffn", "3"],
        ["--tp=2 must divide --ffn=3: choose --tp in [1]", "--ffn a multiple of 2"],
        [["--tp", "2", "--hidden", "64", "--heads", "4", "--ffn", "4", "--rank", "4"]]),
    "default-rank-over-hidden": (
        ["--hidden", "96"],
        ["--rank=128 (the default) must be <= 96", "linear_qkv, set by --hidden=96", "give --rank <= 96"],
        [["--hidden", "96", "--rank", "96", "--optimizers", "logra"]]),
    "rank-over-the-mlp-width": (
        ["--hidden", "64", "--heads", "4", "--ffn", "32", "--rank", "48"],
        ["--rank=48 must be <= 32", "linear_fc2, set by --ffn=32", "or a larger --ffn"],
        [["--hidden", "64", "--heads", "4", "--ffn", "32", "--rank", "32"]]),
    "rank-over-a-preset": (
        ["--model", "qwen2.5-1.5b", "--rank", "2000"],
        ["--rank=2000 must be <= 1536", "in --model qwen2.5-1.5b: give --rank <= 1536"],
        [["--model", "qwen2.5-1.5b", "--rank", "1536"]]),
    "unknown-preset": (
        ["--model", "qwen-9000"], ["--model qwen-9000 is neither a preset (qwen2.5-1.5b, qwen2.5-7b, 27b)"],
        [["--model", "qwen2.5-1.5b"]]),
    "steps": (["--steps", "0"], ["--steps=0 must be >= 1"], [["--steps", "1"]]),
    "optimizers": (["--optimizers", "sgd"], ["--optimizers='sgd': give logra and/or adam"], [["--optimizers", "adam"]]),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_the_error_names_the_flags_and_its_fix_plans(tool, capsys, tmp_path, name):
    argv, says, fixes = CASES[name]
    line = _error(tool, capsys, argv, tmp_path / "refused")
    for text in says:
        assert text in line, line
    for i, fix in enumerate(fixes):
        assert tool.main([*fix, "--dry-run", "--out", str(tmp_path / f"fixed{i}")]) == 0, fix
        assert (tmp_path / f"fixed{i}" / "memory_stress.csv").is_file()


def test_a_missing_config_json_is_named_by_model(tool, capsys, tmp_path):
    missing = tmp_path / "no-such-model" / "config.json"
    line = _error(tool, capsys, ["--model", str(missing)], tmp_path / "out")
    assert line == f"--model {missing}: no such config.json (give a preset name or a path to a config.json)"


def test_a_config_json_the_trainer_refuses_is_named_by_model(tool, capsys, tmp_path):
    (tmp_path / "config.json").write_text('{"hidden_size": 64}')
    line = _error(tool, capsys, ["--model", str(tmp_path)], tmp_path / "out")
    assert line.startswith(f"--model {tmp_path / 'config.json'}: "), line


def test_the_shared_message_is_unchanged_for_the_trainer():
    """The rewrite lives in the script's layer: ``train`` users still read the config fields."""
    from megatron_logra.models.gpt import ModelConfig

    with pytest.raises(ValueError, match=r"^model\.hidden_size=63 must be divisible by model\.num_attention_heads=4"):
        ModelConfig(num_layers=1, hidden_size=63, num_attention_heads=4, ffn_hidden_size=64, vocab_size=64,
                    seq_length=16)


def test_an_unforeseen_field_message_gets_the_flags(tool):
    from megatron_logra.memory.stress_flags import flag_error

    args = tool.build_parser().parse_args([])
    assert flag_error("model.vocab_size=0 must be >= 1 (seq_len=0 too)", args) == "--vocab=0 must be >= 1 (--seq-len=0 too)"
    with_model = argparse.Namespace(**{**vars(args), "model": "27b"})
    assert flag_error("pp=2 must divide 3", with_model) == "--model 27b: pp=2 must divide 3"


def test_chunk_tokens_zero_is_one_chunk_and_below_zero_is_refused(tool, capsys, tmp_path):
    """0 is the trainer's unchunked log-prob (rl.loss.logprob_chunk_tokens=0): meaningful, planned as one chunk
    of the whole micro-batch, so more memory than small chunks; -1 is refused naming the flag."""
    peaks = {}
    for chunk in ("0", "16"):
        out = tmp_path / chunk
        assert tool.main(["--hidden", "64", "--heads", "4", "--rank", "8", "--vocab", "32000", "--seq-len", "256",
                          "--optimizers", "adam", "--chunk-tokens", chunk, "--dry-run", "--out", str(out)]) == 0
        with open(out / "memory_stress.csv", newline="") as f:
            peaks[chunk] = int(next(csv.DictReader(f))["predicted_peak_bytes"])
    assert peaks["0"] > peaks["16"], peaks
    line = _error(tool, capsys, ["--chunk-tokens", "-1"], tmp_path / "refused")
    assert line == "--chunk-tokens=-1 must be >= 0 (0 = unchunked)"

