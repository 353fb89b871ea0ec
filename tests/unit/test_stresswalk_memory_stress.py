"""tools/memory_stress.py used hard on the CPU: each misuse or mishap ends with one ``error:`` line, no traceback.

* ``--tp 2`` in one process (no torchrun) is refused naming ``--tp`` before any process group is made (it was a
  ValueError traceback from ``initialize_parallel``);
* Ctrl-C mid-run ends with exit status 130 and one line, and the steps measured so far are written (it was a
  traceback and no CSV);
* an allocation that fails ends with one line naming the size flags and the planner's peak, and the steps measured
  so far are written (it was the allocator's traceback);
* a CPU run whose planned peak exceeds the host's available memory is refused before anything is built (the
  kernel's OOM killer would end it without a word);
* ``--out ''`` is refused (it wrote into the working directory).
"""

from __future__ import annotations

import csv
import importlib.util
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
TOOL = ROOT / "tools" / "memory_stress.py"
TINY = ["--hidden", "64", "--heads", "4", "--layers", "2", "--vocab", "512", "--seq-len", "64", "--micro-batch", "2",
        "--rank", "8", "--chunk-tokens", "48"]


def _tool():
    spec = importlib.util.spec_from_file_location("memory_stress_tool", TOOL)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _planned_peak(**over) -> int:
    """The planner's trainer peak of TINY's LoGRA step, planned here from the sizes (not read from the tool)."""
    from megatron_logra.memory import PlanConfig, plan
    from megatron_logra.models.gpt import ModelConfig

    model = ModelConfig(num_layers=2, hidden_size=64, num_attention_heads=4, ffn_hidden_size=128, vocab_size=512,
                        seq_length=64, params_dtype="bfloat16", swiglu=True)
    cfg = dict(rank=8, micro_batch=2, seq_len=64, distributed_optimizer=False, overhead_bytes=0,
               logprob_chunk_tokens=48, policy_sync=False, scaled_native_step=False)
    cfg.update(over)
    return plan(model, PlanConfig(**cfg)).worst.trainer_peak


def _error_line(capsys) -> str:
    err = capsys.readouterr().err
    assert "Traceback" not in err, err
    return err.strip().splitlines()[-1]


@pytest.fixture
def one_process(monkeypatch):
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
              "MEGATRON_LOGRA_TRACEBACK"):
        monkeypatch.delenv(k, raising=False)


def test_tp_that_does_not_divide_one_process_names_tp(one_process, tmp_path, capsys):
    tool = _tool()
    with pytest.raises(SystemExit) as exc:
        tool.main([*TINY, "--tp", "2", "--device", "cpu", "--steps", "1", "--out", str(tmp_path)])
    assert exc.value.code == 2
    line = _error_line(capsys)
    assert line.startswith("memory_stress.py: error: --tp=2") and "world size 1" in line, line
    assert not (tmp_path / "memory_stress.csv").exists()


def test_empty_out_is_refused(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as exc:
        _tool().main([*TINY, "--dry-run", "--out", ""])
    assert exc.value.code == 2
    assert _error_line(capsys).startswith("memory_stress.py: error: --out=")
    assert list(tmp_path.iterdir()) == []


def test_available_bytes_agrees_with_psutil():
    psutil = pytest.importorskip("psutil")
    from megatron_logra.memory.stress_setup import available_bytes

    have, ref = available_bytes(), psutil.virtual_memory().available
    assert have is not None and 0 < have <= ref * 1.1, (have, ref)


def test_cpu_run_planned_past_available_memory_is_refused_before_building(one_process, monkeypatch, tmp_path, capsys):
    import megatron_logra.memory.stress_setup as setup

    peak = _planned_peak()
    monkeypatch.setattr(setup, "available_bytes", lambda: peak - 1)  # one byte short of LoGRA's planned peak
    tool = _tool()
    monkeypatch.setattr(tool, "run_kind", lambda *a, **k: pytest.fail("a step ran"))
    with pytest.raises(SystemExit) as exc:
        tool.main([*TINY, "--optimizers", "logra", "--device", "cpu", "--out", str(tmp_path)])
    assert exc.value.code == 2
    line = _error_line(capsys)
    assert f"{peak / 2 ** 30:.2f} GiB" in line and "--hidden" in line and "--seq-len" in line, line


def test_failed_allocation_is_one_line_and_keeps_the_measured_steps(one_process, monkeypatch, tmp_path, capsys):
    import torch.distributed as dist

    import megatron_logra.memory.stress_setup as setup
    import megatron_logra.parallel as parallel

    monkeypatch.setattr(setup, "available_bytes", lambda: None)
    for name in ("init_distributed", "destroy_parallel"):
        monkeypatch.setattr(parallel, name, lambda *a, **k: None)
    monkeypatch.setattr(parallel, "initialize_parallel", lambda *a, **k: object())
    monkeypatch.setattr(dist, "get_world_size", lambda *a, **k: 1)
    monkeypatch.setattr(dist, "get_rank", lambda *a, **k: 0)
    tool = _tool()

    def run_kind(kind, mcfg, args, device, world, groups, into=None):
        # one step measured, then the CPU allocator's own error on the second
        into.append({"optimizer": kind, "step": 1, "device": "cpu", "world": 1, "tp": 1, "tokens_per_step": 128,
                     "live_tensor_peak_bytes": 1000, "predicted_peak_bytes": 2000,
                     "predicted_optimizer_state_bytes": 10})
        raise RuntimeError("[enforce fail at alloc_cpu.cpp:127] err == 0. DefaultCPUAllocator: can't allocate "
                           "memory: you tried to allocate 262144000 bytes. Error code 12 (Cannot allocate memory)")

    monkeypatch.setattr(tool, "run_kind", run_kind)
    code = tool.main([*TINY, "--optimizers", "logra", "--device", "cpu", "--out", str(tmp_path)])
    assert code == 1
    line = _error_line(capsys)
    assert line.startswith("memory_stress.py: error: out of memory at logra step 2"), line
    assert f"{_planned_peak() / 2 ** 30:.2f} GiB" in line and "--micro-batch" in line, line
    with open(tmp_path / "memory_stress.csv", newline="") as f:
        assert [(r["optimizer"], r["step"]) for r in csv.DictReader(f)] == [("logra", "1")]


def test_ctrl_c_mid_run_writes_the_measured_steps(tmp_path):
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "MEGATRON_LOGRA_TRACEBACK")}
    env.update(OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    log = tmp_path / "stderr.txt"
    out = tmp_path / "out"
    with open(log, "w") as err:
        proc = subprocess.Popen([sys.executable, str(TOOL), "--device", "cpu", *TINY, "--no-track-tensors",
                                 "--optimizers", "logra", "--steps", "100000", "--out", str(out)], cwd=ROOT, env=env,
                                stdout=subprocess.PIPE, stderr=err, text=True,
                                preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
        try:
            deadline = time.monotonic() + 240
            while "logra step 2:" not in log.read_text() and proc.poll() is None and time.monotonic() < deadline:
                time.sleep(0.2)
            assert proc.poll() is None, log.read_text()[-3000:]
            proc.send_signal(signal.SIGINT)
            stdout, _ = proc.communicate(timeout=120)
        finally:
            if proc.poll() is None:
                proc.kill()
    text = log.read_text()
    assert proc.returncode == 130, text[-3000:]
    assert "Traceback" not in text, text[-3000:]
    last = text.strip().splitlines()[-1]
    assert last.startswith("memory_stress.py: error: interrupted (Ctrl-C, SIGINT) at logra step"), last
    measured = len(re.findall(r"^memory_stress: logra step \d+:", text, flags=re.M))  # the tool's own log lines
    with open(out / "memory_stress.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    assert len(rows) == measured >= 2 and [int(r["step"]) for r in rows] == list(range(1, measured + 1))
    assert f"{measured} measured step(s)" in last and "interrupted" in stdout
