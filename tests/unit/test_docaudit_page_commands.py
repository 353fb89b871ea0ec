"""The launch lines of every docs/*.md page are accepted by the real command line (README.md and docs/gpu.md
have their own test, test_documented_commands.py): each ``megatron-logra train|config`` and ``torchrun ... -m
megatron_logra.cli train`` line of a page's ``bash`` blocks, run as ``megatron-logra config`` with the same recipe,
flags and overrides. ``/ckpt/...`` checkpoints and ``/data/...`` files become small ones written here;
``--resume`` lines need a run and are left to the resume tests, lines ending in ``...`` are sketches."""

from __future__ import annotations

import json
import re
import shlex

import pytest

from megatron_logra.cli import main
from support.docs import DOCS, ROOT
from support.run_fixtures import tiny_llama_dir


@pytest.fixture(autouse=True)
def one_process(monkeypatch):
    for name in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "MEGATRON_LOGRA_TRACEBACK"):
        monkeypatch.delenv(name, raising=False)


def page_commands() -> list[tuple[str, str]]:
    """(page, command line) of every training launch in a docs/*.md ``bash`` block (comments cut)."""
    found = []
    for page in sorted(DOCS.glob("*.md")):
        for block in re.findall(r"```bash\n(.*?)```", page.read_text(), re.S):
            for line in block.replace("\\\n", " ").splitlines():
                line = line.split("  #")[0].strip()
                if re.search(r"(^|\s)(\.venv/bin/)?megatron-logra (train|config)\b|-m megatron_logra\.cli train\b", line) \
                        and "--resume" not in line and not line.endswith("..."):
                    found.append((page.name, line))
    return found


def _config_argv(line: str, hf, jsonl) -> list[str]:
    words = shlex.split(line)
    start = next(i for i, w in enumerate(words) if w in ("train", "config") and i and (
        words[i - 1].endswith("megatron-logra") or words[i - 1] == "megatron_logra.cli"))
    words = [re.sub(r"^/ckpt/\S+$", str(hf), w) for w in words[start + 1:]]
    return [re.sub(r"(jsonl|parquet):/data/\S+", f"jsonl:{jsonl}", w) for w in words]


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
    pages = {page for page, _ in page_commands()}
    assert "usage.md" in pages and len(page_commands()) >= 10


def test_the_argv_rewrite_finds_the_subcommand(tmp_path):
    line = "nsys profile -o runs/q7 megatron-logra train qwen2.5-1.5b --model.hf_path /ckpt/Q task.datasets=jsonl:/data/a.jsonl"
    assert _config_argv(line, tmp_path / "hf", tmp_path / "a.jsonl") == [
        "qwen2.5-1.5b", "--model.hf_path", str(tmp_path / "hf"), f"task.datasets=jsonl:{tmp_path / 'a.jsonl'}"]


@pytest.mark.parametrize("page, line", page_commands(), ids=[f"{p}:{line[:60]}" for p, line in page_commands()])
def test_page_launch_line_is_accepted(page, line, inputs, capsys, monkeypatch):
    if "profile.tool=nsys" in line:
        pytest.skip("profile.tool=nsys needs CUDA (refused without it)")
    monkeypatch.chdir(ROOT)  # examples/tiny.yaml is named from the checkout
    argv = _config_argv(line, *inputs)
    if argv[0] == "tiny" and "--model.hf_path" in argv:
        # the stand-in checkpoint's tokenizer spells a prompt character by character (a chain_sum prompt is ~70
        # of its tokens), a real checkpoint's in far fewer: room for the stand-in's
        argv.append("model.seq_length=96")
    code = main(["config", *argv])
    assert code == 0, f"docs/{page}: {line}\n{capsys.readouterr().err}"
