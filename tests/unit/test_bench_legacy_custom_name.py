"""``megatron-logra bench paper --render-only`` of a run with other settings than the preset's written when
every such run was named ``results[-quick]-custom[-FIGURE...]``: the JSON is found under that older name and
re-rendered under the current one when it recorded the run of the given flags; another run's JSON under that
shared name, or no JSON at all, is one ``error:`` line naming the files and the command to run."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from megatron_logra.bench.cli import build_parser, config_from_args
from megatron_logra.bench.cli import main as bench_main
from megatron_logra.bench.config import PaperBenchConfig
from megatron_logra.bench.report_names import image_prefix, legacy_image_prefix, legacy_report_stem, report_stem
from support.scripts import exit_code

ROOT = Path(__file__).resolve().parents[2]
QUICK_JSON = ROOT / "docs" / "results" / "results-quick.json"


def _cfg(*argv: str) -> PaperBenchConfig:
    return config_from_args(build_parser().parse_args(["paper", *argv]))


@pytest.mark.parametrize("argv, legacy", [
    ([], None),
    (["--quick"], None),
    (["--quick", "--figures", "cosine"], None),
    (["--quick", "--rl-steps", "10"], "results-quick-custom"),
    (["--seeds", "1", "--figures", "accuracy", "memory"], "results-custom-memory-accuracy"),
])
def test_legacy_stem_is_the_old_custom_name(argv, legacy):
    cfg = _cfg(*argv)
    assert legacy_report_stem(cfg) == legacy
    assert legacy_image_prefix(cfg) == (None if legacy is None else legacy[len("results-"):] + "-")


@pytest.fixture
def legacy_run(tmp_path) -> Path:
    """A ``--quick --rl-steps 10`` run's JSON and one PNG under the older ``-custom`` name."""
    if not QUICK_JSON.exists():
        pytest.skip("docs/results/results-quick.json is not in this checkout")
    (tmp_path / "results").mkdir()
    data = json.loads(QUICK_JSON.read_text())
    data["config"]["rl_steps"] = 10
    data["command"] = "megatron-logra bench paper --quick --rl-steps 10"
    (tmp_path / "results" / "results-quick-custom.json").write_text(json.dumps(data))
    (tmp_path / "results" / "quick-custom-fig1_memory.png").write_bytes(b"\x89PNG old")
    return tmp_path


def test_render_only_reads_the_old_custom_name(legacy_run, capsys):
    """It used to look only for ``results-quick-rl-steps_10.json`` and end with 'does not exist'."""
    argv = ["paper", "--quick", "--rl-steps", "10", "--render-only", "--out-dir", str(legacy_run)]
    assert exit_code(bench_main, argv) == 0, capsys.readouterr().err
    cfg = _cfg(*argv[1:])
    assert report_stem(cfg) == "results-quick-rl-steps_10"
    text = (legacy_run / "results-quick-rl-steps_10.md").read_text()
    assert "--rl-steps 10" in text
    assert f"(results/{image_prefix(cfg)}fig1_memory.png)" in text
    assert (legacy_run / "results" / f"{image_prefix(cfg)}fig1_memory.png").read_bytes() == b"\x89PNG old"
    new_json = json.loads((legacy_run / "results" / "results-quick-rl-steps_10.json").read_text())
    assert new_json["config"]["rl_steps"] == 10
    # the older files are left as they are, and the report now re-renders from its own name
    assert (legacy_run / "results" / "results-quick-custom.json").exists()
    assert (legacy_run / "results" / "quick-custom-fig1_memory.png").exists()
    (legacy_run / "results" / "results-quick-custom.json").unlink()
    assert exit_code(bench_main, argv) == 0


def test_render_only_refuses_another_runs_old_custom_json(legacy_run, capsys):
    """The older name was shared by every custom run: one of ``--rl-steps 10`` is not the report of ``--rl-steps 12``."""
    argv = ["paper", "--quick", "--rl-steps", "12", "--render-only", "--out-dir", str(legacy_run)]
    assert exit_code(bench_main, argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("megatron-logra bench paper: error: "), err
    assert "results-quick-custom.json" in err and "`megatron-logra bench paper --quick --rl-steps 10`" in err
    assert "rl_steps: 10 -> 12" in err and "--rl-steps 12" in err
    assert not (legacy_run / "results-quick-rl-steps_12.md").exists()
    assert not (legacy_run / "results" / "results-quick-rl-steps_12.json").exists()


def test_render_only_without_either_name_says_both(tmp_path, capsys):
    argv = ["paper", "--quick", "--rl-steps", "10", "--render-only", "--out-dir", str(tmp_path)]
    assert exit_code(bench_main, argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1, err
    assert "results-quick-rl-steps_10.json does not exist (nor its older name results-quick-custom.json)" in err
    assert f"run `megatron-logra bench paper --quick --out-dir {tmp_path} --rl-steps 10` first" in err
