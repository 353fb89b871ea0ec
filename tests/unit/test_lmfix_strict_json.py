"""Every JSON file a run writes, and the JSON the command line prints, is standard JSON: a non-finite value
(a diverged LM run's losses) is ``null``, never the bare ``NaN`` / ``Infinity`` tokens that jq, JavaScript
and strict parsers reject."""

from __future__ import annotations

import json
import math

import pytest

from megatron_logra.cli import main
from megatron_logra.metrics import json_safe, strict_dumps

LM_SMALL = ["train.progress=false", "train.eval_batches=1", "train.eval_interval=0", "train.save_interval=0",
            "--num-layers", "1", "--hidden-size", "32", "--ffn-hidden-size", "64", "logra.rank=4"]


def strict_loads(text: str):
    def refuse(name):
        raise ValueError(f"non-standard JSON constant {name}")

    return json.loads(text, parse_constant=refuse)


def test_strict_dumps_writes_null_for_non_finite_values_at_any_depth():
    value = {"a": math.nan, "b": [1.5, math.inf, {"c": -math.inf}], "d": (2, math.nan), "e": "NaN", "f": True}
    assert strict_loads(strict_dumps(value)) == {"a": None, "b": [1.5, None, {"c": None}], "d": [2, None],
                                                 "e": "NaN", "f": True}
    assert json_safe({"x": [math.nan]}) == {"x": [None]}


def test_a_diverged_lm_run_writes_and_prints_strict_json(tmp_path, capsys, one_thread):
    """fp16 weights drawn with std 300 overflow: every step is skipped and every loss is NaN."""
    run = tmp_path / "run"
    assert main(["train", "lm-tiny", f"train.run_dir={run}", "train.steps=2", "model.params_dtype=float16",
                 "model.init_std=300", *LM_SMALL]) == 0
    printed = strict_loads(capsys.readouterr().out)
    summary = strict_loads((run / "summary.json").read_text())
    assert summary == printed
    for key in ("first_loss", "last_loss", "eval_loss_before", "eval_loss_after"):
        assert summary[key] is None, (key, summary)
    assert summary["steps"] == 2 and summary["chance_loss"] == pytest.approx(math.log(12))
    records = [strict_loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["skipped"] for r in records] == [True, True] and all(r["loss"] is None for r in records)

    # megatron-logra eval of that run prints strict JSON too
    assert main(["eval", str(run)]) == 0
    result = strict_loads(capsys.readouterr().out)
    assert result["eval_loss"] is None and result["step"] == 2
