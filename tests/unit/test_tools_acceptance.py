"""The scripts under ``tools/`` and ``benchmarks/`` as a user runs them: a bad value is a one-line
``error:`` naming the argument (exit status 2, no traceback, nothing written) before any work starts;
a smoke test that cannot run here says why and exits non-zero instead of reporting success; a run of
other settings never replaces a committed results table; every command line the READMEs show for
these scripts parses.

Most scripts run as ``__main__`` in this process (``runpy``, their own ``sys.argv``): an exception that
escapes is the traceback a user would see, and no interpreter start-up is paid per case.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import re
import runpy
import shlex
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
from support import forked
from support.docs import doc_pages
from support.scripts import run_script

ROOT = Path(__file__).resolve().parents[2]


def _load(rel: str):
    """A script as a module (not run as ``__main__``)."""
    spec = importlib.util.spec_from_file_location(f"_acceptance_{Path(rel).stem}", ROOT / rel)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# (script, arguments, what the error line names); {tmp} is the test's directory, {file} a plain file in it
BAD = [
    ("tools/sglang_rollout_smoke.py", ["--steps", "0"], "--steps"),
    ("tools/sglang_rollout_smoke.py", ["--recipe", "no-such-recipe"], "--recipe"),
    ("tools/sglang_rollout_smoke.py", ["--max-logprob-gap", "nan"], "--max-logprob-gap"),
    ("tools/sglang_sync_smoke.py", ["--hidden", "0"], "--hidden"),
    ("tools/sglang_sync_smoke.py", ["--heads", "5"], "--kv-heads"),
    ("tools/sglang_sync_smoke.py", ["--rank", "5000"], "--rank"),
    ("tools/fuzz_sync_codec.py", ["--messages", "0"], "--messages"),
    ("tools/fuzz_sync_codec.py", ["--max-seconds", "0", "--messages", "2"], "--max-seconds"),
    ("tools/fuzz_sync_codec.py", ["--dump", "{file}", "--messages", "2"], "--dump"),
    ("tools/memory_stress.py", ["--heads", "0", "--dry-run", "--out", "{tmp}/ms"], "--heads"),
    ("tools/memory_stress.py", ["--ffn", "0", "--dry-run", "--out", "{tmp}/ms"], "--ffn"),
    ("tools/memory_stress.py", ["--dry-run", "--out", "{file}"], "--out"),
    ("benchmarks/rl_parity.py", ["--steps", "0", "--run-root", "{tmp}/rlp"], "--steps"),
    ("benchmarks/rl_parity.py", ["--seeds", "1", "1", "--steps", "1", "--run-root", "{tmp}/rlp"], "--seeds"),
    ("benchmarks/rl_parity.py", ["--seeds", "-1", "--steps", "1", "--run-root", "{tmp}/rlp"], "--seeds"),
    ("benchmarks/bf16_rounding.py", ["--lr", "-1", "--steps", "1", "--run-root", "{tmp}/bf16"], "--lr"),
    # small settings: without the check they run for seconds, then fail writing the report
    ("benchmarks/refit_memory.py", ["--sizes", "64x1", "--repeats", "1", "--out", "{tmp}"], "--out"),
    ("benchmarks/logprob_memory.py", ["--shapes", "4x8", "--chunks", "2", "--out", "{tmp}"], "--out"),
]


@pytest.mark.parametrize("script, args, names", BAD, ids=[f"{Path(s).stem}:{' '.join(a)}" for s, a, _ in BAD])
def test_bad_argument_is_a_one_line_usage_error(script, args, names, tmp_path, monkeypatch, capsys):
    plain = tmp_path / "plain-file"
    plain.write_text("")
    code, out, err = run_script(script, [a.format(tmp=tmp_path, file=plain) for a in args], monkeypatch, capsys)
    assert code == 2, out[-2000:] + err[-2000:]
    assert "Traceback" not in err, err[-3000:]
    last = err.strip().splitlines()[-1]
    assert last.startswith(f"{Path(script).name}: error:") and names in last, err[-2000:]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["plain-file"], "a refused run left output behind"


@pytest.mark.parametrize("script", ["tools/sglang_rollout_smoke.py", "tools/sglang_sync_smoke.py"])
def test_sglang_smoke_without_sglang_says_so_and_fails(script, monkeypatch, capsys):
    """Without SGLang the smoke tests used to print 'nothing to do' and exit 0, a pass that checked nothing."""
    if importlib.util.find_spec("sglang") is not None:
        pytest.skip("SGLang is installed here")
    code, out, err = run_script(script, [], monkeypatch, capsys)
    assert code == 3, out[-2000:] + err[-2000:]
    assert "Traceback" not in err
    last = err.strip().splitlines()[-1]
    assert "SGLang is not installed" in last and "nothing was checked" in last, err


STUB_PYTHON = """#!/usr/bin/env bash
# gpu_check.sh's interpreter: records each call; "-c import torch" succeeds, any other "-c" is its CUDA probe,
# answered "no CUDA"
printf '%s\\n' "$@" --- >> "$(dirname "$0")/calls.txt"
[[ "$1" == -c && "$2" == "import torch" ]] && exit 0
[[ "$1" == -c ]] && exit 1
exit 0
"""


def test_gpu_check_without_cuda_says_nothing_was_checked_on_a_gpu(tmp_path):
    """On a machine without CUDA gpu_check.sh exits 0; its summary must say that no GPU was checked."""
    root = tmp_path / "repo"
    for rel in ("tools/gpu_check.sh", "tools/gpu_smoke.py", "benchmarks/sync_bytes.py"):
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text((ROOT / rel).read_text() if rel.endswith(".sh") else "")
    (root / "tests" / "gpu").mkdir(parents=True)
    py = tmp_path / "bin" / "python"
    py.parent.mkdir()
    py.write_text(STUB_PYTHON)
    py.chmod(0o755)
    out = tmp_path / "report"
    env = {k: v for k, v in os.environ.items() if k not in ("GPU_CHECK_SLOW", "CHECK_BUDGET")}
    proc = subprocess.run(["bash", str(root / "tools" / "gpu_check.sh"), str(out), str(tmp_path / "no-wheels")],
                          env=dict(env, PYTHON=str(py)), capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    summary = (out / "summary.txt").read_text()
    assert summary.startswith("NO CUDA DEVICE: nothing was checked on a GPU"), summary
    assert "smoke benchmark: exit 0 (no CUDA device: not run)" in summary
    assert "tools/gpu_smoke.py" not in (py.parent / "calls.txt").read_text()


def test_refit_memory_of_other_sizes_leaves_the_committed_table(tmp_path):
    """A run of other settings used to write ``benchmarks/results/refit_memory.md`` (relative to the working
    directory: the committed table when run from the checkout)."""
    committed = ROOT / "benchmarks" / "results" / "refit_memory.md"
    before = committed.read_bytes()
    proc = forked.python([str(ROOT / "benchmarks" / "refit_memory.py"), "--sizes", "64x1", "--repeats", "1"],
                         cwd=tmp_path, timeout=300, env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert committed.read_bytes() == before
    assert not (tmp_path / "benchmarks").exists()
    report = (tmp_path / "runs" / "bench-refit-memory" / "refit_memory.md").read_text()
    assert report.startswith("Command: `python benchmarks/refit_memory.py --sizes 64x1 --repeats 1`\n"), report
    assert "| hidden 64 x 1 |" in report


def test_refit_memory_documented_run_writes_the_committed_table():
    mod = _load("benchmarks/refit_memory.py")
    assert mod.parse_sizes(mod.DEFAULT_SIZES) == [(512, 4), (1024, 8)] and mod.DEFAULT_REPEATS == 3
    assert mod.COMMITTED == ROOT / "benchmarks" / "results" / "refit_memory.md"


def test_logprob_memory_report_goes_to_results_only_for_the_documented_run(tmp_path, monkeypatch, capsys):
    """Only the documented shapes/chunks/threads may write ``results/logprob_memory.md`` by default; a
    smaller run used to replace it. Checked on the refusal path (no benchmark runs): ``--out`` unset and
    its default's directory unwritable names that default."""
    mod = _load("benchmarks/logprob_memory.py")
    assert mod.COMMITTED == ROOT / "benchmarks" / "results" / "logprob_memory.md"
    assert (mod.DEFAULT_SHAPES, mod.DEFAULT_CHUNKS, mod.DEFAULT_THREADS) == ("4096x32768,4096x151936", "256,1024,0", 1)
    monkeypatch.chdir(tmp_path)
    (tmp_path / "runs").write_text("")  # a file where runs/ would be created: the default is named in the refusal
    monkeypatch.setattr(sys, "argv", ["logprob_memory.py", "--shapes", "4x8", "--chunks", "2"])
    with pytest.raises(SystemExit) as exc:
        mod.main(["--shapes", "4x8", "--chunks", "2"])
    assert exc.value.code == 2
    assert "runs/bench-logprob-memory/logprob_memory.md cannot be written" in capsys.readouterr().err


class _Parsed(Exception):
    """Raised right after a script's ``parse_args`` succeeded."""


def _readme_commands() -> list[tuple[str, list[str]]]:
    """``python tools/X.py ...`` / ``python benchmarks/X.py ...`` command lines of the READMEs and docs/: inline code
    and code blocks, optional ``[...]`` parts taken as given, placeholders filled in."""
    found = []
    for doc in (*doc_pages(), ROOT / "benchmarks" / "README.md", ROOT / "docker" / "README.md"):
        for m in re.finditer(r"python ((?:tools|benchmarks)/\w+\.py)([^`\n#]*)", doc.read_text()):
            rest = m.group(2).replace("[", " ").replace("]", " ").replace("overrides...", "")
            rest = rest.split(";")[0].split("|")[0]
            words = [w for w in shlex.split(rest) if w not in ("...",)]
            words = [{"DIR": "/tmp/x", "FILE": "/tmp/x.md", "STEM": "/tmp/x", "REV": "HEAD"}.get(w, w) for w in words]
            found.append((m.group(1), words))
    return sorted(set((s, tuple(a)) for s, a in found))


README_COMMANDS = _readme_commands()


@pytest.mark.parametrize("script, args", README_COMMANDS, ids=[f"{s} {' '.join(a)}" for s, a in README_COMMANDS])
def test_readme_command_lines_parse(script, args, monkeypatch, capsys):
    assert (ROOT / script).is_file(), f"the documentation names {script}, which does not exist"
    original = argparse.ArgumentParser.parse_args

    def parse_then_stop(self, *a, **kw):
        original(self, *a, **kw)
        raise _Parsed

    monkeypatch.setattr(argparse.ArgumentParser, "parse_args", parse_then_stop)
    monkeypatch.chdir(ROOT)
    monkeypatch.setattr(sys, "argv", [str(ROOT / script), *args])
    monkeypatch.setattr(sys, "path", list(sys.path))
    with warnings.catch_warnings(), pytest.raises(_Parsed):
        runpy.run_path(str(ROOT / script), run_name="__main__")
    assert "error:" not in capsys.readouterr().err


def test_readme_names_the_commands_it_quotes():
    """The extraction above finds the labelled benchmark commands (so the parse test covers them)."""
    scripts = {s for s, _ in README_COMMANDS}
    assert {"benchmarks/rl_parity.py", "benchmarks/sync_bytes.py", "benchmarks/bf16_rounding.py",
            "benchmarks/optimizer_memory.py", "benchmarks/logprob_memory.py", "tools/gpu_smoke.py",
            "tools/fuzz_sync_codec.py"} <= scripts
    assert ("benchmarks/rl_parity.py", ("--seeds", "1", "2", "3", "--steps", "120")) in README_COMMANDS


def test_make_warm_start_replaces_the_asset_whole_and_leaves_no_scratch(tmp_path):
    """``tools/make_warm_start.py`` trains in a scratch directory of its own (it used ``runs/.make_warm_start``
    under the working directory, which it deleted) and moves the three outputs into ``--out`` only once all are
    written; other files of ``--out`` stay. The result loads as the tiny recipe's warm start."""
    import json as _json

    from safetensors import safe_open

    out = tmp_path / "asset"
    out.mkdir()
    (out / "model.safetensors").write_bytes(b"old")
    (out / "tokenizer").mkdir()
    (out / "tokenizer" / "stale.json").write_text("{}")
    (out / "README").write_text("kept")
    (tmp_path / "runs" / ".make_warm_start").mkdir(parents=True)  # a directory of the user's, never touched
    (tmp_path / "runs" / ".make_warm_start" / "mine").write_text("mine")
    proc = forked.python([str(ROOT / "tools" / "make_warm_start.py"), "--steps", "2", "--out", str(out),
                          "task.num_eval=4"], cwd=tmp_path, timeout=600, env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert sorted(p.name for p in out.iterdir()) == ["README", "info.json", "model.safetensors", "tokenizer"]
    assert not (out / "tokenizer" / "stale.json").exists() and (out / "README").read_text() == "kept"
    assert _json.loads((out / "info.json").read_text())["steps"] == 2
    with safe_open(str(out / "model.safetensors"), "pt") as f:
        assert len(list(f.keys())) > 0
    assert (tmp_path / "runs" / ".make_warm_start" / "mine").read_text() == "mine"
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".asset.")]  # no staging left
