"""Under pipeline parallelism each column of the breakdown is its plan's worst stage, and those can differ.

Qwen2.5-7B at PP 2 with 1024-token sequences: dense AdamW is worst on the last stage (the logits), LoGRA on the
first (two micro-batches in flight). The table put the two side by side without naming a stage, so LoGRA
seemed to store more activations than dense AdamW; the header now names each column's stage."""

from __future__ import annotations

from megatron_logra.memory.cli import main
from megatron_logra.memory.units import format_bytes

H, A, G, D, F, V, L, PP, S, R = 3584, 28, 4, 128, 18944, 152064, 28, 2, 1024, 64


def _table(capsys) -> dict[str, list[str]]:
    assert main(["--model", "qwen2.5-7b", "--pp", str(PP), "--seq-len", str(S), "--rank", str(R), "--compare",
                 "--markdown"]) == 0
    rows = {}
    for line in capsys.readouterr().out.splitlines():
        if line.startswith("| ") and not line.startswith("|---"):
            cells = [c.strip() for c in line.strip("|").split("|")]
            rows[cells[0]] = cells[1:]
    return rows


def test_each_column_names_the_stage_its_figures_are_of(capsys):
    rows = _table(capsys)
    dense_head, logra_head = rows["per rank"]
    # independent figures: the last stage holds the 16-bit logits and their gradient, 2·2·T·V bytes (TP 1);
    # LoGRA's sketches on a stage of 14 layers: 4·r bytes per output row of qkv, proj, fc1 (2f) and fc2
    logits_last = format_bytes(2 * 2 * S * V)
    sketch_rows = (A + 2 * G) * D + H + 2 * F + H
    sketches = format_bytes(4 * R * (L // PP) * sketch_rows)
    dense_logits, logra_logits = rows["logits"]
    assert rows["sketches"][1] == sketches
    for head, logits in ((dense_head, dense_logits), (logra_head, logra_logits)):
        stage = 1 if logits == logits_last else 0
        if stage == 0:
            assert logits == format_bytes(0)
        assert head.endswith(f"(pipeline stage {stage})"), (head, logits)
    assert dense_head.endswith("(pipeline stage 1)") and logra_head.endswith("(pipeline stage 0)")


def test_single_stage_headers_stay_plain(capsys):
    assert main(["--model", "qwen2.5-7b", "--seq-len", str(S), "--rank", str(R), "--compare", "--markdown"]) == 0
    out = capsys.readouterr().out
    assert f"| per rank | dense AdamW | LoGRA r={R} |" in out and "pipeline stage" not in out
