"""The launch lines the documentation gives are accepted by the real command line: every ``megatron-logra
train|config`` and ``torchrun ... -m megatron_logra.cli train`` line of README.md and every docs/*.md page, and what each
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
from support.docs import DOCS, README, ROOT
from support.run_fixtures import tiny_llama_dir

pytestmark = pytest.mark.usefixtures("one_process")

LAUNCHERS = {"train_1.5b_1gpu.sh": {}, "train_27b_8gpu.sh": {},
             "train_7b_multinode.sh": {"NNODES": "2", "NODE_RANK": "0", "MASTER_ADDR": "10.0.0.1"},
             "train_tiny_tp2.sh": {}, "train_tiny_pp2_dp2.sh": {},
             "train_slime_args.sh": {"DATA": "{slime_jsonl}"}}


@pytest.fixture
def one_process(monkeypatch):
    for name in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "MEGATRON_LOGRA_TRACEBACK"):
        monkeypatch.delenv(name, raising=False)


def _documented(page: Path) -> list[str]:
    """Command lines of the page's ``bash`` blocks that start a training run (comments cut; lines ending in
    ``...`` are sketches)."""
    lines = []
    for block in re.findall(r"```bash\n(.*?)```", page.read_text(), re.S):
        for line in block.replace("\\\n", " ").splitlines():
            line = line.split("  #")[0].strip()
            if re.search(r"(^|\s)(\.venv/bin/)?megatron-logra (train|config)\b|-m megatron_logra\.cli train\b", line) \
                    and "--resume" not in line and not line.endswith("..."):
                lines.append(line)
    return lines


def _config_argv(line: str, hf: Path, jsonl: Path) -> list[str]:
    """``line``'s arguments after its ``train`` / ``config`` subcommand, with /ckpt/... and /data/... paths
    replaced."""
    words = shlex.split(line)
    start = next(i for i, w in enumerate(words) if w in ("train", "config") and i and (
        words[i - 1].endswith("megatron-logra") or words[i - 1] == "megatron_logra.cli"))
    words = [re.sub(r"^/ckpt/\S+$", str(hf), w) for w in words[start + 1:]]
    return [re.sub(r"(jsonl|parquet):/data/\S+", f"jsonl:{jsonl}", w) for w in words]


PAGES = [README, *sorted(DOCS.glob("*.md"))]
LAUNCH_LINES = [(page.name, line) for page in PAGES for line in _documented(page)]


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
    assert len(_documented(DOCS / "usage.md")) >= 5 and _documented(DOCS / "gpu.md")


def test_the_argv_rewrite_finds_the_subcommand(tmp_path):
    line = "nsys profile -o runs/q7 megatron-logra train qwen2.5-1.5b --model.hf_path /ckpt/Q task.datasets=jsonl:/data/a.jsonl"
    assert _config_argv(line, tmp_path / "hf", tmp_path / "a.jsonl") == [
        "qwen2.5-1.5b", "--model.hf_path", str(tmp_path / "hf"), f"task.datasets=jsonl:{tmp_path / 'a.jsonl'}"]


@pytest.mark.parametrize("page, line", LAUNCH_LINES, ids=[f"{p}:{line[:60]}" for p, line in LAUNCH_LINES])
def test_documented_line_is_accepted(page, line, inputs, capsys, monkeypatch):
    if "profile.tool=nsys" in line:
        pytest.skip("profile.tool=nsys needs CUDA (refused without it)")
    monkeypatch.chdir(ROOT)  # examples/tiny.yaml is named from the checkout
    argv = _config_argv(line, *inputs)
    if argv[:1] == ["tiny"] and "--model.hf_path" in argv:
        # the stand-in checkpoint's tokenizer spells a prompt character by character (a chain_sum prompt is ~70
        # of its tokens), a real checkpoint's in far fewer: room for the stand-in's
        argv.append("model.seq_length=96")
    code = main(["config", *argv])
    assert code == 0, f"{page}: {line}\n{capsys.readouterr().err}"


@pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash")
@pytest.mark.parametrize("script", sorted(LAUNCHERS))
def test_launcher_arguments_are_accepted(script, inputs, tmp_path, capsys, monkeypatch):
    """The launcher's torchrun line (torchrun a stub that prints it) read back as ``config`` arguments."""
    stub = tmp_path / "bin"
    stub.mkdir()
    (stub / "torchrun").write_text('#!/bin/sh\nprintf "%s\\n" "$@"\n')
    (stub / "torchrun").chmod(0o755)
    env = {k: v for k, v in os.environ.items() if k not in ("IMPL", "FP8")}
    if script == "train_slime_args.sh":  # --apply-chat-template: the instruct checkpoint's tokenizer has a template
        tokenizer_config = inputs[0] / "tokenizer_config.json"
        settings = json.loads(tokenizer_config.read_text())
        settings["chat_template"] = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
        tokenizer_config.write_text(json.dumps(settings))
    slime_jsonl = tmp_path / "dapo.jsonl"  # slime's rows: prompt / label (its --input-key / --label-key)
    slime_jsonl.write_text("".join(json.dumps({"prompt": f"{i}+1=", "label": str(i + 1)}) + "\n" for i in range(4)))
    env.update(PATH=f"{stub}{os.pathsep}{env.get('PATH', '')}", HF_PATH=str(inputs[0]),
               **{k: v.format(slime_jsonl=slime_jsonl) for k, v in LAUNCHERS[script].items()})
    proc = subprocess.run(["bash", str(ROOT / "examples" / script)], env=env, capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode == 0, proc.stderr
    words = proc.stdout.splitlines()
    assert words[words.index("-m") + 1] == "megatron_logra.cli" and words[words.index("-m") + 2] == "train"
    argv = words[words.index("-m") + 3:]
    monkeypatch.chdir(tmp_path)
    assert main(["config", *argv]) == 0, capsys.readouterr().err
