"""The launch lines the documentation gives are accepted by the real command line: every ``megatron-logra
train|config`` and ``torchrun ... -m megatron_logra.cli train`` line of README.md and docs/gpu.md, and what each
GPU launcher (``examples/train_*.sh``) hands torchrun, run as ``megatron-logra config`` with the same recipe,
flags and overrides (``config`` refuses what ``train`` refuses before building anything). Paths to a checkpoint
or a JSONL file become small ones written here; ``--resume`` lines need a run and are left to the resume tests."""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import subprocess
from pathlib import Path

import pytest

from megatron_logra.cli import main
from support.docs import README, ROOT
from support.run_fixtures import tiny_llama_dir

pytestmark = pytest.mark.usefixtures("one_process")

GPU_DOC = ROOT / "docs" / "gpu.md"
LAUNCHERS = {"train_1.5b_1gpu.sh": {}, "train_27b_8gpu.sh": {},
             "train_7b_multinode.sh": {"NNODES": "2", "NODE_RANK": "0", "MASTER_ADDR": "10.0.0.1"},
             "train_tiny_tp2.sh": {}, "train_tiny_pp2_dp2.sh": {}}


@pytest.fixture
def one_process(monkeypatch):
    for name in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "MEGATRON_LOGRA_TRACEBACK"):
        monkeypatch.delenv(name, raising=False)


def _documented(page: Path) -> list[str]:
    """Command lines of the page's ``bash`` blocks that start a training run (comments cut)."""
    lines = []
    for block in re.findall(r"```bash\n(.*?)```", page.read_text(), re.S):
        for line in block.replace("\\\n", " ").splitlines():
            line = line.split("  #")[0].strip()
            if re.match(r"(\.venv/bin/)?megatron-logra (train|config)\b|torchrun .* -m megatron_logra\.cli train", line) \
                    and "--resume" not in line:
                lines.append(line)
    return lines


def _config_argv(line: str, hf: Path, jsonl: Path) -> list[str]:
    """``line``'s arguments after ``train`` / ``config``, with /ckpt/... and /data/... paths replaced."""
    words = shlex.split(line)
    words = words[next(i for i, w in enumerate(words) if w in ("train", "config")) + 1:]
    words = [re.sub(r"^/ckpt/[^\s]+$", str(hf), w) for w in words]
    return [re.sub(r"jsonl:/data/\S+", f"jsonl:{jsonl}", w) for w in words]


@pytest.fixture
def inputs(tmp_path):
    hf = tiny_llama_dir(tmp_path, tokenizer=True)
    config = json.loads((hf / "config.json").read_text())  # eight heads of each kind: TP 8 shards it
    config.update(num_attention_heads=8, num_key_value_heads=8, intermediate_size=128)
    (hf / "config.json").write_text(json.dumps(config))
    jsonl = tmp_path / "math.jsonl"
    jsonl.write_text("".join(json.dumps({"prompt": f"{i}+1=", "answer": str(i + 1)}) + "\n" for i in range(4)))
    return hf, jsonl


def test_the_pages_have_launch_lines():
    assert len(_documented(README)) >= 9 and any("qwen2.5-1.5b" in line for line in _documented(README))


@pytest.mark.parametrize("line", _documented(README) + _documented(GPU_DOC))
def test_documented_line_is_accepted(line, inputs, capsys, monkeypatch, tmp_path):
    monkeypatch.chdir(ROOT)  # examples/tiny.yaml is named from the checkout
    argv = _config_argv(line, *inputs)
    code = main(["config", *argv])
    err = capsys.readouterr().err
    assert code == 0, f"{line}\n{err}"


@pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash")
@pytest.mark.parametrize("script", sorted(LAUNCHERS))
def test_launcher_arguments_are_accepted(script, inputs, tmp_path, capsys, monkeypatch):
    """The launcher's torchrun line (torchrun a stub that prints it) read back as ``config`` arguments."""
    stub = tmp_path / "bin"
    stub.mkdir()
    (stub / "torchrun").write_text('#!/bin/sh\nprintf "%s\\n" "$@"\n')
    (stub / "torchrun").chmod(0o755)
    env = {k: v for k, v in os.environ.items() if k not in ("IMPL", "FP8")}
    env.update(PATH=f"{stub}{os.pathsep}{env.get('PATH', '')}", HF_PATH=str(inputs[0]), **LAUNCHERS[script])
    proc = subprocess.run(["bash", str(ROOT / "examples" / script)], env=env, capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode == 0, proc.stderr
    words = proc.stdout.splitlines()
    assert words[words.index("-m") + 1] == "megatron_logra.cli" and words[words.index("-m") + 2] == "train"
    argv = words[words.index("-m") + 3:]
    monkeypatch.chdir(tmp_path)
    assert main(["config", *argv]) == 0, capsys.readouterr().err
