"""The shell tools run as documented: they parse, and ``tools/gpu_check.sh`` completes on a machine
without CUDA (the gpu-marked tests skip, the smoke benchmark is not started) and writes its report."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from support import forked

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("script", sorted((ROOT / "tools").glob("*.sh")), ids=lambda p: p.name)
def test_tool_scripts_parse(script):
    subprocess.run(["bash", "-n", str(script)], check=True, timeout=30)


def test_gpu_check_reports_without_cuda(tmp_path):
    import torch

    if torch.cuda.is_available():
        pytest.skip("this checks the CPU behaviour; on a GPU machine run the script itself")
    out = tmp_path / "report"
    env = dict(os.environ, PYTHON=sys.executable, TEST_TIMEOUT="120")
    proc = subprocess.run(["bash", str(ROOT / "tools" / "gpu_check.sh"), str(out), str(tmp_path / "no-wheels")],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert {p.name for p in out.iterdir()} == {"env.txt", "pytest.txt", "smoke.txt", "sync_apply.txt", "summary.txt"}
    report = (out / "env.txt").read_text()
    assert "torch" in report and "megatron.core" in report and "transformer_engine   missing" in report
    assert "mcore TE layer spec  NOT usable" in report  # without TE, megatron-core's TE spec is off
    # the reason comes from models.te (both of megatron-core's HAVE_TE flags), and pytest's presence is reported
    assert "NOT usable: transformer_engine is not installed" in report
    assert re.search(r"^pytest\s+\d", report, re.M), report
    # the package's own requirements, which a CUDA image may lack (tools/offline_wheels.sh does not fetch them)
    for module in ("transformers", "tokenizers", "safetensors", "yaml", "rich"):
        assert re.search(rf"^{module}\s+\S", report, re.M), report
    summary = (out / "summary.txt").read_text()
    assert "gpu-marked tests: exit 0 (-m 'gpu and not slow'" in summary and "skipped" in summary
    assert "deselected" in summary and "passed" not in summary  # the slow SGLang tests are left out
    assert "no CUDA device" in (out / "smoke.txt").read_text()
    assert "no CUDA device" in (out / "sync_apply.txt").read_text()
    assert "sync apply vs copy on the GPU: exit 0" in summary


SYNC_TIMING = """
import sys
sys.path.insert(0, {bench!r})
import sync_bytes
from megatron_logra.sync.synthetic import DenseShape
# the report is checked, not the timings: the "big" entry 13x smaller (15M parameters), its copy still some
# milliseconds, so the table's 2-decimal ms give the ratio to well within the 2% the test allows
sync_bytes.DEVICE_MODELS["big"] = ("hidden 512 x 2, ffn 1536, vocab 8000",
                                   DenseShape(hidden=512, layers=2, heads=8, kv_heads=2, ffn=1536, vocab=8000))
sys.exit(sync_bytes.main())
"""


def test_sync_timing_device_mode_runs_and_reports_the_ratio(tmp_path):
    """``benchmarks/sync_bytes.py --device`` (what gpu_check.sh runs with cuda) on the CPU, one repeat; without
    ``--out`` it writes ``results/sync_bytes_<device>.md``, never the committed CPU tables. Its own process (forked
    warm where it can be), with the ``big`` model of ``--device-models`` shrunk: the rows and ratios are checked,
    not the time of a 190M-parameter apply."""
    out = tmp_path / "benchmarks" / "results" / "sync_bytes_cpu.md"
    proc = forked.python(["-c", SYNC_TIMING.format(bench=str(ROOT / "benchmarks")), "--device", "cpu",
                          "--repeats", "1", "--big-dtypes", "float32,bfloat16", "--device-models", "big",
                          "--timing-rank", "8"],
                         env=dict(os.environ, PYTHONPATH=str(ROOT)), cwd=tmp_path, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert out.exists() and not (out.parent / "sync_bytes.md").exists()
    lines = out.read_text().splitlines()
    header = [c.strip() for c in next(line for line in lines if line.startswith("| model")).strip("|").split("|")]
    rows = [dict(zip(header, (c.strip() for c in line.strip("|").split("|"))))
            for line in lines if line.startswith("| hidden") or line.startswith("| Qwen")]
    # bf16 is timed with both merge roundings (stochastic: the training default)
    assert [(r["params"].split()[-1], r["bf16 rounding"]) for r in rows] == [
        ("float32", "-"), ("bfloat16", "nearest"), ("bfloat16", "stochastic")]
    for row in rows:
        apply_ms, copy_ms = float(row["apply ms"]), float(row["copy all ms (copy bandwidth)"].split()[0])
        ratio = float(row["apply / copy"].strip("*x"))
        assert apply_ms > 0 and copy_ms > 0 and abs(ratio - apply_ms / copy_ms) < 0.02 * ratio + 0.01


STUB_PYTHON = """#!/usr/bin/env bash
# records each call's arguments (one per line, then ---); "-c" is gpu_check.sh's CUDA probe: CUDA present
printf '%s\\n' "$@" --- >> "$(dirname "$0")/calls.txt"
exit 0
"""


def _stub_checkout(tmp_path, *paths):
    """A copy of gpu_check.sh in a tree holding only ``paths``, and a PYTHON that records its calls and
    reports CUDA: the script's control flow in well under a second, without torch."""
    root = tmp_path / "repo"
    (root / "tools").mkdir(parents=True)
    (root / "tools" / "gpu_check.sh").write_text((ROOT / "tools" / "gpu_check.sh").read_text())
    for rel in paths:
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        if rel.endswith(".py"):
            (root / rel).write_text("")
        else:
            (root / rel).mkdir()
    py = tmp_path / "bin" / "python"
    py.parent.mkdir()
    py.write_text(STUB_PYTHON)
    py.chmod(0o755)
    return root, py


def test_gpu_check_names_a_file_missing_from_the_image(tmp_path):
    """An image built without benchmarks/ used to fail the sync step with a bare exit status."""
    root, py = _stub_checkout(tmp_path, "tests/gpu", "tools/gpu_smoke.py")
    out = tmp_path / "report"
    proc = subprocess.run(["bash", str(root / "tools" / "gpu_check.sh"), str(out), str(tmp_path / "no-wheels")],
                          env=dict(os.environ, PYTHON=str(py)), capture_output=True, text=True, timeout=60)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    summary = (out / "summary.txt").read_text()
    assert "gpu-marked tests: exit 0" in summary and "smoke benchmark: exit 0" in summary
    assert "sync apply vs copy on the GPU: exit 1 (MISSING: benchmarks/sync_bytes.py)" in summary
    assert "MISSING: benchmarks/sync_bytes.py" in (out / "sync_apply.txt").read_text()
    calls = (py.parent / "calls.txt").read_text()
    assert "tools/gpu_smoke.py" in calls and "benchmarks/sync_bytes.py" not in calls


def _stub_run(tmp_path, **env):
    """gpu_check.sh over a complete stub tree: (exit status, summary, the stub's calls as argument lists)."""
    root, py = _stub_checkout(tmp_path, "tests/gpu", "tools/gpu_smoke.py", "benchmarks/sync_bytes.py")
    out = tmp_path / "report"
    ours = ("GPU_CHECK_SLOW", "CHECK_BUDGET", "TEST_TIMEOUT", "SMOKE_TIMEOUT", "SYNC_TIMEOUT")
    base = {k: v for k, v in os.environ.items() if k not in ours}
    proc = subprocess.run(["bash", str(root / "tools" / "gpu_check.sh"), str(out), str(tmp_path / "no-wheels")],
                          env=dict(base, PYTHON=str(py), **env), capture_output=True, text=True, timeout=60)
    calls = [c.strip("\n").split("\n") for c in (py.parent / "calls.txt").read_text().split("---\n") if c.strip()]
    return proc.returncode, (out / "summary.txt").read_text(), calls


def _pytest_markers(calls):
    (call,) = [c for c in calls if c[:2] == ["-m", "pytest"]]
    return call[call.index("-m", 2) + 1]


def test_gpu_check_leaves_the_slow_gpu_tests_out_unless_asked(tmp_path):
    """The slow SGLang tests (HTTP servers, RL runs: several engine starts) do not fit the default run's
    10 minutes; GPU_CHECK_SLOW=1 adds them with a longer budget."""
    rc, summary, calls = _stub_run(tmp_path / "default")
    assert rc == 0, summary
    assert _pytest_markers(calls) == "gpu and not slow"
    assert "gpu-marked tests: exit 0 (-m 'gpu and not slow', limit 360s)" in summary
    assert "smoke benchmark: exit 0 (limit 240s)" in summary and "CHECK_BUDGET=540s" in summary
    rc, summary, calls = _stub_run(tmp_path / "slow", GPU_CHECK_SLOW="1")
    assert rc == 0 and _pytest_markers(calls) == "gpu"
    assert "(-m 'gpu', limit 1800s)" in summary and "CHECK_BUDGET=2100s" in summary


def test_gpu_check_stages_share_one_budget(tmp_path):
    """Each stage runs under its own limit or what is left of CHECK_BUDGET, whichever is less; a stage
    that finds the budget spent is reported as not run and the check fails."""
    rc, summary, _ = _stub_run(tmp_path / "short", CHECK_BUDGET="100")
    assert rc == 0
    limits = [int(x) for x in re.findall(r"limit (\d+)s", summary)]
    assert len(limits) == 3 and all(95 <= x <= 100 for x in limits), summary
    rc, summary, calls = _stub_run(tmp_path / "spent", CHECK_BUDGET="5")
    assert rc == 1
    assert summary.count("not run: CHECK_BUDGET=5s spent") == 3, summary
    assert not [c for c in calls if c[:2] == ["-m", "pytest"] or "tools/gpu_smoke.py" in c]


def test_gpu_check_paths_are_relative_to_where_it_is_run(tmp_path):
    """``bash tools/gpu_check.sh OUT WHEELS`` run from another directory (the wheelhouse copied beside the
    checkout, as tools/offline_wheels.sh says): both name paths there. They were taken relative to the checkout,
    so the report landed inside it and the wheels were skipped without a word."""
    root, py = _stub_checkout(tmp_path, "tests/gpu", "tools/gpu_smoke.py", "benchmarks/sync_bytes.py")
    here = tmp_path / "here"
    (here / "wheels").mkdir(parents=True)
    (here / "wheels" / "x-1.0-py3-none-any.whl").write_text("")
    proc = subprocess.run(["bash", str(root / "tools" / "gpu_check.sh"), "report", "wheels"], cwd=here,
                          env=dict(os.environ, PYTHON=str(py)), capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert (here / "report" / "summary.txt").is_file() and not (root / "report").exists()
    calls = [c.strip("\n").split("\n") for c in (py.parent / "calls.txt").read_text().split("---\n") if c.strip()]
    (install,) = [c for c in calls if c[:3] == ["-m", "pip", "install"]]
    assert str(here / "wheels" / "x-1.0-py3-none-any.whl") in install


def test_gpu_check_says_when_the_named_wheel_dir_is_missing(tmp_path):
    root, py = _stub_checkout(tmp_path, "tests/gpu", "tools/gpu_smoke.py", "benchmarks/sync_bytes.py")
    proc = subprocess.run(["bash", str(root / "tools" / "gpu_check.sh"), str(tmp_path / "out"), "nowhere"],
                          cwd=tmp_path, env=dict(os.environ, PYTHON=str(py)), capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode == 0 and f"WHEEL_DIR {tmp_path / 'nowhere'} does not exist" in proc.stderr
    calls = (py.parent / "calls.txt").read_text()
    assert "--target" not in calls
