"""``benchmarks/README.md`` lists every benchmark script, and the scripts' docs point to where the live
tensor tracker really lives."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_readme_table_lists_every_benchmark_script():
    text = (ROOT / "benchmarks" / "README.md").read_text()
    rows = set(re.findall(r"^\| `([a-z0-9_]+\.py)` \|", text, flags=re.M))
    scripts = {p.name for p in (ROOT / "benchmarks").glob("*.py")}
    assert scripts and rows == scripts
    for name in scripts:  # and each has its own section
        assert f"## {name}" in text, name


def test_live_tensor_tracker_references_name_its_module():
    from megatron_logra.memory import measure

    assert "LiveTensorTracker" in vars(measure)  # where it is defined
    files = [*(ROOT / "benchmarks").glob("*.py"), *(ROOT / "tools").glob("*.py"),
             *(ROOT / "benchmarks" / "results").glob("*.md"), ROOT / "benchmarks" / "README.md"]
    wrong = [f"{p.relative_to(ROOT)}: {m.group(0)}" for p in files
             for m in re.finditer(r"LiveTensorTracker`*\s+of\s+`*([\w/.]+)", p.read_text())
             if m.group(1).rstrip(".`") not in ("megatron_logra/memory/measure.py", "megatron_logra.memory.measure")]
    assert not wrong, wrong
