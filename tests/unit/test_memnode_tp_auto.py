"""``megatron-logra memory --tp auto`` keeps tensor parallelism inside one node (``--gpus-per-node``, default 8).

Megatron-LM lays a job out with TP inside a node (its all-reduces in every layer need NVLink) and PP and DP across
nodes. ``--model 27b --tp auto --gpus 16`` used to plan TP 16, one TP group over two 8-GPU nodes; it plans TP 8 x
DP 2 now. The expected TP is computed here by placing Megatron's consecutive TP ranks on nodes and keeping the
largest TP whose groups all stay in one node, not by the planner's own formula. A fixed ``--tp`` whose groups span
nodes is still planned, with a ``Note:`` line saying so.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from megatron_logra.memory.cli import main as memory_main
from megatron_logra.models.presets import get_preset

ROOT = Path(__file__).resolve().parents[2]
_LAYOUT = re.compile(r"\*\*(\S+) on \S+\*\* \(TP(\d+) PP(\d+) DP(\d+),")
# a Llama config of 12 heads: TP 6 and 12 shard it, so a node of 8 is split unevenly by them
TWELVE_HEADS = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 768,
                "num_hidden_layers": 4, "num_attention_heads": 12, "num_key_value_heads": 12,
                "intermediate_size": 3072, "vocab_size": 32000, "rope_theta": 500000.0, "rms_norm_eps": 1e-5,
                "tie_word_embeddings": False, "torch_dtype": "bfloat16", "hidden_act": "silu",
                "max_position_embeddings": 8192}


def _run(capsys, argv: list[str]) -> tuple[list[str], tuple[int, int, int]]:
    """The lines before the first table of ``memory argv --markdown`` and the (TP, PP, DP) it planned."""
    assert memory_main(argv + ["--markdown"]) in (0, 2)
    out = capsys.readouterr().out
    layouts = {(int(m[2]), int(m[3]), int(m[4])) for m in _LAYOUT.finditer(out)}
    assert len(layouts) == 1, out
    head = out[:out.index("**")].splitlines()
    return [line for line in head if line], layouts.pop()


def _in_one_node(tp: int, gpus: int, per_node: int) -> bool:
    """Whether every TP group (Megatron's consecutive ranks) of a ``gpus``-GPU job lies in one node."""
    return all(len({r // per_node for r in range(k, k + tp)}) == 1 for k in range(0, gpus, tp))


def _expected_tp(model, gpus: int, pp: int, per_node: int) -> int:
    heads, groups = model.num_attention_heads, model.num_query_groups or model.num_attention_heads
    return max(t for t in range(1, gpus // pp + 1)
               if heads % t == groups % t == model.ffn_hidden_size % t == (gpus // pp) % t == 0
               and _in_one_node(t, gpus, per_node))


def _twelve_heads(tmp_path: Path) -> str:
    (tmp_path / "config.json").write_text(json.dumps(TWELVE_HEADS))
    return str(tmp_path / "config.json")


def test_27b_on_sixteen_gpus_plans_tp_8_dp_2(capsys):
    """The reported case: TP 16 would all-reduce across two 8-GPU nodes."""
    head, layout = _run(capsys, ["--model", "27b", "--tp", "auto", "--gpus", "16"])
    assert layout == (8, 1, 2)
    assert head == []  # nothing assumed, nothing spans nodes


@pytest.mark.parametrize("gpus, pp, per_node", [(16, 1, 8), (32, 2, 8), (16, 1, 4), (16, 1, 16), (64, 2, 8),
                                                (8, 1, 8), (4, 1, 8), (24, 1, 8)])
def test_tp_auto_is_the_largest_that_stays_in_a_node(capsys, gpus, pp, per_node):
    tp = _expected_tp(get_preset("27b"), gpus, pp, per_node)
    _, layout = _run(capsys, ["--model", "27b", "--tp", "auto", "--gpus", str(gpus), "--pp", str(pp),
                              "--gpus-per-node", str(per_node)])
    assert layout == (tp, pp, gpus // (tp * pp))
    assert tp <= per_node


def test_a_tp_that_would_split_a_node_unevenly_is_not_chosen(capsys, tmp_path):
    """12 heads on 12 GPUs of 8-GPU nodes: TP 12 and TP 6 shard the model but a group would straddle two nodes."""
    model = _twelve_heads(tmp_path)
    _, layout = _run(capsys, ["--model", model, "--tp", "auto", "--gpus", "12"])
    assert layout == (4, 1, 3)
    _, layout = _run(capsys, ["--model", model, "--tp", "auto", "--gpus", "6"])  # one node: TP 6 stays in it
    assert layout == (6, 1, 1)


def test_without_gpus_tp_times_pp_stays_in_the_node_of_the_flag(capsys):
    head, layout = _run(capsys, ["--model", "27b", "--tp", "auto", "--gpus-per-node", "4", "--dp", "2"])
    assert layout == (4, 1, 2)
    assert head[0].startswith("GPUs: 8 = TP 4 x PP 1 x DP 2 (no --gpus: 4-GPU nodes assumed"), head
    assert "TP <= 4 / PP = 4" in head[0]
    head, layout = _run(capsys, ["--model", "27b", "--tp", "auto", "--pp", "2"])  # the default node: 8 / PP
    assert layout == (4, 2, 1) and "8-GPU nodes assumed" in head[0]


@pytest.mark.parametrize("style", [["--markdown"], []])
def test_a_fixed_tp_larger_than_a_node_is_planned_with_a_note(capsys, style):
    assert memory_main(["--model", "27b", "--tp", "16", "--gpus", "16", *style]) == 0
    out = capsys.readouterr().out
    assert "TP16 PP1 DP1" in out
    notes = [line for line in out.splitlines() if line.startswith("Note:")]
    assert len(notes) == 1, out
    assert "TP 16 spans nodes (--gpus-per-node 8)" in notes[0] and "larger than one node of 8" in notes[0]
    assert "choose a --tp that divides 8" in notes[0]


def test_a_fixed_tp_that_straddles_nodes_is_noted(capsys, tmp_path):
    head, layout = _run(capsys, ["--model", _twelve_heads(tmp_path), "--tp", "6", "--gpus", "12"])
    assert layout == (6, 1, 2)
    assert len(head) == 1 and "TP 6 does not divide the 8 GPUs of a node" in head[0], head
    assert "--gpus 12" in head[0] and "straddle" in head[0]


@pytest.mark.parametrize("argv", [["--tp", "16", "--gpus", "16", "--gpus-per-node", "16"], ["--tp", "8", "--gpus", "16"],
                                  ["--tp", "auto", "--gpus", "16"]])
def test_no_note_when_tp_stays_in_a_node(capsys, argv):
    head, _ = _run(capsys, ["--model", "27b", *argv])
    assert not any(line.startswith("Note:") for line in head), head


def test_without_gpus_a_fixed_tp_larger_than_the_node_is_noted(capsys):
    head, layout = _run(capsys, ["--model", "27b", "--tp", "16"])
    assert layout == (16, 1, 1)
    assert head and head[-1].startswith("Note: TP 16 spans nodes"), head


@pytest.mark.parametrize("value", ["0", "-8"])
def test_gpus_per_node_below_one_is_refused_naming_the_flag(capsys, value):
    with pytest.raises(SystemExit) as exc:
        memory_main(["--model", "27b", "--tp", "auto", "--gpus", "16", "--gpus-per-node", value])
    assert exc.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err == f"megatron-logra memory: error: --gpus-per-node: gpus_per_node={value} must be an integer >= 1"


def test_help_and_docs_state_the_node_rule(capsys):
    with pytest.raises(SystemExit):
        memory_main(["--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "--gpus-per-node GPUS_PER_NODE" in text and "TP stays within a node" in text
    assert "``--model 27b --tp auto --gpus 16`` plans TP 8 x DP 2" in text
    for page in ("memory.md", "usage.md"):
        doc = " ".join((ROOT / "docs" / page).read_text().split())
        assert "`--model 27b --tp auto --gpus 16` plans TP 8 × DP 2" in doc, page
        assert "`--gpus-per-node`" in doc, page
