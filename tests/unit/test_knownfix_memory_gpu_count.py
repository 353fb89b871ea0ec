"""``megatron-logra memory --tp auto`` without ``--gpus`` states the GPUs its planned layout occupies, TP x PP x DP,
and what it assumed. It used to print ``GPUs: 8 (default; set --gpus)`` whatever the layout: ``--model 27b --tp auto
--dp 2`` planned TP 8 x DP 2, sixteen GPUs. The count is checked against the layout printed for each model and
against a plan of the same TP and PP given that many GPUs with ``--gpus`` (which then derives the same DP)."""

from __future__ import annotations

import re

import pytest

from megatron_logra.memory.cli import DEFAULT_AUTO_TP_GPUS
from megatron_logra.memory.cli import main as memory_main

_LAYOUT_RE = re.compile(r"\*\*(\S+) on \S+\*\* \(TP(\d+) PP(\d+) DP(\d+),")


def _plan(capsys, argv: list[str]) -> tuple[str, dict[str, tuple[int, int, int]]]:
    """The first output line of ``memory argv --markdown`` and the layout planned per model."""
    assert memory_main(argv + ["--markdown"]) == 0
    out = capsys.readouterr().out
    layouts = {m[1]: (int(m[2]), int(m[3]), int(m[4])) for m in _LAYOUT_RE.finditer(out)}
    assert layouts, out
    return out.splitlines()[0], layouts


@pytest.mark.parametrize("model, extra", [("27b", ["--dp", "2"]), ("qwen2.5-7b", ["--dp", "2"]),
                                          ("qwen2.5-1.5b", []), ("27b", ["--pp", "2", "--dp", "3"])])
def test_the_stated_gpu_count_is_the_planned_layouts(capsys, model, extra):
    first, layouts = _plan(capsys, ["--model", model, "--tp", "auto", *extra])
    ((tp, pp, dp),) = layouts.values()
    assert first.startswith(f"GPUs: {tp * pp * dp} = TP {tp} x PP {pp} x DP {dp} (no --gpus: "), first
    assert f"{DEFAULT_AUTO_TP_GPUS}-GPU nodes assumed" in first and "set --gpus" in first
    assert f"TP <= {DEFAULT_AUTO_TP_GPUS} / PP = {DEFAULT_AUTO_TP_GPUS // pp}" in first
    assert (f"DP {dp} from --dp" if "--dp" in extra else "DP 1 (default; set --dp)") in first
    # the same TP and PP planned for that many GPUs: the same DP, and nothing left to state
    assert memory_main(["--model", model, "--tp", str(tp), "--pp", str(pp), "--gpus", str(tp * pp * dp),
                        "--markdown"]) == 0
    out = capsys.readouterr().out
    assert "GPUs:" not in out and f"TP{tp} PP{pp} DP{dp}," in out


def test_the_dp2_case_of_a_model_that_shards_eight_ways_counts_sixteen(capsys):
    """The reported case: TP 8 (the node's bound) with two data-parallel replicas is more than one node."""
    first, layouts = _plan(capsys, ["--model", "27b", "--tp", "auto", "--dp", "2"])
    tp, pp, dp = layouts["27b"]
    assert (tp, dp) == (DEFAULT_AUTO_TP_GPUS, 2)  # 27b shards DEFAULT_AUTO_TP_GPUS ways
    assert not first.startswith(f"GPUs: {DEFAULT_AUTO_TP_GPUS} ")
    assert first.startswith(f"GPUs: {2 * DEFAULT_AUTO_TP_GPUS} = ")


def test_models_of_different_layouts_are_counted_each(capsys):
    first, layouts = _plan(capsys, ["--model", "qwen2.5-1.5b,27b", "--tp", "auto", "--pp", "2", "--dp", "3"])
    assert len(set(layouts.values())) == 2  # the two models shard differently
    listed = ", ".join(f"{tp * pp * dp} for {name} (TP {tp} x PP {pp} x DP {dp})"
                       for name, (tp, pp, dp) in layouts.items())
    assert first.startswith(f"GPUs: {listed} (no --gpus: "), first
