"""Where ``benchmarks/optimizer_memory.py``, ``benchmarks/sync_bytes.py`` and ``megatron-logra bench paper``
write: only the documented runs write the committed tables by default, runs of other settings write somewhere
else (the benchmarks) or under a name derived from those settings (``bench paper``), and an output that cannot
be written is refused in one line before anything runs. Also ``megatron-logra memory``'s LoGRA-only flags with
``--optimizer adam``."""

from __future__ import annotations

import importlib.util
import json
import shlex
import sys
from pathlib import Path
from types import ModuleType

import pytest

from megatron_logra.bench.cli import build_parser as bench_parser
from megatron_logra.bench.cli import config_from_args
from megatron_logra.bench.cli import main as bench_main
from megatron_logra.bench.config import PaperBenchConfig
from megatron_logra.bench.outputs import why_unwritable
from megatron_logra.bench.report import write_report
from megatron_logra.bench.report_names import SETTINGS_NAME_LIMIT, image_prefix, report_stem
from megatron_logra.memory.cli import main as memory_main
from support.scripts import exit_code

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "benchmarks" / "results"
PROG = Path(sys.argv[0]).name
"""argparse's name for a script's parser run in this process (``main(argv)``)."""


def _load(name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(f"{name}_bench_outputs", ROOT / "benchmarks" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def om() -> ModuleType:
    return _load("optimizer_memory")


@pytest.fixture(scope="module")
def sb() -> ModuleType:
    return _load("sync_bytes")


def _one_error_line(err: str) -> str:
    assert "Traceback" not in err, err[-3000:]
    lines = [line for line in err.strip().splitlines() if line.strip()]
    return lines[-1]


class _CommittedGuard:
    """The committed files' bytes before a test; restored (and reported) if a run replaced them."""

    def __init__(self, *paths: Path) -> None:
        self.before = {p: p.read_bytes() for p in paths if p.exists()}

    def changed(self) -> list[str]:
        changed = [str(p) for p, data in self.before.items() if not p.exists() or p.read_bytes() != data]
        for p, data in self.before.items():
            if not p.exists() or p.read_bytes() != data:
                p.write_bytes(data)
        return changed


# ---------------------------------------------------------------------------------------------- optimizer_memory
def _command_args(command: str) -> list[str]:
    """The arguments of a recorded ``python benchmarks/X.py ARGS`` command."""
    words = shlex.split(command)
    return words[words.index(next(w for w in words if w.endswith(".py"))) + 1:]


def test_optimizer_memory_committed_commands_write_the_committed_tables(om):
    """The commands the committed tables record (and the README's plain and ``--quick`` runs) are documented
    runs: without ``--out`` they write ``benchmarks/results/optimizer_memory{,_quick}``."""
    for name in ("optimizer_memory", "optimizer_memory_quick"):
        command = json.loads((RESULTS / f"{name}.json").read_text())["meta"]["command"]
        args = om.build_parser().parse_args(_command_args(command))
        assert om.default_stem(args) == RESULTS / name, command
    assert om.default_stem(om.build_parser().parse_args([])) == RESULTS / "optimizer_memory"
    assert om.default_stem(om.build_parser().parse_args(["--quick"])) == RESULTS / "optimizer_memory_quick"


@pytest.mark.parametrize("argv", [
    ["--steps", "1"], ["--quick", "--steps", "1"], ["--sizes", "64x1"], ["--quick", "--sizes", "64x1"],
    ["--seq", "64"], ["--micro-batch", "1"], ["--vocab", "256"], ["--threads", "1"], ["--quick", "--no-reuse-processes"],
    ["--reuse-processes"],
])
def test_optimizer_memory_other_settings_write_elsewhere(om, argv):
    args = om.build_parser().parse_args(argv)
    name = "optimizer_memory_quick" if args.quick else "optimizer_memory"
    assert om.default_stem(args) == Path("runs/bench-optimizer-memory") / name


def test_optimizer_memory_small_run_is_routed_away_from_the_committed_table(om, tmp_path, monkeypatch, capsys):
    """A ``--quick --sizes 64x1 --steps 1`` run used to replace ``results/optimizer_memory_quick.{md,json}``.
    Checked on the refusal path (nothing runs): a file where ``runs/`` would be created makes the default
    unwritable, and the refusal names it."""
    guard = _CommittedGuard(RESULTS / "optimizer_memory_quick.md", RESULTS / "optimizer_memory_quick.json")
    monkeypatch.chdir(tmp_path)
    (tmp_path / "runs").write_text("")
    try:
        code = exit_code(om.main, ["--quick", "--sizes", "64x1", "--steps", "1", "--seq", "32"])
    finally:
        replaced = guard.changed()
    assert not replaced, f"the run replaced {replaced}"
    assert code == 2
    last = _one_error_line(capsys.readouterr().err)
    assert last.startswith(f"{PROG}: error: argument --out:"), last
    assert "runs/bench-optimizer-memory/optimizer_memory_quick.md cannot be written" in last


@pytest.mark.parametrize("argv, says", [
    (["--quick", "--out", "{file}/sub/x"], "is not a directory, so"),
    (["--quick", "--out", "{tmp}/dir"], "dir.md is a directory"),
    (["--render", "{binary}"], "not UTF-8"),
    (["--render", "{rowless}"], "its rows lack the measured numbers"),
])
def test_optimizer_memory_bad_output_or_render_is_one_line(om, tmp_path, capsys, argv, says):
    """An unwritable ``--out`` used to fail only after the whole run; a binary or malformed ``--render``
    JSON was a traceback."""
    plain = tmp_path / "plain"
    plain.write_text("")
    (tmp_path / "dir.md").mkdir()
    binary = tmp_path / "binary.json"
    binary.write_bytes(b"\xab\xcd\x00\xff")
    rowless = tmp_path / "rowless.json"
    rowless.write_text(json.dumps({"rows": [{}], "meta": {}}))
    before = sorted(p.name for p in tmp_path.iterdir())
    code = exit_code(om.main, [a.format(file=plain, tmp=tmp_path, binary=binary, rowless=rowless) for a in argv])
    assert code == 2
    last = _one_error_line(capsys.readouterr().err)
    assert last.startswith(f"{PROG}: error: argument --") and says in last, last
    assert sorted(p.name for p in tmp_path.iterdir()) == before, "a refused run left output behind"


# ---------------------------------------------------------------------------------------------------- sync_bytes
def test_sync_bytes_committed_command_writes_the_committed_table(sb):
    """The committed table's recorded command (more repeats, a baseline revision) and the plain run are the
    documented run."""
    command = next(line for line in (RESULTS / "sync_bytes.md").read_text().splitlines() if line.startswith("Command:"))
    args = sb.build_parser().parse_args(_command_args(command.split("`")[1]))
    assert args.repeats > sb.DEFAULT_REPEATS and args.baseline_rev
    assert sb.default_out(args) == RESULTS / "sync_bytes.md" == sb.COMMITTED
    assert sb.default_out(sb.build_parser().parse_args([])) == sb.COMMITTED


@pytest.mark.parametrize("argv", [
    ["--repeats", "1"], ["--threads", "1"], ["--ranks", "32"], ["--timing-rank", "8"], ["--big-dtypes", "float32"],
])
def test_sync_bytes_other_settings_write_elsewhere(sb, argv):
    assert sb.default_out(sb.build_parser().parse_args(argv)) == Path("runs/bench-sync-bytes/sync_bytes.md")


def test_sync_bytes_device_run_keeps_its_own_file(sb):
    assert sb.default_out(sb.build_parser().parse_args(["--device", "cpu"])) == Path(
        "benchmarks/results/sync_bytes_cpu.md")


def test_sync_bytes_small_run_is_routed_away_from_the_committed_table(sb, tmp_path, monkeypatch, capsys):
    """``--repeats 1`` (and fewer threads and dtypes) used to write ``benchmarks/results/sync_bytes.md``
    relative to the working directory: the committed table when run from the checkout."""
    guard = _CommittedGuard(RESULTS / "sync_bytes.md")
    monkeypatch.chdir(tmp_path)
    (tmp_path / "runs").write_text("")
    try:
        code = exit_code(sb.main, ["--repeats", "1", "--threads", "1", "--big-dtypes", "float32"])
    finally:
        replaced = guard.changed()
    assert not replaced, f"the run replaced {replaced}"
    assert code == 2
    last = _one_error_line(capsys.readouterr().err)
    assert "argument --out:" in last and "runs/bench-sync-bytes/sync_bytes.md cannot be written" in last, last
    assert not (tmp_path / "benchmarks").exists()


@pytest.mark.parametrize("argv, says", [
    (["--out", "{file}/x.md"], "argument --out: {file} is not a directory"),
    (["--out", "{tmp}"], "argument --out: {tmp} is a directory"),
    (["--timing-rank", "129", "--out", "{tmp}/x.md"], "argument --timing-rank: 129 is more than 128"),
    (["--device", "cpu", "--device-models", "big", "--timing-rank", "1025", "--out", "{tmp}/x.md"],
     "argument --timing-rank: 1025 is more than 1024"),
])
def test_sync_bytes_bad_values_are_one_line(sb, tmp_path, capsys, argv, says):
    """An unwritable ``--out`` used to fail after the timing loops; a timing rank above a target's input
    width ran (a 1 GiB delta for the tiny model) instead of being refused."""
    plain = tmp_path / "plain"
    plain.write_text("")
    code = exit_code(sb.main, [a.format(file=plain, tmp=tmp_path) for a in argv])
    assert code == 2
    last = _one_error_line(capsys.readouterr().err)
    assert says.format(file=plain, tmp=tmp_path) in last, last
    assert sorted(p.name for p in tmp_path.iterdir()) == ["plain"]


def test_why_unwritable(tmp_path):
    plain = tmp_path / "plain"
    plain.write_text("")
    assert why_unwritable(tmp_path / "new" / "deeper" / "x.md") is None
    assert why_unwritable(tmp_path / "new", directory=True) is None
    assert not (tmp_path / "new").exists(), "the check created a directory"
    assert why_unwritable(tmp_path) == f"{tmp_path} is a directory; give a file path"
    assert why_unwritable(plain, directory=True) == f"{plain} is not a directory"
    assert why_unwritable(plain / "x.md") == f"{plain} is not a directory, so {plain / 'x.md'} cannot be written"
    if Path("/proc/self").is_dir():  # no file can be created in /proc, even by root (os.access says yes to root)
        assert why_unwritable("/proc/nope/x.md") == "/proc is not a writable directory, so /proc/nope/x.md cannot be written"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["plain"]


# ---------------------------------------------------------------------------------------------------- bench paper
def _cfg(*argv: str) -> PaperBenchConfig:
    return config_from_args(bench_parser().parse_args(["paper", *argv]))


@pytest.mark.parametrize("argv, stem", [
    ([], "results"),
    (["--quick"], "results-quick"),
    (["--figures", "cosine"], "results-cosine"),
    (["--seeds", "1"], "results-seeds_1"),
    (["--seeds", "1", "2"], "results-seeds_1_2"),
    (["--rl-steps", "3"], "results-rl-steps_3"),  # the eval interval --rl-steps brings along is not named
    (["--quick", "--rl-steps", "10", "--figures", "kl", "memory"], "results-quick-rl-steps_10-memory-kl"),
    (["--quick", "--figures", "cosine", "memory", "--optimizers", "logra", "adam"],
     "results-quick-optimizers_logra_adam-memory-cosine"),
    (["--seeds", "1", "2", "--rl-steps", "3", "--kl-modes", "none", "k3", "--out-dir", "x", "--run-root", "y"],
     "results-seeds_1_2-rl-steps_3-kl-modes_none_k3"),
])
def test_paper_report_name_names_the_settings(argv, stem):
    cfg = _cfg(*argv)
    assert report_stem(cfg) == stem
    assert image_prefix(cfg) == ("" if stem == "results" else stem[len("results-"):] + "-")


def test_paper_custom_runs_of_different_settings_keep_both_reports(tmp_path):
    """Every custom run used to be ``results-custom`` (or ``results-quick-custom``): the second replaced the first."""
    runs = [_cfg("--seeds", "1", "--out-dir", str(tmp_path)), _cfg("--seeds", "2", "--out-dir", str(tmp_path)),
            _cfg("--quick", "--rl-steps", "10", "--out-dir", str(tmp_path)),
            _cfg("--quick", "--rl-steps", "12", "--out-dir", str(tmp_path))]
    paths = [write_report(cfg, f"report {i}\n", {"run": i}) for i, cfg in enumerate(runs)]
    assert len(set(paths)) == len(runs)
    assert len({image_prefix(cfg) for cfg in runs}) == len(runs)
    for i, (cfg, path) in enumerate(zip(runs, paths)):
        assert path.read_text() == f"report {i}\n"
        assert json.loads((tmp_path / "results" / f"{report_stem(cfg)}.json").read_text()) == {"run": i}


def test_paper_settings_set_through_the_api_are_named_and_long_ones_hashed():
    cfg = PaperBenchConfig.preset(True, memory_sizes=[(64, 1), (192, 2)], k3_coef=0.25)
    assert report_stem(cfg) == "results-quick-k3-coef_0.25-memory-sizes_64x1_192x2"
    many = [PaperBenchConfig.preset(True, seeds=list(range(1, 60))), PaperBenchConfig.preset(True, seeds=list(range(1, 61)))]
    stems = [report_stem(cfg) for cfg in many]
    assert stems[0] != stems[1]
    for stem in stems:
        assert stem.startswith("results-quick-custom-") and len(stem) <= len("results-quick-") + SETTINGS_NAME_LIMIT


def test_paper_render_only_finds_its_own_custom_run(tmp_path, capsys):
    """The JSON of a ``--rl-steps 10`` run re-renders with those flags; ``--rl-steps 12`` asks for its own run
    instead of finding the other one under a shared name."""
    (tmp_path / "results").mkdir()
    data = json.loads((ROOT / "docs" / "results" / "results-quick.json").read_text())
    data["config"]["rl_steps"] = 10
    data["command"] = "megatron-logra bench paper --quick --rl-steps 10"
    cfg = _cfg("--quick", "--rl-steps", "10", "--out-dir", str(tmp_path))
    (tmp_path / "results" / f"{report_stem(cfg)}.json").write_text(json.dumps(data))
    argv = ["paper", "--quick", "--render-only", "--out-dir", str(tmp_path)]
    assert exit_code(bench_main, argv + ["--rl-steps", "12"]) == 2
    err = capsys.readouterr().err
    assert "results-quick-rl-steps_12.json does not exist" in err and err.count("\n") == 1, err
    assert exit_code(bench_main, argv + ["--rl-steps", "10"]) == 0
    assert "--rl-steps 10" in (tmp_path / "results-quick-rl-steps_10.md").read_text()


@pytest.mark.parametrize("argv, says", [
    (["--figures", "cosine", "--out-dir", "{file}/sub"], "--out-dir: {file} is not a directory"),
    (["--figures", "cosine", "--out-dir", "{file}"], "--out-dir: {file} is not a directory"),
    (["--figures", "kl", "--kl-modes", "none", "--out-dir", "{tmp}/out", "--run-root", "{file}"],
     "--run-root: {file} is not a directory"),
])
def test_paper_unwritable_output_is_refused_before_running(tmp_path, capsys, argv, says):
    """A file (or unwritable directory) as ``--out-dir`` / ``--run-root`` used to fail with a traceback after
    the figures were computed."""
    plain = tmp_path / "plain"
    plain.write_text("")
    code = exit_code(bench_main, ["paper", "--quick", *[a.format(file=plain, tmp=tmp_path) for a in argv]])
    err = capsys.readouterr().err
    assert code == 2
    assert err.startswith(f"megatron-logra bench paper: error: {says.format(file=plain)}") and err.count("\n") == 1, err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["plain"]


# ----------------------------------------------------------------------------------------------------- memory CLI
@pytest.mark.parametrize("argv, flags", [
    (["--optimizer", "adam", "--rank", "8"], ["--rank"]),
    (["--optimizer", "adam", "--rank", "256"], ["--rank"]),  # the default's value, given: still refused
    (["--optimizer", "adam", "--masters", "none"], ["--masters"]),
    (["--optimizer", "adam", "--no-cache-projections"], ["--no-cache-projections"]),
    (["--optimizer", "adam", "--no-kl-control"], ["--no-kl-control"]),
    (["--optimizer", "adam", "--rank", "64", "--masters", "fp32"], ["--rank", "--masters"]),
])
def test_memory_logra_only_flags_with_adam_are_refused(capsys, argv, flags):
    """``--rank`` (and the other LoGRA-only flags) used to be ignored in silence by the dense AdamW plan."""
    with pytest.raises(SystemExit) as exc:
        memory_main(["--model", "qwen2.5-1.5b", *argv])
    assert exc.value.code == 2
    last = _one_error_line(capsys.readouterr().err)
    assert last.startswith("megatron-logra memory: error: "), last
    assert all(flag in last for flag in flags) and "--optimizer adam" in last and "--compare" in last, last


def test_memory_rank_with_compare_plans_that_rank(capsys):
    assert memory_main(["--model", "qwen2.5-1.5b", "--optimizer", "adam", "--compare", "--rank", "8", "--markdown"]) == 0
    out = capsys.readouterr().out
    assert "| per rank | dense AdamW | LoGRA r=8 |" in out
    assert memory_main(["--model", "qwen2.5-1.5b", "--markdown"]) == 0
    assert "LoGRA r=256" in capsys.readouterr().out  # the default rank
    assert memory_main(["--model", "qwen2.5-1.5b", "--optimizer", "adam", "--markdown"]) == 0
    assert "dense AdamW" in capsys.readouterr().out


def test_memory_negative_seq_len_names_its_flag(capsys):
    """Was ``--model qwen2.5-1.5b: model.seq_length=-1 ...``: the error named the wrong flag."""
    with pytest.raises(SystemExit) as exc:
        memory_main(["--model", "qwen2.5-1.5b", "--seq-len", "-1"])
    assert exc.value.code == 2
    assert _one_error_line(capsys.readouterr().err) == "megatron-logra memory: error: --seq-len: seq_len=-1 must be an integer >= 1"
