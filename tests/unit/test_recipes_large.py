"""The GPU recipes fit their own memory preflight on 80 GB GPUs, and the docs quote what it plans.

``train.memory_check`` plans ``rl.micro_batch_size × model.seq_length``. ``qwen2.5-1.5b`` at micro-batch 8
was OOM by 6.3% on one H100, so every launch of ``examples/train_1.5b_1gpu.sh`` warned and
``train.memory_check=error`` refused it.

The planner's correctness is tested against measured memory elsewhere
(``test_memory_planner.py::test_planner_matches_the_measured_optimizer_memory_benchmark``). Here:

* each recipe passes its own preflight in ``error`` mode with at least 15% headroom;
* the figures quoted by the recipes' docstring, docs/gpu.md, docs/memory.md and the 1.5B launcher are read
  from those files and compared with what the preflight plans, rounded as quoted;
* the ``megatron-logra memory`` command those files quote prints the same figures.
"""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest

import megatron_logra.config.recipes_large
from megatron_logra.config import RECIPES, parse_args_to_config
from megatron_logra.memory.preflight import memory_preflight
from megatron_logra.memory.units import GiB, parse_bytes

REPO = Path(__file__).resolve().parents[2]
H100 = parse_bytes("81559MiB")
LAYOUTS = {"qwen2.5-1.5b": (1, 1, 4), "qwen2.5-7b": (4, 2, 4), "27b": (8, 1, 2)}  # name: (tp, dp, micro-batch)
F = r"[0-9]+\.[0-9]+"  # a quoted decimal figure


def _preflight(name: str, dp: int, *overrides: str):
    cfg = parse_args_to_config(name, ["train.memory_check=error", *overrides])
    return cfg, memory_preflight(cfg, tp=cfg.parallel.tp, pp=1, dp=dp, gpu_memory_bytes=H100)


def _flat(text: str) -> str:
    """Whitespace collapsed, comment markers of a shell script dropped: quoted figures wrap across lines."""
    return " ".join(line.lstrip("# ") for line in text.splitlines()).replace("  ", " ")


def _quotes() -> dict[str, dict[str, str]]:
    """The figures each document quotes, by document: 1.5B total / headroom, GPU memory, 1.5B at micro-batch
    8 (total, OOM percentage), 7B and 27B headroom (percentages without sign)."""
    sources = {
        "megatron_logra/config/recipes_large.py": (megatron_logra.config.recipes_large.__doc__, [
            rf"1\.5B \+(?P<h15>{F})% headroom \((?P<t15>{F}) GiB of (?P<gpu>{F}) GiB; at "
            rf"micro-batch 8 it would be OOM by (?P<oom8>{F})%\), 7B \(TP4 × DP2\) \+(?P<h7>{F})%, "
            rf"27B \+(?P<h27>{F})%"]),
        "docs/gpu.md": ((REPO / "docs" / "gpu.md").read_text(), [
            rf"1\.5B on one GPU (?P<t15>{F}) GiB, \+(?P<h15>{F})% headroom \(micro-batch 8 would be "
            rf"OOM by (?P<oom8>{F})%\); 7B at TP4 × DP2 \+(?P<h7>{F})%; 27B at TP8 "
            rf"\+(?P<h27>{F})%"]),
        "docs/memory.md": ((REPO / "docs" / "memory.md").read_text(), [
            rf"`qwen2\.5-1\.5b` at TP 1, 4 × 4096, (?P<t15>{F}) GiB, \+(?P<h15>{F})% headroom "
            rf"\(8 × 4096: (?P<t8>{F}) GiB, OOM by (?P<oom8>{F})%\); `qwen2\.5-7b` at TP4 × DP2, "
            rf"4 × 4096, \+(?P<h7>{F})%; `27b` at TP 8, 2 × 4096, \+(?P<h27>{F})%"]),
        "examples/train_1.5b_1gpu.sh": ((REPO / "examples" / "train_1.5b_1gpu.sh").read_text(), [
            rf"-> (?P<t15>{F}) GiB of (?P<gpu>{F}) GiB, fit \(\+(?P<h15>{F})% headroom\)",
            rf"8 x 4096 would be OOM by (?P<oom8>{F})%"]),
    }
    out = {}
    for path, (text, patterns) in sources.items():
        flat, found = _flat(text), {}
        for pattern in patterns:
            m = re.search(pattern, flat)
            assert m is not None, f"{path} no longer quotes the recipe memory figures as /{pattern}/"
            found.update(m.groupdict())
        out[path] = found
    return out


@pytest.fixture(scope="module")
def planned() -> dict[str, str]:
    """What the recipes' own preflights plan, formatted as the documents quote it."""
    got = {}
    for name, (tp, dp, micro_batch) in LAYOUTS.items():
        cfg, p = _preflight(name, dp)  # error mode: raises if it did not fit
        assert (cfg.parallel.tp, cfg.rl.micro_batch_size, cfg.model.seq_length, cfg.model.recompute) == \
            (tp, micro_batch, 4096, "full")
        got[name] = p
    _, old = _preflight("qwen2.5-1.5b", 1, "rl.micro_batch_size=8", "train.memory_check=warn")
    small = got["qwen2.5-1.5b"]
    return {"t15": f"{small.worst.total / GiB:.2f}", "h15": f"{100 * small.headroom:.1f}",
            "gpu": f"{H100 / GiB:.2f}", "t8": f"{old.worst.total / GiB:.2f}", "oom8": f"{-100 * old.headroom:.1f}",
            "h7": f"{100 * got['qwen2.5-7b'].headroom:.1f}", "h27": f"{100 * got['27b'].headroom:.1f}",
            "_old_fits": old.fits}


@pytest.mark.parametrize("name, dp", [("qwen2.5-1.5b", 1), ("qwen2.5-1.5b", 8), ("qwen2.5-7b", 2), ("27b", 1)])
def test_each_gpu_recipe_fits_its_own_preflight_with_15_percent_headroom(name, dp):
    _, p = _preflight(name, dp)  # examples/train_1.5b_1gpu.sh with GPUS=8: data-parallel, the same per GPU
    assert p is not None and p.fits and p.headroom >= 0.15, (p.worst.total / GiB, p.headroom)


def test_the_old_1_5b_micro_batch_did_not_fit(planned):
    assert planned["_old_fits"] is False and float(planned["oom8"]) > 0


@pytest.mark.parametrize("path", ["megatron_logra/config/recipes_large.py", "docs/gpu.md", "docs/memory.md",
                                  "examples/train_1.5b_1gpu.sh"])
def test_the_quoted_memory_figures_are_what_the_preflight_plans(path, planned):
    quoted = _quotes()[path]
    wrong = {k: (v, planned[k]) for k, v in quoted.items() if v != planned[k]}
    assert not wrong, f"{path} quotes (quoted, planned): {wrong}"


def test_the_quoted_memory_command_prints_the_quoted_figures(capsys):
    """The ``megatron-logra memory`` command of the recipes' docstring, run as quoted."""
    from megatron_logra.memory.cli import main as memory_main

    flat = _flat(megatron_logra.config.recipes_large.__doc__)
    command = re.search(r"``megatron-logra memory (.*?)``", flat).group(1)
    assert memory_main(shlex.split(command) + ["--markdown"]) == 0
    out = capsys.readouterr().out
    quoted = _quotes()["megatron_logra/config/recipes_large.py"]
    assert re.search(rf"\| total \| {re.escape(quoted['t15'])} GiB \|", out), out
    assert re.search(rf"\| GPU memory \| {re.escape(quoted['gpu'])} GiB \|", out), out
    assert re.search(rf"\| verdict \| fit \(\+{re.escape(quoted['h15'])}% headroom\) \|", out), out


@pytest.mark.parametrize("name", ["qwen2.5-1.5b", "qwen2.5-7b", "27b"])
def test_the_recipe_line_names_its_layout(name):
    cfg = RECIPES[name]()
    doc = RECIPES[name].__doc__
    assert f"TP {cfg.parallel.tp}, micro-batch {cfg.rl.micro_batch_size}," in doc
