"""JSONL inputs several test files write: prompt / answer rows, and a reward plugin module over a small file."""

from __future__ import annotations

import json
import uuid
from pathlib import Path


def write_rows(path: Path, rows) -> str:
    """``rows`` of ``(prompt, answer)`` written to ``path`` as JSONL; returns ``"jsonl:PATH"``."""
    path.write_text("".join(json.dumps({"prompt": p, "answer": a}) + "\n" for p, a in rows))
    return f"jsonl:{path}"


def plugin_and_file(tmp_path: Path, monkeypatch, source: str, prefix: str) -> tuple[str, Path]:
    """A reward plugin module of ``source`` under a unique name starting with ``prefix`` (importable for the
    test), and a 40-row JSONL file of sums (``"i+1="`` -> ``i + 1``); returns ``(module name, file path)``."""
    name = f"{prefix}_{uuid.uuid4().hex[:8]}"
    (tmp_path / f"{name}.py").write_text(source)
    monkeypatch.syspath_prepend(str(tmp_path))
    data = tmp_path / "p.jsonl"
    write_rows(data, [(f"{i}+1=", str(i + 1)) for i in range(40)])
    return name, data


def plugin_task(plugin: tuple[str, Path], fn: str):
    """The task scoring :func:`plugin_and_file`'s file with its plugin's ``fn``, without a held-out set."""
    from megatron_logra.rewards import TaskConfig, build_task

    name, data = plugin
    return build_task(TaskConfig(datasets=[f"jsonl:{data}"], reward=f"{name}:{fn}", num_eval=0))
