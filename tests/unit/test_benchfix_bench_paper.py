"""``megatron-logra bench paper``: a run of some figures or with other settings writes a report named
after them and never replaces the full one; the header names the command that reproduces the run
and the machine it ran on; ``--render-only`` still reproduces the committed reports byte for byte."""

from __future__ import annotations

import json
import os
import shlex
import shutil
from dataclasses import asdict
from pathlib import Path

import pytest

from megatron_logra.bench.cli import build_parser, config_from_args, main
from megatron_logra.bench.config import PaperBenchConfig
from megatron_logra.bench.provenance import command_line, environment
from megatron_logra.bench.report import render_report, write_report
from megatron_logra.bench.report_names import image_prefix, report_stem

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"


def _cfg(*argv: str) -> PaperBenchConfig:
    return config_from_args(build_parser().parse_args(["paper", *argv]))


@pytest.mark.parametrize("argv, stem, prefix", [
    ([], "results", ""),
    (["--quick"], "results-quick", "quick-"),
    (["--figures", "kl", "cosine", "memory", "accuracy"], "results", ""),
    (["--out-dir", "elsewhere", "--run-root", "r"], "results", ""),
    (["--figures", "cosine"], "results-cosine", "cosine-"),
    (["--quick", "--figures", "kl", "memory"], "results-quick-memory-kl", "quick-memory-kl-"),
    (["--seeds", "1"], "results-seeds_1", "seeds_1-"),
    (["--quick", "--figures", "cosine", "memory", "--optimizers", "logra", "adam"],
     "results-quick-optimizers_logra_adam-memory-cosine", "quick-optimizers_logra_adam-memory-cosine-"),
    (["--rl-steps", "3"], "results-rl-steps_3", "rl-steps_3-"),
])
def test_report_name_says_what_ran(argv, stem, prefix):
    cfg = _cfg(*argv)
    assert report_stem(cfg) == stem and image_prefix(cfg) == prefix


@pytest.mark.parametrize("argv", [
    [], ["--quick"], ["--figures", "cosine"], ["--quick", "--figures", "cosine", "memory", "--optimizers", "logra", "adam"],
    ["--seeds", "1", "2", "--rl-steps", "3", "--kl-modes", "none", "k3", "--run-root", "/tmp/a b", "--out-dir", "x"],
])
def test_command_line_reproduces_the_config(argv):
    """The recorded command used to be ``megatron-logra bench paper [--quick]`` whatever the flags."""
    cfg = _cfg(*argv)
    command = command_line(cfg)
    words = shlex.split(command)
    assert words[:3] == ["megatron-logra", "bench", "paper"]
    assert asdict(config_from_args(build_parser().parse_args(words[2:]))) == asdict(cfg)
    if argv in ([], ["--quick"]):
        assert command == shlex.join(["megatron-logra", "bench", "paper", *argv])


def test_command_line_lists_what_no_flag_sets():
    cfg = PaperBenchConfig.preset(True, figures=["cosine"], cosine_draws=4)
    assert command_line(cfg) == "megatron-logra bench paper --quick --figures cosine (and, through the API: cosine_draws=4)"


def _render(cfg, env):
    return render_report(cfg, timings={"total": 60.0, "cosine": 60.0}, missing={}, memory=[], planned=[],
                         by_optimizer={}, by_rank={}, cosines=None, kl_rows=[], images={},
                         command=command_line(cfg), environment=env)


def test_header_names_the_real_command_and_machine():
    """The header used to say "(full run)", the bare command and "shared 2-core machine" on any machine."""
    cfg = _cfg("--figures", "accuracy", "--seeds", "1")
    env = environment(cfg.threads)
    assert env["cpu_count"] == os.cpu_count() and env["torch_threads"] == 1
    assert env["omp_num_threads"] == os.environ.get("OMP_NUM_THREADS", "unset")
    text = _render(cfg, env)
    title, _, header = text.splitlines()[:3]
    assert title == "# Paper figures at small scale (full budget, accuracy only, settings changed: see the command)"
    assert header.startswith("Command: `megatron-logra bench paper --figures accuracy --seeds 1` (")
    assert f"{env['cpu_count']} cores" in header and env["cpu"] in header and "shared 2-core" not in header
    assert f"OMP_NUM_THREADS={env['omp_num_threads']}, 1 torch thread(s)" in header
    assert _render(PaperBenchConfig.preset(False), env).startswith("# Paper figures at small scale (full run)\n")


def test_partial_run_leaves_the_full_report_alone(tmp_path):
    """``--figures cosine`` used to replace ``results.md`` and ``results/results.json`` with a partial report."""
    (tmp_path / "results").mkdir()
    (tmp_path / "results.md").write_text("full report\n")
    (tmp_path / "results" / "results.json").write_text('{"full": true}')
    cfg = _cfg("--figures", "cosine", "--out-dir", str(tmp_path))
    path = write_report(cfg, "partial\n", {"config": asdict(cfg)})
    assert path == tmp_path / "results-cosine.md" and path.read_text() == "partial\n"
    assert json.loads((tmp_path / "results" / "results-cosine.json").read_text())["config"]["figures"] == ["cosine"]
    assert (tmp_path / "results.md").read_text() == "full report\n"
    assert (tmp_path / "results" / "results.json").read_text() == '{"full": true}'


@pytest.fixture
def docs_copy(tmp_path) -> Path:
    if not (DOCS / "results" / "results.json").exists():
        pytest.skip("docs/results/results.json is not in this checkout")
    out = tmp_path / "docs"
    shutil.copytree(DOCS, out)
    return out


@pytest.mark.parametrize("quick", [False, True])
def test_render_only_reproduces_the_committed_reports(docs_copy, quick):
    """Their JSON predates the recorded command and machine: the command is rebuilt from the config and the
    machine is the one they were measured on."""
    name = "results-quick.md" if quick else "results.md"
    assert main(["paper", "--render-only", "--out-dir", str(docs_copy)] + (["--quick"] if quick else [])) == 0
    assert (docs_copy / name).read_bytes() == (DOCS / name).read_bytes()


def test_render_only_of_a_partial_run_uses_what_it_recorded(docs_copy):
    data = json.loads((docs_copy / "results" / "results-quick.json").read_text())
    data["config"].update(figures=["cosine"], out_dir=str(docs_copy))
    data["command"] = "megatron-logra bench paper --quick --figures cosine --out-dir D"
    data["environment"] = {"omp_num_threads": "2", "torch_threads": 1, "machine": "aarch64", "cpu": "Some CPU",
                           "cpu_count": 64, "torch": "9.9", "python": "3.11", "load_average": 0.5}
    (docs_copy / "results" / "results-quick-cosine.json").write_text(json.dumps(data))
    assert main(["paper", "--render-only", "--quick", "--figures", "cosine", "--out-dir", str(docs_copy)]) == 0
    text = (docs_copy / "results-quick-cosine.md").read_text()
    assert text.splitlines()[2].startswith(
        "Command: `megatron-logra bench paper --quick --figures cosine --out-dir D` (OMP_NUM_THREADS=2, 1 torch "
        "thread(s), Some CPU (aarch64, 64 cores, load average 0.5 at the start), torch 9.9).")
    assert text.startswith("# Paper figures at small scale (quick budget, cosine only)\n")
    assert (docs_copy / "results-quick.md").read_bytes() == (DOCS / "results-quick.md").read_bytes()


@pytest.mark.parametrize("argv, flag, add", [
    (["--figures", "memory", "cosine", "--seeds", "1", "2"], "--seeds", "add accuracy to --figures"),
    (["--figures", "cosine", "--rl-steps", "3"], "--rl-steps", "add accuracy or kl to --figures"),
    (["--figures", "accuracy", "--kl-modes", "none"], "--kl-modes", "add kl to --figures"),
    (["--figures", "cosine", "kl", "--optimizers", "adam"], "--optimizers", "add memory or accuracy to --figures"),
])
def test_a_setting_no_selected_figure_reads_is_refused(tmp_path, capsys, argv, flag, add):
    """Such a flag used to be taken silently: it changed nothing but the report's name."""
    assert main(["paper", *argv, "--out-dir", str(tmp_path / "docs"), "--run-root", str(tmp_path / "runs")]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"megatron-logra bench paper: error: {flag} is read only by the ") and "--figures" in err
    assert not (tmp_path / "docs").exists() and not (tmp_path / "runs").exists()
    assert f"drop {flag} or {add}" in err, err
